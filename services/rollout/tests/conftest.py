"""Fixtures of the orchestrator's tests: a char tokenizer and a fake fleet around a real orchestrator
process (Redis fixtures come from the repository's conftest).

This directory goes on sys.path so the test modules can import `rollout_test_support` by its plain
name, which pytest's importlib mode would not give them.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from tokenizers import Tokenizer, decoders, models

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from rollout_test_support import (  # noqa: E402
    FakeFleet,
    Orchestrator,
    delete_prefix,
    start_fake_fleet,
    start_orchestrator,
)

from rlfleet.char_tokenizer import SPECIAL_TOKENS, UNK, vocabulary  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as submit reads it: the tiny model's tokenizer.json (written with `tokenizers`, no
    transformers) and a config.json (only its presence is checked; the fake trainer loads nothing)."""
    out = tmp_path_factory.mktemp("tokenizer")
    core = Tokenizer(models.BPE(vocab=vocabulary(), merges=[], unk_token=UNK))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.decoder = decoders.Fuse()
    core.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text("{}")
    return out


@pytest.fixture(scope="session")
def fleet(redis_client: redis.Redis) -> Iterator[FakeFleet]:
    prefix = f"rlfleet-test:{uuid.uuid4().hex[:12]}:"
    fleet = start_fake_fleet(redis_client, prefix)
    yield fleet
    fleet.stop()
    delete_prefix(redis_client, prefix)


@pytest.fixture(scope="session")
def orchestrator(fleet: FakeFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Orchestrator]:
    orch = start_orchestrator(fleet, tmp_path_factory.mktemp("logs") / "rollout.log")
    yield orch
    code = orch.process.stop(timeout=15)
    assert code == 0, f"the orchestrator exited with {code} on SIGTERM:\n{orch.process.log_tail()}"
