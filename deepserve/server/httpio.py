"""HTTP plumbing: bounded body reads, header limits, disconnect detection, server-sent events."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from deepserve.server.errors import APIError, bad_request, error_body

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"
MAX_HEADERS = 100


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def incoming_request_id(request: Request) -> str | None:
    """The caller's X-Request-ID (a router's, a gateway's, a client's) when it is a plain token of at most 128
    characters, for the audit log to join the tiers' records on; anything else is ignored (it is the
    caller's label, not ours to refuse a request over)."""
    value = request.headers.get("x-request-id")
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header", param="content-length")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies carry no length: count as they arrive
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size}+ bytes exceeds the server's limit of {limit} bytes "
                    "(--max-body-bytes)", code="request_too_large")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away; call only after the body was read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


class HeaderLimitMiddleware:
    """431 for requests whose headers exceed a byte or count budget, before any route runs."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(k) + len(v) + 4 for k, v in headers)
            if size > self.max_bytes or len(headers) > MAX_HEADERS:
                msg = (f"request headers too large ({size} bytes, {len(headers)} headers; the limit is "
                       f"{self.max_bytes} bytes and {MAX_HEADERS} headers)")
                await JSONResponse(error_body(431, msg), status_code=431)(scope, receive, send)
                return
        await self.app(scope, receive, send)
