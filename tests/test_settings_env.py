"""Which variables under a settings class's prefix set nothing: matched as pydantic-settings matches them."""

from __future__ import annotations

import pytest
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlfleet.settings_env import setting_variables, unknown_variables


class Plain(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLFLEET_DEMO_")

    port: int = 8000
    step_timeout_s: float = 60.0
    score_timeout_s: float = 60.0


def test_each_setting_has_its_prefixed_upper_case_variable() -> None:
    assert setting_variables(Plain) == {
        "port": "RLFLEET_DEMO_PORT",
        "step_timeout_s": "RLFLEET_DEMO_STEP_TIMEOUT_S",
        "score_timeout_s": "RLFLEET_DEMO_SCORE_TIMEOUT_S",
    }


def test_a_near_miss_gets_the_closest_setting_only_and_a_far_one_gets_none() -> None:
    environ = {"RLFLEET_DEMO_STEP_TIMEOUT": "1", "RLFLEET_DEMO_COLOUR": "red", "RLFLEET_DEMO_PORT": "1"}
    assert unknown_variables(Plain, environ) == {
        "RLFLEET_DEMO_STEP_TIMEOUT": ["RLFLEET_DEMO_STEP_TIMEOUT_S"],
        "RLFLEET_DEMO_COLOUR": [],
    }


def test_names_equally_close_are_all_suggested() -> None:
    assert unknown_variables(Plain, {"RLFLEET_DEMO_TIMEOUT_S": "1"}) == {
        "RLFLEET_DEMO_TIMEOUT_S": ["RLFLEET_DEMO_STEP_TIMEOUT_S", "RLFLEET_DEMO_SCORE_TIMEOUT_S"]
    }


def test_a_lower_case_misspelling_is_caught_and_a_lower_case_setting_is_known() -> None:
    """pydantic-settings reads names in any case by default, so the check does too."""
    environ = {"rlfleet_demo_port": "1", "rlfleet_demo_step_timeout": "1"}
    assert unknown_variables(Plain, environ) == {"rlfleet_demo_step_timeout": ["RLFLEET_DEMO_STEP_TIMEOUT_S"]}


@pytest.mark.parametrize(
    "config",
    [
        SettingsConfigDict(env_prefix="RLFLEET_DEMO_", case_sensitive=True),
        SettingsConfigDict(env_prefix="RLFLEET_DEMO_", env_nested_delimiter="__"),
    ],
)
def test_a_class_read_another_way_is_refused_rather_than_misjudged(config: SettingsConfigDict) -> None:
    class Other(BaseSettings):
        model_config = config

        port: int = 8000

    with pytest.raises(TypeError, match="prefix \\+ field name in any case"):
        unknown_variables(Other, {})


def test_a_field_with_an_alias_is_refused_rather_than_misjudged() -> None:
    class Aliased(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="RLFLEET_DEMO_")

        port: int = Field(8000, validation_alias=AliasChoices("RLFLEET_DEMO_HTTP_PORT"))

    with pytest.raises(TypeError, match="aliases on \\['port'\\]"):
        setting_variables(Aliased)


def test_kubernetes_service_links_are_no_settings() -> None:
    """`helm install rlfleet` makes Service rlfleet-trainer, whose links every pod gets under RLFLEET_TRAINER_."""
    links = {
        "RLFLEET_DEMO_SERVICE_HOST": "10.0.0.7",
        "RLFLEET_DEMO_SERVICE_PORT": "8002",
        "RLFLEET_DEMO_SERVICE_PORT_GRPC": "50052",
        "RLFLEET_DEMO_METRICS_SERVICE_HOST": "10.0.0.8",
        "RLFLEET_DEMO_PORT_8002_TCP": "tcp://10.0.0.7:8002",
        "RLFLEET_DEMO_PORT_8002_TCP_PROTO": "tcp",
        "RLFLEET_DEMO_PORT_8002_TCP_PORT": "8002",
        "RLFLEET_DEMO_PORT_8002_TCP_ADDR": "10.0.0.7",
        "RLFLEET_DEMO_METRICS_PORT": "tcp://10.0.0.8:9090",
    }
    assert unknown_variables(Plain, links) == {}
    assert list(unknown_variables(Plain, {"RLFLEET_DEMO_HTTP_PORT": "8002"})) == ["RLFLEET_DEMO_HTTP_PORT"]


def test_a_class_without_a_prefix_is_not_checked() -> None:
    class Unprefixed(BaseSettings):
        port: int = 8000

    assert unknown_variables(Unprefixed, {"HOME": "/root", "PROT": "1"}) == {}
