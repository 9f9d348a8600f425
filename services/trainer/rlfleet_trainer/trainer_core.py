"""The transport-free trainer: StartRun, Status, Checkpoint, StopRun and WatchSteps semantics.

One run trains at a time. StartRun of a run this process does not know resumes it from the
trainer's record in Redis when there is one: the run's last checkpoint (model, optimizer, schedule,
critic, RNG) and the groups it does not cover, which are still pending on the stream. So a trainer
restarted after a crash retrains exactly the groups after its last checkpoint.

Until StopRun the trainer holds its run and refuses every other one, so whoever decided a run is over
must be able to stop it whatever the trainer is doing: `held` names the run it is busy with (the
orchestrator compares it with its records), StopRun during StartRun ends the run as soon as it is
loaded, StopRun during a step answers within its caller's bound while the stop stands, and StopRun of a
run that has stopped answers with its final status every time. A run that is starting is known by name
(Status answers STARTING), and a start that fails leaves nothing loaded on any rank. A run that has ended
still holds its policy until its thread has let go of it (and of its weight sync with the fleet): the next
start waits for that, bounded, so the old run's unload never throws the new run's policy away. A start that
meets Redis or storage failing answers Unavailable naming it, so its caller asks again. A start loads in a thread
of its own: a shutdown answers the calls waiting for it at once (Unavailable, naming the shutdown), and the process
ends without waiting for a load nobody waits for any more (it writes nothing that a stop midway leaves half done:
weight versions and checkpoints are renamed into place whole).
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from rlfleet.errors import Conflict, DeadlineExceeded, InvalidInput, NotFound, Unavailable
from rlfleet.run_spec import resolve, validate
from rlfleet.sample_stream import SampleStream, redis_refusal, redis_unavailable
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import CheckpointResponse, StepReport, TrainerState, TrainerStatus
from rlfleet_trainer.active_run import ActiveRun
from rlfleet_trainer.checkpoint import (
    CheckpointFailed,
    checkpoint_steps,
    prune_checkpoints,
    set_aside,
    set_aside_after,
)
from rlfleet_trainer.checkpoint_commit import CheckpointCommitter
from rlfleet_trainer.config import SHUTDOWN_TIMEOUT_S, TrainerSettings
from rlfleet_trainer.generation_pause import resume_generation
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.rank_group import RankGroup
from rlfleet_trainer.rank_ops import RANK_OPS, RankState, ShardingOptions
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.run_loop import release_policy, train_run
from rlfleet_trainer.run_state import RunRecord, RunStateStore
from rlfleet_trainer.stream_lag import scrape_client
from rlfleet_trainer.weights import save_version

logger = logging.getLogger(__name__)

# The longest StopRun waits for the step in progress (a caller without a deadline: grpc_server.NO_DEADLINE_WAIT_S).
STOP_WAIT_S = 300.0
# How long a StartRun of a run already starting waits for that start before it answers "ask again".
START_JOIN_WAIT_S = 60.0
# A run id names the run's directory under the work dir, so it must be one plain name: no separator
# or leading dot could then write outside it or into another run's.
RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
# The most of a refused run id an error quotes.
_RUN_ID_SHOWN = 128
# Finished runs whose step reports are kept beside their status.
KEPT_FINISHED_RUNS = 4


@dataclass
class _Start:
    """A StartRun in progress (loading the policy, making the fleet serve its version), in a thread of its own."""

    stop: threading.Event = field(default_factory=threading.Event)
    """Set by a StopRun meanwhile: once loaded, the run ends instead of training."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the start has its outcome: `status`, or `error`."""
    settled: threading.Event = field(default_factory=threading.Event)
    """Set with `done`, or earlier by the shutdown: the calls waiting for the start stop waiting."""
    status: TrainerStatus | None = None
    error: Exception | None = None
    first_step: int | None = None
    """The first step the run takes (its checkpoint's step + 1 when it resumes), once it is loaded."""


class TrainerCore:
    def __init__(
        self,
        settings: TrainerSettings,
        client: redis.Redis,
        router: RouterClient,
        metrics: TrainerMetrics,
        ranks: RankGroup | None = None,
    ) -> None:
        """`ranks`: the torchrun ranks the policy is sharded over (rank 0 is this process); by
        default this process alone."""
        self.settings = settings
        self.ranks = ranks or RankGroup(RANK_OPS, RankState(ShardingOptions()))
        self.client = client
        self.router = router
        self.metrics = metrics
        self.store = RunStateStore(client, settings.redis_prefix, keep_trained_groups=settings.keep_trained_groups)
        self.checkpoints = CheckpointCommitter(self.store, settings.keep_checkpoints, metrics)
        self._runs: dict[str, ActiveRun] = {}
        self._finished: dict[str, TrainerStatus] = {}
        # The step reports of the latest runs that ended: a follower of WatchSteps away when a run ended, and the next
        # one started, still gets the last steps (they went with the run's object, and the stream ended empty).
        self._finished_reports: dict[str, list[StepReport]] = {}
        self._starting: dict[str, _Start] = {}
        self._closing = False
        """Set by shutdown: no run starts after it."""
        self._lock = threading.Lock()
        metrics.watch_stream_lag(scrape_client(settings.redis_url), settings.redis_prefix, self._training)

    # -- RPCs -------------------------------------------------------------------------------------

    def start_run(self, run_id: str, spec: RunSpec, join_wait_s: float = START_JOIN_WAIT_S) -> TrainerStatus:
        """Starts (or resumes) the run; asked again while that run starts, waits up to `join_wait_s` for
        the start's outcome, then answers Unavailable (ask again)."""
        check_run_id(run_id)
        spec = resolve(spec)
        validate(spec)
        deadline = time.monotonic() + join_wait_s
        start: _Start | None = None  # this call's start, registered (STARTING to Status and StopRun) once it waits
        while True:
            with self._lock:
                current = self._runs.get(run_id)
                under_way = self._starting.get(run_id)
                releasing = None
                if start is not None and (
                    self._closing or (current is not None and not current.finished) or under_way is not start
                ):
                    self._give_up(start)
                    start = None
                if self._closing:
                    raise Unavailable(f"the trainer is shutting down; run {run_id} cannot start here")
                stopping = current if current is not None and not current.finished and current.stop.is_set() else None
                if current is not None and not current.finished and stopping is None:
                    return current.status()
                if stopping is None and (under_way is None or under_way is start):
                    busy = [r.run_id for r in self._runs.values() if not r.finished]
                    busy += sorted(other for other in self._starting if other != run_id)
                    if busy:
                        self._give_up(start)
                        raise Conflict(f"the trainer is busy with run {busy[0]}; stop it before starting {run_id}")
                    if start is None:
                        start = self._starting[run_id] = _Start()
                    # A run that has ended still holds its policy until its thread lets go of it: loaded now, this
                    # run's policy would be the one that thread unloads.
                    releasing = next((r for r in self._runs.values() if r.releasing), None)
                    if releasing is None:
                        break
            remaining = max(0.0, deadline - time.monotonic())
            if stopping is not None:
                # Asked to stop (a StopRun whose caller gave up, say) and training until its step ends: answered
                # TRAINING, the caller took the run for live while it stopped. It starts again from its record.
                if remaining <= 0 or not stopping.wait_released(remaining):
                    raise Unavailable(
                        f"run {run_id} was asked to stop and is finishing its step; it starts again once it has "
                        "stopped: ask again"
                    )
            elif releasing is not None:
                if not releasing.wait_released(remaining):
                    with self._lock:
                        self._give_up(start)
                    raise Unavailable(
                        f"run {releasing.run_id} has ended and the trainer is still letting go of it (closing its "
                        f"weight sync with the fleet, freeing its policy); run {run_id} starts once it has: ask again"
                    )
            # The same run asked again while it starts (a caller that restarted or timed out): the answer is
            # that start's outcome, not "busy with" the run itself (or, once the shutdown has begun, Unavailable).
            elif under_way is not None and not under_way.settled.wait(remaining):
                raise Unavailable(f"run {run_id} is still starting (loading its policy, loading the fleet); ask again")
        assert start is not None  # registered before the loop ends
        threading.Thread(target=self._load, args=(start, run_id, spec), name=f"start-{run_id}", daemon=True).start()
        # As long as the load: each of its waits (the ranks' collective timeout, the router's weight_load_timeout_s)
        # is bounded, and the shutdown ends this one at once.
        start.settled.wait()
        if not start.done.is_set():
            raise Unavailable(
                f"the trainer is shutting down; run {run_id} was still starting and does not start here: ask again "
                "once the trainer is back (the run resumes from its last checkpoint)"
            )
        if start.error is not None:
            raise start.error
        assert start.status is not None  # one of the two, before `done`
        return start.status

    def _load(self, start: _Start, run_id: str, spec: RunSpec) -> None:
        """Thread of `start`: loads the run and trains it, or ends it at once when it was stopped meanwhile."""
        try:
            with _unavailable_dependencies(run_id, self.settings.work_dir / "runs" / run_id, spec.model.path):
                run = self._prepare(run_id, spec)
            start.first_step = run.step + 1
            with self._lock:
                # Checked under the lock StopRun looks the run up with: a stop either finds the run
                # training (and stops it there) or is seen here.
                if not start.stop.is_set():
                    self._train(run)
                    start.status = run.status()
                    return
            release_policy(self.ranks, run_id, run.policy)
            run.update(state=TrainerState.TRAINER_STATE_STOPPED)
            with self._lock:
                self._release_finished()
                self._runs[run_id] = run
            logger.info("run %s was stopped while it started; it does not train", run_id, extra={"run_id": run_id})
            start.status = run.status()
        except Exception as exc:  # noqa: BLE001 - the outcome of the start, raised to the call waiting for it
            start.error = exc
        finally:
            with self._lock:
                self._starting.pop(run_id, None)
            start.done.set()
            start.settled.set()

    def _give_up(self, start: _Start | None) -> None:
        """Withdraws this call's start, registered while it waited for the previous run's release (under `_lock`)."""
        if start is not None:
            for run_id, registered in list(self._starting.items()):
                if registered is start:
                    del self._starting[run_id]
            start.done.set()
            start.settled.set()

    def _train(self, run: ActiveRun) -> None:
        """Makes `run` this trainer's run and starts its training thread (under `_lock`)."""
        self._release_finished()
        self._starting.pop(run.run_id, None)
        # Resumed: the reports of the steps it resumes after are still its own (the steps after them are taken again).
        run.reports.extend(r for r in self._finished_reports.pop(run.run_id, []) if r.step <= run.step)
        self._runs[run.run_id] = run
        run.update(state=TrainerState.TRAINER_STATE_TRAINING)
        self.metrics.start_run(run.step, run.weight_version, run.checkpoint_step)
        run.thread = threading.Thread(
            target=train_run,
            args=(run, self.settings, self.router, self.checkpoints, self.metrics),
            name=f"train-{run.run_id}",
            daemon=True,
        )
        run.thread.start()
        logger.info("run %s started at step %d (weight version %d)", run.run_id, run.step, run.weight_version)

    def held(self) -> TrainerStatus:
        """The status of the run this trainer is busy with (training or starting it), or state IDLE when
        it would start any run: what Status without a run id answers."""
        with self._lock:
            for run in self._runs.values():
                if not run.finished:
                    return run.status()
            for run_id in self._starting:
                return _starting_status(run_id)
        return TrainerStatus(state=TrainerState.TRAINER_STATE_IDLE)

    def status(self, run_id: str) -> TrainerStatus:
        """The run's status (STARTING while StartRun loads it); Checkpoint and WatchSteps look their run up
        here too."""
        check_run_id(run_id)
        with self._lock:
            # Before `_runs`: a stopped run of the same id may be there while StartRun resumes it.
            if run_id in self._starting:
                return _starting_status(run_id)
            if run_id in self._runs:
                return self._runs[run_id].status()
            if run_id in self._finished:
                return self._finished[run_id]
        raise NotFound(f"this trainer has no run {run_id!r}; StartRun resumes it")

    def checkpoint(self, run_id: str, timeout_s: float | None = None) -> CheckpointResponse:
        """A checkpoint covering every step taken so far, taken at the next step boundary (the
        latest one when it does already).

        Waits up to `timeout_s` (by default `checkpoint_timeout_s`) for the step in progress to end;
        DeadlineExceeded if it has not by then (the checkpoint is still taken at its end: ask again).
        Unavailable while the run is starting: it has taken no step to cover yet."""
        start, run = self._lookup(run_id)
        if start is not None:
            raise Unavailable(f"run {run_id} is still starting (loading its policy and the fleet); ask again")
        if run is None:
            status = self.status(run_id)  # raises NotFound for unknown runs
            if not status.checkpoint_path or status.checkpoint_step != status.step:
                raise Conflict(
                    f"run {run_id} stopped at step {status.step} without a checkpoint of it; "
                    "StartRun resumes it from its last checkpoint"
                )
            return CheckpointResponse(
                path=status.checkpoint_path, step=status.checkpoint_step, weight_version=status.checkpoint_step
            )
        return run.request_checkpoint(self.settings.checkpoint_timeout_s if timeout_s is None else timeout_s)

    def stop_run(self, run_id: str, checkpoint: bool = False, timeout_s: float = STOP_WAIT_S) -> TrainerStatus:
        """Stops after the step in progress (a run still starting stops once loaded, without training);
        with `checkpoint`, checkpoints first, so the groups it trained since the last checkpoint are
        acknowledged instead of trained again on resume.

        Waits up to `timeout_s` for the run to stop; DeadlineExceeded if it has not by then (the stop
        stands: ask again). A run that has stopped answers with its final status, however often asked.
        """
        check_run_id(run_id)
        deadline = time.monotonic() + timeout_s
        self.request_stop(run_id, checkpoint)
        with self._lock:
            run, start = self._runs.get(run_id), self._starting.get(run_id)
        if start is not None:
            start.stop.set()
            if not start.done.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise DeadlineExceeded(
                    f"run {run_id} is still starting after {timeout_s:.0f}s; it stops once loaded: ask again"
                )
            run = self._active(run_id)  # stopped at its start, or it had started before the stop came
        if run is None:
            status = self.status(run_id)
        else:
            run.update(checkpoint_on_stop=checkpoint or run.checkpoint_on_stop)
            run.stop.set()
            if run.thread is not None:
                run.thread.join(timeout=max(0.0, deadline - time.monotonic()))
                if run.thread.is_alive():
                    raise DeadlineExceeded(
                        f"run {run_id} is still finishing its step (or letting go of its policy) after "
                        f"{timeout_s:.0f}s; it stops after it: ask again"
                    )
            if not run.finished:
                run.update(state=TrainerState.TRAINER_STATE_STOPPED)
            status = run.status()
        if checkpoint and status.state == TrainerState.TRAINER_STATE_STOPPED and status.checkpoint_step != status.step:
            raise Conflict(
                f"run {run_id} had stopped at step {status.step} before a checkpoint was asked for; its last "
                f"checkpoint is of step {status.checkpoint_step}, and StartRun resumes from there"
            )
        return status

    def request_stop(self, run_id: str, checkpoint: bool = False) -> None:
        """What StopRun records before it waits: the run stops after its step in progress (checkpointing first
        when asked), or once loaded when it is still starting. Waits for nothing, so the gRPC layer records the stop
        before it waits for a handler thread, and the stop stands even when its caller hears no answer."""
        with self._lock:  # the lock StartRun checks its stop under: the start sees this stop, or it trains already
            start, run = self._starting.get(run_id), self._runs.get(run_id)
            if start is not None:
                start.stop.set()
            elif run is not None and not run.finished:
                run.update(checkpoint_on_stop=checkpoint or run.checkpoint_on_stop)
                run.stop.set()

    def request_checkpoint(self, run_id: str) -> None:
        """What a Checkpoint call records before it waits: the training run takes a checkpoint at its next step
        boundary unless one covers its last step already. Waits for nothing (see `request_stop`)."""
        start, run = self._lookup(run_id)
        if start is None and run is not None:
            run.want_checkpoint()

    def reports(self, run_id: str, from_step: int) -> tuple[list[StepReport], bool]:
        """Step reports with step >= from_step, and whether the run has finished (a run that is starting
        has none yet, and goes on)."""
        start, run = self._lookup(run_id)
        if start is not None:
            return [], False
        if run is None:
            self.status(run_id)  # raises NotFound for unknown runs
            with self._lock:
                kept = self._finished_reports.get(run_id, [])
            return [r for r in kept if r.step >= from_step], True
        finished = run.finished
        return run.reports_from(from_step), finished

    def first_step_to_watch(self, run_id: str) -> Callable[[], int | None]:
        """Where WatchSteps with from_step 0 ("the next step") begins, as a function to ask until it answers: the step
        after the run's current one; for a run that is starting, the first step that start takes (its checkpoint's
        step + 1 when it resumes), None until the run is loaded. A run resumed in this process keeps the reports of
        the steps it resumes after, which "the next step" must not replay. NotFound for a run this trainer never had
        (also once a start it was asked during failed)."""
        start, _ = self._lookup(run_id)
        if start is None:
            step = self.status(run_id).step + 1
            return lambda: step

        def first_step() -> int | None:
            if not start.done.is_set():
                return None
            return start.first_step if start.first_step is not None else self.status(run_id).step + 1

        return first_step

    def wait_for_change(self, run_id: str, timeout_s: float) -> None:
        start, run = self._lookup(run_id)
        if start is not None:
            start.done.wait(timeout=timeout_s)
        elif run is not None:
            with run.changed:
                run.changed.wait(timeout=timeout_s)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stops every run after its step in progress, checkpointing it (a graceful termination,
        e.g. SIGTERM, loses no training); a run still starting stops once loaded, without training,
        and no run starts afterwards. The calls waiting for a start answer Unavailable at once. Waits up to
        `timeout_s` in all (`serve` passes --shutdown-timeout-s): a step still going on then is abandoned without
        its checkpoint, a start still loading (its thread does not hold the process) without its run."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._closing = True
            starts = list(self._starting.values())
        for start in starts:
            start.stop.set()
            start.settled.set()  # its callers hear of the shutdown now, not once the load (of the fleet) has ended
        for start in starts:
            start.done.wait(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            runs = list(self._runs.values())  # with any that had started before its stop came
        for run in runs:
            run.update(checkpoint_on_stop=True)
            run.stop.set()
        for run in runs:
            if run.thread is not None:
                run.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- internals --------------------------------------------------------------------------------

    def _active(self, run_id: str) -> ActiveRun | None:
        with self._lock:
            return self._runs.get(run_id)

    def _training(self) -> tuple[str, int] | None:
        """The run being trained, as (run id, groups trained); None when no run trains (none, starting, ended)."""
        with self._lock:
            runs = [run for run in self._runs.values() if not run.finished]
        if not runs:
            return None
        with runs[0].changed:
            return runs[0].run_id, runs[0].groups_trained

    def _lookup(self, run_id: str) -> tuple[_Start | None, ActiveRun | None]:
        """The run's start in progress, if any, and its run object (a stopped one while it starts again)."""
        with self._lock:
            return self._starting.get(run_id), self._runs.get(run_id)

    def _release_finished(self) -> None:
        """Keeps only the status and step reports of finished runs, freeing their models (the reports of the latest
        KEPT_FINISHED_RUNS only)."""
        for run_id, run in list(self._runs.items()):
            if run.finished:
                self._finished[run_id] = run.status()
                self._finished_reports.pop(run_id, None)
                self._finished_reports[run_id] = run.reports_from(0)
                while len(self._finished_reports) > KEPT_FINISHED_RUNS:
                    del self._finished_reports[next(iter(self._finished_reports))]
                del self._runs[run_id]

    def _prepare(self, run_id: str, spec: RunSpec) -> ActiveRun:
        """The run loaded on every rank (resumed from its record when it has one), its version served by
        the fleet."""
        base = Path(spec.model.path)
        if not (base / "config.json").exists():
            raise InvalidInput(f"model.path: no Hugging Face model at {base} (config.json missing)")
        record = self.store.load(run_id)
        run_dir = self.settings.work_dir / "runs" / run_id
        weights_root, checkpoints_root = run_dir / "weights", run_dir / "checkpoints"
        if record is None and (steps := checkpoint_steps(checkpoints_root)):
            aside = set_aside(checkpoints_root)
            logger.warning(
                "run %s has no record in Redis but checkpoints of steps %s in %s: it starts from step 0, and they "
                "were moved to %s. Redis lost the run's record (emptied, restored from an old snapshot, another "
                "--redis-prefix), or a trainer died before recording them; to resume from them, restore Redis's "
                "data and move them back",
                run_id,
                ", ".join(map(str, steps)),
                checkpoints_root,
                aside,
                extra={"run_id": run_id},
            )
        # A fresh run writes nothing before its first step: a work dir it cannot write would fail the run only
        # then, a step of rollouts later, for good. Found now, the start is UNAVAILABLE and asked again.
        for directory in (weights_root, checkpoints_root):
            directory.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        try:
            try:
                policy = self.ranks.call("load_run", spec)
            # transformers', safetensors' and huggingface_hub's (a config field of the wrong type) "cannot load"
            except (ValueError, KeyError, SafetensorError, StrictDataclassError) as exc:
                raise InvalidInput(
                    f"model.path: the model at {base} cannot be loaded: {type(exc).__name__}: {exc}"
                ) from exc
            # A token id outside the model's vocabulary would fail every step holding it (an index error in the
            # embedding or the log-prob gather): such an entry goes to the dead letters when it is read.
            vocab_size = int(policy.model.config.vocab_size)
            run = ActiveRun(
                run_id=run_id,
                spec=spec,
                ranks=self.ranks,
                policy=policy,
                stream=SampleStream(self.client, run_id, prefix=self.settings.redis_prefix, vocab_size=vocab_size),
                weights_root=weights_root,
                checkpoints_root=checkpoints_root,
                tokenizer_dir=Path(spec.model.tokenizer_path),
                weights_path=str(base.absolute()),  # the engines need not share this process's directory
            )
            if record is not None:  # last: restoring the RNG state must be the final use of the RNG
                self._resume(run, record)
            run.stream.ensure_consumer_group()
            # The fleet must serve the version the run continues from before anyone samples from it.
            self.router.load_weights(run.weights_path, run.weight_version)
            # A trainer that died between /pause_generation and /continue_generation left the fleet paused;
            # only now, with the whole version loaded (the pause may have caught a version half broadcast).
            resume_generation(self.router)
        except Exception:
            # A failed start holds nothing: on a GPU the model, optimizer and reference would stay pinned.
            release_policy(self.ranks, run_id)
            raise
        return run

    def _resume(self, run: ActiveRun, record: RunRecord) -> None:
        """Restores `run` from the checkpoint its record names and republishes that version."""
        path = Path(record.checkpoint_path)
        try:
            meta = self.ranks.call("checkpoint_load", str(path))
        except FileNotFoundError as exc:
            raise Conflict(f"run {run.run_id} cannot be resumed: {exc}") from exc
        except (pickle.UnpicklingError, EOFError) as exc:  # DCP's .metadata is a pickle: truncated or overwritten
            raise Conflict(
                f"run {run.run_id} cannot be resumed: its checkpoint {path} cannot be read ({type(exc).__name__}: "
                f"{exc}); it is damaged: restore it from a copy, or start the run under a new id"
            ) from exc
        except CheckpointFailed as exc:
            if exc.damaged:  # asking again would meet the same; the checkpoint's model is not the question
                raise Conflict(
                    f"run {run.run_id} cannot be resumed: its checkpoint {path} is damaged ({exc}); restore it from "
                    "a copy, or start the run under a new id"
                ) from exc
            if exc.storage:
                raise Unavailable(f"run {run.run_id} cannot be resumed now: {exc}") from exc
            raise Conflict(
                f"run {run.run_id} cannot be resumed with model.path {run.spec.model.path}: its checkpoint does "
                f"not fit that model (the run was trained from another one): {exc}"
            ) from exc
        if meta.step != record.step:
            raise Conflict(
                f"run {run.run_id}: the checkpoint at {path} is of step {meta.step} but the run's record says "
                f"step {record.step}; the checkpoint directory was replaced behind the trainer's back"
            )
        later = [s for s in checkpoint_steps(run.checkpoints_root) if s > record.step]
        if aside := set_aside_after(run.checkpoints_root, record.step):
            logger.warning(
                "run %s resumes from step %d, its record's, but %s holds checkpoints of later steps %s: they were "
                "moved to %s. A trainer died before recording them, or Redis was restored from an older snapshot; "
                "delete them, or, to resume from them, restore Redis's data and move them back",
                run.run_id,
                record.step,
                run.checkpoints_root,
                ", ".join(map(str, later)),
                aside,
                extra={"run_id": run.run_id},
            )
        prune_checkpoints(run.checkpoints_root, newest=record.step, keep=self.settings.keep_checkpoints)
        run.step, run.weight_version, run.groups_trained = meta.step, meta.weight_version, meta.groups_trained
        # The path as recorded: the next commit writes only over the record that names it (run_state.py).
        run.checkpoint_step, run.checkpoint_path, run.last_entry_id = (
            meta.step,
            record.checkpoint_path,
            meta.last_entry_id,
        )
        if meta.weight_version > 0:
            full = self.ranks.call("full_state_dict")
            weights = save_version(run.model, run.weights_root, meta.weight_version, run.tokenizer_dir, full)
            run.weights_path, run.weights_version = str(weights), meta.weight_version
        logger.info(
            "run %s resumes from its checkpoint of step %d (%d groups, through stream entry %s)",
            run.run_id,
            meta.step,
            meta.groups_trained,
            meta.last_entry_id or "-",
            extra={"run_id": run.run_id},
        )


@contextmanager
def _unavailable_dependencies(run_id: str, run_dir: Path, model_path: str) -> Iterator[None]:
    """Raises a failure of Redis or of storage while run `run_id` starts as Unavailable naming it: the caller
    asks again (the orchestrator retries only UNAVAILABLE and DEADLINE_EXCEEDED), instead of failing the run for
    good with an "internal error". Redis counts as failing when it stays unreachable past its client's retries or
    refuses writes (OOM, READONLY, MISCONF), storage when the OS reports an error (an `errno`) on a path. A
    library's own "cannot load" (transformers on a directory without weights, or with a config.json that is not
    JSON) is the spec's model: InvalidInput naming model.path."""
    try:
        yield
    except redis.RedisError as exc:
        if not redis_unavailable(exc):
            raise
        # A refusal's own text may quote the command sent (a run's record): say what it means instead.
        why = redis_refusal(exc) or f"Redis does not answer ({type(exc).__name__}: {exc})"
        raise Unavailable(f"run {run_id} cannot start now: {why}; ask again once Redis serves") from exc
    except OSError as exc:
        if exc.errno is None:  # a library's own "cannot load" rather than the OS failing on a path
            raise InvalidInput(f"model.path: the model at {model_path} cannot be loaded: {exc}") from exc
        where = exc.filename or run_dir
        raise Unavailable(
            f"run {run_id} cannot start now: storage failed at {where}: {exc.strerror or exc}; ask again once it serves"
        ) from exc


def check_run_id(run_id: str) -> None:
    """InvalidInput naming run_id unless a run can have it (RUN_ID), so every RPC refuses the same ids. An oversized
    one is quoted by its start only: quoted whole, the refusal outgrew what a gRPC status may carry, and the caller
    heard RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead of the field at fault."""
    if not run_id:
        raise InvalidInput("run_id must be set")
    if not RUN_ID.fullmatch(run_id):
        shown = (
            repr(run_id)
            if len(run_id) <= _RUN_ID_SHOWN
            else f"{run_id[:_RUN_ID_SHOWN]!r}... ({len(run_id)} characters)"
        )
        raise InvalidInput(f"run_id {shown} must be 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'")


def _starting_status(run_id: str) -> TrainerStatus:
    return TrainerStatus(run_id=run_id, state=TrainerState.TRAINER_STATE_STARTING)
