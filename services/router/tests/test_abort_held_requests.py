"""A client's /abort_request reaches the generation requests the router holds, not only those at the engines.

A request the router has not sent yet (held back by the prefill stagger, or waiting to be retried after an engine
failed) is at no engine when the abort is fanned out: sent afterwards, it generated in full. It now finishes at
once, answered as SGLang answers a request aborted before its prefill, in the shape of its route. A batch named in
part goes on, and its engine aborts the prompts named; a request written just before the abort, which the fan-out
may reach its engine ahead of, is aborted there again once the engine knows it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from router_fakes import FakeEngine, RunningRouter, metric_value

from rlfleet.processes import free_port
from rlfleet_router.engine_client import EngineClient, Interrupt
from rlfleet_router.held_requests import HeldRequests, RequestAborted

ABORT = {"type": "abort", "message": "Abort before prefill"}


class Sent:
    """A request posted in a thread; `answer()` waits for its answer (bounded) and says how long it took."""

    def __init__(self, router: RunningRouter, route: str, body: dict[str, object]) -> None:
        self.answers: list[httpx.Response] = []
        self.took = 0.0

        def post() -> None:
            started = time.monotonic()
            self.answers.append(router.client.post(route, json=body, timeout=20.0))
            self.took = time.monotonic() - started

        self._thread = threading.Thread(target=post, daemon=True)
        self._thread.start()

    def answer(self, timeout: float = 20.0) -> httpx.Response:
        self._thread.join(timeout)
        assert self.answers, f"no answer within {timeout}s"
        return self.answers[0]


def sent_rids(engine: FakeEngine) -> list[object]:
    return [json.loads(raw).get("rid") for raw in engine.raw_bodies]


def hold_in_stagger(
    router: RunningRouter, engine: FakeEngine, route: str, body: dict[str, object]
) -> tuple[Sent, Sent]:
    """Sends a first request of a prompt (at the engine for 3 s), then `body`, a repeat the stagger holds back."""
    first = Sent(router, route, {**body, "rid": "first/", "delay": 3, "stream": False})
    router.wait_for(lambda: engine.in_flight == 1, what="the first request at the engine")
    held = Sent(router, route, body)
    router.wait_for(lambda: router.workers()[0]["in_flight"] == 2, what="the repeat held back by the stagger")
    return first, held


@pytest.fixture
def staggering(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> tuple[RunningRouter, FakeEngine]:
    engine = start_engine("a", serves_openai=True)
    router = start_router([engine.url], policy="cache_aware", prefill_stagger_ms=1000)
    router.wait_healthy(1)
    return router, engine


def test_an_abort_by_rid_reaches_a_request_held_by_the_prefill_stagger(
    staggering: tuple[RunningRouter, FakeEngine],
) -> None:
    router, engine = staggering
    first, held = hold_in_stagger(router, engine, "/generate", {"text": "solve: " + "x" * 200, "rid": "held/"})
    aborted = router.client.post("/abort_request", json={"rid": "held/"})
    assert aborted.status_code == 200, aborted.text
    answer = held.answer()
    assert answer.status_code == 200, answer.text
    assert held.took < 0.6, f"answered at the abort, not after the stagger: {held.took:.3f}s"
    assert answer.json() == {
        "text": "",
        "output_ids": [],
        "meta_info": {"id": "held/", "finish_reason": ABORT, "prompt_tokens": 0, "completion_tokens": 0,
                      "cached_tokens": 0},
    }  # fmt: skip
    assert answer.headers["content-type"] == "application/json"
    time.sleep(1.0)  # past the moment the stagger would have sent it
    assert sent_rids(engine) == ["first/"], "the aborted request never reached the engine"
    assert metric_value(router.client.get("/metrics").text, "rlfleet_router_aborted_unsent_total") == 1
    assert first.answer().status_code == 200
    assert router.workers()[0]["in_flight"] == 0


def test_an_abort_of_another_rid_leaves_a_held_request_alone(staggering: tuple[RunningRouter, FakeEngine]) -> None:
    router, engine = staggering
    first, held = hold_in_stagger(router, engine, "/generate", {"text": "solve: " + "y" * 200, "rid": "kept/"})
    assert router.client.post("/abort_request", json={"rid": "kep"}).status_code == 200, "a prefix names no request"
    answer = held.answer()
    assert answer.status_code == 200 and answer.json()["text"] == "answer from a", answer.text
    assert sent_rids(engine) == ["first/", "kept/"]
    first.answer()


def test_abort_all_reaches_a_stream_held_by_the_prefill_stagger(staggering: tuple[RunningRouter, FakeEngine]) -> None:
    router, engine = staggering
    first, held = hold_in_stagger(
        router, engine, "/generate", {"text": "solve: " + "s" * 200, "rid": "stream/", "stream": True}
    )
    assert router.client.post("/abort_request", json={"abort_all": True}).status_code == 200
    answer = held.answer()
    assert answer.status_code == 200 and held.took < 0.6, (answer.text, held.took)
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = [e for e in answer.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    [output] = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert output["meta_info"]["finish_reason"] == ABORT and output["meta_info"]["id"] == "stream/"
    assert output["text"] == "" and output["output_ids"] == []
    first.answer()
    assert sent_rids(engine) == ["first/"]


def test_an_abort_reaches_a_request_waiting_to_be_retried(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    engine = start_engine("a", generate_status=503)
    router = start_router([engine.url], retry_max_retries=3, retry_initial_backoff_ms=2000)
    router.wait_healthy(1)
    held = Sent(router, "/generate", {"input_ids": [1, 2, 3], "rid": "retry/"})
    router.wait_for(lambda: len(engine.raw_bodies) == 1, what="the first attempt failed")
    time.sleep(0.1)  # into the wait before the retry
    engine.generate_status = 200  # the retry would succeed
    assert router.client.post("/abort_request", json={"rid": "retry/"}).status_code == 200
    answer = held.answer()
    assert answer.status_code == 200 and held.took < 1.5, (answer.text, held.took)
    assert answer.json()["meta_info"]["finish_reason"] == ABORT
    time.sleep(2.0)
    assert len(engine.raw_bodies) == 1, "not retried once aborted"


def test_abort_all_reaches_a_batch_and_answers_each_of_its_outputs(
    staggering: tuple[RunningRouter, FakeEngine],
) -> None:
    router, engine = staggering
    body = {"input_ids": [list(range(200)), list(range(1, 201))], "rid": ["b/0/", "b/1/"]}
    first, held = hold_in_stagger(router, engine, "/generate", body)
    assert router.client.post("/abort_request", json={"rid": "b/0/"}).status_code == 200
    time.sleep(0.2)
    assert held.answers == [], "one of the batch's rids named: it goes on (the router cannot split it)"
    assert router.client.post("/abort_request", json={"rid": "b/1/"}).status_code == 200
    answer = held.answer()
    assert answer.status_code == 200, answer.text
    outputs = answer.json()
    assert [o["meta_info"]["id"] for o in outputs] == ["b/0/", "b/1/"]
    assert all(o["meta_info"]["finish_reason"] == ABORT and o["output_ids"] == [] for o in outputs)
    first.answer()
    assert sent_rids(engine) == ["first/"]


def test_an_abort_naming_part_of_a_held_batch_aborts_those_prompts_at_its_engine(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """SGLang runs a batch's prompts under their own rids: an abort of one ends that prompt (finish_reason abort)
    and the others go on. The router cannot split a batch it holds, so it sends it, and has its engine abort the
    prompts named once the engine knows their rids (the fan-out found the batch at no engine)."""
    engine = start_engine("a", drops_unknown_aborts=True)
    router = start_router([engine.url], policy="cache_aware", prefill_stagger_ms=1000)
    router.wait_healthy(1)
    body = {"input_ids": [list(range(200)), list(range(1, 201))], "rid": ["part/0/", "part/1/"], "delay": 1.0}
    first, held = hold_in_stagger(router, engine, "/generate", body)
    assert router.client.post("/abort_request", json={"rid": "part/0/"}).status_code == 200
    assert engine.events == ["generate"], "the fan-out found no request part/0/ at the engine"
    answer = held.answer()
    assert answer.status_code == 200 and answer.json()["text"] == "answer from a", answer.text
    assert sent_rids(engine) == ["first/", ["part/0/", "part/1/"]], "the batch went on"
    assert engine.aborted() == ["part/0/", "part/0/"], "asked again once the batch was at the engine"
    assert engine.events == ["generate", "generate", "abort"], "the prompt named was aborted there"
    first.answer()


def test_an_abort_that_reaches_the_engine_before_the_request_it_names_is_sent_there_again(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """The request was written to its engine just before the abort came: the fan-out reached the engine before the
    engine knew the rid, and SGLang drops such an abort. The router asks again ABORT_RACE_SECS after the write."""
    engine = start_engine("a", hang=True, drops_unknown_aborts=True, rid_delay=0.4)
    router = start_router([engine.url])
    router.wait_healthy(1)
    request = Sent(router, "/generate", {"input_ids": [1, 2, 3], "rid": "race/"})
    router.wait_for(lambda: len(engine.raw_bodies) == 1, what="the request written to the engine")
    assert router.client.post("/abort_request", json={"rid": "race/"}).status_code == 200
    assert "abort" not in engine.events, "the engine did not know the rid yet: the fan-out's abort was dropped"
    answer = request.answer(timeout=5.0)  # the engine hangs for 30 s unless the abort reaches it
    assert answer.status_code == 200 and request.took < 2.0, (answer.text, request.took)
    assert engine.aborted() == ["race/", "race/"] and engine.events == ["generate", "abort"]
    assert router.workers()[0]["in_flight"] == 0
    assert metric_value(router.client.get("/metrics").text, "rlfleet_router_client_aborts_resent_total") == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_an_openai_request_held_is_answered_as_aborted_in_its_routes_shape(
    staggering: tuple[RunningRouter, FakeEngine], route: str, stream: bool
) -> None:
    router, engine = staggering
    chat = route == "/v1/chat/completions"
    prompt = {"messages": [{"role": "user", "content": "q" * 200}]} if chat else {"prompt": "p" * 200}
    body: dict[str, object] = {**prompt, "model": "m", "rid": "oa/", "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    first, held = hold_in_stagger(router, engine, route, body)
    assert router.client.post("/abort_request", json={"rid": "oa/"}).status_code == 200
    answer = held.answer()
    assert answer.status_code == 200 and held.took < 0.6, (answer.text, held.took)
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and stream else "")
    if not stream:
        whole = answer.json()
        assert (whole["id"], whole["object"], whole["model"]) == ("oa/", kind, "m")
        [choice] = whole["choices"]
        assert (choice["index"], choice["finish_reason"], choice["matched_stop"], choice["logprobs"]) == (
            0,
            "abort",
            None,
            None,
        )
        assert choice["message"]["content"] == "" if chat else choice["text"] == ""
        assert whole["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    else:
        events = [e.removeprefix("data: ") for e in answer.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["id"] == "oa/" and c["object"] == kind and c["model"] == "m" for c in chunks)
        finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert [f["finish_reason"] for f in finals] == ["abort"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 0
        if chat:
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    first.answer()
    assert sent_rids(engine) == ["first/"]


def test_a_pause_does_not_abort_a_held_request(staggering: tuple[RunningRouter, FakeEngine]) -> None:
    """The system's own aborts (a pause, a weight load's abort_all_requests) reach the engines only, as before."""
    router, engine = staggering
    first, held = hold_in_stagger(router, engine, "/generate", {"text": "solve: " + "w" * 200, "rid": "paused/"})
    assert router.client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    assert router.client.post("/continue_generation", json={}).status_code == 200
    answer = held.answer()
    assert answer.status_code == 200 and answer.json()["text"] == "answer from a", answer.text
    assert sent_rids(engine) == ["first/", "paused/"]
    first.answer()


def test_an_abort_reaches_a_retry_waiting_for_the_abort_of_its_first_attempt(
    start_engine: Callable[..., FakeEngine], start_router: Callable[..., RunningRouter]
) -> None:
    """One engine: the retry goes back to it under the same rid, once the abort of its first attempt (2 s here) has
    been answered; a client's abort ends that wait too."""
    engine = start_engine("a", control_delay=2.0)
    router = start_router([engine.url], retry_max_retries=1, retry_initial_backoff_ms=0)
    router.wait_healthy(1)
    held = Sent(router, "/generate", {"text": "x", "rid": "settling/", "dies_once": True})
    router.wait_for(lambda: engine.aborted() == ["settling/"], what="the first attempt's abort under way")
    aborting = Sent(router, "/abort_request", {"rid": "settling/"})  # answered once the engine's 2 s are over
    started = time.monotonic()
    answer = held.answer()
    assert time.monotonic() - started < 1.0, "answered at the client's abort, not once the first abort was done"
    assert answer.status_code == 200 and answer.json()["meta_info"]["finish_reason"] == ABORT, answer.text
    assert aborting.answer().status_code == 200
    assert engine.events.count("generate") == 1, "not sent again"


def test_a_request_aborted_while_it_connects_is_never_written_and_one_written_is_left_to_its_engine() -> None:
    """What an abort marks stops the request's sending only: a request written to its engine is the engine's to
    abort (the fan-out asks it), and its answer still comes back."""

    async def scenario() -> None:
        received: list[bytes] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                received.append(await reader.readuntil(b"\r\n\r\n"))
            except asyncio.IncompleteReadError:  # a connection opened for a request that was never written
                writer.close()
                return
            await asyncio.sleep(0.2)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()

        port = free_port()
        server = await asyncio.start_server(serve, "127.0.0.1", port)
        client = EngineClient()
        held = HeldRequests()
        try:
            unsent, written = held.hold(("unsent/",)), held.hold(("written/",))
            stopped = Interrupt()
            unsent.attach(stopped)
            connecting = asyncio.create_task(
                client.request("POST", f"http://127.0.0.1:{port}", "/generate", b"{}", {}, 5, 5, stopped)
            )
            await asyncio.sleep(0)  # the request is opening its connection
            assert held.abort("unsent/") == 1  # before the connection is open: the request is not written on it
            with pytest.raises(RequestAborted):
                await connecting
            interrupt = Interrupt()
            written.attach(interrupt)
            sending = asyncio.create_task(
                client.request("POST", f"http://127.0.0.1:{port}", "/generate", b"{}", {}, 5, 5, interrupt)
            )
            while interrupt.connection is None:
                await asyncio.sleep(0.005)
            assert held.abort(None) == 1, "abort_all marks every request held"
            got = await sending
            assert got.status == 200 and await got.read() == b"{}"
            got.release()
            assert len(received) == 1, "only the written request reached the engine"
            held.release(unsent)
            held.release(written)
            assert len(held) == 0
        finally:
            await client.close()
            server.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_abort_whose_body_is_not_json_is_refused_and_aborts_nothing(
    staggering: tuple[RunningRouter, FakeEngine],
) -> None:
    router, engine = staggering
    first, held = hold_in_stagger(router, engine, "/generate", {"text": "solve: " + "j" * 200, "rid": "json/"})
    answer = router.client.post("/abort_request", content=b"{not json", headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert held.answer().json()["text"] == "answer from a", "nothing was aborted"
    first.answer()
