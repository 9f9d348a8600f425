"""The engine client against a scripted HTTP server on loopback: reuse, streams, timeouts, broken connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from rlfleet.processes import free_port
from rlfleet_router import engine_client
from rlfleet_router.engine_client import (
    EngineClient,
    EngineConnectionError,
    EngineConnectionLost,
    EngineReadTimeout,
    Interrupt,
    request_head,
)

# Reads one request (head and content-length body) and writes back whatever the script says.
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def answer(body: bytes, status: int = 200) -> bytes:
    return (
        b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (status, len(body)) + body
    )


def run(script: Script, scenario: Callable[[EngineClient, str, list[int]], Awaitable[None]]) -> list[int]:
    """Serves `script` on a free port, runs `scenario` against it; returns the port of each connection accepted."""
    accepted: list[int] = []

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer.get_extra_info("peername")[1])
            try:
                while True:
                    await script(reader, writer, await read_request(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        port = free_port()
        server = await asyncio.start_server(serve, "127.0.0.1", port)
        client = EngineClient()
        try:
            await asyncio.wait_for(scenario(client, f"http://127.0.0.1:{port}", accepted), 10)
        finally:
            await client.close()
            server.close()

    asyncio.run(main())
    return accepted


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
    writer.write(answer(request.split(b"\r\n\r\n", 1)[1]))
    await writer.drain()


def test_request_head_carries_the_host_headers_and_length() -> None:
    head = request_head("POST", "/generate", "engine:30000", {"content-type": "application/json"}, 12)
    assert head == (
        b"POST /generate HTTP/1.1\r\nhost: engine:30000\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n"
    )


def test_answers_come_back_whole_over_one_kept_alive_connection() -> None:
    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        for n in range(3):
            got = await client.request("POST", url, "/generate", b'{"n": %d}' % n, {}, 5, 5)
            assert (got.status, got.content_length, got.content_type) == (200, 8, "application/json")
            assert await got.read() == b'{"n": %d}' % n
            got.release()

    assert len(run(echo, scenario)) == 1


def test_a_chunked_stream_is_read_piece_by_piece_as_it_is_written() -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for n in range(3):
            event = b"data: %d\n\n" % n
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        got = await client.request("POST", url, "/generate", b"{}", {}, 5, 5)
        assert got.content_length is None
        pieces = []
        while (piece := await got.read_chunk()) is not None:
            pieces.append(piece)
        assert pieces == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
        got.release()

    run(stream, scenario)


def test_an_engine_silent_past_the_read_bound_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        await asyncio.sleep(5)

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        with pytest.raises(EngineReadTimeout):
            await client.request("POST", url, "/generate", b"{}", {}, 5, 0.2)

    run(silent, scenario)


def test_an_answer_trickling_past_the_read_bound_is_a_read_timeout() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        head, body = answer(b'{"text": "' + b"x" * 100 + b'"}').split(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        for i in range(0, len(body), 4):  # a piece every 50 ms: each one well inside the bound, the whole not
            writer.write(body[i : i + 4])
            await writer.drain()
            await asyncio.sleep(0.05)

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        started = time.monotonic()
        got = await client.request("POST", url, "/generate", b"{}", {}, 5, 0.5)
        with pytest.raises(EngineReadTimeout):
            await got.read()
        got.close()
        assert time.monotonic() - started < 1.0, "the bound is on the whole answer, not on each wait"

    run(trickle, scenario)


def test_an_interrupt_ends_the_wait_with_its_error_and_drops_the_connection() -> None:
    class Gone(Exception):
        pass

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        await asyncio.sleep(5)

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        interrupt = Interrupt()
        asyncio.get_running_loop().call_later(0.1, interrupt.fire, Gone("the client left"))
        with pytest.raises(Gone):
            await client.request("POST", url, "/generate", b"{}", {}, 5, 5, interrupt)
        assert interrupt.connection is None
        with pytest.raises(Gone):  # fired before the request is sent: nothing is sent
            await client.request("POST", url, "/generate", b"{}", {}, 5, 5, interrupt)
        assert len(accepted) == 1

    run(silent, scenario)


def test_a_refused_connection_is_a_connection_error() -> None:
    async def main() -> None:
        client = EngineClient()
        with pytest.raises(EngineConnectionError, match="cannot connect"):
            await client.request("POST", f"http://127.0.0.1:{free_port()}", "/generate", b"{}", {}, 5, 5)
        await client.close()

    asyncio.run(main())


def test_engines_that_came_and_went_are_not_kept_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, every engine URL ever used kept its parsed origin, and its pool once it had one, for the router's
    lifetime: engines that come and go by pod IP grew both without bound."""
    monkeypatch.setattr(engine_client, "MAX_ORIGINS", 8)

    async def main() -> EngineClient:
        client = EngineClient()
        for _ in range(20):  # each engine gone: its connection refused
            with pytest.raises(EngineConnectionError):
                await client.request("POST", f"http://127.0.0.1:{free_port()}", "/generate", b"{}", {}, 5, 5)
        await client.close()
        return client

    assert len(asyncio.run(main())._origins) <= 8


def test_an_answer_cut_short_is_a_connection_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        writer.write(answer(b'{"text": "the whole answer"}')[:-5])
        await writer.drain()
        writer.close()
        raise ConnectionError("cut")

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        got = await client.request("POST", url, "/generate", b"{}", {}, 5, 5)
        with pytest.raises(EngineConnectionError, match="before its answer was complete"):
            await got.read()
        got.close()

    run(cut, scenario)


def test_a_pooled_connection_the_engine_closed_is_replaced_without_an_error() -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        await echo(reader, writer, request)
        raise ConnectionError("the engine ends idle connections")

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        for _ in range(2):
            got = await client.request("POST", url, "/generate", b"{}", {}, 5, 5)
            assert await got.read() == b"{}"
            got.release()
            await asyncio.sleep(0.05)
        assert not client._idle  # the engine's pool went with its last connection

    assert len(run(once, scenario)) == 2


def closing_the_second_request(wait: float, then: Script = echo) -> tuple[Script, list[int]]:
    """A script that answers the first request, closes the connection `wait` seconds after reading the second
    without answering it, and serves every later one with `then`; and the count of requests it read."""
    read = [0]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        read[0] += 1
        if read[0] == 2:
            await asyncio.sleep(wait)
            raise ConnectionError("the engine closes the connection")
        await (echo if read[0] == 1 else then)(reader, writer, request)

    return script, read


async def first_request(client: EngineClient, url: str) -> None:
    """One request answered, its connection back in the pool."""
    got = await client.request("POST", url, "/generate", b"{}", {}, 5, 5)
    assert await got.read() == b"{}"
    got.release()


def test_a_pooled_connection_closed_as_the_request_arrives_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "IDLE_CLOSE_SECS", 0.2)  # "at once", with room for a loaded machine
    script, read = closing_the_second_request(0)

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        await first_request(client, url)
        got = await client.request("POST", url, "/generate", b'{"n": 2}', {}, 5, 5)
        assert await got.read() == b'{"n": 2}'
        got.release()

    assert len(run(script, scenario)) == 2
    assert read == [3]


def test_a_pooled_connection_closed_after_the_engine_held_the_request_is_not_resent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_client, "IDLE_CLOSE_SECS", 0.2)
    script, read = closing_the_second_request(0.5)  # the engine may have worked on it all that time

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        await first_request(client, url)
        with pytest.raises(EngineConnectionLost, match="before its answer was complete"):
            await client.request("POST", url, "/generate", b"{}", {}, 5, 5)

    assert len(run(script, scenario)) == 1
    assert read == [2], "sent once: whether to send it again is the caller's decision"


def test_a_request_sent_again_has_only_the_time_its_bound_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "IDLE_CLOSE_SECS", 1.0)  # here a close 0.5 s after the request is "at once"

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
        await asyncio.sleep(5)

    script, read = closing_the_second_request(0.5, then=silent)

    async def scenario(client: EngineClient, url: str, accepted: list[int]) -> None:
        await first_request(client, url)
        started = time.monotonic()
        with pytest.raises(EngineReadTimeout):
            await client.request("POST", url, "/generate", b"{}", {}, 5, 1.0)
        assert time.monotonic() - started < 1.3, "the bound is on the request, not on each sending of it"

    run(script, scenario)
    assert read == [3]
