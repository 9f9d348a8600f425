"""/update_weights_from_disk on a live engine: new logprobs, the new version everywhere, requests held not broken."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_test_support import RunningEngine, reference_logprobs, start_engine, wait_until_running
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.e2e
PROMPT = [20, 21, 22, 23]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def own_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    running = start_engine(tiny_model_dir, tmp_path_factory.mktemp("weights-logs"))
    yield running
    running.process.stop()


@pytest.fixture(scope="module")
def perturbed_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("perturbed")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    generator = torch.Generator().manual_seed(7)
    state = load_file(str(tiny_model_dir / "model.safetensors"))
    noisy = {k: (v + 0.05 * torch.randn(v.shape, generator=generator)).contiguous() for k, v in state.items()}
    save_file(noisy, str(out / "model.safetensors"))
    return out


def logprobs(engine: RunningEngine) -> tuple[list[int], list[float], dict[str, Any]]:
    out = engine.generate({"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY})
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


def test_loading_new_weights_changes_logprobs_and_reports_the_version(
    own_engine: RunningEngine, perturbed_dir: Path
) -> None:
    before_ids, before, meta = logprobs(own_engine)
    assert meta["weight_version"] == "default"

    response = own_engine.post("/update_weights_from_disk", {"model_path": str(perturbed_dir), "weight_version": "7"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and "7" in body["message"]

    info = own_engine.get("/get_model_info").json()
    assert info["weight_version"] == "7" and info["model_path"] == str(perturbed_dir)
    after_ids, after, meta = logprobs(own_engine)
    assert meta["weight_version"] == "7"
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3
    reference = AutoModelForCausalLM.from_pretrained(perturbed_dir).eval()
    expected = reference_logprobs(reference, PROMPT, after_ids)
    assert max(abs(a - b) for a, b in zip(after, expected, strict=True)) < 1e-4


def test_a_bad_checkpoint_is_refused_and_the_old_weights_keep_serving(
    own_engine: RunningEngine, tmp_path: Path
) -> None:
    _, before, _ = logprobs(own_engine)
    response = own_engine.post("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "8"})
    assert response.status_code == 400
    assert response.json()["success"] is False and "safetensors" in response.json()["message"]
    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    response = own_engine.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert response.status_code == 400 and "not.a.weight" in response.json()["message"]
    (tmp_path / "model.safetensors").write_bytes(b"garbage")  # before, a 500 without SGLang's body
    response = own_engine.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert response.status_code == 400 and response.json()["success"] is False
    assert "model.safetensors is not a readable safetensors file" in response.json()["message"]
    _, after, meta = logprobs(own_engine)
    assert after == before and meta["weight_version"] != "8"


def test_requests_in_flight_are_paused_not_broken(own_engine: RunningEngine, tiny_model_dir: Path) -> None:
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["out"] = own_engine.generate(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}, timeout=60
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_until_running(own_engine, 1)
    assert own_engine.post("/pause_generation", {"mode": "retract"}).json()["status"] == "ok"
    response = own_engine.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "9"})
    assert response.status_code == 200, response.text
    assert response.json()["num_paused_requests"] == 1
    assert own_engine.post("/continue_generation", {}).status_code == 200
    worker.join(timeout=60)
    out = result["out"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert out["meta_info"]["weight_version"] == "9"
    # Tokens were sampled before and after the load: the output names both versions, oldest first, each with the
    # tokens it sampled (SGLang's spans: start inclusive, end exclusive).
    first, second = out["meta_info"]["weight_versions"]
    assert first["version"] != "9" and second["version"] == "9"
    assert first["start"] == 0 and 0 < first["end"] == second["start"] < second["end"] == 300
    assert own_engine.get("/get_weight_version").json() == {"weight_version": "9"}


def test_a_load_with_abort_all_requests_answers_the_partial_output_with_the_old_version(
    own_engine: RunningEngine, tiny_model_dir: Path
) -> None:
    old = own_engine.get("/get_weight_version").json()["weight_version"]
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["out"] = own_engine.generate(
            {
                "input_ids": PROMPT,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
            },
            timeout=60,
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_until_running(own_engine, 1)
    body = {"model_path": str(tiny_model_dir), "weight_version": "10", "abort_all_requests": True}
    response = own_engine.post("/update_weights_from_disk", body)
    assert response.status_code == 200, response.text
    assert response.json()["num_paused_requests"] == 0
    worker.join(timeout=60)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < len(result["out"]["output_ids"]) < 300
    assert len(meta["output_token_logprobs"]) == len(result["out"]["output_ids"])
    spans = [{"version": old, "start": 0, "end": len(result["out"]["output_ids"])}]
    assert meta["weight_version"] == old and meta["weight_versions"] == spans
    assert own_engine.get("/get_weight_version").json() == {"weight_version": "10"}


def test_an_integer_weight_version_is_read_as_text(own_engine: RunningEngine, tiny_model_dir: Path) -> None:
    # Trainers count steps; the distributed path already takes an integer version.
    response = own_engine.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": 11})
    assert response.status_code == 200, response.text
    assert own_engine.get("/get_weight_version").json() == {"weight_version": "11"}


def test_a_pause_in_abort_mode_leaves_the_load_nothing_to_hold(own_engine: RunningEngine, tiny_model_dir: Path) -> None:
    old = own_engine.get("/get_weight_version").json()["weight_version"]
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["out"] = own_engine.generate(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}, timeout=60
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_until_running(own_engine, 1)
    assert own_engine.post("/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    worker.join(timeout=10)  # answered by the pause, before any load
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and 0 < meta["completion_tokens"] < 300
    assert meta["weight_versions"] == [{"version": old, "start": 0, "end": meta["completion_tokens"]}]
    try:
        response = own_engine.post(
            "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": "12"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["num_paused_requests"] == 0
    finally:
        assert own_engine.post("/continue_generation", {}).status_code == 200
    assert own_engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["meta_info"]["weight_version"] == "12"
