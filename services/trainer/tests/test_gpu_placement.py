"""Where the policy and a broadcast version live on a GPU machine, checked on the CPU: the device is faked with
"meta" (tensors that have a device, a dtype and a shape but no data), and the process group with a flag."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet_trainer import rank_ops, weight_broadcast
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.rank_ops import ShardingOptions, load_model
from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weight_broadcast import WeightBroadcaster, buckets, engine_dtype
from rlfleet_trainer.weight_publisher import DistributedPublisher, make_publisher

FAKE_GPU = torch.device("meta")


def record_sharded_loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    calls: list[tuple[bool, bool]] = []

    def load_sharded(path: Path, trainable: bool, mixed_precision: bool, activation_checkpointing: bool) -> Any:
        calls.append((mixed_precision, activation_checkpointing))
        return None

    monkeypatch.setattr(rank_ops, "load_sharded_model", load_sharded)
    return calls


def test_one_gpu_rank_under_torchrun_is_sharded_so_the_model_reaches_its_gpu(
    small_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job of one rank (`torchrun --nproc_per_node=1`) on a GPU node trained on the CPU: only FSDP moved the
    model to the GPU, and it ran with more than one rank only. bf16 compute and recomputation are FSDP's too."""
    calls = record_sharded_loads(monkeypatch)
    monkeypatch.setattr(rank_ops, "process_group_ready", lambda: True)
    options = ShardingOptions(mixed_precision=True, activation_checkpointing=True)
    load_model(small_model_dir, options, trainable=True, device=FAKE_GPU)
    load_model(small_model_dir, options, trainable=False, device=FAKE_GPU)  # the reference: no recomputation
    assert calls == [(True, True), (True, False)]


def test_one_cpu_rank_keeps_the_model_whole(small_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = record_sharded_loads(monkeypatch)
    monkeypatch.setattr(rank_ops, "process_group_ready", lambda: True)
    model = load_model(small_model_dir, ShardingOptions(), trainable=True, device=torch.device("cpu"))
    assert calls == []
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_a_gpu_process_without_torchrun_moves_the_whole_model_to_its_gpu(
    small_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = record_sharded_loads(monkeypatch)
    monkeypatch.setattr(rank_ops, "process_group_ready", lambda: False)
    with caplog.at_level(logging.WARNING, logger=rank_ops.__name__):
        model = load_model(small_model_dir, ShardingOptions(mixed_precision=True), trainable=True, device=FAKE_GPU)
    assert calls == []
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {FAKE_GPU}
    assert "apply to a sharded model only" in caplog.text


def base_model_dir(path: Path, dtype: str | None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **({"dtype": dtype} if dtype else {})}))
    return path


def test_gpu_engines_are_sent_the_base_models_dtype_and_cpu_engines_fp32(tmp_path: Path) -> None:
    bf16 = base_model_dir(tmp_path / "bf16", "bfloat16")
    assert engine_dtype("nccl", bf16) == torch.bfloat16
    assert engine_dtype("nccl", base_model_dir(tmp_path / "fp16", "float16")) == torch.float16
    assert engine_dtype("gloo", bf16) is None  # the CPU engines compute in fp32
    assert engine_dtype("nccl", base_model_dir(tmp_path / "fp32", "float32")) is None
    assert engine_dtype("nccl", base_model_dir(tmp_path / "unnamed", None)) is None
    assert engine_dtype("nccl", None) is None


def test_the_publisher_of_an_nccl_fleet_sends_the_base_models_dtype(tmp_path: Path) -> None:
    router = RouterClient("http://127.0.0.1:1", 1.0)
    base = base_model_dir(tmp_path / "base", "bfloat16")
    settings = TrainerSettings(weight_sync="distributed", weight_sync_backend="nccl")
    publisher = make_publisher(settings, router, tmp_path, tmp_path, base_model=base)
    assert isinstance(publisher, DistributedPublisher)
    assert publisher._broadcaster.dtype == torch.bfloat16
    gloo = make_publisher(TrainerSettings(weight_sync="distributed"), router, tmp_path, tmp_path, base_model=base)
    assert isinstance(gloo, DistributedPublisher) and gloo._broadcaster.dtype is None


def test_buckets_are_sized_and_aligned_by_the_bytes_on_the_wire() -> None:
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "steps": torch.zeros(3, dtype=torch.int64)}
    assert [list(p) for p in buckets(state, bucket_bytes=40)] == [["a"], ["b"], ["steps"]]
    # In bf16 two 10-element tensors fill 40 bytes; the int64 travels as it is, first in its bucket (aligned).
    assert [list(p) for p in buckets(state, bucket_bytes=64, dtype=torch.bfloat16)] == [["steps", "a", "b"]]


class FakeGpuBroadcaster(WeightBroadcaster):
    """An NCCL broadcaster whose GPU is the meta device: what it would send, and where from, is recorded."""

    @property
    def device(self) -> str:
        return "meta"


def test_an_nccl_bucket_is_sent_from_the_gpu_in_the_engines_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under mixed precision the gathered weights are fp32 master copies on the CPU: NCCL needs them on the GPU,
    and the engines serve bf16."""
    broadcaster = FakeGpuBroadcaster(
        RouterClient("http://127.0.0.1:1", 1.0), "127.0.0.1", "nccl", 1.0, 1.0, dtype=torch.bfloat16
    )
    bodies: list[dict[str, Any]] = []
    sent: list[list[torch.Tensor]] = []

    def together(route: str, body: dict[str, Any], collective: Any, *args: Any, **kwargs: Any) -> None:
        bodies.append(body)
        collective()

    monkeypatch.setattr(broadcaster, "_together", together)
    monkeypatch.setattr(
        weight_broadcast, "send", lambda group, tensors, flattened: sent.append(list(tensors)) if flattened else None
    )
    broadcaster.group = type("OpenGroup", (), {"abort": lambda self: None})()  # type: ignore[assignment]
    state = {
        "embed": torch.randn(4, 3),
        "norm": torch.ones(3),
        "steps": torch.arange(2, dtype=torch.int64),
    }
    broadcaster.broadcast(state, version=7)
    [body] = bodies
    assert body["names"] == ["steps", "embed", "norm"]
    assert body["dtypes"] == ["int64", "bfloat16", "bfloat16"]
    assert body["shapes"] == [[2], [4, 3], [3]]
    [tensors] = sent
    assert [t.device for t in tensors] == [FAKE_GPU] * 3
    assert [t.dtype for t in tensors] == [torch.int64, torch.bfloat16, torch.bfloat16]


def test_a_gloo_bucket_keeps_the_trainers_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    broadcaster = WeightBroadcaster(RouterClient("http://127.0.0.1:1", 1.0), "127.0.0.1", "gloo", 1.0, 1.0)
    sent: list[list[torch.Tensor]] = []
    monkeypatch.setattr(broadcaster, "_together", lambda route, body, collective, *a, **k: collective())
    monkeypatch.setattr(weight_broadcast, "send", lambda group, tensors, flattened: sent.append(list(tensors)))
    broadcaster.group = type("OpenGroup", (), {"abort": lambda self: None})()  # type: ignore[assignment]
    state = {"w": torch.randn(3, 2)}
    broadcaster.broadcast(state, version=1)
    assert torch.equal(sent[0][0], state["w"]) and sent[0][0].dtype == torch.float32
