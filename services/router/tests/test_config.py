"""Settings: defaults, environment variables, and flags mapped onto them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from pydantic import ValidationError

from rlfleet_router.__main__ import config_from_args
from rlfleet_router.config import RouterConfig


def test_flags_use_sglang_router_names_and_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_ROUTER_HEALTH_FAILURE_THRESHOLD", "7")
    monkeypatch.setenv("RLFLEET_ROUTER_POLICY", "round_robin")
    config = config_from_args(
        [
            "--worker-urls",
            "http://127.0.0.1:1",
            "http://127.0.0.1:2/",
            "--port",
            "0",
            "--policy",
            "least_load",
            "--health-check-interval-secs",
            "0.5",
            "--health-success-threshold",
            "4",
            "--disable-retries",
        ]
    )
    assert config.worker_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert config.policy == "least_load", "a flag beats the environment"
    assert config.health_failure_threshold == 7, "the environment fills what no flag gives"
    assert config.health_check_interval_secs == 0.5
    assert config.health_success_threshold == 4
    assert config.disable_retries is True
    assert config.port == 0


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValidationError, match="known policies: cache_aware, least_load, power_of_two, round_robin"):
        RouterConfig(policy="fastest")


@pytest.mark.parametrize(
    ("field", "template", "error"),
    [
        (
            "local_engine_command",
            "python -m rlfleet_engine --model-path {model} --port {port}",
            r"placeholders \['model'\]",
        ),
        ("local_engine_command", "python -m rlfleet_engine --host {host", "does not parse"),
        ("local_engine_command", "python -m rlfleet_engine --chat-template '{port}", "does not parse"),
        ("docker_container", "engine-{index}", r"placeholders \['index'\]"),
    ],
)
def test_restart_templates_fill_only_host_and_port(field: str, template: str, error: str) -> None:
    """A placeholder the restarter does not fill in fails when the router starts, not at the first restart."""
    with pytest.raises(ValidationError, match=error):
        RouterConfig(**{field: template})
    RouterConfig(local_engine_command="sh -c 'echo {{}} && serve --host {host} --port {port}'")


def test_cli_rejects_bad_config_with_the_field_named() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet_router", "--health-failure-threshold", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "health_failure_threshold" in result.stderr


def test_help_lists_the_flags_without_importing_the_server() -> None:
    probe = (
        "import sys\n"
        "from rlfleet_router.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY' if {'uvicorn', 'fastapi', 'httpx'} & set(sys.modules) else 'LIGHT')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for flag in ("--worker-urls", "--policy", "--health-check-interval-secs", "--health-failure-threshold"):
        assert flag in result.stdout
    assert result.stdout.strip().endswith("LIGHT")


def test_every_cache_aware_setting_has_a_flag_that_reaches_the_policy() -> None:
    settings = {
        "--cache-threshold": 0.5,
        "--cache-tokens-per-request": 20,
        "--balance-abs-threshold": 3,
        "--balance-rel-threshold": 1.5,
        "--balance-share-threshold": 1.4,
        "--balance-placement-slack": 3.5,
        "--max-tree-tokens": 4096,
    }
    config = config_from_args([arg for flag, value in settings.items() for arg in (flag, str(value))])
    options = config.policy_options()
    for flag, value in settings.items():
        assert getattr(options, flag.removeprefix("--").replace("-", "_")) == value, flag
    # PolicyOptions' remaining field, the power_of_two seed, is for tests and replays only.
    assert {f.name for f in dataclasses.fields(options)} - {f[2:].replace("-", "_") for f in settings} == {"seed"}
