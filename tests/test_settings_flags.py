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
    add_flags(parser, FLAGS, DemoSettings)
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


def test_a_variable_under_the_prefix_that_names_no_setting_is_refused_with_the_closest_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLFLEET_DEMO_TIMEOUT", "7")  # the flag is --timeout, the setting timeout_s
    with pytest.raises(SystemExit) as exit_info:
        settings([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: demo" in err
    assert "environment variable RLFLEET_DEMO_TIMEOUT is not a setting (did you mean RLFLEET_DEMO_TIMEOUT_S?)" in err


def test_a_misspelling_in_lower_case_is_refused_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The settings are case-insensitive, so pydantic-settings reads lower-case names as well: they count."""
    monkeypatch.setenv("rlfleet_demo_prot", "9001")
    with pytest.raises(SystemExit):
        settings([])
    assert "rlfleet_demo_prot is not a setting (did you mean RLFLEET_DEMO_PORT?)" in capsys.readouterr().err


def test_a_known_variable_is_read_and_other_prefixes_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_DEMO_TIMEOUT_S", "7")
    monkeypatch.setenv("rlfleet_demo_port", "9001")
    monkeypatch.setenv("RLFLEET_DEMOS_ANYTHING", "1")  # not under RLFLEET_DEMO_
    monkeypatch.setenv("RLFLEET_ROUTER_NOT_A_SETTING", "1")
    monkeypatch.setenv("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    got = settings([])
    assert (got.port, got.timeout_s) == (9001, 7.0)


def test_a_misspelled_variable_is_refused_even_when_a_flag_sets_the_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RLFLEET_DEMO_URL", '["http://env"]')
    with pytest.raises(SystemExit):
        settings(["--urls", "http://a"])
    assert "RLFLEET_DEMO_URL is not a setting (did you mean RLFLEET_DEMO_URLS?)" in capsys.readouterr().err


def test_help_names_the_variable_of_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    class WithoutFlags(DemoSettings):
        retries: int = Field(3, description="Attempts after the first.")

    parser = argparse.ArgumentParser(prog="demo")
    add_flags(parser, FLAGS, WithoutFlags)
    text = parser.format_help()
    assert "seconds to wait (env RLFLEET_DEMO_TIMEOUT_S)" in " ".join(text.split())
    assert "settings without a flag:\n  RLFLEET_DEMO_RETRIES\n      Attempts after the first (default 3)\n" in text


def test_a_list_variable_that_is_not_json_names_the_variable_and_how_to_write_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pydantic-settings reads a list from the environment as JSON only, and its SettingsError escaped as a
    traceback (exit 1) where every other bad value is a usage error naming the variable (exit 2)."""
    monkeypatch.setenv("RLFLEET_DEMO_URLS", "http://a:8000")
    with pytest.raises(SystemExit) as exit_info:
        settings([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "urls (--urls or RLFLEET_DEMO_URLS): 'http://a:8000' is not JSON" in err, err
    assert 'written in JSON, e.g. ["http://a:8000", "http://b:8000"], or give --urls one value after another' in err
