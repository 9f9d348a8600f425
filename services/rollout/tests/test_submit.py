"""Submit in the transport-free core, against a real reward hub process: everything a run would fail on
later is refused at submit naming the field, nothing is stored for a refused spec, and a reward hub that
cannot be asked makes Submit Unavailable."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format
from rollout_test_support import REDIS_URL, spec_json

from rlfleet.errors import InvalidInput, Unavailable
from rlfleet.processes import ServiceProcess, free_port
from rlfleet.v1.runs_pb2 import Run, RunSpec, RunState
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunsCore

SCORE_TIMEOUT_S = 120.0
"""The orchestrator's bound on one /score call (its default)."""


@pytest.fixture(scope="module")
def reward_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real reward hub (one worker, its built-in functions and its default limits); yields its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "rlfleet_reward", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--grpc-port", str(free_port()), "--workers", "1"]
    hub = ServiceProcess("reward", argv, tmp_path_factory.mktemp("logs") / "reward.log")
    try:
        hub.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        hub.stop(timeout=10)


def submit(redis_prefix: str, hub_url: str, spec: dict[str, Any], validate_timeout_s: float = 10) -> tuple[Run, int]:
    """Submits `spec` through a RunsCore over Redis and the hub at `hub_url`: the run and the runs then stored.

    A refused submit raises, having checked that nothing was stored."""

    async def scenario() -> tuple[Run, int]:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
        store = RunStore(client, redis_prefix)
        try:
            async with httpx.AsyncClient() as http:
                hub = RewardClient(
                    http, hub_url, score_timeout_s=SCORE_TIMEOUT_S, validate_timeout_s=validate_timeout_s
                )
                core = RunsCore(
                    store,
                    hub,
                    RunNotifier(),
                    RolloutMetrics(),
                    filters=FilterRegistry({}),
                    rollouts=RolloutRegistry.from_entry_points(),
                    poll_interval_s=0.1,
                    run_data_retention_s=60,
                )
                try:
                    run = await core.submit(json_format.ParseDict(spec, RunSpec()))
                except Exception:
                    assert await store.page() == ([], "")
                    raise
                return run, len((await store.page())[0])
        finally:
            await client.aclose()

    return asyncio.run(scenario())


def with_reward(tokenizer_dir: Path, **reward: Any) -> dict[str, Any]:
    return spec_json(tokenizer_dir, reward=reward)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"terms": [{"function": "exact", "params": {"bogus": 1}}]}, "reward.terms[0].params.bogus: Extra inputs"),
        (
            {"terms": [{"function": "exact", "params": {"strip": "maybe"}}]},
            "reward.terms[0].params.strip: Input should",
        ),
        (
            {"terms": [{"function": "arith_exact"}, {"function": "numeric", "params": {"abs_tol": "tiny"}}]},
            "reward.terms[1].params.abs_tol:",
        ),
        (
            {"terms": [{"function": "arith_exact", "params": {"x": 1}}]},
            "reward.terms[0].params: 'arith_exact' takes no",
        ),
        ({"terms": [{"function": "nope"}]}, "reward.terms[0].function: unknown reward function 'nope'; known: "),
        (
            {"terms": [{"function": "arith_exact"}], "timeout_seconds": 1000},
            "reward.timeout_seconds: must be > 0 and <= 300",
        ),
        (
            {"terms": [{"function": "arith_exact"}], "timeout_seconds": 1e9},
            "reward.timeout_seconds: must be > 0 and <= 300",
        ),
        # Static bounds, refused before the hub is asked (JSON, the hub's wire format, has no NaN).
        (
            {"terms": [{"function": "numeric", "params": {"abs_tol": float("nan")}}]},
            "reward.terms[0].params.abs_tol: must be a finite number",
        ),
        ({"terms": [{"function": "arith_exact"}], "timeout_seconds": -1}, "reward.timeout_seconds: must be > 0"),
        ({"terms": [{"function": "math"}, {"function": "math"}]}, "reward.terms[1].function: 'math' is already"),
        # The hub takes it (<= 300 s), but one item running to its limit would outlast the orchestrator's /score.
        (
            {"terms": [{"function": "arith_exact"}], "timeout_seconds": 120},
            "reward.timeout_seconds: 120 s is not below this orchestrator's limit on one /score call (120 s",
        ),
    ],
)
def test_a_reward_the_hub_would_refuse_is_refused_at_submit_naming_the_field(
    reward_hub: str, redis_prefix: str, tokenizer_dir: Path, reward: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        submit(redis_prefix, reward_hub, with_reward(tokenizer_dir, **reward))
    assert str(refused.value).startswith(message), refused.value


@pytest.mark.e2e
def test_a_reward_the_hub_takes_is_stored_as_given(reward_hub: str, redis_prefix: str, tokenizer_dir: Path) -> None:
    terms = [{"function": "exact", "params": {"strip": False}, "weight": 0.5}, {"function": "arith_exact"}]
    run, stored = submit(redis_prefix, reward_hub, with_reward(tokenizer_dir, terms=terms, timeout_seconds=100))
    assert (run.state, stored) == (RunState.RUN_STATE_QUEUED, 1)
    assert json_format.MessageToDict(run.spec.reward.terms[0].params) == {"strip": False}
    assert run.spec.reward.timeout_seconds == 100


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # A model directory without config.json, the tokenizer elsewhere and fine: the trainer would refuse it.
        ({"model": {"path": "{tmp}", "tokenizer_path": "{tokenizer}"}}, "model.path: no Hugging Face model at"),
        # Without a tokenizer_path the model's path is the one named, not the tokenizer_path it defaults to.
        ({"model": {"path": "/nonexistent"}}, "model.path: no Hugging Face model at '/nonexistent' (config.json"),
        # A relative path is resolved where the orchestrator runs, which the submitter may not know.
        ({"model": {"path": "models/none"}}, "model.path: no Hugging Face model at 'models/none' (relative to /"),
        ({"model": {"path": "{tokenizer}", "tokenizer_path": "{tmp}"}}, "model.tokenizer_path: "),
        ({"trainer": {"learning_rate": 0}, "algorithm": {"name": "ppo"}}, "trainer.learning_rate: must be in (0, 1)"),
        ({"dataset": {"arithmetic": {"digits": 2}, "eval_size": 100_000}}, "dataset.eval_size: must be in [1, 10000]"),
        ({"dataset": {"arithmetic": {"digits": 2}, "eval_size": 5000}}, "dataset.eval_size: the test split of 2-digit"),
    ],
)
def test_what_the_trainer_or_the_dataset_would_fail_on_is_refused_at_submit(
    reward_hub: str, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path, overrides: dict, message: str
) -> None:
    spec = spec_json(tokenizer_dir)
    for section, value in overrides.items():
        spec[section] = {**spec.get(section, {}), **value}
    for key, path in spec["model"].items():
        spec["model"][key] = path.format(tmp=tmp_path, tokenizer=tokenizer_dir)
    started = time.monotonic()
    with pytest.raises(InvalidInput) as refused:
        submit(redis_prefix, reward_hub, spec)
    assert str(refused.value).startswith(message), refused.value
    assert time.monotonic() - started < 5  # eval_size 100000 held a worker thread for 38 s before its bound


def test_submit_with_the_reward_hub_down_is_unavailable_and_stores_nothing(
    redis_prefix: str, tokenizer_dir: Path
) -> None:
    with pytest.raises(Unavailable, match=r"^the reward hub could not check the spec's reward \(POST http.*/validate"):
        submit(redis_prefix, f"http://127.0.0.1:{free_port()}", spec_json(tokenizer_dir), validate_timeout_s=0.5)
