"""The pieces of weight publishing that need no engines: buckets, tied weights, the wire format, the fallback
(inside the pause), a refusal that ends the wait for a collective."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.errors import Unavailable
from rlfleet.weight_update_group import request_fields, spec_of, unflatten
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weight_broadcast import WeightBroadcaster, buckets, unique_tensors
from rlfleet_trainer.weight_publisher import DiskPublisher, DistributedPublisher, make_publisher


def test_buckets_keep_order_and_size_and_a_large_tensor_travels_alone() -> None:
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(5)}  # 4 bytes each
    parts = buckets(state, bucket_bytes=80)
    assert [list(p) for p in parts] == [["a", "b"], ["big"], ["c"]]
    assert [n for p in parts for n in p] == list(state)


def test_every_tensor_of_a_bucket_starts_aligned_to_its_dtype() -> None:
    """SGLang unpacks a flattened bucket with `flat[start:end].view(dtype)`, no copy: a float32 after an odd number
    of bfloat16 values failed there (storage offset not a multiple of 4)."""
    state = {
        "odd_half": torch.randn(3, 5).to(torch.bfloat16),
        "f": torch.randn(7),
        "i": torch.arange(3, dtype=torch.int64),
        "byte": torch.ones(3, dtype=torch.uint8),
        "g": torch.randn(2),
    }
    [bucket] = buckets(state, bucket_bytes=1 << 20)
    assert list(bucket) == ["i", "f", "g", "odd_half", "byte"]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in bucket.values()])
    start = 0
    for name, tensor in bucket.items():
        end = start + tensor.numel() * tensor.element_size()
        assert torch.equal(flat[start:end].view(tensor.dtype).reshape(tensor.shape), tensor), name  # no clone
        start = end


def test_tied_weights_travel_once() -> None:
    embed = torch.nn.Parameter(torch.ones(4, 2))
    state = {"embed": embed, "lm_head": embed, "norm": torch.ones(2), "half": embed[2:]}
    assert list(unique_tensors(state)) == ["embed", "norm", "half"]


def test_a_flattened_bucket_round_trips_mixed_dtypes() -> None:
    named = {
        "f": torch.randn(3, 4),
        "h": torch.randn(5).to(torch.bfloat16),
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in named.values()])
    back = unflatten(flat, [spec_of(n, t) for n, t in named.items()])
    assert all(torch.equal(back[n], t) for n, t in named.items())
    assert request_fields(named) == {
        "names": ["f", "h", "i"],
        "dtypes": ["float32", "bfloat16", "int64"],
        "shapes": [[3, 4], [5], [2, 3]],
    }


def test_settings_choose_the_publisher(tmp_path: Path) -> None:
    router = RouterClient("http://127.0.0.1:1", 1.0)
    assert isinstance(make_publisher(TrainerSettings(), router, tmp_path, tmp_path), DiskPublisher)
    distributed = make_publisher(TrainerSettings(weight_sync="distributed"), router, tmp_path, tmp_path)
    assert isinstance(distributed, DistributedPublisher)
    with pytest.raises(ValueError, match="weight_sync"):
        TrainerSettings(weight_sync="carrier-pigeon")


class BrokenBroadcaster(WeightBroadcaster):
    """Opens fine, then every broadcast fails, as when an engine dies mid-version."""

    def __init__(self, router_url: str = "http://127.0.0.1:1", bucket_mb: float = 1.0) -> None:
        super().__init__(RouterClient(router_url, 1.0), "127.0.0.1", "gloo", bucket_mb, 1.0)
        self.closed = 0

    def is_current(self) -> bool:
        return True

    def broadcast(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        raise Unavailable("engine http://10.0.0.2:30001 closed the connection")

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("bucket_mb", [1.0, 0.05])  # the small model (~0.2 MB) in one bucket, and in several
def test_a_version_travels_paused_and_a_failed_broadcast_brings_it_by_disk_before_generation_resumes(
    fake_router: Any, small_model_dir: Path, tmp_path: Path, bucket_mb: float
) -> None:
    """Engines that applied some buckets hold a mix of two versions: they must not sample until the disk load.
    A version in one bucket travels paused too: SGLang takes an update while not paused only once every
    generation under way has ended, and the broadcast waited for the longest past its timeout."""
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    broadcaster = BrokenBroadcaster(fake_router.url, bucket_mb=bucket_mb)
    disk = DiskPublisher(RouterClient(fake_router.url, 10.0), tmp_path, small_model_dir)
    path = DistributedPublisher(broadcaster, disk, tmp_path, small_model_dir).publish(model, 5)
    assert fake_router.calls == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
    assert fake_router.loads == [{"model_path": str(path), "weight_version": "5"}]
    assert (path / "config.json").exists() and broadcaster.closed == 1


def test_a_router_refusal_ends_the_wait_for_the_collective_at_once(fake_router: Any) -> None:
    """The router refuses a bucket (409) while this side is blocked sending it: the refusal is the answer,
    not the group's timeout with the fleet paused."""
    broadcaster = WeightBroadcaster(RouterClient(fake_router.url, 10.0), "127.0.0.1", "gloo", 1.0, timeout_s=30.0)
    release, aborted = threading.Event(), threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(Unavailable, match="HTTP 409: engines .* are out of routing"):
            broadcaster._together(
                "/update_weights_from_distributed", {}, lambda: release.wait(10), 0.0, abort=aborted.set
            )
        assert time.monotonic() - started < 5.0 and aborted.is_set()
    finally:
        release.set()


def test_registering_the_disk_copy_is_retried_like_a_load(fake_router: Any) -> None:
    """The version arrived over the group already: a router restarting for a moment must not fail the run."""
    fake_router.fail_next = 2
    WeightBroadcaster(RouterClient(fake_router.url, 10.0), "127.0.0.1", "gloo", 1.0, 1.0).register_disk_copy("/w/v2", 2)
    assert fake_router.disk_copies == [{"model_path": "/w/v2", "weight_version": "2"}]
    fake_router.fail_next = 100
    broadcaster = WeightBroadcaster(RouterClient(fake_router.url, 1.0), "127.0.0.1", "gloo", 1.0, 1.0)
    with pytest.raises(Unavailable, match="did not register the disk copy of weight version 3 .*HTTP 503"):
        broadcaster.register_disk_copy("/w/v3", 3)  # within the router client's bound


def test_a_disk_copy_a_restarted_router_refuses_is_loaded_through_it(
    fake_router: Any, small_model_dir: Path, tmp_path: Path
) -> None:
    """A router that restarted since the broadcast knows no version and refuses the disk copy (409): the engines,
    which serve the version, load the copy through it instead (the router has its version again); the run goes on."""
    fake_router.disk_copy_conflict = True
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    router = RouterClient(fake_router.url, 10.0)
    broadcaster = WeightBroadcaster(router, "127.0.0.1", "gloo", 1.0, 1.0)
    publisher = DistributedPublisher(
        broadcaster, DiskPublisher(router, tmp_path, small_model_dir), tmp_path, small_model_dir
    )
    path = publisher.write_disk_copy(model, model.state_dict(), 2)
    assert fake_router.loads == [{"model_path": str(path), "weight_version": "2"}]
    assert fake_router.disk_copies == []


@pytest.mark.parametrize("abort", [False, True])
def test_only_a_versions_first_bucket_asks_engines_to_abort(abort: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    broadcaster = WeightBroadcaster(
        RouterClient("http://127.0.0.1:1", 1.0), "127.0.0.1", "gloo", 80 / 2**20, 1.0, abort_all_requests=abort
    )
    bodies: list[dict[str, Any]] = []
    monkeypatch.setattr(broadcaster, "_together", lambda route, body, *args, **kwargs: bodies.append(body))
    broadcaster.group = type("OpenGroup", (), {"abort": lambda self: None})()  # type: ignore[assignment]
    broadcaster.broadcast({"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(20)}, version=3)
    assert len(bodies) == 2
    assert [body.get("abort_all_requests", False) for body in bodies] == [abort, False]
    assert [body["weight_version"] for body in bodies] == [None, "3"]
