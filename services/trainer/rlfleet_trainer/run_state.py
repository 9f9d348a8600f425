"""The trainer's durable record of a run: how far it got, and which groups that covers.

The record and the acknowledgement of the groups a step trained on are written in one Redis
transaction, so after a crash the record and the stream's pending list always agree: every group
the record covers is acknowledged, every group it does not cover is still pending and is trained
on again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import redis

from rlfleet.sample_stream import SampleStream


@dataclass(frozen=True)
class RunRecord:
    step: int = 0
    weight_version: int = 0
    weights_path: str = ""
    groups_trained: int = 0


class RunStateStore:
    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def key(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}:trainer"

    def load(self, run_id: str) -> RunRecord | None:
        raw = cast(dict[bytes, bytes], self.client.hgetall(self.key(run_id)))
        if not raw:
            return None
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        return RunRecord(
            step=int(fields["step"]),
            weight_version=int(fields["weight_version"]),
            weights_path=fields["weights_path"],
            groups_trained=int(fields["groups_trained"]),
        )

    def commit(self, run_id: str, record: RunRecord, stream: SampleStream, entry_ids: Sequence[str]) -> None:
        """Saves `record` and acknowledges `entry_ids` atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(
            self.key(run_id),
            mapping={
                "step": record.step,
                "weight_version": record.weight_version,
                "weights_path": record.weights_path,
                "groups_trained": record.groups_trained,
            },
        )
        if entry_ids:
            pipe.xack(stream.key, stream.consumer_group, *entry_ids)
        pipe.execute()
