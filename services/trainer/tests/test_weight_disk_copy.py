"""The disk copy of a broadcast version, written in the background while the next step trains: one at a time and in
order, of exactly the weights broadcast, its failure raised at the next wait, and waited for by a checkpoint and by
the run's end. The group is a stand-in (no engines); the router is the fake one, over HTTP."""

from __future__ import annotations

import errno
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlfleet.errors import Unavailable
from rlfleet.sample_stream import SampleStream
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.trainer_pb2 import TrainerState
from rlfleet_trainer import run_loop, weight_publisher
from rlfleet_trainer.active_run import ActiveRun
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.trainer_core import TrainerCore
from rlfleet_trainer.weight_broadcast import WeightBroadcaster
from rlfleet_trainer.weight_disk_copy import DiskCopyFailed, private_state
from rlfleet_trainer.weight_publisher import DiskPublisher, DistributedPublisher
from rlfleet_trainer.weights import save_version

sys.path.insert(0, str(Path(__file__).parent))

from trainer_core_support import rollout_group, spec_for, wait_for  # noqa: E402

WAIT_S = 30.0


class OpenGroup(WeightBroadcaster):
    """A weight update group that is always open and delivers every version at once (no engines). Records each
    version broadcast with the disk copies the router had registered by then."""

    def __init__(self, router_url: str, registered: list[dict[str, Any]], router_timeout_s: float = 10.0) -> None:
        super().__init__(RouterClient(router_url, router_timeout_s), "127.0.0.1", "gloo", 1.0, 1.0)
        self._registered = registered
        self.broadcasts: list[tuple[int, list[str]]] = []

    def is_current(self) -> bool:
        return True

    def broadcast(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.broadcasts.append((version, [copy["weight_version"] for copy in self._registered]))

    def close(self) -> None:
        return None


class GatedSave:
    """`save_version` that holds each write until `gate` is set (bounded), or fails it with `error`."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.error: BaseException | None = None
        self.writing = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Path:
        self.writing.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        if self.error is not None:
            raise self.error
        return save_version(*args, **kwargs)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> GatedSave:
    save = GatedSave()
    monkeypatch.setattr(weight_publisher, "save_version", save)
    return save


@pytest.fixture
def model(small_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(small_model_dir)


class Written(list[tuple[int, Path]]):
    """The (version, directory) pairs a publisher told complete, in order."""

    def __call__(self, version: int, path: Path) -> None:
        self.append((version, path))


def publisher_for(
    fake_router: Any, root: Path, tokenizer_dir: Path, router_timeout_s: float = 10.0, **kwargs: Any
) -> tuple[DistributedPublisher, OpenGroup]:
    group = OpenGroup(fake_router.url, fake_router.disk_copies, router_timeout_s)
    on_written = kwargs.get("on_written")
    disk = DiskPublisher(
        RouterClient(fake_router.url, router_timeout_s),
        root,
        tokenizer_dir,
        **({} if on_written is None else {"on_written": on_written}),
    )
    return DistributedPublisher(group, disk, root, tokenizer_dir, **kwargs), group


def sample(metrics: TrainerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_publish_returns_while_the_copy_is_written_and_the_next_one_waits_for_it(
    fake_router: Any, small_model_dir: Path, tmp_path: Path, model: PreTrainedModel, gated: GatedSave
) -> None:
    metrics, written = TrainerMetrics(), Written()
    publisher, group = publisher_for(fake_router, tmp_path, small_model_dir, metrics=metrics, on_written=written)
    gated.gate.clear()
    path = publisher.publish(model, 1)
    assert gated.writing.wait(WAIT_S) and not path.exists()
    assert sample(metrics, "rlfleet_trainer_weight_disk_copy_in_flight") == 1 and written == []
    assert group.broadcasts == [(1, [])] and fake_router.disk_copies == []

    second = threading.Thread(target=publisher.publish, args=(model, 2))
    second.start()
    time.sleep(0.5)
    assert second.is_alive() and group.broadcasts == [(1, [])], "version 2 went out before version 1's copy"
    gated.gate.set()
    second.join(WAIT_S)
    # Version 1's copy was registered before version 2 was broadcast: a copy never reaches the router late.
    assert group.broadcasts == [(1, []), (2, ["1"])]
    publisher.settle()
    assert [copy["weight_version"] for copy in fake_router.disk_copies] == ["1", "2"]
    assert fake_router.disk_copies[0]["model_path"] == str(path) and (path / "model.safetensors").exists()
    assert written == [(1, path), (2, tmp_path / "v2")], "told once each copy was registered"
    assert fake_router.loads == [], "the engines serve the broadcast versions: nothing loaded from disk"
    assert sample(metrics, "rlfleet_trainer_weight_disk_copy_in_flight") == 0
    assert sample(metrics, "rlfleet_trainer_weight_disk_copy_seconds_count") == 2
    assert sample(metrics, "rlfleet_trainer_weight_disk_copy_wait_seconds_count") >= 1


def test_the_copy_holds_the_weights_broadcast_not_the_next_steps(
    fake_router: Any, small_model_dir: Path, tmp_path: Path, model: PreTrainedModel, gated: GatedSave
) -> None:
    """The model's state on one process is its live parameters: the optimizer step after `publish` returned changed
    them in place while they were written."""
    publisher, _ = publisher_for(fake_router, tmp_path, small_model_dir)
    published = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    gated.gate.clear()
    path = publisher.publish(model, 1)
    assert gated.writing.wait(WAIT_S)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # the next step, in place, as an optimizer steps
    gated.gate.set()
    publisher.settle()
    written = load_file(str(path / "model.safetensors"))
    assert written.keys() <= published.keys() and "model.embed_tokens.weight" in written
    for name, tensor in written.items():
        assert torch.equal(tensor, published[name]), name


def test_a_private_state_copies_only_what_is_the_models_own_memory(model: PreTrainedModel) -> None:
    gathered = {name: t.detach().clone() for name, t in model.state_dict().items()}  # as FSDP's full gather gives it
    assert all(private_state(gathered, model)[n] is t for n, t in gathered.items()), "no second copy of a gather"
    live = model.state_dict()
    copied = private_state(live, model)
    assert all(copied[n] is not t and torch.equal(copied[n], t) for n, t in live.items())


@pytest.mark.parametrize("failure", ["disk_full", "router_refuses"])
def test_a_copy_that_fails_is_counted_and_raised_at_the_next_publish(
    failure: str, fake_router: Any, small_model_dir: Path, tmp_path: Path, model: PreTrainedModel, gated: GatedSave
) -> None:
    metrics = TrainerMetrics()
    publisher, group = publisher_for(fake_router, tmp_path, small_model_dir, router_timeout_s=1.0, metrics=metrics)
    if failure == "disk_full":
        gated.error, expected = OSError(errno.ENOSPC, "No space left on device"), "OSError: .*No space left"
    else:
        fake_router.fail_next, expected = 1000, "Unavailable: .*did not register the disk copy of weight version 1"
    publisher.publish(model, 1)
    wait_for(lambda: sample(metrics, "rlfleet_trainer_weight_disk_copy_failures_total") == 1, timeout=WAIT_S)
    with pytest.raises(DiskCopyFailed, match=f"disk copy of weight version 1 failed: {expected}"):
        publisher.publish(model, 2)
    assert group.broadcasts == [(1, [])], "the next version is not broadcast over a copy that failed"
    publisher.settle()  # raised once


def test_a_copy_past_its_bound_is_raised_and_not_waited_for_again(
    fake_router: Any, small_model_dir: Path, tmp_path: Path, model: PreTrainedModel, gated: GatedSave
) -> None:
    metrics = TrainerMetrics()
    publisher, _ = publisher_for(fake_router, tmp_path, small_model_dir, disk_copy_timeout_s=0.5, metrics=metrics)
    gated.gate.clear()
    publisher.publish(model, 1)
    with pytest.raises(DiskCopyFailed, match="version 1 is still being written .* after [0-9]+s"):
        publisher.settle()
    started = time.monotonic()
    publisher.close()  # the run has failed on it: closing does not wait the bound again
    assert time.monotonic() - started < 0.4
    gated.gate.set()
    wait_for(lambda: sample(metrics, "rlfleet_trainer_weight_disk_copy_in_flight") == 0, timeout=WAIT_S)


def test_a_copy_given_up_at_its_bound_reaches_neither_the_router_nor_the_status_once_the_sync_is_closed(
    fake_router: Any, small_model_dir: Path, tmp_path: Path, model: PreTrainedModel, gated: GatedSave
) -> None:
    """The run failed on the copy and let go of its weight sync; by the time storage lets the write end, the run may
    have been resumed and the fleet serve another version (the router refuses the copy, 409). Loaded through the
    router then, the failed run's version would replace the fleet's, labelled as that run's."""
    metrics, written = TrainerMetrics(), Written()
    publisher, _ = publisher_for(
        fake_router, tmp_path, small_model_dir, disk_copy_timeout_s=0.5, metrics=metrics, on_written=written
    )
    gated.gate.clear()
    publisher.publish(model, 1)
    with pytest.raises(DiskCopyFailed, match="still being written"):
        publisher.settle()
    publisher.close()
    fake_router.disk_copy_conflict = True
    gated.gate.set()
    wait_for(lambda: sample(metrics, "rlfleet_trainer_weight_disk_copy_in_flight") == 0, timeout=WAIT_S)
    assert fake_router.loads == [] and fake_router.disk_copies == [] and written == []
    assert sample(metrics, "rlfleet_trainer_weight_disk_copy_failures_total") == 1


def test_the_fallback_to_disk_is_written_before_publish_returns(
    fake_router: Any, small_model_dir: Path, tmp_path: Path, model: PreTrainedModel
) -> None:
    written = Written()
    publisher, group = publisher_for(fake_router, tmp_path, small_model_dir, on_written=written)

    def broken(state: Mapping[str, torch.Tensor], version: int) -> None:
        raise Unavailable("engine http://10.0.0.2:30001 closed the connection")

    group.broadcast = broken  # type: ignore[method-assign]
    path = publisher.publish(model, 3)
    assert (path / "model.safetensors").exists() and written == [(3, path)]
    assert fake_router.loads == [{"model_path": str(path), "weight_version": "3"}] and fake_router.disk_copies == []


def test_a_version_written_before_the_run_reports_it_is_named_once_it_does(tmp_path: Path) -> None:
    """A copy can be registered while its step's checkpoint is taken, before the run reports the version: Status
    never names a version later than the one it reports."""
    nothing: Any = None  # no ranks, no stream: what Status says is all this needs
    run = ActiveRun("ahead", RunSpec(), nothing, nothing, tmp_path, tmp_path, tmp_path, weights_path="/base")
    run.weights_written(1, tmp_path / "v1")
    assert (run.status().weight_version, run.status().weights_path) == (0, "/base")
    run.update(step=1, weight_version=1)
    assert (run.status().weight_version, run.status().weights_path, run.weights_version) == (1, str(tmp_path / "v1"), 1)
    run.weights_written(2, tmp_path / "v2")  # reported already: named at once
    run.update(step=2, weight_version=2)
    run.weights_written(3, tmp_path / "v3")
    assert run.status().weights_path == str(tmp_path / "v2")


def test_a_checkpoint_is_taken_once_the_copy_is_done() -> None:
    from rlfleet_trainer.run_loop import AfterPublished

    events: list[str] = []

    class Publisher:
        def settle(self) -> None:
            events.append("settled")

    class Checkpoints:
        def commit(self, run: Any, step: int, groups_trained: int) -> None:
            events.append(f"checkpoint {step}")

    AfterPublished(Checkpoints(), Publisher()).commit(None, 3, 6)  # type: ignore[arg-type]
    assert events == ["settled", "checkpoint 3"]


@pytest.fixture
def distributed_runs(fake_router: Any, monkeypatch: pytest.MonkeyPatch) -> list[DistributedPublisher]:
    """Runs publish through a DistributedPublisher whose group is `OpenGroup`; the publishers made, in order."""
    made: list[DistributedPublisher] = []

    def make(
        settings: Any, router: RouterClient, root: Path, tokenizer_dir: Path, full_state: Callable[..., Any], **kw: Any
    ) -> DistributedPublisher:
        disk = DiskPublisher(router, root, tokenizer_dir, full_state, on_written=kw["on_written"])
        group = OpenGroup(fake_router.url, fake_router.disk_copies)
        made.append(
            DistributedPublisher(
                group, disk, root, tokenizer_dir, full_state, metrics=kw["metrics"], on_written=kw["on_written"]
            )
        )
        return made[-1]

    monkeypatch.setattr(run_loop, "make_publisher", make)
    return made


def feed(redis_client: Any, redis_prefix: str, run_id: str, model_dir: Path, groups: int) -> SampleStream:
    stream = SampleStream(redis_client, run_id, prefix=redis_prefix)
    model = load_policy(model_dir)
    for i in range(groups):
        stream.append(rollout_group(model, run_id, 0, i))
    return stream


def test_a_run_ends_once_its_last_copy_is_registered(
    core: Any,
    small_model_dir: Path,
    redis_client: Any,
    redis_prefix: str,
    fake_router: Any,
    gated: GatedSave,
    distributed_runs: list[DistributedPublisher],
) -> None:
    gated.gate.clear()
    core.start_run("copied", spec_for(small_model_dir, steps=1, groups_per_step=1))
    feed(redis_client, redis_prefix, "copied", small_model_dir, 1)
    assert gated.writing.wait(WAIT_S)
    time.sleep(0.5)
    assert core.status("copied").state == TrainerState.TRAINER_STATE_TRAINING, "ended with its copy being written"
    assert core.status("copied").checkpoint_step == 0, "checkpointed before its version's copy was written"
    gated.gate.set()
    wait_for(lambda: core.status("copied").state == TrainerState.TRAINER_STATE_STOPPED)
    status = core.status("copied")
    assert status.checkpoint_step == 1 and fake_router.disk_copies == [
        {"model_path": status.weights_path, "weight_version": "1"}
    ]
    assert Path(status.weights_path, "model.safetensors").exists()


def test_a_run_whose_last_copy_fails_fails_and_its_last_step_stays_unacknowledged(
    core: Any,
    small_model_dir: Path,
    redis_client: Any,
    redis_prefix: str,
    fake_router: Any,
    gated: GatedSave,
    distributed_runs: list[DistributedPublisher],
) -> None:
    gated.error = OSError(errno.ENOSPC, "No space left on device")
    core.start_run("full", spec_for(small_model_dir, steps=1, groups_per_step=2))
    stream = feed(redis_client, redis_prefix, "full", small_model_dir, 2)
    wait_for(lambda: core.status("full").state == TrainerState.TRAINER_STATE_FAILED)
    status = core.status("full")
    assert "DiskCopyFailed: the disk copy of weight version 1 failed: OSError" in status.error, status.error
    assert status.checkpoint_step == 0 and stream.pending_count() == 2, "trained again when the run resumes"
    assert status.weights_path == str(small_model_dir.absolute()), "named version 1, whose copy was never written"
    assert core.metrics.registry.get_sample_value("rlfleet_trainer_weight_disk_copy_failures_total") == 1


def test_a_stop_without_a_checkpoint_waits_for_the_copy_in_flight(
    core: Any,
    small_model_dir: Path,
    redis_client: Any,
    redis_prefix: str,
    fake_router: Any,
    gated: GatedSave,
    distributed_runs: list[DistributedPublisher],
) -> None:
    gated.gate.clear()
    core.start_run("stopped", spec_for(small_model_dir, steps=5, groups_per_step=1))
    feed(redis_client, redis_prefix, "stopped", small_model_dir, 1)
    assert gated.writing.wait(WAIT_S)
    stop = threading.Thread(target=core.stop_run, args=("stopped",))
    stop.start()
    time.sleep(0.5)
    assert stop.is_alive() and core.status("stopped").state == TrainerState.TRAINER_STATE_TRAINING
    gated.gate.set()
    stop.join(WAIT_S)
    status = core.status("stopped")
    assert status.state == TrainerState.TRAINER_STATE_STOPPED and status.step == 1 and status.checkpoint_step == 0
    assert fake_router.disk_copies == [{"model_path": status.weights_path, "weight_version": "1"}]


@pytest.fixture
def checking_core(
    tmp_path: Path, redis_client: Any, redis_prefix: str, fake_router: Any, gated: GatedSave
) -> Iterator[TrainerCore]:
    """A core that checks the fleet's version every 0.1 s and keeps one weight version. The fake router reports the
    version it last loaded from disk (0 once the run started), as a restarted router reports none: each check while
    the run waits for groups after a broadcast loads the run's version again."""
    settings = TrainerSettings(
        redis_prefix=redis_prefix,
        work_dir=tmp_path / "trainer",
        read_block_ms=100,
        fleet_check_s=0.1,
        keep_weight_versions=1,
    )
    core = TrainerCore(settings, redis_client, RouterClient(fake_router.url, 30.0), TrainerMetrics())
    yield core
    gated.gate.set()
    core.shutdown()


def test_the_fleets_version_is_not_reloaded_from_a_copy_still_being_written(
    checking_core: TrainerCore,
    small_model_dir: Path,
    redis_client: Any,
    redis_prefix: str,
    fake_router: Any,
    gated: GatedSave,
    distributed_runs: list[DistributedPublisher],
) -> None:
    core = checking_core
    gated.gate.clear()
    core.start_run("checked", spec_for(small_model_dir, steps=5, groups_per_step=1))
    feed(redis_client, redis_prefix, "checked", small_model_dir, 1)
    assert gated.writing.wait(WAIT_S)
    wait_for(lambda: core.status("checked").weight_version == 1)
    time.sleep(1.0)  # ten checks
    assert [load["weight_version"] for load in fake_router.loads] == ["0"]
    gated.gate.set()
    wait_for(lambda: [load["weight_version"] for load in fake_router.loads] == ["0", "1"])
    assert Path(fake_router.loads[-1]["model_path"], "model.safetensors").exists()


def test_the_fleets_version_is_not_reloaded_from_a_copy_that_failed(
    checking_core: TrainerCore,
    small_model_dir: Path,
    redis_client: Any,
    redis_prefix: str,
    fake_router: Any,
    gated: GatedSave,
    distributed_runs: list[DistributedPublisher],
) -> None:
    """No directory holds version 1: the run fails at its next publish, checkpoint or end, and meanwhile no engine
    is asked to load a directory that does not exist (or an older version labelled 1)."""
    core = checking_core
    gated.error = OSError(errno.ENOSPC, "No space left on device")
    core.start_run("unchecked", spec_for(small_model_dir, steps=5, groups_per_step=1))
    feed(redis_client, redis_prefix, "unchecked", small_model_dir, 1)
    wait_for(lambda: core.metrics.registry.get_sample_value("rlfleet_trainer_weight_disk_copy_failures_total") == 1)
    wait_for(lambda: core.status("unchecked").weight_version == 1)
    time.sleep(1.0)  # ten checks
    assert fake_router.loads == [{"model_path": str(small_model_dir.absolute()), "weight_version": "0"}]
    status = core.status("unchecked")
    assert status.state == TrainerState.TRAINER_STATE_TRAINING and status.weights_path == str(
        small_model_dir.absolute()
    )


def test_status_names_only_a_weight_directory_that_is_complete(
    checking_core: TrainerCore,
    small_model_dir: Path,
    redis_client: Any,
    redis_prefix: str,
    gated: GatedSave,
    distributed_runs: list[DistributedPublisher],
) -> None:
    """While version v's copy is written, Status names v - 1's directory (the base model's for 0), which is kept
    meanwhile even when only one version is kept; v's once its copy is registered, without waiting for a step."""
    core = checking_core
    base = str(small_model_dir.absolute())
    gated.gate.clear()
    core.start_run("named", spec_for(small_model_dir, steps=5, groups_per_step=1))
    stream = feed(redis_client, redis_prefix, "named", small_model_dir, 1)
    assert gated.writing.wait(WAIT_S)
    wait_for(lambda: core.status("named").weight_version == 1)
    status = core.status("named")
    assert (status.weights_path, status.weights_version) == (base, 0), "named version 1 while its copy was written"
    gated.gate.set()
    v1 = core.settings.work_dir / "runs" / "named" / "weights" / "v1"
    wait_for(lambda: core.status("named").weights_path == str(v1))
    assert (v1 / "model.safetensors").exists() and core.status("named").step == 1

    gated.gate.clear()
    gated.writing.clear()
    stream.append(rollout_group(load_policy(small_model_dir), "named", 1, 1))
    assert gated.writing.wait(WAIT_S)
    wait_for(lambda: core.status("named").weight_version == 2)
    status = core.status("named")
    assert (status.weights_path, status.weights_version) == (str(v1), 1), "named version 2 while it was written"
    assert (v1 / "model.safetensors").exists(), "the version Status names was pruned"
    gated.gate.set()
    wait_for(lambda: core.status("named").weights_path == str(v1.with_name("v2")))
