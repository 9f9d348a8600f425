"""Tied weights (embedding and lm_head) travel once in a broadcast version and are saved once in a version's
directory, also from a state FSDP2 gathered, which holds a copy of the tied parameter under each of its names."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlfleet_trainer.router_client import RouterClient
from rlfleet_trainer.weight_broadcast import WeightBroadcaster
from rlfleet_trainer.weight_publisher import DiskPublisher, DistributedPublisher
from rlfleet_trainer.weights import save_version, without_tied_copies

sys.path.insert(0, str(Path(__file__).parent))

from torchrun_jobs import SCRIPTS, finish, torchrun  # noqa: E402

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def gathered_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as FSDP2's full gather gives it: every name a tensor in a storage of its own."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_without_tied_copies_drops_the_later_name_of_a_tied_parameter(small_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    state = gathered_copy(model)
    kept = without_tied_copies(state, model)
    assert EMBED in kept and LM_HEAD not in kept
    assert list(kept) == [name for name in state if name != LM_HEAD]
    # A name is dropped only for an earlier one the state holds: alone, the lm_head still travels.
    assert list(without_tied_copies({LM_HEAD: state[LM_HEAD]}, model)) == [LM_HEAD]


def test_a_gathered_state_broadcasts_its_tied_parameter_once(
    fake_router: Any, small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    broadcaster = WeightBroadcaster(RouterClient(fake_router.url, 10.0), "127.0.0.1", "gloo", 0.05, 1.0)
    bodies: list[dict[str, Any]] = []
    monkeypatch.setattr(broadcaster, "_together", lambda route, body, *args, **kwargs: bodies.append(body))
    monkeypatch.setattr(broadcaster, "is_current", lambda: True)
    broadcaster.group = type("OpenGroup", (), {"abort": lambda self: None})()  # type: ignore[assignment]
    disk = DiskPublisher(RouterClient(fake_router.url, 10.0), tmp_path, small_model_dir)
    publisher = DistributedPublisher(broadcaster, disk, tmp_path, small_model_dir)

    assert publisher.serve(model, gathered_copy(model), 3) is None, "broadcast, not loaded from disk"
    sent = [name for body in bodies for name in body["names"]]
    assert len(bodies) > 1 and sorted(sent) == sorted(n for n in model.state_dict() if n != LM_HEAD)


def test_a_gathered_state_is_saved_with_its_tied_parameter_once(small_model_dir: Path, tmp_path: Path) -> None:
    """save_pretrained wrote both copies (the tied tensors' storages differ): 545 MB more per version of a tied
    0.5B model, written and read at every step."""
    model = AutoModelForCausalLM.from_pretrained(small_model_dir)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # trained: the values differ from the model on disk
    saved = save_version(model, tmp_path, 4, small_model_dir, gathered_copy(model))
    with safe_open(str(saved / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert EMBED in names and LM_HEAD not in names
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.e2e
def test_two_fsdp_ranks_gather_tied_copies_that_travel_once(small_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "names.json"
    job = torchrun(2, [str(SCRIPTS / "tied_weights_gather.py"), str(small_model_dir), str(out)], tmp_path / "ranks.log")
    finish(job, timeout_s=180)
    names = json.loads(out.read_text())
    assert LM_HEAD in names["gathered"] and EMBED in names["gathered"]
    assert LM_HEAD not in names["sent"] and names["sent"] == [n for n in names["gathered"] if n != LM_HEAD]
