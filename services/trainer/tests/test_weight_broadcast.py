"""Distributed weight sync end to end: this process is the trainer (rank 0, gloo), two real CPU engines behind
the real router receive its versions in buckets, and then score a prompt exactly as the trainer's model does."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

sys.path.insert(0, str(Path(__file__).parent))

from engine_fleet import EngineFleet, start_engine_fleet  # noqa: E402

from rlfleet.errors import Unavailable  # noqa: E402
from rlfleet_trainer import weight_broadcast, weight_publisher  # noqa: E402
from rlfleet_trainer.router_client import RouterClient  # noqa: E402
from rlfleet_trainer.weight_broadcast import WeightBroadcaster, buckets, unique_tensors  # noqa: E402
from rlfleet_trainer.weight_publisher import DiskPublisher, DistributedPublisher  # noqa: E402

pytestmark = pytest.mark.e2e
PROMPT = [20, 21, 22, 23, 24]
BUCKET_MB = 0.05  # the small model is ~0.2 MB: several buckets per version


@pytest.fixture(scope="module")
def engine_fleet(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFleet]:
    # A slow health check, so the router still counts an engine this test kills as healthy.
    router_args = ["--health-check-interval-secs", "30", "--policy", "round_robin"]
    fleet = start_engine_fleet(small_model_dir, tmp_path_factory.mktemp("weight-sync-logs"), router_args=router_args)
    yield fleet
    fleet.stop()


def broadcaster_for(fleet: EngineFleet) -> WeightBroadcaster:
    return WeightBroadcaster(RouterClient(fleet.router_url, 30.0), "127.0.0.1", "gloo", BUCKET_MB, timeout_s=15.0)


@pytest.fixture(scope="module")
def publisher(
    engine_fleet: EngineFleet, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DistributedPublisher]:
    weights_root = tmp_path_factory.mktemp("weights")
    disk = DiskPublisher(RouterClient(engine_fleet.router_url, 30.0), weights_root, small_model_dir)
    published = DistributedPublisher(broadcaster_for(engine_fleet), disk, weights_root, small_model_dir)
    yield published
    published.close()


@pytest.fixture(scope="module")
def model(small_model_dir: Path) -> Iterator[PreTrainedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(small_model_dir).eval()
    torch.set_num_threads(threads)


def take_a_step(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def assert_engines_serve(fleet: EngineFleet, urls: list[str], model: PreTrainedModel, version: int) -> None:
    """Each engine's greedy logprobs for PROMPT equal the trainer model's (1e-4), under `version`."""
    for url in urls:
        out = fleet.generate(url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY})
        output = out["output_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + output])).logits[0].float()  # (T, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        expected = [float(logprobs[len(PROMPT) - 1 + i, tok]) for i, tok in enumerate(output)]
        served = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-4, url
        assert out["meta_info"]["weight_version"] == str(version)
        assert httpx.get(f"{url}/get_model_info", timeout=10).json()["weight_version"] == str(version)


GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_versions_broadcast_in_buckets_reach_every_engine_exactly(
    engine_fleet: EngineFleet, publisher: DistributedPublisher, model: PreTrainedModel
) -> None:
    assert len(buckets(unique_tensors(model.state_dict()), int(BUCKET_MB * 2**20))) > 2
    for version in (1, 2):
        take_a_step(model, seed=version)
        path = publisher.publish(model, version)
        assert_engines_serve(engine_fleet, engine_fleet.engine_urls, model, version)
        publisher.settle()  # the disk copy, written in the background
        # The disk copy for engines that rejoin is registered as the fleet's current version.
        current = httpx.get(f"{engine_fleet.router_url}/weight_version", timeout=10).json()
        assert current == {"weight_version": str(version), "model_path": str(path)}
        assert (path / "config.json").exists()

    group = httpx.get(f"{engine_fleet.router_url}/weights_update_groups/rlfleet-trainer", timeout=10).json()
    assert group["current"] is True and [e["rank_offset"] for e in group["engines"]] == [1, 2]
    metrics = httpx.get(f"{engine_fleet.router_url}/metrics", timeout=10).text
    assert 'rlfleet_router_weight_sync_seconds_count{path="distributed"} 2.0' in metrics
    assert 'rlfleet_router_weight_sync_seconds_count{path="disk"}' not in metrics, "no fallback to disk"


def test_an_engine_that_rejoins_while_the_disk_copy_is_written_is_held_out_until_it_is_registered(
    engine_fleet: EngineFleet, publisher: DistributedPublisher, model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy is written while the next step trains: an engine that rejoins meanwhile is not admitted on the
    version before (the router has no disk copy of the fleet's version to load into it), and joins on the copy."""
    router = engine_fleet.router_url
    rejoining = engine_fleet.engine_urls[1]
    gate = threading.Event()
    save = weight_publisher.save_version

    def held(*args: Any, **kwargs: Any) -> Path:
        assert gate.wait(60), "the test never opened the gate"
        return save(*args, **kwargs)

    monkeypatch.setattr(weight_publisher, "save_version", held)
    take_a_step(model, seed=10)
    try:
        publisher.publish(model, 10)
        assert httpx.get(f"{router}/weight_version", timeout=10).json() == {"weight_version": "10", "model_path": None}
        assert httpx.delete(f"{router}/workers/{rejoining}", timeout=10).status_code == 200
        assert httpx.post(f"{router}/workers", json={"url": rejoining}, timeout=10).status_code == 202
        deadline = time.monotonic() + 30
        while "disk copy is not registered yet" not in str(_worker(router, rejoining)["last_error"]):
            assert time.monotonic() < deadline, _worker(router, rejoining)
            time.sleep(0.1)
        assert _worker(router, rejoining)["state"] != "healthy"
    finally:
        gate.set()
    publisher.settle()
    path = httpx.get(f"{router}/weight_version", timeout=10).json()["model_path"]
    assert path is not None and Path(path, "model.safetensors").exists()
    # Back in promptly (the module's router probes every 30 s): it loads the registered copy before it routes.
    assert httpx.delete(f"{router}/workers/{rejoining}", timeout=10).status_code == 200
    assert httpx.post(f"{router}/workers", json={"url": rejoining}, timeout=10).status_code == 202
    engine_fleet.wait_healthy_engines(2)
    assert_engines_serve(engine_fleet, engine_fleet.engine_urls, model, 10)


def _worker(router: str, url: str) -> dict[str, Any]:
    workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    return next(w for w in workers if w["url"] == url)


def test_a_bucket_the_router_refuses_ends_the_broadcast_at_once_and_the_version_arrives_from_disk(
    engine_fleet: EngineFleet, publisher: DistributedPublisher, model: PreTrainedModel, small_model_dir: Path
) -> None:
    """An engine leaves the router between two buckets: the router refuses the next one (409) at once, and the
    trainer falls back then, not after the group's timeout (30 s here) with the fleet paused."""
    live, gone = engine_fleet.engine_urls
    broadcaster = publisher._broadcaster
    broadcaster._timeout_s = 30.0
    together = broadcaster._together
    buckets_sent = 0

    def remove_before_the_second_bucket(route: str, *args: Any, **kwargs: Any) -> None:
        nonlocal buckets_sent
        if route == "/update_weights_from_distributed":
            buckets_sent += 1
            if buckets_sent == 2:
                assert httpx.delete(f"{engine_fleet.router_url}/workers/{gone}", timeout=10).status_code == 200
        together(route, *args, **kwargs)

    broadcaster._together = remove_before_the_second_bucket  # type: ignore[method-assign]
    take_a_step(model, seed=3)
    started = time.monotonic()
    try:
        path = publisher.publish(model, 3)
    finally:
        broadcaster._together = together  # type: ignore[method-assign]
    assert time.monotonic() - started < 15.0
    assert_engines_serve(engine_fleet, [live], model, 3)
    assert httpx.get(f"{engine_fleet.router_url}/weight_version", timeout=10).json()["model_path"] == str(path)
    # Back in the fleet for the next test: the router brings it to version 3 before it routes to it.
    assert httpx.post(f"{engine_fleet.router_url}/workers", json={"url": gone}, timeout=10).status_code == 202
    engine_fleet.wait_healthy_engines(2)


def test_a_version_whose_buckets_miss_a_tensor_is_not_served_and_arrives_from_disk(
    engine_fleet: EngineFleet,
    publisher: DistributedPublisher,
    model: PreTrainedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor left out of every bucket (a bucketing bug, a bucket lost): the engines apply the bucket that carries
    the version but keep their old label (`weights_partial`) rather than serve it with that tensor's previous value,
    the router fails that bucket, and the trainer's disk fallback brings every engine to the whole version."""
    lost = "model.layers.1.mlp.up_proj.weight"

    def without_the_lost_tensor(state: Any) -> dict[str, torch.Tensor]:
        return {name: t for name, t in unique_tensors(state).items() if name != lost}

    monkeypatch.setattr(weight_broadcast, "unique_tensors", without_the_lost_tensor)
    disk_loads = _disk_loads(engine_fleet)
    take_a_step(model, seed=4)
    path = publisher.publish(model, 4)
    assert_engines_serve(engine_fleet, engine_fleet.engine_urls, model, 4)
    assert httpx.get(f"{engine_fleet.router_url}/weight_version", timeout=10).json()["model_path"] == str(path)
    assert _disk_loads(engine_fleet) == disk_loads + 1, "the version came from disk"
    for url in engine_fleet.engine_urls:
        assert httpx.get(f"{url}/get_model_info", timeout=10).json()["weights_partial"] is False


def _disk_loads(fleet: EngineFleet) -> int:
    metrics = httpx.get(f"{fleet.router_url}/metrics", timeout=10).text
    found = re.search(r'rlfleet_router_weight_sync_seconds_count\{path="disk"\} ([0-9.]+)', metrics)
    return int(float(found.group(1))) if found else 0


def test_a_dead_engine_is_named_and_the_version_still_arrives_from_disk(
    engine_fleet: EngineFleet, publisher: DistributedPublisher, model: PreTrainedModel
) -> None:
    live, dead = engine_fleet.engine_urls
    engine_fleet.engines[1].kill()
    with pytest.raises(Unavailable, match=dead.replace(".", r"\.")):
        broadcaster_for(engine_fleet).open()

    take_a_step(model, seed=5)
    path = publisher.publish(model, 5)
    assert_engines_serve(engine_fleet, [live], model, 5)
    assert httpx.get(f"{engine_fleet.router_url}/weight_version", timeout=10).json()["model_path"] == str(path)
    metrics = httpx.get(f"{engine_fleet.router_url}/metrics", timeout=10).text
    assert re.search(r'rlfleet_router_weight_sync_seconds_count\{path="disk"\} [1-9]', metrics), "fell back to disk"
