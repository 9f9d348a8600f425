"""SIGTERM at the moments of `serve` that held it or lost the signal: while a StartRun waits for the fleet's weight
load, and while the trainer starts. Each time the process ends within its bound, with a stop's status (0)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import StartRunRequest
from rlfleet_trainer.run_state import RunStateStore

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import spec_for, wait_for  # noqa: E402

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

# `python -m rlfleet_trainer` with one part of its startup made slow (argv[1]: which, for argv[2] seconds), which
# creates file argv[3] as it begins; the trainer's own arguments follow.
SLOW_START = """
import sys
import time
from pathlib import Path

which, seconds, begun = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])


def slowed(original):
    def slow(*args, **kwargs):
        begun.touch()
        time.sleep(seconds)
        return original(*args, **kwargs)

    return slow


if which == "core":
    import rlfleet_trainer.trainer_core as made

    made.TrainerCore.__init__ = slowed(made.TrainerCore.__init__)
else:
    import rlfleet_trainer.grpc_server as made

    made.make_grpc_server = slowed(made.make_grpc_server)
from rlfleet_trainer.__main__ import main

sys.exit(main(sys.argv[4:]))
"""


def serve_argv(tmp_path: Path, router_url: str, redis_prefix: str, grpc_port: int, http_port: int) -> list[str]:
    return [
        "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
        "--router-url", router_url, "--redis-url", REDIS_URL, "--redis-prefix", redis_prefix,
        "--work-dir", str(tmp_path / "work"), "--read-block-ms", "100", "--shutdown-timeout-s", "2",
    ]  # fmt: skip


@pytest.mark.e2e
def test_sigterm_while_a_start_run_waits_for_the_fleet_answers_it_and_ends_within_the_bound(
    tmp_path: Path, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, fake_router: Any
) -> None:
    """The start's thread, a handler of the servicer's own pool, waited for the router's load (up to
    --weight-load-timeout-s, 300 s): the process ended only once the load did (the pool's threads are joined at
    exit), and its StartRun heard gRPC's own "Cancelling all calls" at the end of the drain, naming nothing."""
    grpc_port, http_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "rlfleet_trainer",
        *serve_argv(tmp_path, fake_router.url, redis_prefix, grpc_port, http_port),
    ]
    trainer = ServiceProcess("trainer", argv, tmp_path / "trainer.log", env={"OMP_NUM_THREADS": "1"})
    try:
        trainer.wait_healthy(f"http://127.0.0.1:{http_port}/health", 90)
        fake_router.delay_s = 30.0
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            spec = spec_for(small_model_dir, steps=2, groups_per_step=1)
            call = trainer_pb2_grpc.TrainerStub(channel).StartRun.future(
                StartRunRequest(run_id="t", spec=spec), timeout=90
            )
            assert fake_router.loading.wait(60), "StartRun did not reach its weight load"
            signalled = time.monotonic()
            os.kill(trainer.pid, signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as answer:
                call.result(timeout=60)
            answered = time.monotonic() - signalled
        code = trainer.proc.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        trainer.stop(timeout=10)
    assert took < 15 and code == 0, (took, code, trainer.log_tail(40))
    assert answer.value.code() == grpc.StatusCode.UNAVAILABLE and answered < 3, (answer.value, answered)
    assert "the trainer is shutting down; run t was still starting" in (answer.value.details() or "")
    # Nothing written: no record, no load the fleet finished, no file under the run's directory.
    assert RunStateStore(redis_client, redis_prefix).load("t") is None and fake_router.loads == []
    assert [p for p in (tmp_path / "work" / "runs" / "t").rglob("*") if not p.is_dir()] == []


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("slow", "seconds", "bound_s"),
    [
        ("core", 60.0, 5.0),  # Python's default SIGTERM killed the process: status -15, not a stop's 0
        ("grpc", 3.0, 15.0),  # swallowed before uvicorn took SIGTERM over: the trainer went on serving
    ],
)
def test_sigterm_while_the_trainer_starts_ends_it_promptly_with_a_stops_status(
    tmp_path: Path, redis_prefix: str, fake_router: Any, slow: str, seconds: float, bound_s: float
) -> None:
    """`slow`: the part of the startup the SIGTERM comes in (made `seconds` long), which it ends (the core being
    made) or which it waits for (the gRPC server being made: the servers then stop before they serve)."""
    begun = tmp_path / "begun"
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    grpc_port, http_port = free_port(), free_port()
    argv = [
        sys.executable, str(script), slow, str(seconds), str(begun),
        *serve_argv(tmp_path, fake_router.url, redis_prefix, grpc_port, http_port),
    ]  # fmt: skip
    trainer = ServiceProcess("trainer", argv, tmp_path / "trainer.log", env={"OMP_NUM_THREADS": "1"})
    try:
        wait_for(begun.exists, timeout=90)
        signalled = time.monotonic()
        os.kill(trainer.pid, signal.SIGTERM)
        code = trainer.proc.wait(timeout=30)
        took = time.monotonic() - signalled
    finally:
        trainer.stop(timeout=10)
    assert code == 0 and took < bound_s, (code, took, trainer.log_tail(40))
