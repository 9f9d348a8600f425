"""A router that restarts in the middle of a weight version sent in buckets, with two real CPU engines behind it.

The router keeps which engines hold part of a version in memory only; the engines keep their old label until
the version's last bucket. The restarted router must still never route to an engine holding part of a version,
however generation is continued, until it has loaded a whole one: here the trainer's disk fallback of the
version, which reaches the engines through the new router.
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

sys.path.insert(0, str(Path(__file__).parent))

from engine_fleet import EngineFleet, start_engine_fleet  # noqa: E402

from rlfleet.weight_update_group import FLATTENED_BUCKET, request_fields, send  # noqa: E402
from rlfleet_trainer.router_client import RouterClient  # noqa: E402
from rlfleet_trainer.weight_broadcast import WeightBroadcaster, buckets, unique_tensors  # noqa: E402
from rlfleet_trainer.weight_publisher import DiskPublisher  # noqa: E402

pytestmark = pytest.mark.e2e
PROMPT = [20, 21, 22, 23, 24]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
BUCKET_MB = 0.05  # the small model is ~0.2 MB: several buckets per version
SETTLE_S = 30.0


def greedy_answer(url: str) -> httpx.Response:
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY}
    return httpx.post(f"{url}/generate", json=body, timeout=60.0)


def logprob_gap(answer: dict[str, Any], model: PreTrainedModel) -> float:
    """How far the answer's logprobs are from `model`'s for the same tokens (0 up to float noise: its weights)."""
    output = answer["output_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0].float()  # (T, V)
    logprobs = torch.log_softmax(logits, dim=-1)
    expected = [float(logprobs[len(PROMPT) - 1 + i, tok]) for i, tok in enumerate(output)]
    served = [t[0] for t in answer["meta_info"]["output_token_logprobs"]]
    return max(abs(a - b) for a, b in zip(served, expected, strict=True))


def workers(fleet: EngineFleet) -> list[dict[str, Any]]:
    return httpx.get(f"{fleet.router_url}/workers", timeout=10).json()["workers"]


def wait_until_each_engine_was_judged(fleet: EngineFleet) -> list[dict[str, Any]]:
    """The restarted router's workers once each engine is in routing or was held back with a reason."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        seen = workers(fleet)
        if all(w["healthy"] or w["last_error"] for w in seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"the restarted router judged not every engine within {SETTLE_S}s: {workers(fleet)}")


def test_engines_holding_part_of_a_version_stay_out_of_routing_after_the_router_restarts(
    small_model_dir: Path, tmp_path: Path
) -> None:
    router_args = ["--health-check-interval-secs", "0.5", "--policy", "round_robin"]
    fleet = start_engine_fleet(small_model_dir, tmp_path / "logs", router_args=router_args)
    router = RouterClient(fleet.router_url, 30.0)
    broadcaster = WeightBroadcaster(router, "127.0.0.1", "gloo", BUCKET_MB, timeout_s=15.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        boot = AutoModelForCausalLM.from_pretrained(small_model_dir).eval()  # version "0" on every engine
        model = copy.deepcopy(boot)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
        state = model.state_dict()
        parts = buckets(unique_tensors(state), int(BUCKET_MB * 2**20))
        assert len(parts) > 2

        # The trainer pauses generation and sends the first bucket of version 1; then the router restarts.
        router.post("/pause_generation", {"mode": "retract"}, "pause generation")
        broadcaster.open()
        group = broadcaster.group
        assert group is not None
        first = parts[0]
        body = {
            **request_fields(first),
            "group_name": broadcaster.group_name,
            "load_format": FLATTENED_BUCKET,
            "flush_cache": False,
            "weight_version": None,
        }
        collective = functools.partial(send, group, [t.detach() for t in first.values()], True)
        broadcaster._together("/update_weights_from_distributed", body, collective, 0.0, group.abort)
        fleet.restart_router()

        judged = wait_until_each_engine_was_judged(fleet)
        # Generation continues (the trainer's own continue after a failed fallback, or a second trainer's): an
        # engine the new router routes to would answer from the first bucket of version 1 over the rest of 0.
        assert httpx.post(f"{fleet.router_url}/continue_generation", json={}, timeout=30).status_code == 200
        answer = greedy_answer(fleet.router_url)
        if answer.status_code == 200:
            out = answer.json()
            pytest.fail(
                f"the restarted router routes to engines holding part of version 1 ({judged}): the answer says "
                f"weight version {out['meta_info']['weight_version']!r}, its logprobs are "
                f"{logprob_gap(out, boot):.3g} off that version's and {logprob_gap(out, model):.3g} off version 1's"
            )
        assert answer.status_code == 503, answer.text
        assert [w["healthy"] for w in judged] == [False, False]
        assert all("part of a weight version" in str(w["last_error"]) for w in judged), judged
        for url in fleet.engine_urls:
            info = httpx.get(f"{url}/get_model_info", timeout=10).json()
            assert (info["weight_version"], info["weights_partial"]) == ("0", True), url

        # The trainer's next bucket finds no group at the new router: it falls back to disk, which loads the
        # version whole into the engines it strands, and brings them back.
        DiskPublisher(router, tmp_path / "weights", small_model_dir).publish_state(model, state, 1)
        fleet.wait_healthy_engines(2, timeout_s=SETTLE_S)
        for url in [fleet.router_url, *fleet.engine_urls]:
            response = greedy_answer(url)
            assert response.status_code == 200, response.text
            out = response.json()
            assert out["meta_info"]["weight_version"] == "1" and logprob_gap(out, model) < 1e-4, url
    finally:
        torch.set_num_threads(threads)
        broadcaster.close()
        fleet.stop()
