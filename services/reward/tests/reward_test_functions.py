"""Reward functions that misbehave on purpose, for the hub's tests (never registered by entry point).

They live in a plain module, not in a conftest, because worker processes import them by name.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored
from rlfleet_reward.time_limit import time_limit


class SleepParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = 0.2


def sleep_then_one(sample: RewardInput, params: Mapping[str, Any]) -> float:
    time.sleep(params["seconds"])
    return 1.0


def hang(sample: RewardInput, params: Mapping[str, Any]) -> float:
    """Deaf to every signal but SIGKILL, as a function stuck inside C code is."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
    time.sleep(3600)
    return 1.0


def hang_on_label(sample: RewardInput, params: Mapping[str, Any]) -> float:
    if sample.label == "hang":
        hang(sample, params)
    return 1.0


class RecordParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log: str


def record_label(sample: RewardInput, params: Mapping[str, Any]) -> float:
    """Appends the label to the file `log`, then: "hang" hangs, "exit" ends the worker, "slow" takes 0.15 s."""
    with open(params["log"], "a") as log:
        log.write(sample.label + "\n")
    if sample.label == "hang":
        hang(sample, params)
    if sample.label == "exit":
        os._exit(3)
    if sample.label == "slow":
        time.sleep(0.15)
    return 1.0


def raise_error(sample: RewardInput, params: Mapping[str, Any]) -> float:
    raise RuntimeError(f"cannot score {sample.response!r}")


def exit_process(sample: RewardInput, params: Mapping[str, Any]) -> float:
    os._exit(3)


def not_a_number(sample: RewardInput, params: Mapping[str, Any]) -> float:
    return "high"  # type: ignore[return-value]


def length_parts(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    """Sees only what it declared: the response, never the label or prompt."""
    assert sample.label == "" and sample.prompt == "", "undeclared inputs must arrive empty"
    return Scored(
        score=0.5, parts={"chars": float(len(sample.response)), "lines": float(sample.response.count("\n") + 1)}
    )


def metadata_value(sample: RewardInput, params: Mapping[str, Any]) -> float:
    return float(sample.metadata["value"])


class PartsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int = 1


def many_parts(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    """A large result from a small request."""
    return Scored(score=1.0, parts={f"part{i}": 1.0 for i in range(params["count"])})


class LimitParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    limit: float = 0.2


def spin_within_own_limit(sample: RewardInput, params: Mapping[str, Any]) -> float:
    """Works in Python until its own `limit` interrupts it (a verifier's library, bounded by the function)."""
    with time_limit(params["limit"], "the spin"):
        while True:
            sum(range(1000))


async def own_timeout(sample: RewardInput, params: Mapping[str, Any]) -> float:
    """An async function whose own wait on something gives up: its error, not the hub's time limit."""
    raise TimeoutError("the upstream did not answer within its 2 s")


async def wait_then_one(sample: RewardInput, params: Mapping[str, Any]) -> float:
    """An async function waiting `seconds` on the network, as `remote` or `judge` would."""
    await asyncio.sleep(params["seconds"])
    return 1.0


def _declare(
    fn: Any,
    inputs: set[str],
    description: str,
    params: type[BaseModel] | None = None,
    timeout_score: float | None = None,
) -> RewardFunction:
    return RewardFunction(
        fn=fn, inputs=frozenset(inputs), description=description, params=params, timeout_score=timeout_score
    )


TEST_FUNCTIONS = {
    "sleep": _declare(sleep_then_one, {"response"}, "sleeps `seconds`, then scores 1.0", SleepParams),
    "hang": _declare(hang, {"response"}, "never returns and ignores signals"),
    "hang_on_label": _declare(hang_on_label, {"label"}, "hangs when the label is 'hang', else 1.0"),
    "verify_or_hang": _declare(
        hang_on_label, {"label"}, "a verifier: hangs when the label is 'hang', else 1.0", timeout_score=0.0
    ),
    "own_limit": _declare(spin_within_own_limit, {"response"}, "spins until its own limit", LimitParams),
    "verify_own_limit": _declare(
        spin_within_own_limit, {"response"}, "a verifier that spins until its own limit", LimitParams, 0.0
    ),
    "record_label": _declare(record_label, {"label"}, "logs the label, then misbehaves as it says", RecordParams),
    "raise": _declare(raise_error, {"response"}, "always raises"),
    "exit": _declare(exit_process, {"response"}, "ends its worker process"),
    "not_a_number": _declare(not_a_number, {"response"}, "returns a string"),
    "length_parts": _declare(length_parts, {"response"}, "0.5, with the response's size as parts"),
    "metadata_value": _declare(metadata_value, {"metadata"}, "the float in metadata['value']"),
    "many_parts": _declare(many_parts, {"response"}, "1.0 with `count` parts", PartsParams),
    "own_timeout": _declare(own_timeout, {"response"}, "async; raises a TimeoutError of its own"),
    "wait": _declare(wait_then_one, {"response"}, "async; waits `seconds`, then scores 1.0", SleepParams),
}
