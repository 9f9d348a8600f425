"""The command line: SGLang's flag names, RLFLEET_ENGINE_* variables, and a --help that never loads torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlfleet_engine.config import config_from_args


def test_help_answers_without_importing_torch() -> None:
    probe = (
        "import sys\n"
        "from rlfleet_engine.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY' if {'torch', 'transformers'} & set(sys.modules) else 'LIGHT')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--max-running-requests" in result.stdout and "--model-path" in result.stdout
    assert result.stdout.strip().endswith("LIGHT")


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_ENGINE_MAX_RUNNING_REQUESTS", "4")
    monkeypatch.setenv("RLFLEET_ENGINE_PORT", "31000")
    config = config_from_args(["--model-path", "/m", "--port", "30001", "--served-model-name", "tiny"])
    assert (config.max_running_requests, config.port, config.served_model_name) == (4, 30001, "tiny")
    assert config.tokenizer_path == "/m" and config.backend == "transformers"


def test_a_missing_model_path_exits_with_a_clear_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet_engine", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin"},
    )
    assert result.returncode != 0 and "model_path" in result.stderr


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--model-path", ""], "model_path"),
        (["--model-path", "  "], "model_path"),
        (["--model-path", "/m", "--tokenizer-path", ""], "tokenizer_path"),
    ],
)
def test_an_empty_or_blank_path_is_refused_naming_the_setting(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Path("") is the working directory: the engine loaded from there and failed later, about its files.
    with pytest.raises(SystemExit) as exited:
        config_from_args(argv)
    assert exited.value.code == 2
    assert f"{field} is " in capsys.readouterr().err
