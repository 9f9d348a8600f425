"""The distributed weight path on a live engine: the test process is the trainer (rank 0 over gloo)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_test_support import RunningEngine, reference_logprobs, start_engine
from transformers import AutoModelForCausalLM

from rlfleet.processes import free_port
from rlfleet.weight_update_group import WeightUpdateGroup, open_group, request_fields, send

pytestmark = pytest.mark.e2e
PROMPT = [20, 21, 22, 23]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def own_engine(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    running = start_engine(small_model_dir, tmp_path_factory.mktemp("distributed-logs"))
    yield running
    running.process.stop()


def in_thread(call: Callable[[], Any]) -> Callable[[], Any]:
    """Starts `call` in a thread; the returned function joins it (bounded) and returns its result."""
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.setdefault("value", call()), daemon=True)
    worker.start()

    def join() -> Any:
        worker.join(TIMEOUT_S)
        assert not worker.is_alive(), "the engine did not answer in time"
        return result["value"]

    return join


def open_trainer_group(engine: RunningEngine, name: str) -> WeightUpdateGroup:
    port = free_port()
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }
    answer = in_thread(lambda: engine.post("/init_weights_update_group", body, timeout=TIMEOUT_S))
    group = open_group("127.0.0.1", port, 0, 2, name, "gloo", TIMEOUT_S)
    response = answer()
    assert response.status_code == 200 and response.json()["success"] is True, response.text
    # Updates need a weight-update session, as on SGLang from 0.5.23 (one an earlier test left open is ended).
    engine.post("/end_weight_update", {})
    assert engine.post("/begin_weight_update", {}).json()["success"] is True
    return group


def push(
    engine: RunningEngine, group: WeightUpdateGroup, named: dict[str, torch.Tensor], **extra: Any
) -> httpx.Response:
    body = {**request_fields(named), "group_name": group.name, **extra}
    answer = in_thread(lambda: engine.post("/update_weights_from_distributed", body, timeout=TIMEOUT_S))
    send(group, list(named.values()), flattened=extra.get("load_format") == "flattened_bucket")
    return answer()


def whole_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `model_dir`, as a trainer sends a version (tied ones once)."""
    state = dict(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    state.pop("lm_head.weight")  # tied to the embedding: one copy travels
    return state


def weight_state(engine: RunningEngine) -> tuple[str, object]:
    """The engine's weight version and whether it says it holds only part of a version (`weights_partial`)."""
    info = engine.get("/get_server_info").json()
    return info["weight_version"], info.get("weights_partial")


def perturbed_model(model_dir: Path, seed: int) -> Any:
    """The checkpoint at `model_dir` after a random step: weights the engine does not hold yet."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def greedy_logprobs(engine: RunningEngine) -> tuple[list[int], list[float], dict[str, Any]]:
    out = engine.generate({"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY})
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


def test_updates_are_taken_only_inside_a_weight_update_session(own_engine: RunningEngine) -> None:
    """As SGLang from 0.5.23, whose refusals these are: a router that keeps no sessions fails here, not on GPUs."""
    own_engine.post("/end_weight_update", {})  # whatever an earlier test left open
    body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"}
    outside = own_engine.post("/update_weights_from_distributed", body)
    assert outside.status_code == 400 and "between begin_weight_update() and end_weight_update()" in outside.text
    assert own_engine.post("/begin_weight_update", {}).status_code == 200
    again = own_engine.post("/begin_weight_update", {})
    assert again.status_code == 400 and "already open" in again.json()["message"]
    assert own_engine.post("/end_weight_update", {}).status_code == 200
    unopened = own_engine.post("/end_weight_update", {})
    assert unopened.status_code == 400 and "no weight-update session is open" in unopened.json()["message"]


def test_received_buckets_change_the_logprobs_to_the_senders(own_engine: RunningEngine, small_model_dir: Path) -> None:
    group = open_trainer_group(own_engine, "buckets")
    model = AutoModelForCausalLM.from_pretrained(small_model_dir).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    state = dict(model.state_dict())
    state.pop("lm_head.weight")  # tied to the embedding: one copy travels
    names = list(state)
    first = {n: state[n] for n in names[: len(names) // 2]}
    second = {n: state[n].to(torch.bfloat16).float() for n in names[len(names) // 2 :]}

    one = push(own_engine, group, first)  # one broadcast per tensor, no version yet
    assert one.status_code == 200 and one.json()["success"] is True, one.text
    assert own_engine.get("/get_model_info").json()["weight_version"] == "default"
    two = push(own_engine, group, second, load_format="flattened_bucket", weight_version=5)
    assert two.status_code == 200 and "5" in two.json()["message"], two.text

    with torch.no_grad():
        for name, tensor in second.items():
            state[name].copy_(tensor)
    ids, logprobs, meta = greedy_logprobs(own_engine)
    assert meta["weight_version"] == "5"
    expected = reference_logprobs(model, PROMPT, ids)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
    assert own_engine.post("/destroy_weights_update_group", {"group_name": "buckets"}).json()["success"] is True
    group.close()


def test_bad_updates_are_refused_before_anything_is_received(own_engine: RunningEngine, small_model_dir: Path) -> None:
    own_engine.post("/end_weight_update", {})
    assert own_engine.post("/begin_weight_update", {}).status_code == 200
    none = own_engine.post("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
    assert none.status_code == 400 and "init_weights_update_group" in none.json()["message"]

    group = open_trainer_group(own_engine, "strict")
    embed = "model.embed_tokens.weight"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"names": ["not.a.weight"], "dtypes": ["float32"], "shapes": [[2]]}, "not.a.weight"),
        ({"names": [embed], "dtypes": ["float32"], "shapes": [[3, 3]]}, "shape"),
        ({"names": [embed], "dtypes": ["float33"], "shapes": [[3, 3]]}, "float33"),
        # A torch dtype no weight is sent in: the receive failed, answered 503, and closed the group.
        ({"names": [embed], "dtypes": ["qint8"], "shapes": [list(whole_state(small_model_dir)[embed].shape)]}, "qint8"),
        ({"names": [embed], "dtypes": ["float32"], "shapes": []}, "one entry per tensor"),
    ]
    for body, needle in cases:
        answer = own_engine.post("/update_weights_from_distributed", {**body, "group_name": "strict"})
        assert answer.status_code == 400 and needle in answer.text, answer.text
    nccl = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"}
    answer = own_engine.post("/init_weights_update_group", nccl)
    assert answer.status_code == 400 and "NCCL" in answer.json()["message"]

    # Nothing was received for them, so the group is still in step for the next good update.
    assert push(own_engine, group, whole_state(small_model_dir), weight_version="6").json()["success"] is True
    assert greedy_logprobs(own_engine)[2]["weight_version"] == "6"
    assert own_engine.post("/destroy_weights_update_group", {"group_name": "strict"}).status_code == 200
    gone = own_engine.post("/destroy_weights_update_group", {"group_name": "strict"})
    assert gone.status_code == 400 and gone.json()["success"] is False
    group.close()


def test_a_labelled_bucket_that_leaves_the_version_incomplete_is_applied_under_the_old_label(
    own_engine: RunningEngine, small_model_dir: Path
) -> None:
    """SGLang takes weight_version on any bucket: this one is received and applied like any other, but a tensor
    lost on the way, or left out by the trainer, must not be served under the version's label with its old value.
    So the label stays until the version's buckets together delivered every parameter, and the engine says it
    holds part of a version (`weights_partial`, in the answer and in /get_model_info and /get_server_info)."""
    group = open_trainer_group(own_engine, "complete")
    original = whole_state(small_model_dir)  # what the engine holds: the version before loaded it whole
    model = perturbed_model(small_model_dir, seed=7)
    state = dict(model.state_dict())
    state.pop("lm_head.weight")  # tied to the embedding: one copy travels
    before, _ = weight_state(own_engine)
    lost = "model.layers.0.mlp.up_proj.weight"

    first = push(own_engine, group, {n: t for n, t in state.items() if n != lost}, weight_version="7")
    assert first.status_code == 200 and first.json()["success"] is True, first.text
    assert first.json()["weights_partial"] is True, first.text
    message = first.json()["message"]
    assert "1 of the model's" in message and lost in message and "keeps its previous weight version" in message
    assert weight_state(own_engine) == (before, True)
    info = own_engine.get("/get_model_info").json()
    assert (info["weight_version"], info["weights_partial"]) == (before, True)
    # Applied: the engine scores as the new weights with the lost tensor at its old value, under the old label.
    with torch.no_grad():
        model.get_parameter(lost).copy_(original[lost])
    ids, logprobs, meta = greedy_logprobs(own_engine)
    assert meta["weight_version"] == before
    assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs(model, PROMPT, ids), strict=True)) < 1e-4

    # A later bucket that completes the version advances the label to it.
    done = push(own_engine, group, {lost: state[lost]}, weight_version="7")
    assert done.status_code == 200 and done.json()["weights_partial"] is False, done.text
    assert "Weight version updated to 7" in done.json()["message"], done.text
    assert weight_state(own_engine) == ("7", False)
    with torch.no_grad():
        model.get_parameter(lost).copy_(state[lost])
    ids, logprobs, meta = greedy_logprobs(own_engine)
    assert meta["weight_version"] == "7"
    assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs(model, PROMPT, ids), strict=True)) < 1e-4
    assert own_engine.post("/destroy_weights_update_group", {"group_name": "complete"}).status_code == 200
    group.close()


def test_a_client_labelling_every_bucket_ends_on_the_version_only_after_its_last(
    own_engine: RunningEngine, small_model_dir: Path
) -> None:
    """slime sends weight_version on every bucket of a version: the engine takes each, and the label moves only
    with the bucket that completes the model."""
    group = open_trainer_group(own_engine, "slime")
    state = whole_state(small_model_dir)
    names = list(state)
    thirds = [names[: len(names) // 3], names[len(names) // 3 : 2 * len(names) // 3], names[2 * len(names) // 3 :]]
    labelled = {"weight_version": "8", "load_format": "flattened_bucket"}
    left = len(names)
    for part in thirds[:2]:
        answer = push(own_engine, group, {n: state[n] for n in part}, **labelled)
        left -= len(part)
        assert answer.status_code == 200 and answer.json()["weights_partial"] is True, answer.text
        assert f"{left} of the model's" in answer.json()["message"], answer.text
        assert weight_state(own_engine) == ("7", True)
    last = push(own_engine, group, {n: state[n] for n in thirds[2]}, **labelled)
    assert last.status_code == 200 and last.json()["weights_partial"] is False, last.text
    assert weight_state(own_engine) == ("8", False)
    assert greedy_logprobs(own_engine)[2]["weight_version"] == "8"
    assert own_engine.post("/destroy_weights_update_group", {"group_name": "slime"}).status_code == 200
    group.close()


def test_a_group_opened_again_and_a_load_from_disk_each_start_a_version_afresh(
    own_engine: RunningEngine, small_model_dir: Path
) -> None:
    group = open_trainer_group(own_engine, "short")
    norm = {"model.norm.weight": torch.ones(64)}
    assert push(own_engine, group, norm).json()["weights_partial"] is True
    assert weight_state(own_engine) == ("8", True)
    # A version travels through one group: what came before the group opened (again) does not count towards it.
    group.close()
    # As on SGLang, a name the engine holds cannot be opened again before it is destroyed (the router does it).
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    refused = own_engine.post("/init_weights_update_group", {**body, "group_name": "short", "backend": "gloo"})
    assert refused.status_code == 400 and "'short' has already been created" in refused.json()["message"]
    assert own_engine.post("/destroy_weights_update_group", {"group_name": "short"}).status_code == 200
    group = open_trainer_group(own_engine, "short")
    rest = {name: t for name, t in whole_state(small_model_dir).items() if name != "model.norm.weight"}
    answer = push(own_engine, group, rest, weight_version="9")
    assert answer.status_code == 200 and answer.json()["weights_partial"] is True, answer.text
    assert "model.norm.weight" in answer.json()["message"], answer.text
    assert weight_state(own_engine) == ("8", True)

    loaded = own_engine.post("/update_weights_from_disk", {"model_path": str(small_model_dir), "weight_version": "10"})
    assert loaded.status_code == 200, loaded.text
    assert weight_state(own_engine) == ("10", False)
    # What came before the load does not count either: the norm is missing again.
    again = push(own_engine, group, rest, weight_version="11")
    assert again.json()["weights_partial"] is True and "model.norm.weight" in again.json()["message"], again.text
    assert weight_state(own_engine) == ("10", True)
    assert push(own_engine, group, norm, weight_version="11").json()["weights_partial"] is False
    assert weight_state(own_engine) == ("11", False)
    assert own_engine.post("/destroy_weights_update_group", {"group_name": "short"}).status_code == 200
    group.close()


def test_the_sim_engine_receives_and_drops_the_tensors(small_model_dir: Path, tmp_path: Path) -> None:
    sim = start_engine(small_model_dir, tmp_path, "--backend", "sim")
    try:
        group = open_trainer_group(sim, "sim")
        assert weight_state(sim) == ("default", False)
        assert push(sim, group, {"anything": torch.ones(2)}).status_code == 200
        assert weight_state(sim) == ("default", True), "it holds a bucket of a version whose last has not come"
        answer = push(sim, group, {"anything.at.all": torch.ones(3, 5)}, weight_version="9")
        assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
        assert sim.get("/get_model_info").json()["weight_version"] == "9"
        assert weight_state(sim) == ("9", False)
        group.close()
    finally:
        sim.process.stop()
