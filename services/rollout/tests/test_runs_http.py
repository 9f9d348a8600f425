"""The REST Runs API of a real orchestrator process over a fake fleet: validation, a full run, SSE."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rollout_test_support import FakeFleet, Orchestrator, spec_json, wait_for_state, wait_until

from rlfleet.sample_stream import SampleStream


def _count_runs(url: str) -> int:
    return len(httpx.get(f"{url}/v1/runs", params={"page_size": 1000}, timeout=5).json()["runs"])


@pytest.mark.e2e
def test_bad_specs_get_400_naming_the_field_and_nothing_is_stored(
    orchestrator: Orchestrator, tokenizer_dir: Path
) -> None:
    good = spec_json(tokenizer_dir)
    cases: list[tuple[str, bytes, str]] = [
        ("unknown field", json.dumps({**good, "bogus": 1}).encode(), "bogus"),
        (
            "misspelt nested field",
            json.dumps({**good, "rollout": {"group_sise": 4}}).encode(),
            "rollout.group_sise: unknown field of rlfleet.v1.RolloutSpec (its fields: function, group_size, "
            "groups_per_step,",
        ),
        ("wrong type", json.dumps({**good, "rollout": {"group_size": "many"}}).encode(), "rollout.group_size"),
        (
            "a path where a mapping belongs",
            json.dumps({**good, "model": "/some/model"}).encode(),
            "model: expected a mapping (such as {path: ...}), got a string",
        ),
        ("malformed JSON", b'{"name": "x",', "malformed JSON"),
        ("not an object", b"[1, 2]", "JSON object"),
        (
            "unknown reward function",
            json.dumps({**good, "reward": {"terms": [{"function": "arith_exact"}, {"function": "nope"}]}}).encode(),
            "reward.terms[1].function",
        ),
        ("group of one", json.dumps({**good, "rollout": {"group_size": 1}}).encode(), "rollout.group_size"),
        ("no model", json.dumps({**good, "model": {"path": "/nonexistent"}}).encode(), "model.path"),
        (
            "no tokenizer",
            json.dumps({**good, "model": {**good["model"], "tokenizer_path": "/nonexistent"}}).encode(),
            "model.tokenizer_path",
        ),
        (
            "reward function twice",
            json.dumps({**good, "reward": {"terms": [{"function": "arith_exact"}] * 2}}).encode(),
            "reward.terms[1].function",
        ),
        (
            "negative reward time limit",
            json.dumps({**good, "reward": {**good["reward"], "timeout_seconds": -1}}).encode(),
            "reward.timeout_seconds",
        ),
        (
            "huge held-out split",
            json.dumps({**good, "dataset": {**good["dataset"], "eval_size": 100_000}}).encode(),
            "dataset.eval_size",
        ),
        ("zero learning rate", json.dumps({**good, "trainer": {"learning_rate": 0}}).encode(), "trainer.learning_rate"),
        (
            "too few held-out prompts",
            json.dumps({**good, "dataset": {**good["dataset"], "eval_size": 500}}).encode(),
            "dataset.eval_size",
        ),
        (
            "unknown filter",
            json.dumps({**good, "rollout": {**good["rollout"], "filters": ["zero_variance", "nope"]}}).encode(),
            "rollout.filters[1]",
        ),
        (
            "no chat template",
            json.dumps({**good, "dataset": {**good["dataset"], "chat_template": True}}).encode(),
            "dataset.chat_template",
        ),
        ("missing file", json.dumps({**good, "dataset": {"jsonl": {"path": "/nonexistent.jsonl"}}}).encode(), "path"),
        # Python reads these as errors, not as absent files: each was a 500 naming nothing.
        ("model name too long", json.dumps({**good, "model": {"path": "/" + "m" * 300}}).encode(), "model.path"),
        (
            "tokenizer name too long",
            json.dumps({**good, "model": {**good["model"], "tokenizer_path": "/" + "t" * 300}}).encode(),
            "model.tokenizer_path",
        ),
        (
            "data file name too long",
            json.dumps({**good, "dataset": {"jsonl": {"path": "/" + "d" * 300}}}).encode(),
            "dataset.jsonl.path: cannot read",
        ),
        (
            "number beyond a double",
            json.dumps({**good, "trainer": {"learning_rate": 10**400}}).encode(),
            "trainer.learning_rate: a number too large",
        ),
        (
            "unknown rollout function",
            json.dumps({**good, "rollout": {**good["rollout"], "function": "nope"}}).encode(),
            "rollout.function",
        ),
        (
            "unknown environment",
            json.dumps(
                {**good, "rollout": {**good["rollout"], "function": "multi_turn", "multi_turn": {"environment": "no"}}}
            ).encode(),
            "rollout.multi_turn.environment",
        ),
        (
            "no model turn",
            json.dumps(
                {**good, "rollout": {**good["rollout"], "function": "multi_turn", "multi_turn": {"max_turns": 0}}}
            ).encode(),
            "rollout.multi_turn.max_turns",
        ),
    ]
    before = _count_runs(orchestrator.url)
    for name, body, field in cases:
        response = httpx.post(f"{orchestrator.url}/v1/runs", content=body, timeout=10)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["kind"] == "invalid_input"
        assert field in error["message"], (name, error["message"])
    unknown = httpx.post(
        f"{orchestrator.url}/v1/runs",
        json={**good, "reward": {"terms": [{"function": "nope"}]}},
        timeout=10,
    ).json()["error"]["message"]
    assert "arith_exact" in unknown  # the known functions are listed
    unknown = httpx.post(
        f"{orchestrator.url}/v1/runs", json={**good, "rollout": {**good["rollout"], "function": "nope"}}, timeout=10
    ).json()["error"]["message"]
    assert "'multi_turn'" in unknown and "'single_turn'" in unknown
    assert _count_runs(orchestrator.url) == before
    assert httpx.get(f"{orchestrator.url}/v1/runs", params={"state": "bogus"}, timeout=5).status_code == 400
    assert httpx.get(f"{orchestrator.url}/v1/runs/run-missing", timeout=5).status_code == 404


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("method", "path", "query", "message"),
    [
        ("GET", "/v1/runs", {"stat": "RUNNING"}, "query.stat: not a parameter of GET /v1/runs (it takes state, "),
        ("GET", "/v1/runs", {"pageSize": "1"}, "query.pageSize: not a parameter of GET /v1/runs"),
        ("GET", "/v1/runs", [("state", "RUNNING"), ("state", "FAILED")], "query.state: given more than once"),
        (
            "GET",
            "/v1/runs/run-missing",
            {"view": "full"},
            "query.view: not a parameter of GET /v1/runs/{run_id} (it takes none)",
        ),
        ("GET", "/v1/runs/run-missing:watch", {"since": "1"}, "query.since: not a parameter"),
        ("POST", "/v1/runs/run-missing:cancel", {"force": "true"}, "query.force: not a parameter"),
    ],
)
def test_a_query_parameter_a_route_does_not_take_is_a_400_naming_it(
    orchestrator: Orchestrator, method: str, path: str, query: Any, message: str
) -> None:
    """A misspelt filter must not list every run as if it had filtered, nor a misspelt option act as its default."""
    response = httpx.request(method, f"{orchestrator.url}{path}", params=query, timeout=5)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith(message), response.json()
    listed = httpx.get(f"{orchestrator.url}/v1/runs", params={"state": "RUNNING", "page_size": 5}, timeout=5)
    assert listed.status_code == 200, listed.text


@pytest.mark.e2e
def test_a_cancel_sent_as_get_is_a_405_that_says_to_post(orchestrator: Orchestrator) -> None:
    """Before: 404 "run 'run-x:cancel' not found", as GET /v1/runs/{run_id} took `run-x:cancel` for an id."""
    response = httpx.get(f"{orchestrator.url}/v1/runs/run-x:cancel", timeout=5)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == "POST"
    assert response.json()["error"] == {
        "kind": "method_not_allowed",
        "message": "GET /v1/runs/run-x:cancel: method not allowed; this path takes POST",
        "code": 405,
    }


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS"])
def test_another_method_on_the_runs_collection_is_a_405_naming_get_and_post(
    orchestrator: Orchestrator, method: str
) -> None:
    """Before: `Allow: POST` and "this path takes POST", the first route's methods alone, though GET lists runs."""
    response = httpx.request(method, f"{orchestrator.url}/v1/runs", timeout=5)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == "GET, POST"
    assert response.json()["error"] == {
        "kind": "method_not_allowed",
        "message": f"{method} /v1/runs: method not allowed; this path takes GET, POST",
        "code": 405,
    }
    head = httpx.head(f"{orchestrator.url}/v1/runs", timeout=5)
    assert (head.status_code, head.headers["allow"]) == (405, "GET, POST")


@pytest.mark.e2e
def test_a_run_ends_with_its_last_steps_metrics_when_the_trainers_reports_reach_it_late(
    orchestrator: Orchestrator, fleet: FakeFleet, tokenizer_dir: Path
) -> None:
    fleet.trainer.watch_delay_s = 2.0  # every report is made before the orchestrator's WatchSteps reaches the trainer
    try:
        run_id = httpx.post(f"{orchestrator.url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        final = wait_for_state(orchestrator.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=40)
    finally:
        fleet.trainer.watch_delay_s = 0.0
    assert final["state"] == "RUN_STATE_SUCCEEDED", final.get("error")
    assert final["metrics"]["loss"] == pytest.approx(1 / 3)  # step 3 of 3: replayed, and waited for at the end


def _read_sse(url: str, events: list[dict[str, Any]], done: threading.Event) -> None:
    with httpx.stream("GET", url, timeout=httpx.Timeout(5.0, read=60.0)) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    done.set()


@pytest.mark.e2e
def test_a_run_goes_from_queued_to_succeeded_with_exact_groups_and_evals(
    orchestrator: Orchestrator, fleet: FakeFleet, tokenizer_dir: Path, redis_client: redis.Redis
) -> None:
    response = httpx.post(f"{orchestrator.url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10)
    assert response.status_code == 200, response.text
    run = response.json()
    run_id = run["id"]
    assert run["state"] == "RUN_STATE_QUEUED"
    assert run["spec"]["rollout"]["group_size"] == 4  # stored resolved
    assert run["spec"]["algorithm"]["name"] == "grpo"
    events: list[dict[str, Any]] = []
    done = threading.Event()
    threading.Thread(target=_read_sse, args=(f"{orchestrator.url}/v1/runs/{run_id}:watch", events, done)).start()

    final = wait_for_state(orchestrator.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=40)
    assert final["state"] == "RUN_STATE_SUCCEEDED", final.get("error")
    steps, gps, n = 3, 2, 4
    # Evaluations: before training, every 2 steps, after the last; greedy answers are right from version 1.
    assert [int(e["step"]) for e in final["evals"]] == [0, 2, 3]  # int64 is a JSON string
    assert final["evals"][0]["accuracy"] == 0.0
    assert final["evals"][-1]["accuracy"] == 1.0
    assert final["evals"][-1]["weight_version"] == "3"
    assert final["evals"][0]["size"] == 6
    progress = final["progress"]
    assert progress["groups_produced"] == str(steps * gps)
    assert progress["weight_version"] == str(steps)
    assert progress["groups_trained"] == str(steps * gps)
    assert final["metrics"]["loss"] == pytest.approx(1 / steps)  # the fake trainer's report of the last step

    stream = SampleStream(redis_client, run_id, prefix=fleet.prefix)
    groups = [entry.group for entry in stream.entries()]
    assert [g.group_id for g in groups] == [f"{run_id}/{s}/{i}" for s in range(steps) for i in range(gps)]
    assert fleet.trainer.runs[run_id].trained_group_ids == [g.group_id for g in groups]
    for group in groups:
        assert len(group.samples) == n
        for sample in group.samples:
            m = len(sample.response_token_ids)
            assert m > 0
            assert len(sample.rollout_logprobs) == m and list(sample.loss_mask) == [1] * m
            assert sample.reward in (0.0, 1.0) and sample.reward_components["arith_exact"] == sample.reward
            assert len(sample.weight_versions) == 1
    # On-policy: the samples of step s were generated by weight version s.
    assert {int(g.group_id.split("/")[1]) for g in groups} == {0, 1, 2}
    for g in groups:
        assert g.samples[0].weight_versions[0] == int(g.group_id.split("/")[1])
    # The run is recorded SUCCEEDED first, then the trainer is stopped (run_loop): once, not again.
    wait_until(lambda: run_id in fleet.trainer.stop_calls, 10, "StopRun of the finished run")
    assert fleet.trainer.stop_calls.count(run_id) == 1

    assert done.wait(10), "the watch stream did not end with the run"
    states = [e["state"] for e in events]
    assert states[-1] == "RUN_STATE_SUCCEEDED"
    lifecycle = ["RUN_STATE_QUEUED", "RUN_STATE_RUNNING", "RUN_STATE_SUCCEEDED"]
    assert [lifecycle.index(s) for s in states] == sorted(lifecycle.index(s) for s in states)
    # A watch shows the run as it is when it connects, then each change it reads; one that connects
    # after the fake fleet's fast run ended (a loaded machine) sees only the end.
    if states[0] != "RUN_STATE_SUCCEEDED":
        assert "RUN_STATE_RUNNING" in states
    produced = [int(e["progress"]["groups_produced"]) for e in events]
    # Progress only grows. How many intermediate events a client sees depends on when its watch
    # connects (a loaded machine may connect after the fake fleet's fast run is nearly over).
    assert produced == sorted(produced) and produced[-1] == steps * gps

    exported = httpx.get(f"{orchestrator.url}/metrics", timeout=5).text
    for name in (
        "rlfleet_rollout_runs{",
        "rlfleet_rollout_groups_produced_total",
        'rlfleet_rollout_samples_total{status="ok"}',
        "rlfleet_rollout_generate_seconds_bucket",
        "rlfleet_rollout_reward_mean",
        "rlfleet_rollout_eval_accuracy 1.0",
        "rlfleet_rollout_weight_version 3.0",
        "rlfleet_rollout_step 3.0",
    ):
        assert name in exported, name


@pytest.mark.e2e
def test_a_run_fails_with_the_reason_when_no_engine_answers(
    orchestrator: Orchestrator, fleet: FakeFleet, tokenizer_dir: Path
) -> None:
    fleet.router_down.set()
    try:
        run_id = httpx.post(f"{orchestrator.url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        final = wait_for_state(orchestrator.url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=30)
    finally:
        fleet.router_down.clear()
    assert final["state"] == "RUN_STATE_FAILED"
    assert "evaluation at step 0 got no response" in final["error"] and "HTTP 503" in final["error"]
    assert final["finished_at"]
    wait_until(lambda: run_id in fleet.trainer.stop_calls, 10, "StopRun of the failed run")
    cancel = httpx.post(f"{orchestrator.url}/v1/runs/{run_id}:cancel", timeout=5)
    assert cancel.status_code == 409 and cancel.json()["error"]["kind"] == "conflict"
    assert cancel.json()["error"]["message"] == f"run {run_id} already FAILED: it cannot be cancelled"
