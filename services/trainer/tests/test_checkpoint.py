"""DCP checkpoints on one process: what they restore, which ones are kept, and the HF export."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from transformers import AutoModelForCausalLM

from rlfleet.tiny_model import TinyModelConfig, create_tiny_model
from rlfleet_trainer import checkpoint
from rlfleet_trainer.__main__ import main
from rlfleet_trainer.checkpoint import (
    CheckpointFailed,
    CheckpointMeta,
    TrainingState,
    checkpoint_steps,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    set_aside_after,
)
from rlfleet_trainer.checkpoint_checksums import SUMS_FILE
from rlfleet_trainer.critic import Critic
from rlfleet_trainer.export import export_checkpoint
from rlfleet_trainer.optim import LrSchedule, make_optimizer
from rlfleet_trainer.policy import load_policy

sys.path.insert(0, str(Path(__file__).parent))

from checkpoint_files import flip_a_bit  # noqa: E402

SCHEDULE = LrSchedule(warmup_steps=2, kind="cosine", total_steps=10, min_lr_ratio=0.1)


def fresh_state(model_dir: Path) -> TrainingState:
    model = load_policy(model_dir)
    optimizer, scheduler = make_optimizer(model, 1e-2, 0.01, SCHEDULE)
    return TrainingState(model, optimizer, scheduler, Critic(int(model.config.hidden_size), 1e-2, 0.2))


def train_once(parts: TrainingState) -> None:
    """One step of policy and critic on random tokens: it draws from the RNG, as dropout would."""
    assert parts.critic is not None
    ids = torch.randint(3, 40, (2, 10))  # (B, T)
    out = parts.model(input_ids=ids, output_hidden_states=True)
    values = parts.critic.values(out.hidden_states[-1])  # (B, T)
    loss = torch.log_softmax(out.logits, -1)[..., 5].mean() + (values - torch.rand_like(values)).square().mean()
    loss.backward()
    for optimizer in (parts.optimizer, parts.critic.optimizer):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state_dict()["state"].values() for t in state.values() if torch.is_tensor(t)]


def assert_same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert a and len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def assert_same_state(a: TrainingState, b: TrainingState) -> None:
    assert a.critic is not None and b.critic is not None
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(tensor, b.model.state_dict()[name]), name
    assert_same_tensors(optimizer_tensors(a.optimizer), optimizer_tensors(b.optimizer))
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert_same_tensors(list(a.critic.head.parameters()), list(b.critic.head.parameters()))
    assert_same_tensors(optimizer_tensors(a.critic.optimizer), optimizer_tensors(b.critic.optimizer))


def test_round_trip_restores_model_optimizer_schedule_critic_and_rng(small_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    original = fresh_state(small_model_dir)
    for _ in range(3):
        train_once(original)
    meta = CheckpointMeta(step=3, weight_version=3, groups_trained=6, last_entry_id="1700000000000-5")
    path = save_checkpoint(tmp_path / "checkpoints", original, meta)
    assert path == tmp_path / "checkpoints" / "step_3" and (path / ".metadata").exists()
    rng_at_save = torch.get_rng_state()

    torch.manual_seed(1234)  # a restarted process: other weights, optimizer empty, schedule at 0, other RNG
    restored = fresh_state(small_model_dir)
    assert load_checkpoint(path, restored) == meta
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert_same_state(original, restored)

    # Both continue identically: same random draws, same updates, same learning rate.
    torch.set_rng_state(rng_at_save)
    train_once(original)
    torch.set_rng_state(rng_at_save)
    train_once(restored)
    assert_same_state(original, restored)


def test_a_checkpoint_before_the_first_update_leaves_training_as_it_was(small_model_dir: Path, tmp_path: Path) -> None:
    """Reading a state dict gives an optimizer without state a step at learning rate 0, which AdamW counted as its
    first: a stop while the run waited for its first groups made every later update, continued or resumed, one step
    further along its bias correction (step 2 where an uninterrupted run was at 1)."""
    torch.manual_seed(0)
    uninterrupted = fresh_state(small_model_dir)
    torch.manual_seed(0)
    continued = fresh_state(small_model_dir)
    path = save_checkpoint(tmp_path / "checkpoints", continued, CheckpointMeta(step=0))
    assert not continued.optimizer.state and continued.critic is not None and not continued.critic.optimizer.state
    torch.manual_seed(1234)
    resumed = fresh_state(small_model_dir)
    load_checkpoint(path, resumed)
    assert not resumed.optimizer.state and resumed.critic is not None and not resumed.critic.optimizer.state
    for parts in (uninterrupted, continued, resumed):
        torch.manual_seed(5)
        train_once(parts)
    assert_same_state(uninterrupted, continued)
    assert_same_state(uninterrupted, resumed)


def test_load_names_a_missing_checkpoint(small_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "step_9", fresh_state(small_model_dir))


def test_dcp_failures_arrive_as_ordinary_exceptions_naming_the_cause(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP wraps every failure in its CheckpointException, a BaseException that `except Exception` (the
    training thread, the rank protocol, the gRPC layer) lets through."""
    parts = fresh_state(small_model_dir)
    saved = save_checkpoint(tmp_path / "checkpoints", parts, CheckpointMeta(step=1, weight_version=1))

    def disk_full(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(FileSystemWriter, "write_data", disk_full)
        with pytest.raises(CheckpointFailed, match="No space left on device") as full:
            save_checkpoint(tmp_path / "checkpoints", parts, CheckpointMeta(step=2, weight_version=2))
    assert full.value.storage
    assert checkpoint_steps(tmp_path / "checkpoints") == [1]  # no partial step_2

    create_tiny_model(tmp_path / "narrower", TinyModelConfig(hidden_size=32, layers=2, heads=4, kv_heads=2))
    with pytest.raises(CheckpointFailed, match="Size mismatch") as mismatch:
        load_checkpoint(saved, fresh_state(tmp_path / "narrower"))
    assert not mismatch.value.storage


def test_a_checkpoint_carries_the_sums_sha256sum_checks(small_model_dir: Path, tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "checkpoints", fresh_state(small_model_dir), CheckpointMeta(step=1))
    listed = [line.split("  ")[1] for line in (path / SUMS_FILE).read_text().splitlines()]
    assert sorted(listed) == sorted(p.name for p in path.iterdir() if p.name != SUMS_FILE)
    assert ".metadata" in listed and any(name.endswith(".distcp") for name in listed)
    done = subprocess.run(["sha256sum", "--check", "--strict", SUMS_FILE], cwd=path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_flipped_bit_or_a_missing_shard_is_refused_as_damaged(small_model_dir: Path, tmp_path: Path) -> None:
    """DCP keeps tensors as raw bytes: a bit flipped on disk loaded as other weights, without an error."""
    torch.manual_seed(0)
    parts = fresh_state(small_model_dir)
    train_once(parts)
    path = save_checkpoint(tmp_path / "checkpoints", parts, CheckpointMeta(step=1))
    shard = flip_a_bit(path)
    with pytest.raises(CheckpointFailed, match=f"{shard} has SHA-256 .* changed on disk") as flipped:
        load_checkpoint(path, fresh_state(small_model_dir))
    assert flipped.value.damaged and not flipped.value.storage
    with pytest.raises(ValueError, match=f"checkpoint {path} is damaged, restore it from a copy: .*{shard}"):
        export_checkpoint(path, small_model_dir, tmp_path / "hf")

    shard.unlink()
    with pytest.raises(CheckpointFailed, match=f"{shard} is missing") as missing:
        load_checkpoint(path, fresh_state(small_model_dir))
    assert missing.value.damaged


def test_a_checkpoint_saved_without_sums_loads_unchecked(
    small_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    parts = fresh_state(small_model_dir)
    train_once(parts)
    monkeypatch.setattr(checkpoint, "write_sums", lambda directory, sums: None)  # as the trainers before them
    original_state_dict = checkpoint._state_dict
    monkeypatch.setattr(checkpoint, "_state_dict", lambda *a: _WithoutMarker(original_state_dict(*a)))
    path = save_checkpoint(tmp_path / "checkpoints", parts, CheckpointMeta(step=1, weight_version=1))
    assert not (path / SUMS_FILE).exists()
    restored = fresh_state(small_model_dir)
    assert load_checkpoint(path, restored) == CheckpointMeta(step=1, weight_version=1)
    assert_same_state(parts, restored)
    assert f"checkpoint {path} carries no SHA-256 sums" in caplog.text


class _WithoutMarker(dict):  # type: ignore[type-arg]
    """A state dict that drops the key saying the checkpoint was saved with sums, as older trainers wrote it."""

    def __setitem__(self, key: object, value: object) -> None:
        if key != checkpoint.SUMS_KEPT:
            super().__setitem__(key, value)


def test_a_checkpoint_that_lost_its_sums_is_refused_as_damaged(small_model_dir: Path, tmp_path: Path) -> None:
    """A partial copy (the sums file left out) took away the check: a flipped bit then loaded as other weights."""
    torch.manual_seed(0)
    parts = fresh_state(small_model_dir)
    train_once(parts)
    path = save_checkpoint(tmp_path / "checkpoints", parts, CheckpointMeta(step=1))
    flip_a_bit(path)
    (path / SUMS_FILE).unlink()
    with pytest.raises(
        CheckpointFailed, match=f"{path / SUMS_FILE} is missing, and the checkpoint was saved with it"
    ) as lost:
        load_checkpoint(path, fresh_state(small_model_dir))
    assert lost.value.damaged


def test_prune_keeps_the_latest_up_to_the_recorded_one(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / ".step_12.tmp").mkdir()
    (tmp_path / ".step_4.replaced").mkdir()  # a replacement interrupted before it deleted what it replaced
    prune_checkpoints(tmp_path, newest=8, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_6", "step_8"]


def test_checkpoints_after_the_recorded_one_are_moved_aside_never_deleted(tmp_path: Path) -> None:
    """Resumed from a record Redis restored from an old snapshot (step 50), the run deleted the checkpoints of
    steps 100 and 150: all the training since that snapshot."""
    root = tmp_path / "checkpoints"
    for step in (50, 100, 150):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "weights").write_text(str(step))
    aside = set_aside_after(root, 50)
    assert aside is not None and aside.name.startswith("checkpoints.unrecorded-")
    assert checkpoint_steps(root) == [50] and checkpoint_steps(aside) == [100, 150]
    assert (aside / "step_150" / "weights").read_text() == "150"
    prune_checkpoints(root, newest=50, keep=2)
    assert checkpoint_steps(root) == [50] and checkpoint_steps(aside) == [100, 150]
    assert set_aside_after(root, 50) is None  # none later: nothing made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", aside.name]


def test_export_loads_with_transformers_and_gives_the_same_logits(small_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    parts = fresh_state(small_model_dir)
    for _ in range(2):
        train_once(parts)
    path = save_checkpoint(tmp_path / "checkpoints", parts, CheckpointMeta(step=2, weight_version=2))

    out = export_checkpoint(path, small_model_dir, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    ids = torch.tensor([[5, 20, 15, 21, 33, 22, 23]])
    with torch.no_grad():
        expected = parts.model(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    base = load_policy(small_model_dir)
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, expected)  # training moved the weights
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_export_command(small_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    parts = fresh_state(small_model_dir)
    train_once(parts)
    path = save_checkpoint(tmp_path / "checkpoints", parts, CheckpointMeta(step=1, weight_version=1))
    command = [
        sys.executable,
        "-m",
        "rlfleet_trainer",
        "export",
        "--checkpoint",
        str(path),
        "--base-model",
        str(small_model_dir),
        "--out",
        str(tmp_path / "hf"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    for name, tensor in parts.model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0)

    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "is not an empty directory" in again.stderr


def test_export_refuses_an_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "model.safetensors"
    taken.write_text("")
    args = ["export", "--checkpoint", str(tmp_path), "--base-model", str(tmp_path), "--out", str(taken)]
    assert main(args) == 2
    assert f"{taken} is not an empty directory; choose another --out" in capsys.readouterr().err


def test_sft_refuses_a_model_path_without_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path that is not there was taken for a hub id: a 77-line traceback, or 50 s of trying to download it."""
    missing = tmp_path / "tiny"
    assert main(["sft", "--model-path", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert f"--model-path: no Hugging Face model at {missing} (config.json missing" in capsys.readouterr().err
