"""Bad input gets a clear refusal and leaves nothing behind: malformed and oversized requests over
REST and gRPC, absurd specs and sampling parameters, prompts over the model's context, huge batches,
unknown fields, and a few hundred generated mutations of a valid RunSpec."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from launchers import Service, stored_runs

from rlfleet.grpc_limits import MAX_MESSAGE_BYTES
from rlfleet.v1 import runs_pb2, runs_pb2_grpc

pytestmark = pytest.mark.e2e

GENERATED_SPECS = 200
RANDOM_MESSAGES = 150


def valid_spec(tokenizer_dir: Path) -> dict[str, Any]:
    return {
        "model": {"path": str(tokenizer_dir)},
        "dataset": {"arithmetic": {"digits": 1, "ops": "+"}, "eval_size": 4},
        "rollout": {"group_size": 4, "groups_per_step": 2, "sampling": {"max_new_tokens": 4}},
        "reward": {"terms": [{"function": "arith_exact"}]},
        "schedule": {"steps": 2},
    }


def with_value(spec: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


# (field path, value, what the refusal must name)
BAD_FIELDS = [
    ("rollout.group_size", 10**6, "rollout.group_size"),
    ("rollout.groups_per_step", 10**9, "rollout.groups_per_step"),
    ("rollout.group_size", 1, "rollout.group_size"),
    ("rollout.sampling.temperature", -1, "rollout.sampling.temperature"),
    ("rollout.sampling.temperature", 1e308, "rollout.sampling.temperature"),
    ("rollout.sampling.top_p", 5, "rollout.sampling.top_p"),
    ("rollout.sampling.top_k", -7, "rollout.sampling.top_k"),
    ("rollout.sampling.max_new_tokens", 10**9, "rollout.sampling.max_new_tokens"),
    ("rollout.sampling.temperature", "hot", "temperature"),
    ("rollout.oversample", 1000, "rollout.oversample"),
    ("schedule.steps", -3, "schedule.steps"),
    ("schedule.steps", "many", "steps"),
    ("dataset.arithmetic.digits", 40, "dataset.arithmetic.digits"),
    ("model.path", "/nonexistent/model", "model"),
    ("model.bogus", 1, "bogus"),
    ("reward.terms", [{"function": "no_such_reward"}], "no_such_reward"),
    ("reward.terms", [{"function": "arith_exact", "weight": "NaN"}], "weight"),
    ("algorithm.name", "magic", "algorithm.name"),
    ("unknown_section", {"x": 1}, "unknown_section"),
]


def test_bad_specs_get_a_400_naming_the_field_and_store_nothing(
    orchestrator: Service, api_token: tuple[str, Path], tokenizer_dir: Path, redis_client: redis.Redis, runs_prefix: str
) -> None:
    before = stored_runs(redis_client, runs_prefix)
    spec = valid_spec(tokenizer_dir)
    headers = {"Authorization": f"Bearer {api_token[0]}"}
    bodies: list[tuple[str, bytes, str]] = [
        (f"{path}={value!r}", json.dumps(with_value(spec, path, value)).encode(), named)
        for path, value, named in BAD_FIELDS
    ]
    bodies += [
        ("not JSON", b"{model: path", "malformed JSON"),
        ("a list", b"[1, 2, 3]", "must be a JSON object"),
        ("invalid UTF-8", b'{"model": {"path": "\xff\xfe"}}', "body"),
    ]
    with httpx.Client(base_url=orchestrator.url, headers=headers, timeout=30) as http:
        for what, body, named in bodies:
            answer = http.post("/v1/runs", content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 400, (what, answer.status_code, answer.text)
            error = answer.json()["error"]
            assert error["kind"] == "invalid_input" and named in error["message"], (what, error)
        huge = b'{"name": "' + b"x" * (MAX_MESSAGE_BYTES + 1) + b'"}'
        answer = http.post("/v1/runs", content=huge, headers={"Content-Type": "application/json"})
        assert answer.status_code == 413 and answer.json()["error"]["kind"] == "resource_exhausted", answer.text[:300]
        answer = http.get("/v1/runs", params={"page_size": 10**9})
        assert answer.status_code == 400 and "page_size" in answer.text
        answer = http.get("/v1/runs", params={"state": "exploded"})
        assert answer.status_code == 400 and "state" in answer.text
        print(f"runs api: {len(bodies) + 3} hand-written bad requests refused with 4xx")
    assert stored_runs(redis_client, runs_prefix) == before, "a refused submit stored a run"


def _json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.text(max_size=20),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8,
    )


SPEC_PATHS = [
    "model.path",
    "model.tokenizer_path",
    "dataset.arithmetic",
    "dataset.arithmetic.digits",
    "dataset.eval_size",
    "dataset.seed",
    "rollout.group_size",
    "rollout.groups_per_step",
    "rollout.sampling",
    "rollout.sampling.n",
    "rollout.sampling.temperature",
    "rollout.sampling.max_new_tokens",
    "rollout.max_staleness",
    "rollout.function",
    "reward.terms",
    "algorithm",
    "algorithm.clip_low",
    "algorithm.kl_coef",
    "schedule.steps",
    "schedule.eval_every",
    "name",
    "trainer",
    "rollout",
    "extra_field",
]


def test_generated_spec_mutations_never_get_a_5xx_and_refusals_store_nothing(
    orchestrator: Service, api_token: tuple[str, Path], tokenizer_dir: Path, redis_client: redis.Redis, runs_prefix: str
) -> None:
    spec = valid_spec(tokenizer_dir)
    http = httpx.Client(base_url=orchestrator.url, headers={"Authorization": f"Bearer {api_token[0]}"}, timeout=30)
    outcomes = {"refused": 0, "accepted": 0}

    @given(path=st.sampled_from(SPEC_PATHS), value=_json_values())
    @settings(
        max_examples=GENERATED_SPECS,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def submit(path: str, value: Any) -> None:
        before = stored_runs(redis_client, runs_prefix)
        # json.dumps writes NaN and Infinity as Python's parser reads them: the server must cope.
        body = json.dumps(with_value(spec, path, value))
        answer = http.post("/v1/runs", content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code < 500, (path, value, answer.status_code, answer.text[:300])
        if answer.status_code >= 400:
            outcomes["refused"] += 1
            assert answer.json()["error"]["message"], answer.text
            assert stored_runs(redis_client, runs_prefix) == before, (path, value, "refused but stored")
        else:
            outcomes["accepted"] += 1

    try:
        submit()
    finally:
        http.close()
    print(f"runs api: {GENERATED_SPECS} generated spec mutations: {outcomes}")
    assert outcomes["refused"] >= GENERATED_SPECS // 2
    assert orchestrator.process.alive()


def test_grpc_refuses_malformed_and_oversized_messages(
    orchestrator: Service, api_token: tuple[str, Path], redis_client: redis.Redis, runs_prefix: str
) -> None:
    before = stored_runs(redis_client, runs_prefix)
    metadata = (("authorization", f"Bearer {api_token[0]}"),)
    # Bytes no Runs request parses from: truncated tag, length past the end, over-long varint, huge length,
    # wire types 7 and 3 (a group start), field number 0.
    malformed = [
        b"\xff\xff\xff\xff",
        b"\x0a\x05ab",
        b"\x08" + b"\xff" * 11,
        b"\x12\x80\x80\x80\x80\x10",
        b"\x0f\x01",
        b"\x0b\x01",
        b"\x00\x01",
    ]
    tried = 0
    with grpc.insecure_channel(orchestrator.grpc_address, options=[("grpc.max_send_message_length", -1)]) as channel:
        for method in ("Submit", "Get", "List", "Cancel"):
            call = channel.unary_unary(f"/rlfleet.v1.Runs/{method}")
            for raw in malformed:
                with pytest.raises(grpc.RpcError) as refused:
                    call(raw, metadata=metadata, timeout=10)
                tried += 1
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, refused.value.details())
                assert "malformed request" in refused.value.details()
        # Random bytes: each call ends with a status a client can act on, never INTERNAL or UNKNOWN.
        rng = random.Random(8)
        for i in range(RANDOM_MESSAGES):
            call = channel.unary_unary(f"/rlfleet.v1.Runs/{('Get', 'List', 'Cancel')[i % 3]}")
            raw = rng.randbytes(rng.randint(1, 64))
            try:
                call(raw, metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (raw, exc.details())
            tried += 1
        watch = channel.unary_stream("/rlfleet.v1.Runs/Watch")
        with pytest.raises(grpc.RpcError) as refused:
            list(watch(malformed[0], metadata=metadata, timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        oversized = runs_pb2.SubmitRunRequest(spec=runs_pb2.RunSpec(name="x" * (MAX_MESSAGE_BYTES + 1)))
        runs = runs_pb2_grpc.RunsStub(channel)
        with pytest.raises(grpc.RpcError) as too_big:
            runs.Submit(oversized, metadata=metadata, timeout=30)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, too_big.value.details()
        bad = runs_pb2.SubmitRunRequest(spec=runs_pb2.RunSpec(name="bad"))
        bad.spec.rollout.group_size = 10**6
        with pytest.raises(grpc.RpcError) as invalid:
            runs.Submit(bad, metadata=metadata, timeout=30)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as paged:
            runs.List(runs_pb2.ListRunsRequest(page_size=-5), metadata=metadata, timeout=10)
        assert paged.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    print(f"runs grpc: {tried + 4} malformed, random, oversized or invalid messages; none INTERNAL or UNKNOWN")
    assert stored_runs(redis_client, runs_prefix) == before


def test_generation_refuses_over_context_prompts_absurd_sampling_and_huge_batches(
    secured_router: Service, api_token: tuple[str, Path]
) -> None:
    context = 256  # the sim engine behind secured_router is started with --context-length 256
    bad = [
        ({"input_ids": list(range(3, 3 + context + 10)), "sampling_params": {"max_new_tokens": 2}}, "context length"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10**12}}, "context length"),
        ({"input_ids": [5, 6], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [5, 6], "sampling_params": {"top_p": 7}}, "top_p"),
        ({"input_ids": [5, 6], "sampling_params": {"top_k": -9}}, "top_k"),
        ({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [5, 6], "sampling_params": {"n": 10**6}}, "sequences"),
        ({"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 65536}, "top_logprobs_num 65536"),
        ({"input_ids": [[5, 6]] * 5000, "sampling_params": {"max_new_tokens": 1}}, "sequences"),
        ({"input_ids": [-1, 6]}, "token id -1"),
        ({"input_ids": "not ids"}, "input_ids"),
    ]
    with httpx.Client(base_url=secured_router.url, timeout=30) as http:
        # Schema fuzzing in the same session may have paused the engine.
        http.post("/continue_generation", json={}, headers={"Authorization": f"Bearer {api_token[0]}"})
        for body, named in bad:
            answer = http.post("/generate", json=body)
            assert 400 <= answer.status_code < 500, (named, answer.status_code, answer.text[:300])
            assert named in answer.text, (named, answer.text[:300])
        ok = http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200, ok.text
    print(f"generation: {len(bad)} bad requests refused with 4xx")
