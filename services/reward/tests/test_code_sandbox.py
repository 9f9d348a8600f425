"""Hostile `code` responses against a real hub process: each is contained, scored 0 with its reason,
and the hub keeps serving. The fork bomb runs last, held by RLIMIT_NPROC and the group kill."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlfleet.processes import ServiceProcess, free_port
from rlfleet_reward.sandbox import probe_isolation

pytestmark = pytest.mark.e2e

LAUNCHER = Path(__file__).resolve().parent / "reward_hub_for_tests.py"
SECRET_NAME = "RLFLEET_TEST_SANDBOX_SECRET"  # outside RLFLEET_REWARD_, which must name settings
GOOD_PROGRAM = (
    "Here you go:\n```python\ndef add(a, b):\n    return a + b\n\nprint(add(*map(int, input().split())))\n```"
)
GOOD_TESTS = [{"stdin": "1 2\n", "stdout": "3"}, {"stdin": "0 0", "check": "assert add(2, 3) == 5"}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port, grpc_port = free_port(), free_port()
    argv = [sys.executable, str(LAUNCHER), "--host", "127.0.0.1", "--port", str(port), "--grpc-port",
            str(grpc_port), "--workers", "2", "--shutdown-grace-seconds", "2"]  # fmt: skip
    env = {"RLFLEET_LOG_FORMAT": "text", SECRET_NAME: "do-not-leak"}
    process = ServiceProcess("reward-hub-code", argv, tmp_path_factory.mktemp("code") / "hub.log", env=env)
    try:
        process.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop(timeout=10)


def score_code(hub: str, items: list[tuple[str, list[dict]]], **params: object) -> list[dict]:
    body = {
        "spec": {"terms": [{"function": "code", "params": {"timeout_seconds": 2, **params}}], "timeout_seconds": 30},
        "items": [{"id": str(i), "response": code, "label": json.dumps({"tests": tests})}
                  for i, (code, tests) in enumerate(items)],
    }  # fmt: skip
    response = httpx.post(f"{hub}/score", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["results"]


def assert_still_serving(hub: str) -> None:
    assert httpx.get(f"{hub}/health", timeout=10).status_code == 200
    (good,) = score_code(hub, [(GOOD_PROGRAM, GOOD_TESTS)])
    assert (good["status"], good["score"]) == ("SCORE_STATUS_OK", 1.0), good


def failed_because(result: dict, reason: str, tests: int = 1) -> bool:
    return (result["status"], result["score"], result["components"].get(f"code/{reason}")) == (
        "SCORE_STATUS_OK",
        0.0,
        float(tests),
    )


def test_a_correct_program_passes_and_a_wrong_one_fails(hub: str) -> None:
    good, wrong = score_code(hub, [(GOOD_PROGRAM, GOOD_TESTS), ("print(4)", [{"stdin": "1 2", "stdout": "3"}])])
    assert good["components"] == {"code": 1.0, "code/passed": 2.0, "code/tests": 2.0}
    assert failed_because(wrong, "wrong_answer"), wrong


def test_a_program_that_exits_before_its_check_fails_it(hub: str) -> None:
    """Before, the check passed on an exit status of 0, so a wrong function followed by sys.exit(0) or os._exit(0)
    passed every check test: a reward any policy could learn to take."""
    wrong = "def add(a, b):\n    return a - b\n"
    checks = [{"check": "assert add(1, 2) == 3"}, {"check": "assert add(2, 2) == 4"}]
    right, *skipped = score_code(
        hub,
        [("def add(a, b):\n    return a + b\n", checks)]
        + [(wrong + exit_early, checks) for exit_early in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n")],
        partial_credit=True,
    )
    assert right["score"] == 1.0, right
    assert all(failed_because(result, "check_skipped", tests=2) for result in skipped), skipped


def test_a_program_cannot_read_the_status_its_check_ends_with(hub: str) -> None:
    """The status was the last line of main.py (`raise SystemExit(N)`): a program defining no `add` read its own
    file, exited with N before the check, and passed every check test."""
    read_and_exit = (
        "import os, re, sys\n"
        "seen = open(__file__).read() + ' '.join(sys.orig_argv)\n"
        "for name in os.listdir('.'):\n"
        "    if name != os.path.basename(__file__):\n"
        "        seen += open(name).read()\n"
        "found = re.findall(r'SystemExit\\((\\d+)\\)|^(\\d+)$', seen, re.M)\n"
        "os._exit(int(''.join(found[-1])) if found else 0)\n"
    )
    checks = [{"check": "assert add(1, 2) == 3"}, {"check": "assert add(2, 2) == 4"}]
    (result,) = score_code(hub, [(read_and_exit, checks)], partial_credit=True)
    assert failed_because(result, "check_skipped", tests=2), result


def test_lines_padded_with_spaces_pass_however_many(hub: str) -> None:
    """Trailing whitespace is ignored; before, stdout was read up to twice the expected output and 4 KiB, and 20,000
    lines printed 8 wide ran past it and read as cut: a wrong_answer for a right program."""
    padded = "for _ in range(20000):\n    print(f'{1:<8}')\n"
    (result,) = score_code(hub, [(padded, [{"stdout": "1\n" * 20000}])])
    assert result["score"] == 1.0, result


def test_max_processes_counts_the_programs_processes_alone(hub: str) -> None:
    """In its own user namespace the limit also counted the sandbox's two processes: at 2, the smallest a spec may
    ask, no program ran at all (runtime_error), and at 3 a program could not start one child."""
    forks = "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('ok')\n"
    (alone,) = score_code(hub, [("print(3)", [{"stdout": "3"}])], max_processes=2)
    (child,) = score_code(hub, [(forks, [{"stdout": "ok"}])], max_processes=3)
    assert (alone["score"], child["score"]) == (1.0, 1.0), (alone, child)


def test_output_past_file_size_mb_is_output_limit_and_output_within_it_is_read_whole(hub: str) -> None:
    chars = (1 << 20) + 10
    to_file, to_stdout, long_answer = score_code(
        hub,
        [
            ("open('out', 'w').write('x' * (3 << 20))\n", [{"stdout": ""}]),
            ("import sys\nsys.stdout.write('x' * (3 << 20))\n", [{"stdout": ""}]),
            (f"print('x' * {chars})\n", [{"stdout": "x" * chars}]),
        ],
        file_size_mb=2,
    )
    assert failed_because(to_file, "output_limit"), to_file
    assert failed_because(to_stdout, "output_limit"), to_stdout
    assert (long_answer["score"], long_answer["components"]["code/passed"]) == (1.0, 1.0), long_answer


def test_hostile_programs_are_contained_and_scored_as_failures(hub: str, tmp_path: Path) -> None:
    outside = [Path(f"/tmp/rlfleet-escape-{uuid.uuid4().hex}"), tmp_path / "escape.txt"]
    tmp_path.chmod(0o777)  # only the sandbox, not file permissions, may stop the write
    listener = socket.create_server(("127.0.0.1", 0))
    env_probe = (
        "import glob, os\n"
        f"found = {SECRET_NAME!r} in os.environ\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        f"        found = found or {SECRET_NAME.encode()!r} in open(path, 'rb').read()\n"
        "    except OSError:\n"
        "        pass\n"
        "print('LEAKED' if found else 'safe')\n"
    )
    hostile = [
        ("while True:\n    pass\n", [{"stdout": ""}]),
        ("memory = bytearray(10 * 1024**3)\nprint(len(memory))\n", [{"stdout": str(10 * 1024**3)}]),
        ("import sys\nopen(sys.stdin.readline().strip(), 'w').write('escaped')\n",
         [{"stdin": str(path), "stdout": ""} for path in outside]),
        (f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=2)"
         ".sendall(b'leak')\n", [{"stdout": ""}]),
        (env_probe, [{"stdout": "LEAKED"}]),
    ]  # fmt: skip
    started = time.monotonic()
    loop, memory, writer, network, environment = score_code(hub, hostile)
    assert time.monotonic() - started < 20
    assert failed_because(loop, "time_limit"), loop
    assert failed_because(memory, "memory_limit"), memory
    assert failed_because(writer, "runtime_error", tests=2), writer
    assert not any(path.exists() for path in outside)
    assert failed_because(network, "runtime_error"), network
    # A connection would wait in the backlog; there is none.
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert failed_because(environment, "wrong_answer"), environment  # it printed "safe"
    listener.close()
    assert_still_serving(hub)


def test_a_program_that_hangs_is_scored_within_the_item_time_limit(hub: str) -> None:
    """It passes its first test and hangs on the others: three 1 s test timeouts pass the item's 2.5 s limit, and
    the item was a TIMEOUT, which training drops, where the hang should cost the sample its reward."""
    program = "n = int(input())\nwhile n:\n    pass\nprint(n)\n"
    tests = [{"stdin": str(n), "stdout": str(n)} for n in range(4)]
    body = {
        "spec": {"terms": [{"function": "code", "params": {"timeout_seconds": 1}}], "timeout_seconds": 2.5},
        "items": [{"id": "0", "response": program, "label": json.dumps({"tests": tests})}],
    }
    response = httpx.post(f"{hub}/score", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (result,) = response.json()["results"]
    assert (result["status"], result["score"]) == ("SCORE_STATUS_OK", 0.25), result
    components = result["components"]
    assert (components["code/passed"], components["code/time_limit"], components["code/tests"]) == (1, 3, 4)


def test_zz_a_fork_bomb_is_held_and_killed(hub: str) -> None:
    """Runs last (by name, in this module): RLIMIT_NPROC caps it, the group kill ends it, nothing survives."""
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    started = time.monotonic()
    (result,) = score_code(hub, [(bomb, [{"stdout": ""}])], timeout_seconds=2, max_processes=16)
    assert time.monotonic() - started < 15
    assert result["status"] == "SCORE_STATUS_OK" and result["score"] == 0.0, result
    assert result["components"].get("code/time_limit", 0) + result["components"].get("code/runtime_error", 0) == 1
    assert _sandbox_processes() == []
    assert_still_serving(hub)


def _sandbox_processes() -> list[int]:
    isolation = probe_isolation()
    uid = isolation.run_as[0] if isolation.run_as else os.getuid()
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                if b"main.py" in Path(entry.path, "cmdline").read_bytes():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found
