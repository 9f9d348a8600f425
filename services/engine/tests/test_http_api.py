"""The SGLang HTTP contract on a live engine: bad input, batching, streaming, abort, control and info endpoints."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from engine_test_support import RunningEngine

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "body: must be a JSON object, got an array"),
        ({"text": 5}, "body.text"),
        ({"input_ids": "abc"}, "body.input_ids"),
        ({"text": "1+1=", "stream": "sometimes"}, "body.stream"),
    ],
)
def test_malformed_requests_get_sglangs_400_naming_the_problem(engine: RunningEngine, body: Any, fragment: str) -> None:
    """A body of the wrong form, in the shape of SGLang's validation (bad values: test_sglang_error_shapes.py)."""
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(
        engine.url + "/generate", content=content, headers={"content-type": "application/json"}, timeout=10
    )
    assert response.status_code == 400
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400
    assert fragment in error["message"], error["message"]


def test_a_body_sent_as_form_data_gets_a_400_naming_the_content_type(engine: RunningEngine) -> None:
    body = json.dumps({"text": "1+1=", "sampling_params": {"max_new_tokens": 1}})
    # curl -d without -H sends form data's Content-Type; FastAPI then does not read the body as JSON.
    response = httpx.post(engine.url + "/generate", content=body, headers={"content-type": "text/plain"}, timeout=10)
    assert response.status_code == 400
    assert "Content-Type is 'text/plain'" in response.json()["message"]
    assert "application/json" in response.json()["message"]
    # Without a Content-Type the body is read as JSON, as SGLang's server reads it.
    response = httpx.post(engine.url + "/generate", content=body, timeout=10)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"text": "7" * 600}, "longer than the model's context length"),
        ({"text": "1+1=", "sampling_params": {"max_new_tokens": 1000}}, "maximum context length"),
        ({"input_ids": [5, 100000]}, "outside the vocabulary"),
        ({"text": "1+1=", "rid": ""}, "rid must not be empty"),  # /abort_request could never name it
    ],
)
def test_requests_the_model_cannot_run_get_400(engine: RunningEngine, body: Any, fragment: str) -> None:
    response = engine.post("/generate", body)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/generate", {"text": "a\ud800b"}, "text"),
        ("/generate", {"text": ["1+1=", "a\udc00"]}, "text[1]"),
        ("/v1/completions", {"prompt": ["1+1=", "a\ud800b"]}, "prompt[1]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
        # Sent back in the answer, which could not be encoded: a 500 after the generation ran.
        ("/generate", {"text": "1+1=", "rid": "r\ud800"}, "rid"),
        ("/generate", {"text": ["1+1=", "2+2="], "rid": ["a", "b\udfff"]}, "rid.1"),
        ("/v1/completions", {"prompt": "1+1=", "model": "m\ud800"}, "model"),
    ],
)
def test_a_lone_surrogate_in_a_prompt_is_a_400_naming_the_field(
    engine: RunningEngine, route: str, body: dict[str, Any], field: str
) -> None:
    """JSON lets a lone surrogate through escaped; the tokenizer refused it with a TypeError, answered as a 500."""
    sent = json.dumps(body)  # escaped, as a client's JSON would carry it
    response = httpx.post(engine.url + route, content=sent, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    assert f"{field}: holds a lone UTF-16 surrogate" in response.text


@pytest.mark.parametrize("neutral", [{"logit_bias": {}}, {"custom_params": {}}, {"json_schema": ""}, {"regex": None}])
def test_empty_values_of_unsupported_parameters_read_as_absent(engine: RunningEngine, neutral: dict[str, Any]) -> None:
    out = engine.generate({"text": "1+1=", "sampling_params": {"max_new_tokens": 1, **neutral}})
    assert out["meta_info"]["completion_tokens"] == 1
    refused = engine.post("/generate", {"text": "1+1=", "sampling_params": {"logit_bias": {"5": 2.0}}})
    assert refused.status_code == 400 and "logit_bias" in refused.json()["error"]["message"]


def test_null_sampling_parameters_read_as_their_defaults(engine: RunningEngine) -> None:
    """SGLang reads a null parameter as its default (a client's "not set"); each was a 400 here."""
    nulls = dict.fromkeys(("top_p", "top_k", "min_p", "n", "ignore_eos", "skip_special_tokens", "no_stop_trim"))
    greedy = {"max_new_tokens": 4, "temperature": 0}
    out = engine.generate({"text": "1+1=", "sampling_params": {**greedy, "stop_token_ids": [None], **nulls}})
    assert out["output_ids"] == engine.generate({"text": "1+1=", "sampling_params": greedy})["output_ids"]
    answer = engine.post("/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 1, "temperature": None}})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("body", [{"rid": None, "abort_all": True}, {"rid": ""}, {"rid": None}])
def test_an_empty_or_null_rid_is_sglangs_and_aborts_nothing_by_rid(engine: RunningEngine, body: dict[str, Any]) -> None:
    # SGLang's rid is Optional[str]: null reads as "", and "" names no request.
    assert engine.post("/abort_request", body).status_code == 200


def test_an_empty_rid_aborts_no_request(engine: RunningEngine) -> None:
    body = {"text": "1+1=", "rid": "_x", "stream": True, "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=30) as response:
        lines = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(next(lines))["meta_info"]["finish_reason"] is None
        assert engine.post("/abort_request", {"rid": ""}).status_code == 200  # not a prefix of "_x"
        events = list(lines)
    assert json.loads(events[-2])["meta_info"]["finish_reason"] == {"type": "length", "length": 60}


def test_unknown_fields_are_accepted_and_ignored(engine: RunningEngine) -> None:
    out = engine.generate(
        {
            "text": "1+1=",
            "lora_path": None,
            "custom_labels": {"a": "b"},
            "future_field": [1],
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "future_knob": True},
        }
    )
    assert out["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"lora_path": "adapters/math"}, "lora_path"),
        ({"image_data": "https://example.com/cat.png"}, "image_data"),
        ({"custom_logit_processor": "{}"}, "custom_logit_processor"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"token_ids_logprob": [5], "return_logprob": True}, "token_ids_logprob"),
    ],
)
def test_generate_fields_the_engine_cannot_honour_are_refused_naming_them(
    engine: RunningEngine, extra: dict[str, Any], field: str
) -> None:
    """They were ignored: a LoRA request got the base model's tokens, an image request an answer to the text alone."""
    response = engine.post("/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"body: {field}: not supported by rlfleet-engine (leave out, or null)"


def test_single_and_batch_shapes_with_n_and_rid(engine: RunningEngine) -> None:
    single = engine.generate({"text": "1+1=", "rid": "solo", "sampling_params": {"max_new_tokens": 2}})
    assert isinstance(single, dict) and single["meta_info"]["id"] == "solo"
    assert set(single["meta_info"]) >= {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "e2e_latency",
    }
    many = engine.generate(
        {"text": ["1+1=", "2+2="], "rid": "grp", "sampling_params": {"n": 3, "max_new_tokens": 2, "ignore_eos": True}}
    )
    assert [o["meta_info"]["id"] for o in many] == [f"grp_{k}" for k in range(6)]
    assert all(o["meta_info"]["prompt_tokens"] == 4 for o in many)


def test_stop_string_and_zero_tokens(engine: RunningEngine) -> None:
    out = engine.generate({"text": "1+1=", "sampling_params": {"max_new_tokens": 0}})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    first = engine.generate({"text": "1+1=", "sampling_params": {"temperature": 0, "max_new_tokens": 1}})["text"]
    stopped = engine.generate(
        {"text": "1+1=", "sampling_params": {"temperature": 0, "max_new_tokens": 20, "stop": [first]}}
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert stopped["text"] == ""


def test_concurrent_requests_are_batched(engine: RunningEngine) -> None:
    def one(i: int) -> dict[str, Any]:
        return engine.generate(
            {"input_ids": [10 + i, 11, 12], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        )

    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(one, range(8)))
    assert all(o["meta_info"]["completion_tokens"] == 40 for o in outs)
    state = engine.get("/get_server_info").json()["internal_states"][0]
    assert state["peak_batch_size"] > 1
    metrics = engine.get("/metrics").text
    singles = _sample(metrics, 'rlfleet_engine_decode_batch_size_bucket{le="1.0"')
    steps = _sample(metrics, "rlfleet_engine_decode_batch_size_count")
    assert steps > singles, "some decode step must have advanced more than one sequence"


def test_streaming_sends_cumulative_chunks_then_done(engine: RunningEngine) -> None:
    body = {
        "text": "1+1=",
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
    }
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # One chunk per token while the reader keeps up; one that falls behind gets the latest (`LatestOutputs`).
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 5, lengths
    assert all(c["output_ids"] == chunks[-1]["output_ids"][: len(c["output_ids"])] for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 5


def test_abort_finishes_a_running_request(engine: RunningEngine) -> None:
    body = {
        "text": "1+1=",
        "rid": "to-abort",
        "stream": True,
        "sampling_params": {"max_new_tokens": 450, "ignore_eos": True},
    }
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["meta_info"]["finish_reason"] is None
        assert engine.post("/abort_request", {"rid": "to-abort"}).status_code == 200
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    last = json.loads(events[-2])
    assert events[-1] == "[DONE]"
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 450


def test_a_top_k_past_the_vocabulary_samples_and_leaves_its_batch_running(engine: RunningEngine) -> None:
    body = {
        "input_ids": [5, 6, 7],
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["meta_info"]["finish_reason"] is None
        odd = engine.generate({"input_ids": [5], "sampling_params": {"top_k": 2**63, "max_new_tokens": 2}})
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert odd["meta_info"]["finish_reason"]["type"] in ("length", "stop"), odd["meta_info"]["finish_reason"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 400}


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        (
            "/generate",
            {"text": "1+1=", "sampling_params": {"max_new_tokens": 2, "sampling_seed": 2**64}},
            "sampling_seed",
        ),
        ("/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "seed": 2**64}, "seed"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, "seed": 2**64},
            "seed",
        ),
    ],
)
def test_a_seed_past_64_bits_is_refused_naming_the_field(
    engine: RunningEngine, route: str, body: dict[str, Any], field: str
) -> None:
    response = engine.post(route, body)
    assert response.status_code == 400, response.text
    # /generate checks its sampling_params past validation, as SGLang does, and answers in that shape.
    refusal = response.json()
    message = refusal["error"]["message"] if route == "/generate" else refusal["message"]
    assert f".{field}: Input should be less than or equal to {2**64 - 1}" in message
    largest = json.loads(json.dumps(body).replace(str(2**64), str(2**64 - 1)))
    assert engine.post(route, largest).status_code == 200


def test_a_rid_in_flight_is_refused_and_its_request_runs_on(engine: RunningEngine) -> None:
    body = {
        "text": ["1+1=", "2+2="],
        "rid": "taken",  # its prompts run as taken_0 and taken_1
        "stream": True,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    duplicates: list[tuple[dict[str, Any], str]] = [
        ({"text": "3+3=", "rid": "taken_1"}, "taken_1"),
        ({"text": ["3+3=", "4+4="], "rid": ["fresh", "taken_0"]}, "taken_0"),
        ({"text": ["3+3=", "4+4="], "rid": "taken"}, "taken_0"),
    ]
    with httpx.stream("POST", engine.url + "/generate", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["meta_info"]["finish_reason"] is None
        for duplicate, rid in duplicates:
            refused = engine.post("/generate", {**duplicate, "sampling_params": {"max_new_tokens": 1}})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["message"] == f"Duplicate request ID detected: {rid}"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    finals = {c["index"]: c["meta_info"]["finish_reason"] for c in chunks if c["meta_info"]["finish_reason"]}
    assert finals == {0: {"type": "length", "length": 200}, 1: {"type": "length", "length": 200}}
    # Once finished, a rid may be used again.
    assert engine.generate({"text": "1+1=", "rid": "taken_0", "sampling_params": {"max_new_tokens": 1}})


def test_pause_holds_requests_until_continue(engine: RunningEngine) -> None:
    assert engine.post("/pause_generation", {}).status_code == 200
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: result.update(out=engine.generate({"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}))
    )
    try:
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and "out" not in result
        assert engine.get("/health_generate").status_code == 200
    finally:
        assert engine.post("/continue_generation", {}).json()["status"] == "ok"
    worker.join(timeout=30)
    assert result["out"]["meta_info"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"mode": "hold"}, "body.mode: Input should be 'abort', 'retract' or 'in_place'"),
        ({"mode": None}, "body.mode: Input should be 'abort', 'retract' or 'in_place'"),
        ("retract", 'body: must be a JSON object such as {"mode": "retract"}, got a string; mode is one of'),
        ([{"mode": "retract"}], 'body: must be a JSON object such as {"mode": "retract"}, got an array'),
    ],
)
def test_a_pause_in_an_unknown_mode_is_refused_naming_the_field(
    engine: RunningEngine, body: Any, fragment: str
) -> None:
    response = engine.post("/pause_generation", body)
    assert response.status_code == 400, response.text
    assert response.json()["object"] == "error" and fragment in response.json()["message"]
    assert engine.get("/get_server_info").json()["internal_states"][0]["paused"] is False


def test_the_health_probes_generation_is_not_counted(engine: RunningEngine) -> None:
    """/health_generate on an idle engine generates a token under log_metrics=False: it counted as prompt and
    generated tokens (and throughput) all the same, so an idle engine under probes showed traffic."""

    def counted() -> tuple[float, float]:
        text = engine.get("/metrics").text
        return metric_sum(text, "sglang:prompt_tokens_total"), metric_sum(text, "sglang:generation_tokens_total")

    before = counted()
    for _ in range(3):
        assert engine.get("/health_generate").status_code == 200
    assert counted() == before


def test_health_info_and_cache_endpoints(engine: RunningEngine, tiny_model_dir: Any) -> None:
    assert engine.get("/health").status_code == 200
    assert engine.get("/health_generate").status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = engine.get(path).json()
        assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
        assert info["weight_version"] == "default" and info["architectures"] == ["LlamaForCausalLM"]
    for path in ("/get_server_info", "/server_info"):
        server = engine.get(path).json()
        assert server["served_model_name"] == str(tiny_model_dir)
        assert server["dp_size"] == 1 and server["max_running_requests"] == 8 and server["version"]
    assert engine.post("/flush_cache", {}).status_code == 200
    response = engine.post("/abort_request", {})
    assert response.status_code == 400 and "rid" in response.json()["message"]


def test_metrics_use_sglang_names_and_labels(engine: RunningEngine, tiny_model_dir: Any) -> None:
    engine.generate({"text": "1+1=", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    text = engine.get("/metrics").text
    label = f'model_name="{tiny_model_dir}"'
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:cache_hit_rate",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:e2e_request_latency_seconds_bucket",
    ):
        assert any(line.startswith(name + "{") and label in line for line in text.splitlines()), name
    assert _sample(text, "sglang:generation_tokens_total") >= 2


def _sample(metrics_text: str, prefix: str) -> float:
    """Value of the first sample line starting with `prefix`."""
    line = next(line for line in metrics_text.splitlines() if line.startswith(prefix))
    return float(line.rsplit(" ", 1)[1])


def test_a_weight_version_that_is_not_unicode_text_is_refused_and_the_engine_answers_on(
    start_sim: Callable[..., str],
) -> None:
    """Applied, such a version made every later answer that carries it (/generate, /get_model_info) a 500."""
    url = start_sim()
    sent = json.dumps({"model_path": "/ckpt/1", "weight_version": "v\ud800"})
    headers = {"content-type": "application/json"}
    refused = httpx.post(f"{url}/update_weights_from_disk", content=sent, headers=headers, timeout=30)
    assert refused.status_code == 400 and "weight_version: holds a lone UTF-16 surrogate" in refused.text
    info = httpx.get(f"{url}/get_model_info", timeout=10)
    assert info.status_code == 200 and info.json()["weight_version"] == "default"


def metric_sum(exposition: str, name: str) -> float:
    """The sum of `name`'s samples over their labels."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines() if line.startswith(name + "{"))
