"""Every service's --help states the defaults its settings class really has.

The flag tables are written apart from the settings (so `--help` answers before the service imports
anything heavy); a default changed in one place and not the other would make the help lie.
"""

from __future__ import annotations

import re

import pytest
from pydantic_settings import BaseSettings

from rlfleet.settings_flags import Flag
from rlfleet_engine.config import FLAGS as ENGINE_FLAGS
from rlfleet_engine.config import EngineConfig
from rlfleet_reward.__main__ import FLAGS as REWARD_FLAGS
from rlfleet_reward.config import RewardSettings
from rlfleet_rollout.config import FLAGS as ROLLOUT_FLAGS
from rlfleet_rollout.config import RolloutConfig
from rlfleet_router.__main__ import FLAGS as ROUTER_FLAGS
from rlfleet_router.config import RouterConfig
from rlfleet_trainer.__main__ import SERVE_FLAGS as TRAINER_FLAGS
from rlfleet_trainer.config import TrainerSettings

SERVICES: list[tuple[type[BaseSettings], tuple[Flag, ...]]] = [
    (EngineConfig, ENGINE_FLAGS),
    (RewardSettings, REWARD_FLAGS),
    (RolloutConfig, ROLLOUT_FLAGS),
    (RouterConfig, ROUTER_FLAGS),
    (TrainerSettings, TRAINER_FLAGS),
]
STATED = re.compile(r"\(default ([^:()][^()]*)\)")  # "(default 600)"; "(default: ...)" describes, it states no value
CHOSEN = re.compile(r"(\w+) \(default\)")  # "cache_aware (default), least_load, ..."


def stated_value(text: str, default: object) -> object:
    """The help's default as a value of the setting's type: `2**24`, `64 MiB`, `'rlfleet:'`, `600`."""
    if isinstance(default, (int, float)):
        if match := re.fullmatch(r"(\d+)\*\*(\d+)", text):
            return int(match[1]) ** int(match[2])
        if match := re.fullmatch(r"(\d+) MiB", text):
            return int(match[1]) * 2**20
        return float(text)
    return text.strip("'")


def stated_defaults() -> list[tuple[str, str, object, object]]:
    """(service, flag, default in the help, default in the settings) for every flag whose help states one."""
    out = []
    for settings, flags in SERVICES:
        for flag in flags:
            default = settings.model_fields[flag.field].default
            for text in STATED.findall(flag.help) + CHOSEN.findall(flag.help):
                out.append((settings.__name__, flag.name, stated_value(text, default), default))
    return out


def test_the_defaults_are_found() -> None:
    """The parse finds the defaults the tables state, so the comparison below is not vacuous."""
    found = {(service, flag) for service, flag, _, _ in stated_defaults()}
    assert len(found) >= 80
    assert ("RouterConfig", "--balance-rel-threshold") in found
    assert ("RouterConfig", "--policy") in found
    assert ("TrainerSettings", "--grpc-port") in found


@pytest.mark.parametrize(("service", "flag", "stated", "default"), stated_defaults())
def test_help_states_the_settings_default(service: str, flag: str, stated: object, default: object) -> None:
    assert stated == (str(default) if isinstance(stated, str) else default), f"{service} {flag}"


def test_a_stale_default_in_the_help_is_caught() -> None:
    assert stated_value("2**24", 2**24) == 2**24
    assert stated_value("64 MiB", 67108864) == 67108864
    assert stated_value("1.25", 1.3) != 1.3


def test_an_engine_waits_for_the_trainers_weight_group_as_long_as_the_trainer_does() -> None:
    """An engine that gave up joining or receiving sooner would leave the trainer waiting for it to its own bound."""
    engine = EngineConfig.model_fields["weight_group_timeout_s"].default
    assert engine >= TrainerSettings.model_fields["weight_sync_timeout_s"].default
