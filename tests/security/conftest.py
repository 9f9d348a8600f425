"""Fixtures of the security tests: an API token on disk, and the Runs API and the router as real
processes that require it (Redis fixtures come from the repository's conftest).

This directory goes on sys.path so test modules (and tests/load) import `launchers` by its plain name.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from launchers import (  # noqa: E402
    Service,
    StandInRewardHub,
    delete_prefix,
    start_orchestrator,
    start_router,
    start_sim_engines,
    write_char_tokenizer,
    write_token,
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_char_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def api_token(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return write_token(tmp_path_factory.mktemp("secrets"))


@pytest.fixture(scope="session")
def reward_hub() -> Iterator[StandInRewardHub]:
    hub = StandInRewardHub()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def runs_prefix(redis_client: redis.Redis) -> Iterator[str]:
    prefix = f"rlfleet-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    delete_prefix(redis_client, prefix)


@pytest.fixture(scope="module")
def orchestrator(
    tmp_path_factory: pytest.TempPathFactory,
    api_token: tuple[str, Path],
    reward_hub: StandInRewardHub,
    runs_prefix: str,
) -> Iterator[Service]:
    """The orchestrator requiring `api_token`; its router address is a closed port (no run trains)."""
    service = start_orchestrator(
        tmp_path_factory.mktemp("logs"),
        prefix=runs_prefix,
        reward_url=reward_hub.url,
        router_url="http://127.0.0.1:9",
        token_file=api_token[1],
    )
    yield service
    service.stop()


@pytest.fixture(scope="module")
def secured_router(tmp_path_factory: pytest.TempPathFactory, api_token: tuple[str, Path]) -> Iterator[Service]:
    """A router requiring `api_token`, in front of one sim engine with a 256-token context."""
    logs = tmp_path_factory.mktemp("logs")
    engines = start_sim_engines(1, logs, ["--context-length", "256"])
    router = start_router([e.url for e in engines], logs, token_file=api_token[1])
    yield router
    router.stop()
    for engine in engines:
        engine.stop()
