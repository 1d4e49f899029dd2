"""The header-timeout protocol (deepserve/server/timeouts.py) on both of uvicorn's HTTP parsers, with a tiny
ASGI app in this process: pipelined requests keep their connection past the header timeout while one is
running; a header block that never ends is cut at its size limit, also when it is sent behind a running
request (httptools parses pipelined requests as they arrive; h11 stops reading until the response)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from deepserve.server.timeouts import header_timeout_protocol
from tests.server.serverkit import free_port

httptools_impl = pytest.importorskip("uvicorn.protocols.http.httptools_impl")
PROTOCOLS = {"h11": H11Protocol, "httptools": httptools_impl.HttpToolsProtocol}
TIMEOUT_S, MAX_HEADER_BYTES, SLOW_S = 0.5, 4096, 1.5


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=sorted(PROTOCOLS))
def port(request):
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="asyncio",
                            http=header_timeout_protocol(PROTOCOLS[request.param], TIMEOUT_S, MAX_HEADER_BYTES),
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def read_until_closed(s: socket.socket, wait_s: float) -> bytes:
    s.settimeout(wait_s)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_a_pipelined_request_keeps_its_connection_past_the_header_timeout(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        data = read_until_closed(s, SLOW_S + 2)
    assert data.count(b"HTTP/1.1 200") == 2, data


def test_an_endless_header_block_on_a_fresh_connection_gets_431(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n" + b"x-pad: " + b"a" * (4 * MAX_HEADER_BYTES) + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = read_until_closed(s, 5)
    assert data == b"" or data.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), data[:80]


def test_an_endless_header_block_behind_a_running_request_is_not_buffered(port):
    # While /slow runs, the next request's headers never end. The server must not keep taking them:
    # httptools' connection is closed at the cap, h11 stops reading; either way the client can push only
    # what the sockets' buffers hold (with no cap, hundreds of MB went through in this time).
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /fast HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(0.5)
        line = b"x-pad: " + b"a" * 1000 + b"\r\n"
        start = time.monotonic()
        try:
            while time.monotonic() - start < 1.0:
                s.sendall(line * 64)
                sent += 64 * len(line)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass
    assert sent < 32 << 20, f"{sent} header bytes taken behind a running request"
    with socket.create_connection(("127.0.0.1", port)) as s:  # and the server still answers
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_until_closed(s, 5).startswith(b"HTTP/1.1 200")
