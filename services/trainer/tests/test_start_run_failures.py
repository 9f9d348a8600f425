"""StartRun when Redis or the checkpoint's storage fails, or the checkpoint is damaged: UNAVAILABLE naming Redis or
the path (the orchestrator asks again), FAILED_PRECONDITION naming a checkpoint that cannot be read. Before, the
redis or OS error reached the gRPC layer as INTERNAL "internal error", on which the orchestrator (it retries only
UNAVAILABLE and DEADLINE_EXCEEDED) failed the run for good without a reason. Each start that fails leaves nothing
loaded. The tests that make Redis refuse writes use a redis-server of their own on a free port."""

from __future__ import annotations

import errno
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from torch.distributed.checkpoint import FileSystemReader

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.sample_stream import connect_redis
from rlfleet.v1 import trainer_pb2_grpc
from rlfleet.v1.trainer_pb2 import StartRunRequest, StopRunRequest, TrainerState
from rlfleet_trainer.checkpoint_checksums import SUMS_FILE
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.trainer_core import TrainerCore

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import serve_grpc, spec_for  # noqa: E402


def start_code(core: TrainerCore, run_id: str, model_dir: Path) -> tuple[grpc.StatusCode, str]:
    """StartRun of `run_id` over the real gRPC server: its status code and details."""
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            try:
                stub.StartRun(StartRunRequest(run_id=run_id, spec=spec_for(model_dir, 5, 1)), timeout=60)
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""
            return grpc.StatusCode.OK, ""
    finally:
        done.set()


def assert_nothing_held(core: TrainerCore) -> None:
    assert core.ranks.state.policy is None and core.held().state == TrainerState.TRAINER_STATE_IDLE


@pytest.fixture
def core_on(tmp_path: Path, fake_router: Any) -> Iterator[Callable[[redis.Redis, str], TrainerCore]]:
    """A TrainerCore on the Redis client given (with that client's URL for its scrapes)."""
    cores: list[TrainerCore] = []

    def make(client: redis.Redis, url: str) -> TrainerCore:
        settings = TrainerSettings(
            redis_url=url, redis_prefix="rlfleet-test:", work_dir=tmp_path / "trainer", read_block_ms=100
        )
        cores.append(TrainerCore(settings, client, RouterClient(fake_router.url, 30.0), TrainerMetrics()))
        return cores[-1]

    yield make
    for core in cores:
        core.shutdown()


def test_redis_unreachable_at_start_answers_unavailable_naming_redis(
    core_on: Callable[[redis.Redis, str], TrainerCore], small_model_dir: Path
) -> None:
    """As the trainer's client raises once a Redis outage outlasts its 30 s of retries (here without retries)."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    code, details = start_code(core_on(client, url), "down", small_model_dir)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert "run down cannot start now: Redis does not answer (ConnectionError" in details, details


class PrivateRedis:
    """A redis-server of this test's own on a free port, stopped by pid."""

    def __init__(self, data_dir: Path) -> None:
        server = shutil.which("redis-server")
        assert server is not None, "these tests need redis-server (apt-get install redis-server)"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        argv = [server, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(data_dir), "--save", "",
                "--appendonly", "no"]  # fmt: skip
        self.process = ServiceProcess("redis", argv, data_dir / "redis.log")
        probe = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                probe.ping()
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, f"redis-server did not answer: {self.process.log_tail()}"
                time.sleep(0.05)
        probe.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    (tmp_path / "redis").mkdir()
    server = PrivateRedis(tmp_path / "redis")
    yield server
    try:  # no snapshot at shutdown: one that cannot be written (MISCONF's) keeps redis-server up
        redis.Redis.from_url(server.url, socket_timeout=1).config_set("save", "")
    except redis.RedisError:
        pass
    server.process.stop(timeout=5)


def _full(client: redis.Redis) -> None:
    client.config_set("maxmemory", 1)  # noeviction, the default: every write that may use memory is refused (OOM)


def _read_only(client: redis.Redis) -> None:
    client.replicaof("127.0.0.1", free_port())  # a replica of a primary that is gone: READONLY


def _cannot_persist(client: redis.Redis) -> None:
    """A snapshot that cannot be written (its directory is gone) stops writes: MISCONF."""
    client.config_set("save", "3600 1")
    shutil.rmtree(str(client.config_get("dir")["dir"]))
    client.bgsave()
    deadline = time.monotonic() + 10
    while client.info("persistence")["rdb_last_bgsave_status"] != "err":
        assert time.monotonic() < deadline, "the snapshot did not fail"
        time.sleep(0.05)


def _too_few_replicas(client: redis.Redis) -> Callable[[], object]:
    client.config_set("min-replicas-to-write", 1)  # and it has none: NOREPLICAS
    return lambda: client.config_set("min-replicas-to-write", 0)


REFUSALS = {
    "full": (_full, "(OOM)"),
    "read-only": (_read_only, "(READONLY)"),
    "no disk": (_cannot_persist, "(MISCONF"),
    "no replicas": (_too_few_replicas, "(NOREPLICAS)"),
}


@pytest.mark.parametrize("kind", REFUSALS)
def test_redis_refusing_writes_at_start_answers_unavailable_naming_redis(
    core_on: Callable[[redis.Redis, str], TrainerCore], private_redis: PrivateRedis, small_model_dir: Path, kind: str
) -> None:
    refuse, code_word = REFUSALS[kind]
    refuse(redis.Redis.from_url(private_redis.url))
    core = core_on(connect_redis(private_redis.url), private_redis.url)
    code, details = start_code(core, "refused", small_model_dir)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert details.startswith("run refused cannot start now: Redis ") and code_word in details, details
    assert_nothing_held(core)


@pytest.fixture
def stopped_with_checkpoint(core: TrainerCore, small_model_dir: Path) -> Path:
    """Run "c", stopped with a checkpoint (of step 0): StartRun resumes it from there. Its checkpoint directory."""
    port, done = serve_grpc(core)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            stub.StartRun(StartRunRequest(run_id="c", spec=spec_for(small_model_dir, 5, 1)), timeout=60)
            stopped = stub.StopRun(StopRunRequest(run_id="c", checkpoint=True), timeout=60)
    finally:
        done.set()
    assert stopped.checkpoint_path
    return Path(stopped.checkpoint_path)


@pytest.mark.parametrize("damage", ["truncated", "empty", "truncated, saved without sums"])
def test_a_resume_whose_checkpoint_is_damaged_is_refused_naming_it(
    core: TrainerCore, small_model_dir: Path, stopped_with_checkpoint: Path, damage: str
) -> None:
    """Its .metadata (a pickle) cut short, as a copy of the work dir that was interrupted leaves it: asking again
    cannot help, so FAILED_PRECONDITION, naming the checkpoint. Its sums name the file; a checkpoint saved before
    they were kept is refused by what DCP meets."""
    metadata = stopped_with_checkpoint / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100] if damage.startswith("truncated") else b"")
    if damage.endswith("without sums"):
        (stopped_with_checkpoint / SUMS_FILE).unlink()
    code, details = start_code(core, "c", small_model_dir)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    if damage.endswith("without sums"):
        assert f"its checkpoint {stopped_with_checkpoint} cannot be read" in details, details
    else:
        assert f"its checkpoint {stopped_with_checkpoint} is damaged" in details, details
        assert f"checkpoint file {metadata} has SHA-256" in details, details
    assert "restore it from a copy" in details, details
    assert_nothing_held(core)


def test_a_resume_whose_checkpoint_storage_fails_answers_unavailable_naming_the_path(
    core: TrainerCore, small_model_dir: Path, stopped_with_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error reading the checkpoint's metadata (a network file system that failed), which DCP reads outside
    the calls whose failures it reports: retrying later may succeed."""
    metadata = stopped_with_checkpoint / ".metadata"

    def input_output_error(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error", str(metadata))

    monkeypatch.setattr(FileSystemReader, "read_metadata", input_output_error)
    code, details = start_code(core, "c", small_model_dir)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert f"run c cannot start now: storage failed at {metadata}: Input/output error" in details, details
    assert_nothing_held(core)


@pytest.mark.parametrize(
    "damage",
    [
        "no weights",
        "config not JSON",
        "config empty",
        "unknown model type",
        "config field type",
        "weights not safetensors",
    ],
)
def test_a_model_directory_transformers_cannot_load_is_refused_naming_model_path(
    core: TrainerCore, small_model_dir: Path, tmp_path: Path, damage: str
) -> None:
    """transformers raises an OSError of its own (no errno), or a ValueError, for such a directory, and safetensors
    an error of its own for weights it cannot read: each was answered INTERNAL ("internal error; see the service
    log"), naming nothing the caller could fix."""
    model = tmp_path / "model"
    shutil.copytree(small_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    if damage == "no weights":
        for weights in model.glob("*.safetensors"):
            weights.unlink()
    elif damage == "config not JSON":
        (model / "config.json").write_text("{not json")
    elif damage == "config empty":  # transformers' ValueError: no model_type
        (model / "config.json").write_text("{}")
    elif damage == "unknown model type":  # transformers' ValueError (KeyError inside)
        (model / "config.json").write_text(json.dumps({**config, "model_type": "no_such_architecture"}))
    elif damage == "config field type":  # huggingface_hub's StrictDataclassFieldValidationError
        (model / "config.json").write_text(json.dumps({**config, "vocab_size": "x"}))
    else:  # safetensors' own error
        (model / "model.safetensors").write_bytes(b"garbage" * 10)
    code, details = start_code(core, "m", model)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"model.path: the model at {model} cannot be loaded: "), details
    assert_nothing_held(core)


def test_a_work_dir_the_trainer_cannot_write_is_found_at_the_start(core: TrainerCore, small_model_dir: Path) -> None:
    """A fresh run writes nothing before its first step: it was TRAINING, then FAILED a step of rollouts later."""
    core.settings.work_dir.parent.mkdir(parents=True, exist_ok=True)
    core.settings.work_dir.write_text("a file where the work dir should be")
    code, details = start_code(core, "w", small_model_dir)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert f"run w cannot start now: storage failed at {core.settings.work_dir}/runs/w/" in details, details
    assert "Not a directory" in details, details
    assert_nothing_held(core)
