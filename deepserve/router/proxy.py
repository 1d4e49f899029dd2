"""Forwarding one request: validate, take the key's quota, pick a backend, retry, relay.

Retry rule: a request is retried on another backend (at most --max-retries times, never on a backend
it already tried) while nothing of the response has reached the client: on a connection error, a
timeout, a 5xx, or a stream that closes before its first byte. Every such failure also takes the
backend out of rotation at once (passive health). Once the first bytes of a stream went out, a
failure can only be reported in the stream: it ends with one `data: {"error": ...}` event (what the
openai client raises as an APIError) instead of `data: [DONE]`, never silently. A backend's 4xx is
the client's problem and is passed through as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deepserve.router.balance import SESSION_HEADER, affinity_key
from deepserve.router.pool import Backend
from deepserve.router.quota import Ticket
from deepserve.router.state import RouterState
from deepserve.server import protocol as p
from deepserve.server.auth import ApiKey
from deepserve.server.errors import APIError, bad_request, error_body
from deepserve.server.httpio import incoming_request_id, read_body, sse
from deepserve.server.serving import client_addr, upstream_field

logger = logging.getLogger(__name__)
_PASS_HEADERS = ("content-type", "x-request-id", "cache-control")
# What a failed backend raises: connection refused or reset, a closed stream, a timeout.
BACKEND_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError)


class EmptyStream(aiohttp.ClientError):
    pass


@dataclass
class Upstream:
    """A backend's response that the router has committed to relay."""

    backend: Backend
    response: aiohttp.ClientResponse
    content: bytes | None = None  # the whole body (non-streamed, or any non-200)
    first: bytes | None = None  # a 200 stream's first bytes (the rest: response.content)


def parse_request(st: RouterState, raw: bytes, chat: bool) -> dict:
    """The body as a dict; with strict validation (the default) exactly the server's checks and errors."""
    if st.settings.strict_validation:
        p.parse_body(raw, p.ChatCompletionRequest if chat else p.CompletionRequest, p.RequestLimits())
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except ValueError:  # json.loads' one other failure: an integer literal past Python's digit limit
        raise bad_request(p.too_long_number_message()) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def check_model(body: dict, key: ApiKey) -> None:
    model = body.get("model")
    if isinstance(model, str) and not key.may_use(model):
        raise APIError(403, f"key '{key.name}' may not use model `{model}`", param="model", code="model_not_allowed")
    if model is None and "*" not in key.models:
        raise bad_request(f"key '{key.name}' is limited to models {list(key.models)}: name one in 'model'",
                          param="model")


def backend_headers(st: RouterState, request: Request, request_id: str) -> dict[str, str]:
    token = st.settings.backend_api_key
    h = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": request_id}
    if token:
        h["authorization"] = f"Bearer {token}"
    elif auth := request.headers.get("authorization"):
        h["authorization"] = auth  # the replicas see the client's key: their own limits are the second line
    if session := request.headers.get(SESSION_HEADER):
        h[SESSION_HEADER] = session
    # The client's address as this router saw it, for the replicas' audit and per-IP limits (read by replicas
    # whose --forwarded-allow-ips names the routers). Only that: a client's own X-Forwarded-For is replaced,
    # never passed on, so no client can choose the address a replica sees.
    h["x-forwarded-for"] = client_addr(request)
    return h


async def _attempt(st: RouterState, b: Backend, method: str, path: str, raw: bytes | None,
                   headers: dict[str, str], stream: bool) -> Upstream:
    resp = await st.client.request(method, b.url + path, data=raw, headers=headers)
    try:
        if not stream or resp.status != 200:
            content = await resp.read()
            resp.release()
            return Upstream(b, resp, content=content)
        first = await resp.content.readany()
        if not first:
            raise EmptyStream("the stream closed before its first byte")
        return Upstream(b, resp, first=first)
    except BaseException:
        resp.close()
        raise


async def open_upstream(st: RouterState, method: str, path: str, raw: bytes | None, headers: dict[str, str],
                        stream: bool, affinity: str | None) -> Upstream:
    """The first backend response worth relaying, retrying on others; raises APIError(503) if none.
    The returned backend's `outstanding` count includes this request (the caller releases it)."""
    tried: list[Backend] = []
    failures: list[str] = []
    for _ in range(1 + st.settings.max_retries):
        every = st.pool.candidates()
        candidates = [b for b in every if b not in tried]
        if not candidates:
            break
        b = st.balancer.pick(candidates, affinity, every)
        tried.append(b)
        b.outstanding += 1
        try:
            up = await _attempt(st, b, method, path, raw, headers, stream)
        except BACKEND_FAILURES as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            _failed(st, b, "connect_error", why)
            failures.append(f"{b.url}: {why}")
            continue
        except BaseException:  # cancelled (the client left, shutdown): the slot must not leak
            b.outstanding -= 1
            raise
        if up.response.status >= 500:
            up.response.close()
            _failed(st, b, f"http_{up.response.status}", f"answered {up.response.status}")
            failures.append(f"{b.url}: HTTP {up.response.status} {_error_message(up.content)}")
            continue
        return up
    if not tried:
        raise APIError(503, "every backend is drained; retry shortly",
                       code="no_backend_available", headers={"Retry-After": "1"})
    raise APIError(503, f"no backend could serve the request after {len(tried)} attempt(s): " + "; ".join(failures),
                   code="no_backend_available", headers={"Retry-After": "1"})


def _failed(st: RouterState, b: Backend, outcome: str, why: str) -> None:
    b.outstanding -= 1
    st.metrics.backend_requests.labels(b.url, outcome).inc()
    st.metrics.retries.labels(b.url).inc()
    st.pool.mark(b, False, why)


def _error_message(content: bytes | None) -> str:
    try:
        return str(json.loads(content or b"")["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return (content or b"")[:300].decode("utf-8", "replace")


def _usage_tokens(usage: Any) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def _client_headers(up: Upstream, ticket: Ticket) -> dict[str, str]:
    h = {k.lower(): v for k, v in up.response.headers.items()
         if k.lower() in _PASS_HEADERS or k.lower().startswith("x-ratelimit-")}
    h.update(ticket.headers)  # the global quota is the one the client should pace itself by
    return h


async def forward(request: Request, path: str, chat: bool) -> Response:
    st: RouterState = request.app.state.router
    key: ApiKey = request.state.api_key
    arrival, endpoint = time.perf_counter(), "chat" if chat else "completions"
    # This router's own id (unique; sent on, the replica audits it as upstream_request_id) and the client's.
    request_id = uuid.uuid4().hex
    audit = {"request_id": request_id, "endpoint": endpoint, "client": client_addr(request),
             **upstream_field(incoming_request_id(request))}
    try:
        raw = await read_body(request, st.settings.max_body_bytes)
        body = parse_request(st, raw, chat)
        check_model(body, key)
        ticket = await st.quota.admit(key)
    except APIError as e:
        st.record(key.name, f"rejected_{e.status}", status=e.status, error=e.message, **audit)
        e.headers.setdefault("x-request-id", request_id)  # the id this router's audit holds for the refusal
        raise
    stream = body.get("stream") is True
    options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    strip_usage = stream and not options.get("include_usage")
    if strip_usage:  # ask for the usage chunk (tokens/min needs it); it is removed before the client sees it
        raw = json.dumps({**body, "stream_options": {**options, "include_usage": True}}).encode()
    aff = affinity_key(body, request.headers.get(SESSION_HEADER), st.settings.affinity_prefix_chars,
                       st.settings.affinity_min_chars)
    try:
        up = await open_upstream(st, "POST", path, raw, backend_headers(st, request, request_id), stream, aff)
    except APIError as e:
        await st.quota.give_back(ticket)
        st.record(key.name, "error", status=e.status, error=e.message, **audit)
        st.metrics.latency.labels(endpoint).observe(time.perf_counter() - arrival)
        e.headers.setdefault("x-request-id", request_id)
        raise
    audit["backend"] = up.backend.url
    if up.response.headers.get("x-request-id"):  # the replica's own id, which the client gets: joins the two
        audit["backend_request_id"] = up.response.headers["x-request-id"]
    if up.first is None:
        return await _whole(st, up, ticket, key, endpoint, arrival, audit)
    relay = Relay(st, up, ticket, key, endpoint, arrival, audit, strip_usage)
    return RelayResponse(relay.events(), relay, status_code=200, headers=_client_headers(up, ticket))


async def _whole(st: RouterState, up: Upstream, ticket: Ticket, key: ApiKey, endpoint: str, arrival: float,
                 audit: dict) -> Response:
    b, status = up.backend, up.response.status
    b.outstanding -= 1
    st.metrics.backend_requests.labels(b.url, "ok" if status == 200 else f"http_{status}").inc()
    prompt = completion = 0
    if status == 200:
        try:
            prompt, completion = _usage_tokens(json.loads(up.content).get("usage"))
        except (ValueError, AttributeError):
            pass
        await st.quota.charge(ticket, prompt + completion)
    else:
        await st.quota.give_back(ticket)  # the backend refused it: the key is not charged
    st.record(key.name, "ok" if status == 200 else f"backend_{status}", prompt, completion, status=status,
              latency_s=round(time.perf_counter() - arrival, 6), **audit)
    st.metrics.latency.labels(endpoint).observe(time.perf_counter() - arrival)
    return Response(up.content, status_code=status, headers=_client_headers(up, ticket))


class Relay:
    """Relays a backend's event stream event by event; `finish()` runs once however it ends."""

    def __init__(self, st: RouterState, up: Upstream, ticket: Ticket, key: ApiKey, endpoint: str,
                 arrival: float, audit: dict, strip_usage: bool) -> None:
        self.st, self.up, self.ticket, self.key = st, up, ticket, key
        self.endpoint, self.arrival, self.audit, self.strip_usage = endpoint, arrival, audit, strip_usage
        self.usage: Any = None
        self.ended: str | None = None  # "ok" after [DONE], "backend_error" after the backend's error event
        # `ended` once the client has taken that last event: its leaving after it (the openai client
        # closes at [DONE], before the backend's response ends) is no longer a client gone.
        self.delivered: str | None = None
        self.finished = False

    def _keep(self, event: bytes) -> bool:
        """Inspect one SSE event; False to drop it (the usage chunk the client did not ask for)."""
        if event.startswith(b"data: [DONE]"):
            self.ended = "ok"
        elif event.startswith(b'data: {"error"'):
            self.ended = "backend_error"
        elif b'"usage"' in event and event.startswith(b"data: "):
            try:
                obj = json.loads(event[6:])
            except ValueError:
                return True
            if isinstance(obj, dict) and obj.get("usage"):
                self.usage = obj["usage"]
                return not (self.strip_usage and obj.get("choices") == [])
        return True

    async def events(self) -> AsyncIterator[bytes]:
        outcome, buf = "client_gone", b""  # unless the loop below ends
        try:
            try:
                chunk: bytes | None = self.up.first
                while chunk is not None:
                    buf += chunk
                    out = []
                    while (i := buf.find(b"\n\n")) >= 0:
                        event, buf = buf[:i + 2], buf[i + 2:]
                        if self._keep(event):
                            out.append(event)
                    if out:
                        yield b"".join(out)
                        self.delivered = self.ended
                    chunk = await self.up.response.content.readany() or None
            except BACKEND_FAILURES as e:
                self.st.pool.mark(self.up.backend, False, f"stream cut: {type(e).__name__}")
            outcome = self.ended or "stream_cut"
            if not self.ended:
                msg = (f"the backend serving this request stopped mid-stream ({self.up.backend.url}); "
                       "the response is incomplete, retry the request")
                yield sse(error_body(502, msg, code="backend_stream_cut"))
        finally:
            await self.finish(outcome)

    async def finish(self, outcome: str) -> None:
        if self.finished:
            return
        self.finished = True
        outcome = self.delivered or outcome
        st, b = self.st, self.up.backend
        b.outstanding -= 1
        # A stream read to its end gives the connection back; one left mid-way is closed, which the
        # backend sees as its client gone (and aborts the request).
        if self.ended:
            self.up.response.release()
        else:
            self.up.response.close()
        st.metrics.backend_requests.labels(b.url, outcome).inc()
        prompt, completion = _usage_tokens(self.usage)
        await st.quota.charge(self.ticket, prompt + completion)
        st.record(self.key.name, outcome, prompt, completion, status=200,
                  latency_s=round(time.perf_counter() - self.arrival, 6), **self.audit)
        st.metrics.latency.labels(self.endpoint).observe(time.perf_counter() - self.arrival)


class RelayResponse(StreamingResponse):
    """A client can vanish before the body iterator's first step, when its `finally` cannot run; this
    one still releases the backend slot and records the request."""

    def __init__(self, content: Any, relay: Relay, **kwargs: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.finish("client_gone")
