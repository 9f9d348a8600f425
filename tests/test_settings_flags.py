"""A table of flags over pydantic settings: flags win over the environment, absent flags leave it alone."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlfleet.settings_flags import Flag, add_flags, settings_from_flags


class DemoSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLFLEET_DEMO_", extra="forbid")

    port: int = Field(8000, ge=0, le=65535)
    timeout_s: float = Field(5.0, gt=0)
    verbose: bool = False
    urls: list[str] = Field(default_factory=list)


FLAGS = (
    Flag("--port", "port to bind"),
    Flag("--timeout", "seconds to wait", field="timeout_s"),
    Flag("--verbose", "say more", kind="switch"),
    Flag("--urls", "peers", kind="list", metavar="URL"),
)


def settings(argv: Sequence[str]) -> DemoSettings:
    parser = argparse.ArgumentParser(prog="demo")
    add_flags(parser, FLAGS)
    return settings_from_flags(DemoSettings, FLAGS, parser.parse_args(argv), parser)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PORT", "TIMEOUT_S", "VERBOSE", "URLS"):
        monkeypatch.delenv(f"RLFLEET_DEMO_{name}", raising=False)


def test_a_given_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_DEMO_PORT", "9001")
    monkeypatch.setenv("RLFLEET_DEMO_TIMEOUT_S", "7")
    got = settings(["--port", "9002", "--timeout", "2.5"])
    assert (got.port, got.timeout_s) == (9002, 2.5)


def test_an_absent_flag_leaves_the_environment_then_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_DEMO_TIMEOUT_S", "7")
    got = settings([])
    assert (got.port, got.timeout_s, got.verbose, got.urls) == (8000, 7.0, False, [])


def test_a_switch_sets_true_and_its_absence_leaves_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings(["--verbose"]).verbose is True
    monkeypatch.setenv("RLFLEET_DEMO_VERBOSE", "true")
    assert settings([]).verbose is True


def test_a_list_flag_takes_any_number_of_values(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings(["--urls", "http://a", "http://b"]).urls == ["http://a", "http://b"]
    monkeypatch.setenv("RLFLEET_DEMO_URLS", '["http://env"]')
    assert settings(["--urls"]).urls == [], "a given empty list wins over the environment"
    assert settings([]).urls == ["http://env"]


def test_a_bad_value_is_a_parser_error_naming_the_flag_and_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        settings(["--timeout", "-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: demo" in err
    assert "timeout_s (--timeout '-1'): Input should be greater than 0" in err


def test_a_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLFLEET_DEMO_PORT", "http")
    with pytest.raises(SystemExit):
        settings([])
    assert "port (--port or RLFLEET_DEMO_PORT): Input should be a valid integer" in capsys.readouterr().err


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings(["--help"])
    out = capsys.readouterr().out
    assert "--timeout TIMEOUT_S" in out and "--urls [URL ...]" in out and "--verbose " in out
