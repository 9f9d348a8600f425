"""The trainer's durable record of a run: its last checkpoint, and which groups that covers.

A step acknowledges nothing. A checkpoint commit writes the record (pointing at the checkpoint) and
acknowledges every group trained since the previous checkpoint in one Redis transaction, so after
a crash the record and the stream's pending list always agree: every group the checkpoint covers
is acknowledged, every group it does not cover is still pending and is trained on again after the
trainer resumes from that checkpoint. What is acknowledged is then trimmed from the stream (unless the
trainer keeps trained groups), so Redis holds a run's untrained groups, not all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis

from rlfleet.errors import Conflict
from rlfleet.sample_stream import SampleStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecord:
    step: int = 0
    weight_version: int = 0
    checkpoint_path: str = ""
    groups_trained: int = 0
    last_entry_id: str = ""
    """Last stream entry the checkpoint covers (empty before the first group)."""


class RunStateStore:
    def __init__(self, client: redis.Redis, prefix: str, *, keep_trained_groups: bool = False) -> None:
        self.client = client
        self.prefix = prefix
        self.keep_trained_groups = keep_trained_groups

    def key(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}:trainer"

    def load(self, run_id: str) -> RunRecord | None:
        raw = cast(dict[bytes, bytes], self.client.hgetall(self.key(run_id)))
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        if "checkpoint_path" not in fields:
            raise Conflict(
                f"the trainer's record of run {run_id} ({self.key(run_id)}) predates checkpoints and names "
                "no checkpoint to resume from; start the run under a new id"
            )
        try:
            return RunRecord(
                step=int(fields["step"]),
                weight_version=int(fields["weight_version"]),
                checkpoint_path=fields["checkpoint_path"],
                groups_trained=int(fields["groups_trained"]),
                last_entry_id=fields.get("last_entry_id", ""),
            )
        except (KeyError, ValueError) as exc:  # only this store writes it: something else did, or it was cut
            raise Conflict(
                f"the trainer's record of run {run_id} ({self.key(run_id)}) is not one it wrote: {fields!r} "
                f"({type(exc).__name__}: {exc}); start the run under a new id"
            ) from exc

    def commit(
        self, run_id: str, record: RunRecord, stream: SampleStream, entry_ids: Sequence[str], *, replaces: str = ""
    ) -> None:
        """Saves `record` and acknowledges `entry_ids` atomically (MULTI/EXEC), then trims what is acknowledged.

        `replaces` is the checkpoint path of the record this one follows ("" for a run's first): the record is
        written only while it still says so (WATCH), or already says `record` (this commit, its reply lost).
        Anything else means Redis lost writes it had acknowledged (a restart from a snapshot or an AOF missing its
        last second, a failover to a replica behind): the groups acknowledged with the later checkpoints are
        pending again and the orchestrator's appends since may be gone, so training on would train groups twice
        or steps of the wrong groups, and the run fails (Conflict) rather than do so silently."""
        key = self.key(run_id)
        while True:
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key)
                    raw = pipe.hget(key, "checkpoint_path")
                    stored = raw.decode() if isinstance(raw, bytes) else ""
                    if stored == record.checkpoint_path:
                        break
                    if stored != replaces:
                        raise Conflict(
                            f"run {run_id}: Redis lost writes it had acknowledged: its record of the run "
                            f"({key}) names checkpoint {stored or 'none'!r}, not {replaces or 'none'!r}, which "
                            "this trainer committed after it; the run's stream no longer holds what was trained "
                            "(a Redis restarted without its last writes, or a failover to a replica behind). "
                            "Start the run again, or export that checkpoint (rlfleet_trainer export) and warm-start a "
                            "new run from it"
                        )
                    pipe.multi()
                    pipe.hset(
                        key,
                        mapping={
                            "step": record.step,
                            "weight_version": record.weight_version,
                            "checkpoint_path": record.checkpoint_path,
                            "groups_trained": record.groups_trained,
                            "last_entry_id": record.last_entry_id,
                        },
                    )
                    if entry_ids:
                        pipe.xack(stream.key, stream.consumer_group, *entry_ids)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue  # written meanwhile (by this commit, its reply lost): the next look tells
        if self.keep_trained_groups:
            return
        try:
            stream.trim_acknowledged()
        except redis.RedisError as exc:  # the record is committed; the next commit trims what this one left
            logger.warning("run %s: acknowledged groups not trimmed from %s: %s", run_id, stream.key, exc)
