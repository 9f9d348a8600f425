"""The trainer's ranks when one of them fails: a rank that hangs, a step only rank 0 takes failing inside an
op, a stop while an op still runs.

A collective that fails or times out leaves the ranks out of step for good (a gloo group cannot be used
after a timeout): every later call fails at once with UNAVAILABLE naming the cause, /health answers 503
with it, and rank 0 ends with status 1, so that torchrun and Kubernetes restart the job (its runs resume
from their last checkpoint). A rank-0-only step that fails (a checkpoint's directory) fails the op on
every rank at once, with its cause, and the ranks go on. SIGTERM leaves an op hung on a follower at its
bound. tests/torchrun/rank_failures.py drives the rank protocol directly; the other tests run `serve`
under torchrun. Rank 1 is hung with SIGSTOP (as a stuck collective or a frozen node would hang it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from rlfleet.processes import ServiceProcess, free_port, process_runs
from rlfleet.sample_stream import SampleStream
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import CheckpointRequest, StartRunRequest, StatusRequest, StopRunRequest, TrainerState
from rlfleet_trainer.http_app import make_http_app
from rlfleet_trainer.policy import load_policy

sys.path.insert(0, str(Path(__file__).parent))

from torchrun_jobs import SCRIPTS, torchrun  # noqa: E402
from trainer_core_support import rollout_group, spec_for  # noqa: E402

SCRIPT = str(SCRIPTS / "rank_failures.py")
REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
START_TIMEOUT_S = 120.0


def wait_until(predicate: Callable[[], bool], bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {bound_s:.0f}s"
        time.sleep(0.1)


def rank_pid(job: ServiceProcess, rank: int) -> int:
    """The pid of torchrun job `job`'s worker of rank `rank` (a child of the launcher with RANK=<rank>)."""
    children = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
    for child in children:
        with open(f"/proc/{child}/environ", "rb") as environ:  # noqa: PTH123 - a /proc read, bytes
            if f"RANK={rank}".encode() in environ.read().split(b"\0"):
                return int(child)
    raise LookupError(f"no rank {rank} among the children {children} of {job.name}")


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


# -- the rank protocol ----------------------------------------------------------------------------------------


def scenario(name: str, tmp_path: Path, timeout_s: float) -> ServiceProcess:
    return torchrun(2, [SCRIPT, name, str(tmp_path), str(timeout_s)], tmp_path / "ranks.log")


def seen_by(tmp_path: Path, rank: int, job: ServiceProcess, bound_s: float) -> dict[str, Any]:
    out = tmp_path / f"rank{rank}.json"
    wait_until(lambda: out.exists() or not job.alive(), bound_s, f"rank {rank}'s report\n{job.log_tail(40)}")
    assert out.exists(), f"rank {rank} wrote no report; last lines of the log:\n{job.log_tail(40)}"
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def ends(job: ServiceProcess, bound_s: float, pid_files: Path | None = None) -> int | None:
    """The job's exit status once it has ended (killed after `bound_s`: None). torchrun starts each rank in a
    session of its own: ranks named by `pid_files/pid<N>` that outlived it are killed by pid."""
    try:
        wait_until(lambda: not job.alive(), bound_s, "the job's end")
    except AssertionError:
        return None
    finally:
        job.stop(timeout=5)
        for pid_file in pid_files.glob("pid[0-9]*") if pid_files is not None else ():
            pid = int(pid_file.read_text())
            if process_runs(pid):
                os.kill(pid, signal.SIGKILL)
    return job.proc.returncode


@pytest.mark.e2e
def test_a_rank_hung_in_an_op_breaks_the_ranks_for_good_and_says_why(tmp_path: Path) -> None:
    timeout_s = 4.0
    job = scenario("hang_in_op", tmp_path, timeout_s)
    try:
        leader = seen_by(tmp_path, 0, job, 90)["seen"]
        resume(int((tmp_path / "pid1").read_text()))  # back from its hang, rank 1 finds rank 0 gone
        follower = seen_by(tmp_path, 1, job, 30)["seen"]
    finally:
        ends(job, 30, tmp_path)
    hung, after = leader["hung"], leader["after"]
    assert hung.get("error") == "RanksBroken" and hung["grpc_code"] == "UNAVAILABLE", hung
    assert hung["seconds"] < 2 * timeout_s, hung  # the exchange's timeout, once
    assert "out of step" in hung["message"] and "'freeze_on_1'" in hung["message"], hung
    assert "Timed out" in hung["message"], hung  # the cause, in gloo's words
    # From then on every call fails at once, naming the same cause.
    assert after.get("error") == "RanksBroken" and after["seconds"] < 1.0, after
    assert after["message"] == hung["message"] == leader["broken"]
    assert leader["told"] == [leader["broken"]]  # listeners hear of it once
    assert leader["final_stop_seconds"] < 1.0
    assert follower["follow_raised"].startswith("RanksBroken: the trainer's ranks are out of step"), follower


@pytest.mark.e2e
def test_a_rank_that_hangs_while_the_ranks_idle_is_found_by_the_heartbeat(tmp_path: Path) -> None:
    timeout_s = 4.0
    job = scenario("hang_idle", tmp_path, timeout_s)
    try:
        leader = seen_by(tmp_path, 0, job, 90)["seen"]
        resume(int((tmp_path / "pid1").read_text()))
    finally:
        ends(job, 30, tmp_path)
    # The heartbeat's no-op (a quarter of the timeout after the last op) is a round trip: it times out.
    broken_after = leader["broken_after_s"]
    assert broken_after is not None and broken_after < 2 * timeout_s, leader
    assert leader["told"] == [leader["broken"]] and "the heartbeat" in leader["broken"], leader
    assert leader["after"].get("error") == "RanksBroken" and leader["after"]["seconds"] < 1.0, leader


@pytest.mark.e2e
def test_a_checkpoint_step_failing_on_rank_0_fails_every_rank_at_once_and_the_ranks_go_on(tmp_path: Path) -> None:
    timeout_s = 8.0
    job = scenario("rank_0_only", tmp_path, timeout_s)
    try:
        leader, follower = seen_by(tmp_path, 0, job, 90), seen_by(tmp_path, 1, job, 30)
        assert ends(job, 30, tmp_path) == 0, job.log_tail(40)
    finally:
        ends(job, 0, tmp_path)
    seen = leader["seen"]
    # Each fails with rank 0's own error, long before the collective timeout (half of it: a loaded machine took
    # 2.2 s of the 8).
    root_is_a_file, rename_fails = seen["root_is_a_file"], seen["rename_fails"]
    assert root_is_a_file.get("error") == "FileExistsError" and root_is_a_file["seconds"] < timeout_s / 2, (
        root_is_a_file
    )
    assert rename_fails.get("error") == "OSError" and "Input/output error" in rename_fails["message"], rename_fails
    assert rename_fails["seconds"] < timeout_s / 2, rename_fails
    # Every rank raised it, so the ranks stayed in step: the next ops, a checkpoint among them, work.
    assert [line.split(":")[0] for line in follower["log"] if line.startswith("save raised")] == [
        "save raised FileExistsError",
        "save raised OSError",
    ], follower["log"]
    assert seen["after"] == {"result": "b", "seconds": seen["after"]["seconds"]}
    assert seen["good_save"].get("result", "").endswith("step_3") and seen["steps"] == [3], seen
    assert seen["broken"] is None


@pytest.mark.e2e
def test_stop_waits_for_an_op_in_flight_only_up_to_its_bound(tmp_path: Path) -> None:
    timeout_s = 4.0
    job = scenario("stop_in_op", tmp_path, timeout_s)
    try:
        leader = seen_by(tmp_path, 0, job, 90)["seen"]
        follower = seen_by(tmp_path, 1, job, 30)["seen"]  # its op ends after rank 0 has left
    finally:
        ends(job, 30, tmp_path)
    assert leader["stop_released"] is False and leader["stop_seconds"] < 2.5, leader
    assert follower["follow_raised"].startswith("RanksBroken"), follower


def test_health_answers_503_naming_why_the_ranks_broke() -> None:
    why: list[str] = []
    client = TestClient(make_http_app(CollectorRegistry(), 0, 2, lambda: why[0] if why else None))
    assert client.get("/health").json() == {"status": "ok", "rank": 0, "world_size": 2, "serves_api": True}
    why.append("the trainer's ranks are out of step: op 'train_step' failed on rank 0 (RuntimeError: Timed out)")
    answer = client.get("/health")
    assert answer.status_code == 503
    assert answer.json() == {"error": {"kind": "unavailable", "message": why[0], "code": 503}}


# -- serve under torchrun -------------------------------------------------------------------------------------


@contextmanager
def trainer_ranks(
    tmp_path: Path, router_url: str, redis_prefix: str, timeout_s: float, *flags: str, shutdown_s: int = 30
) -> Iterator[tuple[ServiceProcess, trainer_pb2_grpc.TrainerStub, str]]:
    """`serve` on two ranks under torchrun (its --shutdown-timeout `shutdown_s`), healthy: the job, a stub of
    its Trainer API and its /health URL. Stopped by process group afterwards."""
    grpc_port, http_port = free_port(), free_port()
    args = [
        f"--shutdown-timeout={shutdown_s}", "-m", "rlfleet_trainer", "serve", "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--router-url", router_url,
        "--redis-url", REDIS_URL, "--redis-prefix", redis_prefix, "--work-dir", str(tmp_path / "work"),
        "--collective-timeout-s", str(timeout_s), "--read-block-ms", "100", "--torch-threads", "1", *flags,
    ]  # fmt: skip
    job = torchrun(2, args, tmp_path / "trainer.log")
    health = f"http://127.0.0.1:{http_port}/health"
    try:
        job.wait_healthy(health, START_TIMEOUT_S)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            yield job, trainer_pb2_grpc.TrainerStub(channel), health
    finally:
        for rank in (0, 1):
            try:
                resume(rank_pid(job, rank))
            except (LookupError, OSError):
                pass
        job.stop(timeout=10)


def rpc_error(call: Callable[[], Any]) -> tuple[grpc.RpcError, float]:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value, time.monotonic() - started


class HealthWatch:
    """Polls /health every 0.2 s in a thread, noting (time, HTTP status or None when unreachable, body)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, int | None, str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.wait(0.2):
            try:
                answer = httpx.get(self.url, timeout=2.0)
                self.answers.append((time.monotonic(), answer.status_code, answer.text))
            except httpx.HTTPError as exc:
                self.answers.append((time.monotonic(), None, type(exc).__name__))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)


@pytest.mark.e2e
def test_a_hung_follower_ends_the_trainer_which_says_why(
    tmp_path: Path, small_model_dir: Path, redis_prefix: str, fake_router: Any
) -> None:
    """Before: the run failed after the collective timeout, then every StartRun answered INTERNAL at once,
    forever, /health said ok and no rank ended, so nothing restarted the trainer."""
    timeout_s = 6.0
    spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
    with trainer_ranks(tmp_path, fake_router.url, redis_prefix, timeout_s) as (job, stub, health_url):
        stub.StartRun(StartRunRequest(run_id="a", spec=spec), timeout=START_TIMEOUT_S)
        leader, follower = rank_pid(job, 0), rank_pid(job, 1)
        os.kill(follower, signal.SIGSTOP)
        health = HealthWatch(health_url)
        try:
            # The run waits for groups: the checkpoint is taken at once, and is the op that finds rank 1 hung.
            checkpoint, took = rpc_error(lambda: stub.Checkpoint(CheckpointRequest(run_id="a"), timeout=60))
            answered = time.monotonic()
            later, _ = rpc_error(lambda: stub.StartRun(StartRunRequest(run_id="b", spec=spec), timeout=10))
            status, _ = rpc_error(lambda: stub.Status(StatusRequest(run_id="a"), timeout=10))
            wait_until(lambda: not process_runs(leader), 20, f"rank 0's end\n{job.log_tail(30)}")
        finally:
            health.stop()
        resume(follower)  # a hung rank does not end on torchrun's SIGTERM: torchrun would wait 30 s to kill it
        code = ends(job, 30)
    assert "out of step" in checkpoint.details() and "'checkpoint_save'" in checkpoint.details(), checkpoint
    assert took < 2 * timeout_s, took
    assert later.code() == grpc.StatusCode.UNAVAILABLE, later  # refused (the trainer stops), never INTERNAL
    # Nor is the run reported FAILED, which its caller would take as final: the restarted trainer resumes it.
    assert status.code() == grpc.StatusCode.UNAVAILABLE, status
    after = [(status, body) for at, status, body in health.answers if at > answered]
    assert after and all(status in (503, None) for status, _ in after), after  # never "ok" again
    assert all("out of step" in body for status, body in after if status == 503), after
    assert code not in (0, None), job.log_tail(40)  # a failed worker: torchrun (or Kubernetes) restarts the job
    log = (tmp_path / "trainer.log").read_text()
    assert "exiting with status 1 so that the trainer is restarted: the trainer's ranks are out of step" in log


@pytest.mark.e2e
def test_a_checkpoint_failing_on_rank_0_fails_at_once_with_its_cause_and_the_ranks_go_on(
    tmp_path: Path, small_model_dir: Path, redis_prefix: str, fake_router: Any
) -> None:
    """Before: rank 0 left the op for the ranks' exchange while rank 1 waited at the checkpoint's barrier, so the
    call waited out the collective timeout, answered with gloo's timeout instead of the cause, and the ranks
    were broken for good (the next StartRun: INTERNAL)."""
    timeout_s = 30.0
    checkpoints = tmp_path / "work" / "runs" / "ck" / "checkpoints"
    spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
    with trainer_ranks(tmp_path, fake_router.url, redis_prefix, timeout_s) as (job, stub, health_url):
        stub.StartRun(StartRunRequest(run_id="ck", spec=spec), timeout=START_TIMEOUT_S)
        # Once the run is under way (a start checks that it can write there): rank 0's mkdir fails.
        shutil.rmtree(checkpoints)
        checkpoints.write_text("not a directory")
        failed, took = rpc_error(lambda: stub.Checkpoint(CheckpointRequest(run_id="ck"), timeout=90))
        status = stub.Status(StatusRequest(run_id="ck"), timeout=10)
        # The ranks are in step: another run starts, and checkpoints over both ranks.
        started = stub.StartRun(StartRunRequest(run_id="ck2", spec=spec), timeout=START_TIMEOUT_S)
        checkpoint = stub.Checkpoint(CheckpointRequest(run_id="ck2"), timeout=60)
        stub.StopRun(StopRunRequest(run_id="ck2"), timeout=60)
        health = httpx.get(health_url, timeout=5)
        assert job.alive(), job.log_tail(40)
    assert took < 10, (took, failed)
    assert failed.code() == grpc.StatusCode.FAILED_PRECONDITION, failed  # as on one rank
    assert "FileExistsError" in failed.details() and "checkpoints" in failed.details(), failed
    assert status.state == TrainerState.TRAINER_STATE_FAILED and "FileExistsError" in status.error, status
    assert started.state == TrainerState.TRAINER_STATE_TRAINING, started
    assert Path(checkpoint.path, ".metadata").exists(), checkpoint
    assert health.status_code == 200, health.text


@pytest.mark.e2e
def test_sigterm_leaves_a_step_hung_on_a_follower_at_its_bound(
    tmp_path: Path, small_model_dir: Path, redis_client: redis.Redis, redis_prefix: str, fake_router: Any
) -> None:
    """SIGTERM waits for the step in progress up to --shutdown-timeout-s. Before, rank 0 then waited on for the
    ranks' lock, which the step held until its collective timed out (here 120 s)."""
    shutdown_s = 2.0
    spec = spec_for(small_model_dir, steps=5, groups_per_step=1)
    flags = ("--shutdown-timeout-s", str(shutdown_s))
    with trainer_ranks(tmp_path, fake_router.url, redis_prefix, 120.0, *flags, shutdown_s=90) as (job, stub, _):
        stub.StartRun(StartRunRequest(run_id="t", spec=spec), timeout=START_TIMEOUT_S)
        leader, follower = rank_pid(job, 0), rank_pid(job, 1)
        os.kill(follower, signal.SIGSTOP)
        stream = SampleStream(redis_client, "t", prefix=redis_prefix)
        stream.append(rollout_group(load_policy(small_model_dir), "t", 0, 0))

        def step_started() -> bool:
            return int(redis_client.xpending(stream.key, stream.consumer_group)["pending"]) > 0

        wait_until(step_started, 30, "the trainer reading the step's group")
        time.sleep(1.0)  # into the step, whose first collective waits for rank 1
        signalled = time.monotonic()
        os.kill(job.pid, signal.SIGTERM)  # torchrun passes it on to the ranks
        try:
            wait_until(lambda: not process_runs(leader), 30, f"rank 0's end\n{job.log_tail(30)}")
            took = time.monotonic() - signalled
        finally:
            resume(follower)
        ends(job, 30)
    # gRPC's drain (5 s, nothing in flight here), the shutdown bound, then a few seconds for the op in flight.
    assert took < 5 + shutdown_s + 8, took
    log = (tmp_path / "trainer.log").read_text()
    assert "exiting with an op still running on the ranks" in log, log[-3000:]
