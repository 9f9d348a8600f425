"""Shared fixtures of the engine's tests: the tiny model (made once per session) and engines as real processes.

This directory goes on sys.path so the test modules can import `engine_test_support` by its plain
name, which pytest's importlib mode would not give them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from engine_test_support import RunningEngine, start_engine  # noqa: E402

from rlfleet.processes import ServiceProcess, free_port  # noqa: E402
from rlfleet.tiny_model import create_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engine-model") / "tiny"
    create_tiny_model(out)
    return out


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    """One engine shared by the read-only HTTP tests (its weights never change)."""
    running = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine-logs"), "--max-running-requests", "8")
    yield running
    running.process.stop()


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path) -> Iterator[Any]:
    """The same checkpoint as a plain Hugging Face model, for computing expected logprobs (on one torch
    thread, as the engine under test runs; the setting is restored for the tests after this session)."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.set_num_threads(threads)


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Starts `sim` engines (no model) as real processes; returns each one's URL."""
    started: list[ServiceProcess] = []

    def start(*extra: str) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "rlfleet_engine", "--backend", "sim", "--model-path", "sim", "--port", str(port)]
        process = ServiceProcess("sim-engine", [*argv, *extra], tmp_path / f"sim-{port}.log")
        started.append(process)
        url = f"http://127.0.0.1:{port}"
        process.wait_healthy(url + "/health", timeout=30)
        return url

    yield start
    for process in started:
        process.stop(timeout=10)


@pytest.fixture(scope="session")
def tokenizers_by_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tokenizer of every kind the engine serves, by name (see `tokenizer_kinds`)."""
    from tokenizer_kinds import tokenizers_by_kind

    return tokenizers_by_kind(tmp_path_factory.mktemp("char-tokenizer"))
