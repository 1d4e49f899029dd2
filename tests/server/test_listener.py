"""The server's listening socket: connections accepted from it get TCP_NODELAY from asyncio (without
it each response waited ~40 ms for the client's delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

from deepserve.server.api_server import bind_listener


def test_accepted_connections_have_tcp_nodelay():
    async def main() -> int:
        sock = bind_listener("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            s = writer.get_extra_info("socket")
            seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(main()) != 0
