"""Taking a run's checkpoint: write it (checkpoint.py), then commit it (run_state.py).

The commit is what acknowledges groups: the run's record is pointed at the new checkpoint and every
group trained since the previous one is acknowledged in one Redis transaction. A trainer killed
after the write but before the commit resumes from the previous checkpoint, whose groups are the
acknowledged ones; the unrecorded directory is moved aside at the resume (`set_aside_after`). A Redis that is
unavailable is waited out, as the run's reads wait it out: the commit is safe to repeat, and a run whose
checkpoint could not be recorded must not fail for good over an outage that ends.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlfleet_trainer.active_run import ActiveRun
from rlfleet_trainer.checkpoint import CheckpointMeta, prune_checkpoints
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.redis_wait import waiting_out_redis
from rlfleet_trainer.run_state import RunRecord, RunStateStore

logger = logging.getLogger(__name__)


class CheckpointCommitter:
    """Used by the training thread only, between steps."""

    def __init__(self, store: RunStateStore, keep: int, metrics: TrainerMetrics) -> None:
        self.store = store
        self.keep = keep
        self.metrics = metrics

    def commit(self, run: ActiveRun, step: int, groups_trained: int) -> None:
        """Checkpoints `run` as of `step` (its model must be at that step's end), unless its last
        checkpoint is of that step already; wakes whoever asked for a checkpoint."""
        if run.checkpoint_path and run.checkpoint_step == step:
            run.update(checkpoint_wanted=False)
            return
        started = time.perf_counter()
        last_entry_id = run.uncommitted[-1] if run.uncommitted else run.last_entry_id
        meta = CheckpointMeta(
            step=step, weight_version=step, groups_trained=groups_trained, last_entry_id=last_entry_id
        )
        # A save of a large model takes minutes: said as it starts, it is not taken for a hang.
        logger.info(
            "run %s: writing the checkpoint of step %d under %s",
            run.run_id,
            step,
            run.checkpoints_root,
            extra={"run_id": run.run_id, "step": step},
        )
        path = run.ranks.call("checkpoint_save", str(run.checkpoints_root), meta)
        written = time.perf_counter() - started
        megabytes = _megabytes(Path(path))
        logger.info(
            "run %s: checkpoint of step %d written, %s in %.2fs (SHA-256 sums included)",
            run.run_id,
            step,
            "size unknown" if megabytes is None else f"{megabytes:.1f} MB ({megabytes / max(written, 1e-9):.1f} MB/s)",
            written,
            extra={"run_id": run.run_id, "step": step},
        )
        record = RunRecord(
            step=step,
            weight_version=step,
            checkpoint_path=str(path),
            groups_trained=groups_trained,
            last_entry_id=last_entry_id,
        )

        def committed() -> bool:
            self.store.commit(run.run_id, record, run.stream, run.uncommitted, replaces=run.checkpoint_path)
            return True

        if waiting_out_redis(run, committed) is None:
            logger.warning(
                "run %s: the checkpoint of step %d at %s is not recorded (Redis stayed unavailable until the run was "
                "told to stop); the run resumes from its last recorded checkpoint, and the groups since are trained "
                "again",
                run.run_id,
                step,
                path,
                extra={"run_id": run.run_id, "step": step},
            )
            return
        prune_checkpoints(run.checkpoints_root, newest=step, keep=self.keep)
        elapsed = time.perf_counter() - started
        logger.info(
            "run %s: checkpoint of step %d at %s covers %d new group(s) (%.2fs)",
            run.run_id,
            step,
            path,
            len(run.uncommitted),
            elapsed,
            extra={"run_id": run.run_id, "step": step},
        )
        run.update(
            checkpoint_step=step,
            checkpoint_path=str(path),
            last_entry_id=last_entry_id,
            uncommitted=[],
            checkpoint_wanted=False,
        )
        self.metrics.checkpoint_seconds.observe(elapsed)
        self.metrics.checkpoint_step.set(step)


def _megabytes(directory: Path) -> float | None:
    """The size of the files in `directory`, in MB; None if it cannot be read."""
    try:
        return sum(f.stat().st_size for f in directory.iterdir() if f.is_file()) / 1e6
    except OSError:
        return None
