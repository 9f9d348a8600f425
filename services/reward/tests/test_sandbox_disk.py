"""The disk bound of a code run: RLIMIT_FSIZE bounds each file, the disk watchdog what the run's directory holds
(bytes allocated and entries), with and without namespaces; and the watchdog costs a short run nothing."""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from rlfleet.v1 import reward_pb2
from rlfleet_reward import sandbox
from rlfleet_reward.code_execution import CodeCase, CodeParams, score_code, verdict
from rlfleet_reward.reward_function import RewardInput
from rlfleet_reward.sandbox import Isolation, RunResult, SandboxLimits, probe_isolation, run_python
from rlfleet_reward.scoring import Scorer

LIMITS = SandboxLimits(
    wall_seconds=10,
    cpu_seconds=10,
    memory_bytes=512 << 20,
    file_size_bytes=1 << 20,
    max_processes=8,
    disk_bytes=4 << 20,
    disk_entries=2000,
)
# Prints its directory first, so the test can check it is gone afterwards.
_WHERE = "import os, time\nprint(os.getcwd(), flush=True)\n"


@pytest.fixture(params=["as probed", "without namespaces"])
def isolation(request: pytest.FixtureRequest) -> Isolation:
    probed = probe_isolation()
    if request.param == "without namespaces":
        return dataclasses.replace(probed, namespaces=False)
    return probed


def _run(program: str, isolation: Isolation, limits: SandboxLimits = LIMITS) -> RunResult:
    result = run_python(_WHERE + program, "", limits, isolation)
    directory = result.stdout.split("\n", 1)[0]
    assert directory.startswith("/") and not Path(directory).exists(), (directory, result.stderr)
    return result


@pytest.mark.parametrize("then", ["time.sleep(30)", "pass"], ids=["then waits", "then exits"])
def test_many_files_within_the_file_size_limit_but_past_the_disk_bound_are_an_output_limit(
    isolation: Isolation, then: str
) -> None:
    # 64 files of 512 KiB, each within RLIMIT_FSIZE, 32 MiB in all against a bound of 4 MiB.
    program = f"for i in range(64):\n    open(f'f{{i}}', 'wb').write(b'x' * (512 << 10))\n{then}\n"
    result = _run(program, isolation)
    assert result.disk_exceeded and not result.timed_out, result
    assert result.seconds < 5, "killed as the bound passed, not at the wall-clock limit"
    assert verdict(result, CodeCase(check="pass")) == "output_limit"


def test_files_under_the_bound_pass(isolation: Isolation) -> None:
    # 3 MiB of data, 200 entries, a sparse file of 1 MiB that holds a byte, and a link to a large tree that is not
    # followed: all within 4 MiB and 2000 entries.
    program = (
        "os.mkdir('d')\n"
        "for i in range(6):\n    open(f'd/f{i}', 'wb').write(b'x' * (512 << 10))\n"
        "for i in range(190):\n    open(f'e{i}', 'w').close()\n"
        "with open('sparse', 'wb') as f:\n    f.seek((1 << 20) - 1); f.write(b'x')\n"
        "os.symlink('/usr', 'usr')\n"
        "time.sleep(0.3)\n"  # a few watchdog scans while the files are there
        "print('done')\n"
    )
    result = _run(program, isolation)
    assert (result.exit_code, result.disk_exceeded) == (0, False), result
    assert result.stdout.split()[1:] == ["done"]
    assert verdict(result, CodeCase(stdout=result.stdout)) == "passed"


@pytest.mark.parametrize("kind", ["open(f'e{i}', 'w').close()", "os.mkdir(f'e{i}')"], ids=["files", "directories"])
def test_many_empty_entries_past_the_entry_cap_are_an_output_limit(isolation: Isolation, kind: str) -> None:
    program = f"for i in range(5000):\n    {kind}\ntime.sleep(30)\n"
    result = _run(program, isolation)
    assert result.disk_exceeded and result.seconds < 5, result
    assert verdict(result, CodeCase(check="pass")) == "output_limit"


@pytest.mark.parametrize("runs_for", [0.03, 0.08], ids=["ends before the first check", "ends between checks"])
def test_the_wait_ends_when_the_program_does_not_at_a_watchdog_tick(tmp_path: Path, runs_for: float) -> None:
    """Against a baseline measured here, the wait that returns the moment the program ends (`waitid` without
    reaping): a watchdog that slept between its checks would add up to a tick to every run. Timed on `sleep`, not
    on a Python program, so that the machine's load (interpreter start-up) does not drown a few milliseconds."""

    def waited(wait: Callable[[int], object]) -> float:
        process = subprocess.Popen(["sleep", str(runs_for)])
        started = time.monotonic()
        wait(process.pid)
        seconds = time.monotonic() - started
        process.wait(5)
        return seconds

    def watch(pid: int) -> None:
        assert sandbox._watch(pid, tmp_path, LIMITS) == "exited"

    def baseline(pid: int) -> None:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)

    runs: dict[str, list[float]] = {"watch": [], "baseline": []}
    for _ in range(10):
        runs["baseline"].append(waited(baseline))  # interleaved, so load on the machine hits both alike
        runs["watch"].append(waited(watch))
    assert min(runs["watch"]) < min(runs["baseline"]) + 0.005, runs
    assert statistics.median(runs["watch"]) < statistics.median(runs["baseline"]) + 0.010, runs


def _score(program: str, **params: Any) -> dict[str, float]:
    values = CodeParams.model_validate(params).model_dump()
    scored = score_code(RewardInput(response=program, label='{"tests": [{"check": "pass"}]}'), values)
    return dict(scored.parts)


def test_code_scores_a_run_past_disk_mb_as_output_limit() -> None:
    writer = "for i in range(40):\n    open(f'f{i}', 'wb').write(b'x' * (512 << 10))\n"
    assert _score(writer, disk_mb=4, file_size_mb=1) == {"passed": 0.0, "tests": 1.0, "output_limit": 1.0}
    assert _score(writer, disk_mb=32, file_size_mb=1) == {"passed": 1.0, "tests": 1.0}


def _problems(with_scorer: Callable[..., Any], **params: Any) -> list[tuple[str, str]]:
    """(field, message) of every problem /validate finds in a spec of one `code` term with `params`."""
    spec = json_format.ParseDict({"terms": [{"function": "code", "params": params}]}, reward_pb2.RewardSpec())

    async def body(scorer: Scorer) -> list[tuple[str, str]]:
        answer = scorer.validate_spec(reward_pb2.ValidateSpecRequest(spec=spec))
        return [(p.field, p.message) for p in answer.problems]

    return with_scorer(body, workers=1)


def test_the_hubs_cap_refuses_disk_mb_past_it(with_scorer: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert _problems(with_scorer, disk_mb=256) == []
    (refused,) = _problems(with_scorer, disk_mb=257)
    assert refused[0] == "terms[0].params.disk_mb", refused
    assert "257 is past the hub's cap of 256 (RLFLEET_REWARD_CODE_MAX_DISK_MB)" in refused[1], refused
    monkeypatch.setenv("RLFLEET_REWARD_CODE_MAX_DISK_MB", "32")
    # Defaults count too: a hub capping below the default refuses a spec that does not ask for less.
    assert [field for field, _ in _problems(with_scorer)] == ["terms[0].params.disk_mb"]
    assert _problems(with_scorer, disk_mb=32) == []


_ALLOCATE = "os.posix_fallocate(fd, 0, 1 << 20)\n"
# Each makes file `i` of 1 MiB that no directory names, held by a descriptor or, last, by a mapping alone.
_HELD = {
    "unlinked while open": "fd = os.open(f'f{i}', os.O_CREAT | os.O_RDWR); os.unlink(f'f{i}')\n" + _ALLOCATE,
    "O_TMPFILE": "fd = os.open('.', os.O_TMPFILE | os.O_RDWR)\n" + _ALLOCATE,
    "mapped, closed and unlinked": (
        "fd = os.open(f'f{i}', os.O_CREAT | os.O_RDWR)\n"
        + _ALLOCATE
        + "mmap(None, 4096, 1, 1, fd, 0); os.close(fd); os.unlink(f'f{i}')\n"
    ),
}
_MMAP = (
    "import ctypes\nmmap = ctypes.CDLL(None).mmap\nmmap.restype = ctypes.c_void_p\n"
    "mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
)


@pytest.mark.parametrize("how", list(_HELD))
def test_files_no_directory_names_count_against_the_disk_bound(isolation: Isolation, how: str) -> None:
    """A file unlinked while open keeps its blocks until the last descriptor or mapping goes: 40 files of 1 MiB held
    40 MiB under a bound of 4 MiB, unseen by a sum of the directory alone (up to max_processes x 64 files x
    file_size_mb in all, with descriptors; more with mappings)."""
    make = "".join(f"    {line}\n" for line in _HELD[how].splitlines())
    program = f"{_MMAP}for i in range(40):\n{make}time.sleep(30)\n"
    result = _run(program, isolation)
    assert result.disk_exceeded and result.seconds < 5, result
    assert verdict(result, CodeCase(check="pass")) == "output_limit"


def test_a_small_file_no_directory_names_passes(isolation: Isolation) -> None:
    # What `tempfile.TemporaryFile` makes (O_TMPFILE), within the bound.
    program = "import tempfile\nf = tempfile.TemporaryFile()\nf.write(b'x' * (1 << 20)); f.flush()\n"
    result = _run(program + "time.sleep(0.3)\nprint('done')\n", isolation)
    assert (result.exit_code, result.disk_exceeded, result.stdout.split()[1:]) == (0, False, ["done"]), result
