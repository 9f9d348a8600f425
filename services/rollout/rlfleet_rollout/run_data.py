"""A run's data: its train prompts in a seeded order per epoch, its held-out prompts, and where it has got to.

Train prompts are addressed by a position that counts on over every epoch: position `p` is row
`order(p // n)[p % n]` of the n train rows, where `order(e)` is a permutation seeded by the dataset
seed and the epoch. A run that needs more prompts than one pass holds goes on to the next epoch,
and the same position always names the same prompt, so a restarted orchestrator that resumes at a
saved position (`DataPosition`) neither repeats nor skips a prompt of an epoch.

A step takes at most `window` consecutive positions (rollout.max_prompts_per_step), and one that
crosses into the next epoch must not take a prompt twice: each epoch's order after the first moves
the rows that ended the previous epoch out of its first `window` positions (swapping them with rows
from the middle of the epoch, so its own last `window` positions stay those of its shuffle). With
fewer than 3 x window rows the guard covers a third of the rows (a generated pool is never that small
when its split holds more problems); a step that spans more positions than the dataset holds repeats
prompts by necessity.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import redis

from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet_rollout.datasets import LoadedDataset, Prompt, load_dataset


class RunData:
    def __init__(self, loaded: LoadedDataset, *, seed: int, window: int = 0) -> None:
        self.train = loaded.train
        self.eval_prompts = loaded.eval
        self.skipped_rows = len(loaded.skipped)
        self.seed = seed
        self.window = min(max(0, window), len(self.train) // 3)
        self._order = lru_cache(maxsize=4)(self._permutation)

    @classmethod
    def from_spec(cls, spec: RunSpec, position: DataPosition | None = None) -> RunData:
        """Reads the dataset of a resolved, validated spec; InvalidInput naming the field when it cannot serve it.

        A generated (arithmetic) pool holds the problems the steps send first, and at least 3 x
        max_prompts_per_step, so that the epoch guard covers every position a step may take. Given the run's
        `position`, a run that started on the smaller pool sized before (the problems sent first alone, its
        fingerprint recorded) resumes on that pool: its recorded positions name its problems."""
        ro = spec.rollout
        first_waves = spec.schedule.steps * math.ceil(ro.oversample * ro.groups_per_step)
        data = cls._read(spec, max(first_waves, 3 * ro.max_prompts_per_step))
        if position is None or not spec.dataset.HasField("arithmetic"):
            return data
        recorded = position.pinned_dataset()
        if recorded in (None, data.fingerprint()):
            return data
        started = cls._read(spec, first_waves)
        return started if started.fingerprint() == recorded else data

    @classmethod
    def _read(cls, spec: RunSpec, train_prompts_wanted: int) -> RunData:
        loaded = load_dataset(spec.dataset, train_prompts_wanted)
        return cls(loaded, seed=spec.dataset.seed, window=spec.rollout.max_prompts_per_step)

    def fingerprint(self) -> str:
        """A digest of the train and held-out rows in order: positions name the same prompts, and the held-out
        set is the same, exactly when two reads of the dataset give the same fingerprint."""
        digest = hashlib.sha256()
        for part, prompts in (("train", self.train), ("eval", self.eval_prompts)):
            digest.update(f"{part}:{len(prompts)}\n".encode())
            for p in prompts:
                digest.update(json.dumps([p.prompt, p.answer, sorted(p.metadata.items())]).encode() + b"\n")
        return digest.hexdigest()[:16]

    def epoch_of(self, position: int) -> int:
        return position // len(self.train)

    def prompt_at(self, position: int) -> Prompt:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        epoch, offset = divmod(position, len(self.train))
        return self.train[self._order(epoch)[offset]]

    def _permutation(self, epoch: int) -> list[int]:
        order = self._shuffle(epoch)
        w = self.window
        if epoch == 0 or w == 0:
            return order
        previous_tail = set(self._shuffle(epoch - 1)[-w:])
        # Rows of the middle that did not end the previous epoch; with len >= 3w there are at least as many as
        # rows of the previous tail in this epoch's head.
        spare = [i for i in range(w, len(order) - w) if order[i] not in previous_tail]
        for i in range(w):
            if order[i] in previous_tail:
                j = spare.pop()
                order[i], order[j] = order[j], order[i]
        return order

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
        return order


def data_position_key(run_id: str, prefix: str) -> str:
    return f"{prefix}run:{run_id}:data_position"


@dataclass(frozen=True)
class StepCounts:
    """What the producer of a step set aside: groups dropped, by reason, and groups sent with a reduced weight; and
    the rewards of the step's usable samples (their sum and number), for its mean reward."""

    filtered: Mapping[str, int] = field(default_factory=dict)
    downweighted: int = 0
    reward_sum: float = 0.0
    rewards: int = 0
    """0 in a record written before rewards were: its mean is unknown."""


class DataPosition:
    """The position each step of a run starts at, in Redis (`run:<id>:data_position`, a hash step -> position).

    Step 0 starts at 0; step s + 1 starts where step s ended, recorded once step s's groups are chosen and
    before they go on the stream, with the position of the prompt in each of its slots. A restarted
    orchestrator that re-produces step s reads the same start, and fills the slots the stream lacks with
    the recorded prompts (a new pass through the filters could choose others, training a prompt twice in
    the epoch and another never). Each record carries the token of the producer that wrote it (one per
    instance), so a producer whose write went through but whose reply was lost (the client retried it)
    still knows the record is its own, and the step's `StepCounts`, written once with the rest, so that
    whoever records the run's progress counts the step as its producer did, however often it is asked to.
    Record value: "<end> <token> <slot positions, comma-separated> <counts as JSON>".
    """

    def __init__(self, client: redis.Redis, run_id: str, *, prefix: str) -> None:
        self.client = client
        self.key = data_position_key(run_id, prefix)
        self.token = uuid.uuid4().hex

    def pin_dataset(self, fingerprint: str) -> str:
        """Records the run's dataset fingerprint (RunData.fingerprint) the first time; returns the recorded one."""
        self.client.hsetnx(self.key, "dataset", fingerprint)
        return self.pinned_dataset() or fingerprint

    def pinned_dataset(self) -> str | None:
        """The dataset fingerprint the run recorded at its first start; None before it."""
        raw = self.client.hget(self.key, "dataset")
        return raw.decode() if isinstance(raw, bytes) else None

    def start_of(self, step: int) -> int:
        if step == 0:
            return 0
        raw = self.client.hget(self.key, str(step))
        if raw is None:
            raise LookupError(f"no data position recorded for step {step}")
        return int(raw.split()[0])

    def record_end(self, step: int, position: int, slots: list[int], counts: StepCounts) -> bool:
        """Records where step `step` ended, the prompt position of each of its slots and what it set aside; False
        if another producer recorded it first (the step was re-produced after a restart)."""
        tally = {
            "filtered": dict(counts.filtered),
            "downweighted": counts.downweighted,
            "reward_sum": counts.reward_sum,
            "rewards": counts.rewards,
        }
        # Compact JSON: no space in it but those a reason's name may hold, as the fields are split on spaces.
        value = f"{position} {self.token} {','.join(str(p) for p in slots)} {json.dumps(tally, separators=(',', ':'))}"
        if self.client.hsetnx(self.key, str(step + 1), value):
            return True
        return self.client.hget(self.key, str(step + 1)) == value.encode()

    def slots_of(self, step: int) -> list[int] | None:
        """The prompt positions recorded for step `step`'s slots; None when the step has no record yet (or one
        written before slots were recorded)."""
        raw = self.client.hget(self.key, str(step + 1))
        fields = raw.decode().split() if isinstance(raw, bytes) else []
        if len(fields) < 3:
            return None
        return [int(p) for p in fields[2].split(",")]

    def counts_of(self, steps: range) -> dict[int, StepCounts]:
        """What the producers of `steps` set aside, by step."""
        raws = self.client.hmget(self.key, [str(step + 1) for step in steps]) if steps else []
        return {step: _step_counts(raw) for step, raw in zip(steps, raws, strict=True)}


def _step_counts(raw: object) -> StepCounts:
    fields = raw.decode().split(" ", 3) if isinstance(raw, bytes) else []
    if len(fields) < 4:  # recorded before counts were
        return StepCounts()
    tally = json.loads(fields[3])
    return StepCounts(tally["filtered"], tally["downweighted"], tally.get("reward_sum", 0.0), tally.get("rewards", 0))
