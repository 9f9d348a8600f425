from __future__ import annotations

import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from rlfleet_reward.__main__ import settings_from_args
from rlfleet_reward.config import RewardSettings


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_REWARD_WORKERS", "3")
    monkeypatch.setenv("RLFLEET_REWARD_PORT", "9001")
    settings = settings_from_args(["--port", "9002", "--default-timeout-seconds", "2.5"])
    assert (settings.workers, settings.port, settings.default_timeout_seconds) == (3, 9002, 2.5)
    assert (settings.grpc_port, settings.max_batch_size, settings.max_pending_jobs) == (50053, 4096, 16384)
    assert settings_from_args(["--max-pending-jobs", "100"]).max_pending_jobs == 100


def test_admission_wait_settings_from_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (RewardSettings().admission_wait_seconds, RewardSettings().max_waiting_requests) == (5.0, 64)
    monkeypatch.setenv("RLFLEET_REWARD_ADMISSION_WAIT_SECONDS", "0.5")
    settings = settings_from_args(["--max-waiting-requests", "8"])
    assert (settings.admission_wait_seconds, settings.max_waiting_requests) == (0.5, 8)
    with pytest.raises(ValidationError, match="admission_wait_seconds"):
        RewardSettings(admission_wait_seconds=-1)


def test_inconsistent_limits_are_refused() -> None:
    with pytest.raises(ValidationError, match="raise the max or lower the default"):
        RewardSettings(default_timeout_seconds=60, max_timeout_seconds=30)


def test_help_answers_without_starting_anything() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlfleet_reward", "--help"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "--grpc-port" in done.stdout and "RLFLEET_REWARD_" in done.stdout
    assert time.monotonic() - started < 5
