"""The transport-free trainer: StartRun, Status, Checkpoint, StopRun and WatchSteps semantics.

One run trains at a time. StartRun of a run this process does not know resumes it from the
trainer's record in Redis when there is one (the weights of the last version it published, the
groups it has not acknowledged), so a trainer restarted after a crash continues where it stopped.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import redis
import torch

from rlfleet.errors import Conflict, InvalidInput, NotFound
from rlfleet.run_spec import resolve, validate
from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import CheckpointResponse, StepReport, TrainerState, TrainerStatus
from rlfleet_trainer.active_run import ActiveRun
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.optim import optimizer_from_spec
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.run_loop import train_run
from rlfleet_trainer.run_state import RunStateStore

logger = logging.getLogger(__name__)


class TrainerCore:
    def __init__(
        self, settings: TrainerSettings, client: redis.Redis, router: RouterClient, metrics: TrainerMetrics
    ) -> None:
        self.settings = settings
        self.client = client
        self.router = router
        self.metrics = metrics
        self.store = RunStateStore(client, settings.redis_prefix)
        self._runs: dict[str, ActiveRun] = {}
        self._finished: dict[str, TrainerStatus] = {}
        self._starting: set[str] = set()
        self._lock = threading.Lock()

    # -- RPCs -------------------------------------------------------------------------------------

    def start_run(self, run_id: str, spec: RunSpec) -> TrainerStatus:
        if not run_id:
            raise InvalidInput("run_id must be set")
        spec = resolve(spec)
        validate(spec)
        with self._lock:
            current = self._runs.get(run_id)
            if current is not None and not current.finished:
                return current.status()
            busy = [r.run_id for r in self._runs.values() if not r.finished] + sorted(self._starting)
            if busy:
                raise Conflict(f"the trainer is busy with run {busy[0]}; stop it before starting {run_id}")
            self._starting.add(run_id)
        try:
            run = self._prepare(run_id, spec)
            # The fleet must serve the version the run continues from before anyone samples from it.
            self.router.load_weights(run.weights_path, run.weight_version)
        finally:
            with self._lock:
                self._starting.discard(run_id)
        with self._lock:
            self._release_finished()
            self._runs[run_id] = run
        run.update(state=TrainerState.TRAINER_STATE_TRAINING)
        self.metrics.step.set(run.step)
        self.metrics.weight_version.set(run.weight_version)
        run.thread = threading.Thread(
            target=train_run,
            args=(run, self.settings, self.router, self.store, self.metrics),
            name=f"train-{run_id}",
            daemon=True,
        )
        run.thread.start()
        logger.info("run %s started at step %d (weight version %d)", run_id, run.step, run.weight_version)
        return run.status()

    def status(self, run_id: str) -> TrainerStatus:
        with self._lock:
            if run_id in self._runs:
                return self._runs[run_id].status()
            if run_id in self._finished:
                return self._finished[run_id]
        raise NotFound(f"this trainer has no run {run_id!r}; StartRun resumes it")

    def checkpoint(self, run_id: str) -> CheckpointResponse:
        """Every step publishes a complete weight directory; the latest one is the checkpoint."""
        status = self.status(run_id)
        return CheckpointResponse(path=status.weights_path, step=status.step, weight_version=status.weight_version)

    def stop_run(self, run_id: str, timeout_s: float = 300.0) -> TrainerStatus:
        run = self._active(run_id)
        if run is None:
            return self.status(run_id)
        run.stop.set()
        if run.thread is not None:
            run.thread.join(timeout=timeout_s)
            if run.thread.is_alive():
                raise Conflict(f"run {run_id} is still finishing its step after {timeout_s:.0f}s; ask again")
        if not run.finished:
            run.update(state=TrainerState.TRAINER_STATE_STOPPED)
        return run.status()

    def reports(self, run_id: str, from_step: int) -> tuple[list[StepReport], bool]:
        """Step reports with step >= from_step, and whether the run has finished."""
        run = self._active(run_id)
        if run is None:
            self.status(run_id)  # raises NotFound for unknown runs
            return [], True
        finished = run.finished
        return run.reports_from(from_step), finished

    def wait_for_change(self, run_id: str, timeout_s: float) -> None:
        run = self._active(run_id)
        if run is not None:
            with run.changed:
                run.changed.wait(timeout=timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.stop.set()
        for run in runs:
            if run.thread is not None:
                run.thread.join(timeout=timeout_s)

    # -- internals --------------------------------------------------------------------------------

    def _active(self, run_id: str) -> ActiveRun | None:
        with self._lock:
            return self._runs.get(run_id)

    def _release_finished(self) -> None:
        """Keeps only the status of finished runs, freeing their models."""
        for run_id, run in list(self._runs.items()):
            if run.finished:
                self._finished[run_id] = run.status()
                del self._runs[run_id]

    def _prepare(self, run_id: str, spec: RunSpec) -> ActiveRun:
        base = Path(spec.model.path)
        if not (base / "config.json").exists():
            raise InvalidInput(f"model.path: no Hugging Face model at {base} (config.json missing)")
        record = self.store.load(run_id)
        source, step, version, trained = base, 0, 0, 0
        if record is not None and record.weight_version > 0:
            source = Path(record.weights_path)
            if not (source / "config.json").exists():
                raise Conflict(
                    f"run {run_id} was at weight version {record.weight_version} but {source} is gone; "
                    "it cannot be resumed"
                )
            step, version, trained = record.step, record.weight_version, record.groups_trained
        torch.manual_seed(spec.trainer.seed + step)
        model = load_policy(source)
        optimizer, scheduler = optimizer_from_spec(model, spec, start_step=step)
        ref_model = None
        if spec.algorithm.kl_coef > 0:
            ref_model = load_policy(base).eval().requires_grad_(False)
        stream = SampleStream(self.client, run_id, prefix=self.settings.redis_prefix)
        stream.ensure_consumer_group()
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        return ActiveRun(
            run_id=run_id,
            spec=spec,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            ref_model=ref_model,
            stream=stream,
            weights_root=self.settings.work_dir / "runs" / run_id / "weights",
            tokenizer_dir=Path(spec.model.tokenizer_path),
            pad_id=int(pad_id),
            step=step,
            weight_version=version,
            weights_path=str(source),
            groups_trained=trained,
        )
