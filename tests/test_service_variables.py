"""Every service names each of its variables in `--help` and refuses, at its real entry point, a variable
under its prefix that names no setting, before it binds a port or imports anything heavy."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from rlfleet.logs import LEVELS
from rlfleet.settings_env import setting_variables
from rlfleet_engine.config import EngineConfig
from rlfleet_engine.config import build_arg_parser as engine_parser
from rlfleet_reward.__main__ import build_arg_parser as reward_parser
from rlfleet_reward.config import RewardSettings
from rlfleet_rollout.config import RolloutConfig
from rlfleet_rollout.config import build_arg_parser as rollout_parser
from rlfleet_router.__main__ import build_arg_parser as router_parser
from rlfleet_router.config import RouterConfig
from rlfleet_trainer.__main__ import build_parser as trainer_parser
from rlfleet_trainer.config import TrainerSettings

# Modules no service may import before its settings are good: a stand-in of each ends the process with
# status 1 (and says so) instead of the settings error's 2.
HEAVY = ("torch", "transformers", "uvicorn", "fastapi", "grpc", "redis", "httpx")


def trainer_serve_parser() -> argparse.ArgumentParser:
    (commands,) = [a for a in trainer_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["serve"]


SERVICES: dict[str, tuple[type[BaseSettings], argparse.ArgumentParser]] = {
    "engine": (EngineConfig, engine_parser()),
    "reward": (RewardSettings, reward_parser()),
    "rollout": (RolloutConfig, rollout_parser()),
    "router": (RouterConfig, router_parser()),
    "trainer": (TrainerSettings, trainer_serve_parser()),
}


@pytest.mark.parametrize("service", SERVICES)
def test_help_names_every_variable(service: str) -> None:
    settings, parser = SERVICES[service]
    text = parser.format_help()
    for variable in setting_variables(settings).values():
        assert f"(env {variable})" in " ".join(text.split()) or f"\n  {variable}\n" in text, f"{service}: {variable}"


def test_help_lists_the_orchestrator_settings_without_a_flag() -> None:
    text = SERVICES["rollout"][1].format_help()
    for variable in ("RLFLEET_ROLLOUT_REWARD_LIST_TIMEOUT_S", "RLFLEET_ROLLOUT_EVAL_BATCH_SIZE"):
        assert f"\n  {variable}\n" in text
    evaluation = "Held-out samples per /generate request during evaluation; of a multi_turn run, episodes under way"
    assert f"{evaluation} at once (default 32)" in " ".join(text.split())


def test_no_service_prefix_begins_another() -> None:
    """A fleet-wide environment (rlfleet up, the fault tests, a shared env block) hands every service every
    variable; each service must see only its own under its prefix."""
    prefixes = [settings.model_config["env_prefix"] for settings, _ in SERVICES.values()]
    assert len(set(prefixes)) == len(SERVICES)
    assert not [(a, b) for a in prefixes for b in prefixes if a != b and b.startswith(a)]


@pytest.mark.parametrize(
    ("service", "argv", "variable", "meant"),
    [
        ("engine", ["--model-path", "/nonexistent"], "RLFLEET_ENGINE_HEALTH_CHECK_TIMEOUT", "HEALTH_CHECK_TIMEOUT_S"),
        ("reward", [], "RLFLEET_REWARD_SHUTDOWN_GRACE_S", "SHUTDOWN_GRACE_SECONDS"),
        ("rollout", [], "RLFLEET_ROLLOUT_STEP_TIMEOUT", "STEP_TIMEOUT_S"),
        ("router", [], "RLFLEET_ROUTER_HEALTH_CHECK_INTERVAL", "HEALTH_CHECK_INTERVAL_SECS"),
        ("trainer", ["serve"], "RLFLEET_TRAINER_CHECKPOINT_TIMEOUT", "CHECKPOINT_TIMEOUT_S"),
    ],
)
def test_the_entry_point_refuses_a_misspelled_variable(
    service: str, argv: list[str], variable: str, meant: str, tmp_path: Path
) -> None:
    for module in HEAVY:
        (tmp_path / f"{module}.py").write_text(f"import sys\nsys.exit('imported {module} before the settings')\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        variable: "60",
    }
    done = subprocess.run(
        [sys.executable, "-m", f"rlfleet_{service}", *argv], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2, done.stderr
    prefix = SERVICES[service][0].model_config["env_prefix"]
    assert f"{variable} is not a setting (did you mean {prefix}{meant}?)" in done.stderr


@pytest.mark.parametrize("service", ["engine", "reward", "rollout", "router"])
def test_a_log_level_no_logger_knows_is_a_settings_error(service: str) -> None:
    settings, _ = SERVICES[service]
    required = {"model_path": "/nonexistent"} if service == "engine" else {}
    with pytest.raises(ValueError, match="unknown log level 'loud': must be one of debug, info, warning, error"):
        settings.model_validate({**required, "log_level": "loud"})
    assert settings.model_validate({**required, "log_level": "DEBUG"}).model_dump()["log_level"] == "debug"


@pytest.mark.parametrize("service", ["engine", "reward", "rollout", "router"])
def test_log_level_help_names_every_level_the_setting_takes(service: str) -> None:
    _, parser = SERVICES[service]
    (flag,) = [action for action in parser._actions if "--log-level" in action.option_strings]
    assert flag.help is not None and all(level in flag.help for level in LEVELS)
