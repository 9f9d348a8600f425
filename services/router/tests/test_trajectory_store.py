"""The trajectory cache alone: layout of turns, versions, divergence, token budget and staleness."""

from __future__ import annotations

import gc
import json
import random
import tracemalloc

import pytest

from rlfleet.errors import Conflict, InvalidInput, NotFound
from rlfleet_router import trajectory_store
from rlfleet_router.generation_relay import header_dict
from rlfleet_router.trajectory_capture import check_trajectory_request, trajectory_id, turn_from_answer
from rlfleet_router.trajectory_store import ENTRY_TOKENS, TURN_TOKENS, TrajectoryStore, Turn


def turn(prompt: list[int], output: list[int], version: str = "1") -> Turn:
    return Turn("r", tuple(prompt), tuple(output), tuple(-0.5 * (i + 1) for i in range(len(output))), version, "e")


def test_turns_are_laid_out_with_generated_tokens_masked_in() -> None:
    store = TrajectoryStore(max_tokens=1000, max_update_lag=1)
    store.record("t", turn([1, 2], [3, 4]), fleet_update=0)
    store.record("t", turn([1, 2, 3, 4, 9], [5], version="2"), fleet_update=0)
    got = store.get("t").describe()
    assert got["prompt_ids"] == [1, 2]
    assert got["response_ids"] == [3, 4, 9, 5]
    assert got["loss_mask"] == [1, 1, 0, 1]
    assert got["response_logprobs"] == [-0.5, -1.0, 0.0, -0.5]
    assert got["weight_versions"] == ["1", "2"]


def test_every_version_that_sampled_a_turn_is_kept_oldest_first() -> None:
    """A weight update during a turn (on_weight_update "finish"): the turn's tokens came from versions 1 and
    2, and the staleness rule reads the oldest; keeping only the version the answer went out on (2) made old
    tokens look fresh."""
    store = TrajectoryStore(max_tokens=1000, max_update_lag=1)
    store.record("t", Turn("r", (1, 2), (3, 4), (-0.5, -1.0), "2", "e", ("1", "2")), fleet_update=0)
    store.record("t", turn([1, 2, 3, 4, 9], [5], version="3"), fleet_update=1)
    assert store.get("t").weight_versions == ["1", "2", "3"]


@pytest.mark.parametrize("resent", [1, 2])
def test_a_turn_sent_again_under_its_rid_and_prompt_takes_the_first_attempts_place(resent: int) -> None:
    """A client whose connection dropped before it read an answer sends the request again (same rid, same prompt):
    the trajectory already held the first answer, so the second read as history rewritten and the episode was lost,
    with an error telling the client to do what it did."""
    store = TrajectoryStore(max_tokens=1000, max_update_lag=1)
    first = Turn("t/0", (1, 2), (3, 4), (-0.1, -0.2), "1", "e")
    second = Turn("t/1", (1, 2, 3, 4, 9), (5, 6), (-0.3, -0.4), "1", "e")
    store.record("t", first, fleet_update=0)
    if resent == 1:
        store.record("t", Turn("t/0", (1, 2), (7,), (-0.7,), "2", "e"), fleet_update=1)  # lost, on version 2
        store.record("t", first, fleet_update=1)  # what the client read
    store.record("t", second, fleet_update=1)
    if resent == 2:
        store.record("t", Turn("t/1", (1, 2, 3, 4, 9), (8,), (-0.8,), "2", "e"), fleet_update=1)
        store.record("t", second, fleet_update=1)
    got = store.get("t")
    assert got.response_ids.tolist() == [3, 4, 9, 5, 6]
    assert got.logprobs.tolist() == [-0.1, -0.2, 0.0, -0.3, -0.4]
    assert list(got.loss_mask) == [1, 1, 0, 1, 1]
    assert [t["rid"] for t in got.turns] == ["t/0", "t/1"]
    assert got.weight_versions == ["1"], "the taken-back answer's version sampled nothing kept"
    assert store.tokens == got.tokens
    # The same rid with another prompt is history rewritten, as before.
    store.record("t", Turn("t/1", (1, 2, 3, 4, 7), (8,), (-0.8,), "1", "e"), fleet_update=1)
    with pytest.raises(Conflict, match="turn 3 .* at token 4 of 7"):
        store.get("t")


def test_a_prompt_that_rewrites_history_makes_the_trajectory_a_conflict() -> None:
    store = TrajectoryStore(max_tokens=1000, max_update_lag=1)
    store.record("t", turn([1, 2], [3, 4]), fleet_update=0)
    store.record("t", turn([1, 2, 3, 7, 9], [5]), fleet_update=0)
    with pytest.raises(Conflict, match="turn 2 .* at token 3 of 4"):
        store.get("t")


@pytest.mark.parametrize("lost_turn", [1, 2])
def test_a_turn_the_router_could_not_read_makes_the_trajectory_a_conflict(lost_turn: int) -> None:
    """Before, the lost turn was skipped: the trajectory read back 200 without its tokens, or (a first turn
    lost) the next turn started a new one with the model's earlier output inside its prompt."""
    store = TrajectoryStore(max_tokens=1000, max_update_lag=1)
    if lost_turn == 2:
        store.record("t", turn([1, 2], [3, 4]), fleet_update=0)
    store.record_lost("t", "r-lost", "http://e", "3 logprobs for 2 output tokens", fleet_update=0)
    store.record("t", turn([1, 2, 3, 4, 9, 5, 6], [7]), fleet_update=0)
    with pytest.raises(Conflict, match=f"turn {lost_turn} \\(rid 'r-lost'\\) ran on http://e.*3 logprobs for 2"):
        store.get("t")
    store.delete("t")
    assert store.tokens == 0


def test_budget_evicts_least_recently_used_and_updates_evict_stale() -> None:
    record = ENTRY_TOKENS + TURN_TOKENS  # what a one-turn trajectory is charged besides its ids
    store = TrajectoryStore(max_tokens=10 + 2 * record, max_update_lag=1)
    store.record("old", turn([1, 2, 3], [4, 5]), fleet_update=0)
    store.record("new", turn([6, 7, 8], [9]), fleet_update=1)
    store.record("newest", turn([1, 1], [2]), fleet_update=1)
    with pytest.raises(NotFound):
        store.get("old")
    assert store.tokens == 7 + 2 * record and store.evictions == 1
    assert store.evict_stale(fleet_update=2) == 0
    assert store.evict_stale(fleet_update=3) == 2 and len(store) == 0 and store.tokens == 0


@pytest.mark.parametrize("eviction", ["budget", "stale"])
def test_a_conversation_going_on_after_its_trajectory_was_evicted_is_a_conflict(eviction: str) -> None:
    """Before, its next turn started a new trajectory, read back 200 with the model's earlier output inside its
    prompt, masked out and without logprobs."""
    store = TrajectoryStore(max_tokens=2 * (ENTRY_TOKENS + TURN_TOKENS) + 10, max_update_lag=1)
    store.record("conv", turn([1, 2], [3, 4]), fleet_update=0)
    if eviction == "budget":
        store.record("a", turn([5], [6]), fleet_update=0)
        store.record("b", turn([7], [8]), fleet_update=0)
        why = "over the token budget"
    else:
        store.evict_stale(fleet_update=2)
        why = "as stale"
    with pytest.raises(NotFound, match=f"evicted {why}"):
        store.get("conv")
    store.record("conv", turn([1, 2, 3, 4, 9], [5]), fleet_update=2)
    with pytest.raises(Conflict, match=f"arrived after the trajectory was evicted {why}.*; its earlier turns are lost"):
        store.get("conv")
    store.delete("conv")  # the client is done with it: the id may start a new conversation
    store.record("conv", turn([1, 2], [3]), fleet_update=2)
    assert store.get("conv").describe()["response_ids"] == [3]


def test_the_evicted_ids_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trajectory_store, "MAX_EVICTED_IDS", 100)
    store = TrajectoryStore(max_tokens=1, max_update_lag=1)
    for i in range(1000):
        store.record(f"t{i}", turn([1], [2]), fleet_update=0)
    assert store.evictions == 999 and len(store._evicted) == 100
    store.record("t0", turn([1], [2]), fleet_update=0)  # forgotten long ago: a new trajectory
    assert store.get("t0").describe()["response_ids"] == [2]
    store.record("t998", turn([1, 2, 5], [2]), fleet_update=0)
    with pytest.raises(Conflict, match="after the trajectory was evicted"):
        store.get("t998")


def test_a_turn_aborted_before_its_first_token_adds_no_version() -> None:
    """Under abort_resume a weight update aborts a turn still waiting for its first token, and the engine reports
    the version it waited on; the resumed turn runs on the new one. Before, the old version was listed, and the
    staleness rule dropped a sample that no old weights had sampled."""
    store = TrajectoryStore(max_tokens=1000, max_update_lag=1)
    store.record("t", turn([1, 2], [3, 4], version="4"), fleet_update=0)
    store.record("t", Turn("r", (1, 2, 3, 4, 9), (), (), "3", "e", ("3",)), fleet_update=0)
    store.record("t", turn([1, 2, 3, 4, 9], [5], version="4"), fleet_update=1)
    got = store.get("t").describe()
    assert got["weight_versions"] == ["4"] and got["response_ids"] == [3, 4, 9, 5] and got["num_turns"] == 3


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_an_answer_aborted_before_prefill_is_a_turn_with_no_output(route: str) -> None:
    """SGLang answers a request still in its queue when an abort comes (a weight update's abort_all_requests) with no
    output ids or logprobs at all. Read as an answer missing its tokens, it lost the trajectory, and every episode
    whose turn was queued at an update under abort_resume with it."""
    request = {"input_ids": [1, 2], "rid": "r", "return_logprob": True}
    abort = {"type": "abort", "message": "Abort before prefill"}
    if route == "/generate":
        answer: dict[str, object] = {
            "text": "",
            "meta_info": {"id": "r", "finish_reason": abort, "weight_version": "3"},
        }
    else:
        choice = {"index": 0, "text": "", "finish_reason": "abort", "prompt_token_ids": [1, 2], "logprobs": None}
        answer = {"id": "r", "choices": [choice], "metadata": {"weight_version": "3"}}
    turn = turn_from_answer(route, request, json.dumps(answer).encode(), "e", None)
    assert (turn.prompt_ids, turn.output_ids, turn.output_logprobs, turn.weight_version) == ((1, 2), (), (), "3")
    stopped = {"text": "", "meta_info": {"id": "r", "finish_reason": {"type": "stop"}}}
    with pytest.raises(ValueError, match="no output_ids"):  # only an abort may come without its tokens
        turn_from_answer("/generate", request, json.dumps(stopped).encode(), "e", None)


def test_trajectories_without_tokens_are_charged_for_their_records() -> None:
    """Before, a trajectory whose first answer was lost held 0 tokens and a diverged one took turn records
    without tokens, so neither counted against the budget: 10,000 of them stayed under a 100-token budget."""
    store = TrajectoryStore(max_tokens=100 * ENTRY_TOKENS, max_update_lag=1)
    for i in range(10_000):
        store.record_lost(f"lost-{i}", f"r{i}", "http://e", "answer unreadable", fleet_update=0)
    assert len(store) == 100 and store.tokens == 100 * ENTRY_TOKENS
    store.record("t", turn([1, 2], [3]), fleet_update=0)
    for _ in range(1000):  # every later prompt rewrites history: diverged, each turn is dropped
        store.record("t", turn([9, 9, 9, 9], [3]), fleet_update=0)
    with pytest.raises(Conflict, match="turn 2 "):
        store.get("t")
    # "t" took the room of two lost ones; diverged, it is charged for its entry alone, whatever turns followed.
    assert len(store) == 99 and store.tokens == 99 * ENTRY_TOKENS


def test_an_answer_lists_the_versions_that_sampled_it() -> None:
    """SGLang (and rlfleet's CPU engine) report meta_info.weight_versions as spans of tokens; SGLang before them,
    only weight_version."""
    request = {"input_ids": [1, 2], "rid": "r"}
    meta = {"weight_version": "2", "output_token_logprobs": [[-0.5, 3, None], [-1.0, 4, None]]}
    spans = [{"version": "1", "start": 0, "end": 1}, {"version": 2, "start": 1, "end": 2}]
    both = json.dumps({"output_ids": [3, 4], "meta_info": {**meta, "weight_versions": spans}}).encode()
    one = json.dumps({"output_ids": [3, 4], "meta_info": meta}).encode()
    assert turn_from_answer("/generate", request, both, "e", None).weight_versions == ("1", "2")
    assert turn_from_answer("/generate", request, one, "e", None).weight_versions == ()


def test_an_openai_chat_turn_is_read_as_sglang_answers_it() -> None:
    """SGLang's chat choice names its output ids `response_token_ids` (a completion choice `token_ids`), and its
    metadata carries the weight_versions spans: read as `token_ids`, every chat turn was lost on SGLang."""
    request = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True, "logprobs": True}
    content = [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}, {"token": "b", "logprob": -1.0}]
    choice = {"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": {"content": content},
              "finish_reason": "stop", "prompt_token_ids": [1, 2], "response_token_ids": [3, 4]}  # fmt: skip
    spans = [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 2}]
    answer = {"id": "r", "choices": [choice], "metadata": {"weight_version": "2", "weight_versions": spans}}
    turn = turn_from_answer("/v1/chat/completions", request, json.dumps(answer).encode(), "e", None)
    assert (turn.prompt_ids, turn.output_ids, turn.output_logprobs) == ((1, 2), (3, 4), (-0.5, -1.0))
    assert (turn.weight_version, turn.weight_versions, turn.rid) == ("2", ("1", "2"), "r")


def test_a_chat_turn_is_read_from_token_ids_where_an_sglang_release_names_them_so() -> None:
    """Later SGLang releases name a chat choice's output ids `token_ids`, as a completion's: read only as
    `response_token_ids`, every chat turn through such an engine was lost."""
    request = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True, "logprobs": True}
    content = [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}, {"token": "b", "logprob": -1.0}]
    choice = {"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": {"content": content},
              "finish_reason": "stop", "prompt_token_ids": [1, 2], "token_ids": [3, 4]}  # fmt: skip
    answer = json.dumps({"id": "r", "choices": [choice], "metadata": {"weight_version": "2"}}).encode()
    turn = turn_from_answer("/v1/chat/completions", request, answer, "e", None)
    assert (turn.prompt_ids, turn.output_ids, turn.output_logprobs) == ((1, 2), (3, 4), (-0.5, -1.0))


def test_logprobs_come_back_exactly_as_the_engine_sent_them() -> None:
    """Kept as doubles: an engine's logprob need not be a float32 value (-0.1 is not one)."""
    store = TrajectoryStore(max_tokens=1000, max_update_lag=1)
    store.record("t", Turn("r", (1,), (2, 3), (-0.1, -1e-300), "1", "e"), fleet_update=0)
    assert store.get("t").describe()["response_logprobs"] == [-0.1, -1e-300]


def test_one_sampling_params_in_a_list_is_checked_as_one_object() -> None:
    """SGLang takes sampling_params as a list, one per prompt: n = 2 in one reached the engine, whose two samples
    then lost the turn with a TypeError."""
    body = {"input_ids": [1, 2], "return_logprob": True}
    check_trajectory_request("/generate", {**body, "sampling_params": [{"n": 1, "max_new_tokens": 4}]})
    many: list[list[dict[str, int]]] = [[{"n": 2}], [{}, {}]]
    for params in many:
        with pytest.raises(InvalidInput, match="n: must be 1"):
            check_trajectory_request("/generate", {**body, "sampling_params": params})


def test_a_trajectory_id_is_read_as_the_utf8_its_client_sent() -> None:
    """Read as latin-1 (as HTTP hands header values over), "é" was stored as "Ã©", which no GET /trajectories/<id>
    (a URL, UTF-8) could name: the trajectory was unreadable until evicted."""
    assert trajectory_id(header_dict([(b"x-rlfleet-trajectory-id", "épisode-1".encode())])) == "épisode-1"
    with pytest.raises(InvalidInput, match="must be UTF-8 text"):
        trajectory_id(header_dict([(b"x-rlfleet-trajectory-id", b"\xe9pisode")]))


def test_token_ids_outside_32_bits_are_refused() -> None:
    """The store keeps ids in 32 bits: a request's prompt outside them is a 400, an answer's makes its turn lost."""
    with pytest.raises(InvalidInput, match="input_ids"):
        check_trajectory_request("/generate", {"input_ids": [1, 2**31], "return_logprob": True})
    answer = json.dumps({"output_ids": [-1], "meta_info": {"output_token_logprobs": [[-0.5, -1, None]]}}).encode()
    with pytest.raises(ValueError, match="output_ids"):
        turn_from_answer("/generate", {"input_ids": [1]}, answer, "e", None)


@pytest.mark.parametrize(
    ("route", "answer"),
    [
        ("/v1/completions", {"choices": [["not", "an", "object"]]}),
        ("/generate", {"output_ids": [1], "meta_info": ["not", "an", "object"]}),
        ("/generate", {"output_ids": [1]}),
        ("/v1/chat/completions", {"choices": []}),
    ],
)
def test_an_answer_of_another_shape_makes_its_turn_lost_not_an_error(route: str, answer: object) -> None:
    """A malformed engine answer is the turn's loss (ValueError), never an exception the relay does not expect."""
    with pytest.raises(ValueError, match=f"not a {route} answer"):
        turn_from_answer(route, {"input_ids": [1]}, json.dumps(answer).encode(), "e", None)


def test_the_store_keeps_a_token_in_a_few_bytes() -> None:
    """Before, ids, logprobs and mask were lists of Python objects, about 61 bytes a token: the default
    budget of 2**24 tokens alone filled the router's 1 GiB pod. Turns are parsed from JSON, as the router
    reads them, so every id is an object of its own until the store packs it."""
    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = TrajectoryStore(max_tokens=2**24, max_update_lag=1)
        for c in range(20):
            prompt = [rng.randrange(151_000) for _ in range(1000)]
            for k in range(4):  # a 1000-token prompt, 4 turns of 500 tokens, 200 tool tokens between them
                out = [rng.randrange(151_000) for _ in range(500)]
                meta = {"output_token_logprobs": [[-rng.random(), t, None] for t in out]}
                answer = json.dumps({"output_ids": out, "meta_info": meta}).encode()
                request = {"input_ids": prompt, "rid": f"c{c}/{k}"}
                store.record(f"c{c}", turn_from_answer("/generate", request, answer, "e", "1"), fleet_update=0)
                prompt = prompt + out + [rng.randrange(151_000) for _ in range(200)]
        del prompt, out, meta, answer, request
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.tokens == 20 * (3600 + ENTRY_TOKENS + 4 * TURN_TOKENS)
    assert held / store.tokens < 16, f"{held / store.tokens:.1f} bytes a token"
