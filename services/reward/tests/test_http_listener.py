from __future__ import annotations

import asyncio
import socket

from rlfleet_reward.http_listener import tcp_listener


def test_accepted_connections_have_nagle_off() -> None:
    # With Nagle on, each keep-alive response waits ~40 ms for the client's delayed ACK.
    async def main() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = tcp_listener("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=listener)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
