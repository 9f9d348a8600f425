"""`--backend sglang`: the engine's settings become SGLang's launch_server flags, the process becomes
SGLang's (a stand-in `sglang` package records what it was given), and a missing SGLang is a clear error."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet_engine.config import config_from_args
from rlfleet_engine.sglang_backend import INSTALL_HINT, sglang_argv, sglang_env

FAKE_LAUNCH_SERVER = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(),
                  "timeout": os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT")}))
"""


def test_settings_become_launch_server_flags() -> None:
    config = config_from_args(
        [
            "--model-path",
            "/m",
            "--port",
            "30005",
            "--host",
            "0.0.0.0",
            "--max-running-requests",
            "64",
            "--random-seed",
            "3",
            "--dtype",
            "bfloat16",
            "--weight-version",
            "7",
            "--context-length",
            "4096",
            "--served-model-name",
            "policy",
            "--log-level",
            "WARNING",
            "--backend",
            "sglang",
        ]
    )
    argv = sglang_argv(config, python="/py")
    assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model-path"] == "/m" and flags["--tokenizer-path"] == "/m"
    assert (flags["--host"], flags["--port"]) == ("0.0.0.0", "30005")
    assert flags["--max-running-requests"] == "64" and flags["--random-seed"] == "3"
    assert flags["--dtype"] == "bfloat16" and flags["--weight-version"] == "7"
    assert flags["--served-model-name"] == "policy" and flags["--log-level"] == "warning"
    assert argv[argv.index("--context-length") + 1] == "4096"
    # The dashboards read SGLang's own metrics.
    assert "--enable-metrics" in argv
    assert "--trust-remote-code" not in argv and "--skip-server-warmup" not in argv


def test_sglangs_switches_reach_it() -> None:
    """They were accepted and dropped: a model whose code comes with its checkpoint failed to load on SGLang."""
    switches = ["--trust-remote-code", "--skip-server-warmup"]
    argv = sglang_argv(config_from_args(["--model-path", "/m", "--backend", "sglang", *switches]), python="/py")
    assert [flag for flag in argv if flag in switches] == switches


def test_what_the_engine_was_not_given_is_left_to_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU engine's defaults are a CPU's: 16 sequences a batch, float32, seed 0. Passed on, every GPU engine
    decoded at most 16 sequences, held float32 weights (twice the memory, a smaller KV pool, numerics unlike the
    bfloat16 trainer's), and sampled from the same seed as every other engine."""
    config = config_from_args(["--model-path", "/m", "--backend", "sglang"])
    assert (config.max_running_requests, config.dtype, config.random_seed) == (16, "float32", 0)  # the CPU's
    argv = sglang_argv(config)
    for flag in ("--context-length", "--max-running-requests", "--dtype", "--random-seed"):
        assert flag not in argv, argv
    monkeypatch.setenv("RLFLEET_ENGINE_DTYPE", "bfloat16")  # set, by flag or variable: passed on
    argv = sglang_argv(config_from_args(["--model-path", "/m", "--backend", "sglang", "--random-seed", "0"]))
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--random-seed") + 1] == "0"


def test_health_check_timeout_goes_through_sglangs_variable() -> None:
    config = config_from_args(["--model-path", "/m", "--health-check-timeout", "7.5"])
    assert sglang_env(config, {"PATH": "/bin"}) == {"PATH": "/bin", "SGLANG_HEALTH_CHECK_TIMEOUT": "8"}


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_without_sglang_the_engine_names_the_extra_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet_engine", "--backend", "sglang", "--model-path", "/m"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert INSTALL_HINT in result.stderr and "not installed" in result.stderr


def test_the_engine_process_becomes_sglangs_server(tmp_path: Path) -> None:
    fake = tmp_path / "sglang"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "rlfleet_engine", "--backend", "sglang", "--model-path", "/m", "--port", "30009"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    # exec, not a child: the pid the launcher holds is SGLang's.
    assert seen["pid"] == process.pid
    assert seen["argv"][seen["argv"].index("--port") + 1] == "30009" and seen["timeout"] == "20"
