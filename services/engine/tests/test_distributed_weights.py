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
    return group


def push(
    engine: RunningEngine, group: WeightUpdateGroup, named: dict[str, torch.Tensor], **extra: Any
) -> httpx.Response:
    body = {**request_fields(named), "group_name": group.name, **extra}
    answer = in_thread(lambda: engine.post("/update_weights_from_distributed", body, timeout=TIMEOUT_S))
    send(group, list(named.values()), flattened=extra.get("load_format") == "flattened_bucket")
    return answer()


def greedy_logprobs(engine: RunningEngine) -> tuple[list[int], list[float], dict[str, Any]]:
    out = engine.generate({"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY})
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


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


def test_bad_updates_are_refused_before_anything_is_received(own_engine: RunningEngine) -> None:
    none = own_engine.post("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
    assert none.status_code == 400 and "init_weights_update_group" in none.json()["message"]

    group = open_trainer_group(own_engine, "strict")
    embed = "model.embed_tokens.weight"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"names": ["not.a.weight"], "dtypes": ["float32"], "shapes": [[2]]}, "not.a.weight"),
        ({"names": [embed], "dtypes": ["float32"], "shapes": [[3, 3]]}, "shape"),
        ({"names": [embed], "dtypes": ["float33"], "shapes": [[3, 3]]}, "float33"),
        ({"names": [embed], "dtypes": ["float32"], "shapes": []}, "one entry per tensor"),
    ]
    for body, needle in cases:
        answer = own_engine.post("/update_weights_from_distributed", {**body, "group_name": "strict"})
        assert answer.status_code == 400 and needle in answer.text, answer.text
    nccl = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"}
    answer = own_engine.post("/init_weights_update_group", nccl)
    assert answer.status_code == 400 and "NCCL" in answer.json()["message"]

    # Nothing was received for them, so the group is still in step for the next good update.
    norm = {"model.norm.weight": torch.ones(64)}
    assert push(own_engine, group, norm, weight_version="6").json()["success"] is True
    assert greedy_logprobs(own_engine)[2]["weight_version"] == "6"
    assert own_engine.post("/destroy_weights_update_group", {"group_name": "strict"}).status_code == 200
    gone = own_engine.post("/destroy_weights_update_group", {"group_name": "strict"})
    assert gone.status_code == 400 and gone.json()["success"] is False
    group.close()


def test_the_sim_engine_receives_and_drops_the_tensors(small_model_dir: Path, tmp_path: Path) -> None:
    sim = start_engine(small_model_dir, tmp_path, "--backend", "sim")
    try:
        group = open_trainer_group(sim, "sim")
        answer = push(sim, group, {"anything.at.all": torch.ones(3, 5)}, weight_version="9")
        assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
        assert sim.get("/get_model_info").json()["weight_version"] == "9"
        group.close()
    finally:
        sim.process.stop()
