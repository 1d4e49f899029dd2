"""Read timeouts: a request's headers and body must arrive within --request-read-timeout seconds.

Without them a client holds a connection as long as it likes: headers that never end (slowloris), a
Content-Length larger than the body it sends, a chunked body with no last chunk. Two pieces:

- Headers: uvicorn's HTTP protocol class, subclassed through the asyncio Protocol methods only
  (connection_made / data_received / connection_lost) plus `on_response_complete`, which both of
  uvicorn's implementations (h11, httptools) call when a response ends. A timer runs from the
  connection's start, and again from each response's end (the next request on a kept-alive
  connection), until a blank line ends the headers; when it fires the connection is closed.
- Body: an ASGI middleware gives each request a deadline (from its arrival, which follows its
  headers) that every `receive()` of its body must meet; past it the route gets RequestReadTimeout,
  answered 408. After the last body chunk receive() only waits for a disconnect: no deadline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)
HEADERS_END = b"\r\n\r\n"


class RequestReadTimeout(Exception):
    """The request body did not arrive in time."""


def header_timeout_protocol(base: type, timeout: float, max_header_bytes: int | None = None) -> type:
    """uvicorn's protocol class `base`, closing connections whose request headers take over `timeout` s
    or, with max_header_bytes, run past that many bytes before they end: httptools has no cap of its own
    and parses pipelined requests as they arrive (a client could fill memory with one endless header
    block sent behind a running request); h11 has one (h11_max_incomplete_event_size) and reads no
    pipelined request before the running one's response. Answered 431 and closed, or only closed when a
    response is under way on the connection.

    State: `_awaiting` is true while a request's headers are due: from the connection's start, from each
    response's end when no pipelined request runs, and (httptools) from the parser's start of a message to
    its end of headers. While awaiting, bytes are counted up to the blank line that ends the headers."""

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._awaiting:
                seen = self._header_tail + data
                if HEADERS_END in seen:  # this request's headers are complete
                    self._headers_done()
                else:
                    self._header_bytes += len(data)
                    if max_header_bytes is not None and self._header_bytes > max_header_bytes:
                        self._headers_too_large()
                        return
                    self._header_tail = seen[-(len(HEADERS_END) - 1):]
            super().data_received(data)

        # httptools' parser callbacks: where each message's headers begin and end, pipelined ones too
        # (h11's protocol never calls these).
        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._awaiting:
                self._awaiting, self._header_bytes, self._header_tail = True, 0, b""

        def on_headers_complete(self) -> None:
            self._headers_done()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle.response_complete:  # not a pipelined request that started just now
                self._arm_header_timer()  # a kept-alive connection's next request: its headers are due

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_timer()
            self._awaiting, self._header_bytes, self._header_tail = True, 0, b""
            self._header_timer = asyncio.get_event_loop().call_later(timeout, self._headers_too_slow)

        def _headers_done(self) -> None:
            self._cancel_timer()
            self._awaiting, self._header_tail = False, b""

        def _cancel_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            logger.info("closed a connection whose request headers took over %.0f s (--request-read-timeout)",
                        timeout)
            self.transport.close()

        def _headers_too_large(self) -> None:
            self._headers_done()
            logger.info("closed a connection whose request headers ran past %d bytes (--max-header-bytes)",
                        max_header_bytes)
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle.response_complete:  # nothing else is being written: say why
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                                     b"content-length: 0\r\n\r\n")
            self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


def default_protocol_class() -> type:
    """The HTTP protocol class uvicorn would pick by itself ("auto": httptools if installed, else h11)."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    return import_from_string(HTTP_PROTOCOLS["auto"])


class BodyTimeoutMiddleware:
    def __init__(self, app: Any, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done = False

        async def receive_in_time() -> dict:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestReadTimeout() from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_in_time, send)
