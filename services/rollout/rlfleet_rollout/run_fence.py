"""What a driver's write to its run's record checks first, in the write's own transaction: that the run is still
this driver's to write.

The lease (run_lease.py) keeps two orchestrators from driving a run together only as long as each driver stops in
time: its keeper looks every quarter of the lease's time, and a driver that is paused (a frozen VM, a stopped
process), whose task outlives its cancellation, or whose Redis lost the lease key (a failover, a restart without
persistence), could write the run's record after another orchestrator took the run over, under that one's writes.
So every write the run loop makes to its run's record (RunsCore.fenced, RunStore.update) also WATCHes and reads

- the run's lease key: it must still hold this orchestrator's token, else `LeaseLost`;
- the record: it must still exist, else `RecordLost` (Redis lost it; the run is not recreated, not half of it);
- the record's revision (`run:<id>:revision`, counted up by every write of the record in the write's own
  transaction): it must not be below the one this driver's last write of it made or saw, else `RecordLost` (Redis
  went back in time: a failover to a replica that was behind, a restore from an older copy).

A write refused raises, and the driver stops; the run is left as its record says, for whichever orchestrator holds
its lease (LeaseLost), or for the run queue to pick again from what is left of its records (RecordLost). The
working data the run loop writes from worker threads (its data position, its sample stream) is not fenced: each
write there is first-writer-wins or once per group id (run_data.py, rlfleet.sample_stream), so one landing late
from a driver that was stopped is one the run's next driver reconciles, as after a crash.
"""

from __future__ import annotations

from dataclasses import dataclass


class FencedOut(Exception):
    """A driver's write to its run's record was refused: the run is not this driver's to write any more. Not an
    RlfleetError: nothing of the run failed, and it must not be recorded as failed by the driver refused."""


class LeaseLost(FencedOut):
    """The run's lease is not this orchestrator's any more (another holds it, or nobody does)."""


class RecordLost(FencedOut):
    """The run's record vanished from Redis, or went back to an earlier revision, while this orchestrator drove it."""


@dataclass
class RunFence:
    """One driven run's fence: its lease key, the token the lease must hold, and the record's revision as this
    driver last wrote or saw it (only ever raised)."""

    run_id: str
    lease_key: str
    token: str
    revision: int = 0

    def check(self, holder: bytes | str | None, record_exists: bool, revision: int) -> None:
        """Raises unless the run is still this driver's: read in the transaction of the write about to be made."""
        run_id = self.run_id
        if not record_exists:
            raise RecordLost(
                f"run {run_id}: its record is gone from Redis while this orchestrator drove it (Redis lost writes: "
                "restarted without persistence, or failed over to a replica that had not received them); the run "
                "is not recreated"
            )
        holder = holder.decode() if isinstance(holder, bytes) else holder
        if holder != self.token:
            raise LeaseLost(
                f"run {run_id}: its lease is held by {f'orchestrator {holder}' if holder else 'nobody'}, not by this "
                f"one ({self.token}); this one's writes to the run are refused"
            )
        if revision < self.revision:
            raise RecordLost(
                f"run {run_id}: its record went back from revision {self.revision}, written by this orchestrator, to "
                f"{revision} (Redis lost writes: a failover to a replica that was behind, or a restore from an older "
                "copy); the run is picked again from its records as they are now"
            )
