"""The token/logprob cache of multi-turn trajectories: what the engines produced, turn by turn, kept by id.

A trajectory is one conversation whose turns all passed through the router under one trajectory id.
Each turn brings the prompt ids the engine ran on, the ids it generated and their logprobs. The
store lays them out as one sample:

    prompt_ids    = the first turn's prompt
    response_ids  = output_1 + between_2 + output_2 + ... + output_k
    loss_mask     = 1 on every output token, 0 on every between token (tool results, the next user turn)
    logprobs      = the engine's logprob on output tokens, 0.0 on between tokens

where between_i is what turn i's prompt adds after everything before it. A turn sent again under the rid and
with the prompt of the last one (its client lost the answer and retried) takes that turn's place. That layout is
exact only
if each prompt starts with the trajectory so far; a turn whose prompt does not (the client rewrote
history, or re-tokenisation changed a token) marks the trajectory diverged, and reading it is then a
Conflict naming the turn, never a silently different sequence. So does a turn whose answer the router
could not read (`record_lost`): the trajectory would miss its tokens, or its next turn would start a new
one with the model's earlier outputs inside its prompt. So does a turn that arrives after its trajectory
was evicted: the store remembers the last `MAX_EVICTED_IDS` ids it evicted, and why.

Ids are kept as 32-bit integers, logprobs as doubles (exactly as the engine sent them) and the mask as bytes:
a stored token costs 4 bytes in the prompt and 13 in the response (lists of Python objects cost about 60).
Memory is bounded by a token budget (least recently used trajectories go first), which also charges each
trajectory for its entry and every turn's record (as 64 and 32 tokens), so trajectories with few tokens (a first
turn that was lost, a diverged one taking turns) cannot pile up under it; a diverged trajectory gives back its
tokens and records at once, since it can never be read. Memory is bounded by staleness as well:
each trajectory remembers the fleet's weight update count at its last turn, and trajectories more
than `max_update_lag` updates behind are dropped when the fleet loads new weights.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from rlfleet.errors import Conflict, NotFound

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    rid: str | None
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    weight_version: str | None
    """The version the answer went out on."""
    engine: str
    weight_versions: tuple[str | None, ...] = ()
    """Every version that sampled one of the turn's tokens, oldest first (an update during the turn under
    on_weight_update "finish"); empty: only `weight_version`."""


# Ids are stored in 32 bits; callers check them against this first (array raises OverflowError).
TOKEN_ID_LIMIT = 2**31
# What the budget charges, in stored tokens of about 12 bytes, for a trajectory's entry (about 0.7 KB of Python
# objects) and for each turn's record (about 0.35 KB).
ENTRY_TOKENS = 64
TURN_TOKENS = 32
# The evicted ids remembered (about 0.15 KB each), so a conversation that goes on after its trajectory was evicted
# is told apart from a new one: far more than the conversations under way at once.
MAX_EVICTED_IDS = 65_536


def token_ids(ids: tuple[int, ...] = ()) -> array[int]:
    return array("i", ids)


@dataclass
class Trajectory:
    id: str
    prompt_ids: array[int]
    response_ids: array[int] = field(default_factory=token_ids)
    logprobs: array[float] = field(default_factory=lambda: array("d"))
    loss_mask: bytearray = field(default_factory=bytearray)
    turns: list[dict[str, object]] = field(default_factory=list)
    weight_versions: list[str | None] = field(default_factory=list)
    turn_versions: list[tuple[str | None, ...]] = field(default_factory=list)
    """The versions that sampled each turn's tokens, so a turn sent again can be taken back out."""
    diverged: str | None = None
    fleet_update: int = 0  # the fleet's weight update count at the last turn
    updated_at: float = field(default_factory=time.time)

    @property
    def tokens(self) -> int:
        """What the store's budget charges: the ids held, plus the entry and each turn's record."""
        return len(self.prompt_ids) + len(self.response_ids) + ENTRY_TOKENS + TURN_TOKENS * len(self.turns)

    def diverge(self, reason: str) -> None:
        """Marks the trajectory unreadable for `reason` and lets go of what it held: it can never be read again."""
        self.diverged = reason
        self.prompt_ids = token_ids()
        self.response_ids = token_ids()
        self.logprobs = array("d")
        self.loss_mask = bytearray()
        self.turns = []
        self.weight_versions = []
        self.turn_versions = []

    def take_back_last_turn(self) -> None:
        """Removes the last turn's output (its prompt's tokens stay: they are the trajectory so far)."""
        outputs = int(self.turns.pop()["output_tokens"])  # type: ignore[call-overload]
        if outputs:
            del self.response_ids[-outputs:]
            del self.logprobs[-outputs:]
            del self.loss_mask[-outputs:]
        self.turn_versions.pop()
        self.weight_versions = list(dict.fromkeys(v for versions in self.turn_versions for v in versions))

    def last_turn_sent_again(self, turn: Turn) -> bool:
        """Whether `turn` is the last turn sent again: the same rid and the same prompt (a client that lost the
        answer and retried it; the engine ran it twice, the client reads the second answer). A last turn without
        output (aborted before its first token, resumed under its rid) is extended as it is, and keeps its record."""
        if self.diverged is not None or not self.turns or turn.rid is None or self.turns[-1]["rid"] != turn.rid:
            return False
        if not self.turns[-1]["output_tokens"]:
            return False
        prompt_tokens = self.turns[-1]["prompt_tokens"]
        return len(turn.prompt_ids) == prompt_tokens and (self.prompt_ids + self.response_ids)[
            : len(turn.prompt_ids)
        ] == token_ids(turn.prompt_ids)

    def describe(self) -> dict[str, object]:
        return {
            "trajectory_id": self.id,
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "response_logprobs": self.logprobs.tolist(),
            "loss_mask": list(self.loss_mask),
            "turns": self.turns,
            "weight_versions": self.weight_versions,
            "num_turns": len(self.turns),
        }


class TrajectoryStore:
    def __init__(self, max_tokens: int, max_update_lag: int) -> None:
        if max_tokens < 1 or max_update_lag < 0:
            raise ValueError("max_tokens must be >= 1 and max_update_lag >= 0")
        self.max_tokens = max_tokens
        self.max_update_lag = max_update_lag
        self._entries: OrderedDict[str, Trajectory] = OrderedDict()
        self._evicted: OrderedDict[str, str] = OrderedDict()  # why each of the last evicted ids went
        self.tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, trajectory_id: str, turn: Turn, fleet_update: int) -> Trajectory:
        """Appends `turn` to the trajectory (created by its first turn); returns the trajectory."""
        trajectory = self._entries.pop(trajectory_id, None)
        if trajectory is None:
            trajectory = self._new(trajectory_id, turn.prompt_ids, turn.rid)
            between = token_ids()
        else:
            self.tokens -= trajectory.tokens
            if trajectory.last_turn_sent_again(turn):
                trajectory.take_back_last_turn()
            between = self._between(trajectory, turn)
        if trajectory.diverged is None:
            trajectory.response_ids += between + token_ids(turn.output_ids)
            trajectory.logprobs += array("d", [0.0]) * len(between) + array("d", turn.output_logprobs)
            trajectory.loss_mask += bytes(len(between)) + b"\x01" * len(turn.output_ids)
            trajectory.turns.append(
                {
                    "rid": turn.rid,
                    "engine": turn.engine,
                    "weight_version": turn.weight_version,
                    "prompt_tokens": len(turn.prompt_ids),
                    "output_tokens": len(turn.output_ids),
                }
            )
            # A turn aborted before its first token (to be resumed) names the version it waited on: it sampled nothing.
            versions = (turn.weight_versions or (turn.weight_version,)) if turn.output_ids else ()
            trajectory.turn_versions.append(versions)
            for version in versions:
                if version not in trajectory.weight_versions:
                    trajectory.weight_versions.append(version)
        trajectory.fleet_update = fleet_update
        trajectory.updated_at = time.time()
        self._entries[trajectory_id] = trajectory
        self.tokens += trajectory.tokens
        self._fit_budget()
        return trajectory

    def record_lost(self, trajectory_id: str, rid: str | None, engine: str, reason: str, fleet_update: int) -> None:
        """A turn that ran but whose answer could not be read: the trajectory (created if this was its first
        turn) can no longer be laid out, and reading it is a Conflict naming the turn."""
        trajectory = self._entries.pop(trajectory_id, None)
        if trajectory is None:
            trajectory = self._new(trajectory_id, (), rid)
        else:
            self.tokens -= trajectory.tokens
        if trajectory.diverged is None:
            trajectory.diverge(
                f"turn {len(trajectory.turns) + 1} (rid {rid!r}) ran on {engine}, but its answer could not be "
                f"recorded: {reason}"
            )
        trajectory.fleet_update = fleet_update
        trajectory.updated_at = time.time()
        self._entries[trajectory_id] = trajectory
        self.tokens += trajectory.tokens
        self._fit_budget()

    def get(self, trajectory_id: str) -> Trajectory:
        """The trajectory; NotFound if unknown or evicted, Conflict if a turn did not extend it."""
        trajectory = self._entries.get(trajectory_id)
        if trajectory is None:
            why = self._evicted.get(trajectory_id, "never seen, deleted, or evicted as stale or over the token budget")
            raise NotFound(f"trajectory {trajectory_id!r} is not in the router's cache ({why})")
        self._entries.move_to_end(trajectory_id)
        if trajectory.diverged is not None:
            raise Conflict(f"trajectory {trajectory_id!r} cannot be laid out as one sequence: {trajectory.diverged}")
        return trajectory

    def delete(self, trajectory_id: str) -> None:
        """Forgets the trajectory: its id may then start a new one."""
        trajectory = self._entries.pop(trajectory_id, None)
        evicted = self._evicted.pop(trajectory_id, None)
        if trajectory is None:
            why = evicted or "never seen, or deleted"
            raise NotFound(f"trajectory {trajectory_id!r} is not in the router's cache ({why})")
        self.tokens -= trajectory.tokens

    def evict_stale(self, fleet_update: int) -> int:
        """Drops trajectories more than `max_update_lag` weight updates old; returns how many."""
        stale = [k for k, t in self._entries.items() if fleet_update - t.fleet_update > self.max_update_lag]
        for key in stale:
            self._evict(key, f"evicted as stale, its last turn more than {self.max_update_lag} weight updates old")
        if stale:
            logger.info("evicted %d trajectories older than %d weight updates", len(stale), self.max_update_lag)
        return len(stale)

    @staticmethod
    def _between(trajectory: Trajectory, turn: Turn) -> array[int]:
        """What `turn`'s prompt adds to the trajectory so far; marks it diverged if it does not extend it."""
        if trajectory.diverged is not None:
            return token_ids()
        so_far = trajectory.prompt_ids + trajectory.response_ids
        prompt = token_ids(turn.prompt_ids)
        if prompt[: len(so_far)] == so_far:
            return prompt[len(so_far) :]
        common = min(len(so_far), len(prompt))
        at = next((i for i in range(common) if so_far[i] != prompt[i]), common)
        trajectory.diverge(
            f"the prompt of turn {len(trajectory.turns) + 1} (rid {turn.rid!r}) differs from the trajectory so far "
            f"at token {at} of {len(so_far)}; send each turn's prompt as the previous prompt + output + new tokens"
        )
        logger.warning("trajectory %s diverged: %s", trajectory.id, trajectory.diverged)
        return token_ids()

    def _fit_budget(self) -> None:
        # The newest trajectory (last in order) stays even if it alone exceeds the budget.
        while self.tokens > self.max_tokens and len(self._entries) > 1:
            self._evict(next(iter(self._entries)), f"evicted over the token budget of {self.max_tokens}")

    def _evict(self, trajectory_id: str, why: str) -> None:
        self.tokens -= self._entries.pop(trajectory_id).tokens
        self.evictions += 1
        self._evicted[trajectory_id] = why
        if len(self._evicted) > MAX_EVICTED_IDS:
            self._evicted.popitem(last=False)

    def _new(self, trajectory_id: str, prompt_ids: tuple[int, ...], rid: str | None) -> Trajectory:
        """The trajectory a turn of an id not held starts: diverged if the id was evicted, as its earlier turns
        are gone and this turn's prompt holds their outputs as if they were prompt."""
        trajectory = Trajectory(id=trajectory_id, prompt_ids=token_ids(prompt_ids))
        evicted = self._evicted.pop(trajectory_id, None)
        if evicted is not None:
            trajectory.diverge(
                f"a turn (rid {rid!r}) arrived after the trajectory was {evicted}; its earlier turns are lost"
            )
            logger.warning("trajectory %s diverged: %s", trajectory_id, trajectory.diverged)
        return trajectory
