"""Fixtures of the deployment tests: where deploy/ lives, and each service's settings class by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def settings_classes() -> dict[str, type[BaseSettings]]:
    """Service name -> the pydantic-settings class its process reads RLFLEET_<SVC>_* variables into."""
    from rlfleet_engine.config import EngineConfig
    from rlfleet_reward.config import RewardSettings
    from rlfleet_rollout.config import RolloutConfig
    from rlfleet_router.config import RouterConfig
    from rlfleet_trainer.config import TrainerSettings

    return {
        "engine": EngineConfig,
        "router": RouterConfig,
        "reward": RewardSettings,
        "rollout": RolloutConfig,
        "trainer": TrainerSettings,
    }
