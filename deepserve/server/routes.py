"""Every HTTP route. Each path must appear in auth.ROUTE_ROLES or auth.PUBLIC_ROUTES; the app-wide
`require_key` dependency denies anything else (tests assert the two sets agree)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deepserve.server import protocol as p
from deepserve.server.auth import authorize
from deepserve.server.errors import APIError, bad_request
from deepserve.server.httpio import read_body
from deepserve.server.metrics import CONTENT_TYPE
from deepserve.server.serving import chat_prompt, client_addr, run_request
from deepserve.server.state import ServerState
from deepserve.server.tools import template_kwargs_of

T = TypeVar("T")
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def require_key(request: Request) -> None:
    """Authorize by the route Starlette matched — never by a URL rebuilt from headers."""
    st = _state(request)
    route = request.scope.get("route")
    auth_headers = [v.decode("latin-1") for k, v in request.scope["headers"] if k == b"authorization"]
    try:
        request.state.api_key = authorize(st.keys, getattr(route, "path", None), auth_headers)
    except APIError as e:
        if st.audit is not None:
            st.audit.write(key=getattr(e, "key_name", None), outcome=f"denied_{e.status}", endpoint=request.url.path,
                           client=client_addr(request), status=e.status, error=e.message)
        raise


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    st = _state(request)
    if st.dead_reason is not None:
        return JSONResponse({"status": "dead", "reason": st.dead_reason}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    ok, reason = _state(request).readiness()
    return JSONResponse({"status": reason}, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    st = _state(request)
    created = int(time.time())
    data = [_model_card(st, name, created) for name in st.allowed_models(request.state.api_key)]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> JSONResponse:
    """One model's card (the OpenAI client's models.retrieve); a model the key may not use is not there to it,
    as in the list."""
    st = _state(request)
    key = request.state.api_key
    if model not in st.allowed_models(key):
        raise APIError(404, f"The model `{model}` does not exist. Served: {st.allowed_models(key)}",
                       param="model", code="model_not_found")
    return JSONResponse(_model_card(st, model, int(time.time())))


def _model_card(st: ServerState, name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "deepserve",
            "root": st.engine.config.model.model, "max_model_len": st.engine.max_model_len}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await run_request(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await run_request(request, chat=True)


async def _parse(request: Request, model: type) -> tuple[ServerState, object]:
    st = _state(request)
    st.check_accepting()
    raw = await read_body(request, st.settings.max_body_bytes)  # outside the gate: a slow sender holds nothing
    req = await _utility_work(st, p.parse_body, raw, model, st.settings.limits)
    st.resolve_model(req.model, request.state.api_key)
    return st, req


async def _utility_work(st: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """A /tokenize or /detokenize step on the prepare threads, one such step at a time, so large ones cannot
    hold up the completions' parsing and templating."""
    async with st.utility_gate:
        return await st.off_loop(fn, *args)


@contextlib.asynccontextmanager
async def _metered(request: Request) -> AsyncIterator[None]:
    """/tokenize and /detokenize under the key's limits: each is a request to its requests_per_minute and
    max_concurrent (no tokens reserved: nothing is generated), and to --ip-requests-per-minute."""
    st, key = _state(request), request.state.api_key
    st.limiter.check_ip(client_addr(request), st.settings.ip_requests_per_minute)
    admission = st.limiter.admit(key, 0)
    try:
        yield
    finally:
        st.limiter.settle(admission, 0)


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    async with _metered(request):
        return await _tokenize(request)


async def _tokenize(request: Request) -> JSONResponse:
    st, req = await _parse(request, p.TokenizeRequest)
    if req.messages is not None:  # the prompt a chat request with these messages and kwargs would get
        kwargs = {**template_kwargs_of(st.settings, req.chat_template_kwargs), **p.template_flags(req)}
        _, ids = await _utility_work(st, chat_prompt, st, p.ChatCompletionRequest(messages=req.messages), kwargs,
                                     bool(req.add_special_tokens))
    else:
        special = req.add_special_tokens is not False
        ids = await _utility_work(st, lambda: list(st.engine.tokenizer.encode(req.prompt, add_special_tokens=special)))
    return JSONResponse({"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    async with _metered(request):
        return await _detokenize(request)


async def _detokenize(request: Request) -> JSONResponse:
    st, req = await _parse(request, p.DetokenizeRequest)
    vocab = st.engine.config.model.hf_config.vocab_size
    if bad := [t for t in req.tokens if t >= vocab]:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": await _utility_work(st, st.engine.tokenizer.decode, req.tokens)})


@router.get("/admin/usage")
async def usage(request: Request) -> JSONResponse:
    st = _state(request)
    keys = {name: {**u, "in_flight": st.limiter.concurrent(name)} for name, u in st.usage.items()}
    return JSONResponse({"keys": keys, "in_flight": st.in_flight, "engine": st.engine.stats})


@router.post("/admin/keys/reload")
async def reload_keys(request: Request) -> JSONResponse:
    return answer_key_reload(_state(request), request)


def answer_key_reload(st: Any, request: Request) -> JSONResponse:
    """POST /admin/keys/reload on the server and the router (`st`: either's state, with `keys` and `audit`):
    200 with the key count, or 422 naming what is wrong with the file (the previous keys stay); audited."""
    problem = st.keys.reload()
    if st.audit is not None:
        st.audit.admin(request.state.api_key.name, request.url.path, client_addr(request),
                       200 if problem is None else 422, error=problem)
    if problem is not None:  # the admin's file is at fault, not the server: a 4xx that says what is wrong
        raise APIError(422, f"key file not reloaded, the previous keys stay in force: {problem}")
    return JSONResponse({"status": "ok", "keys": len(st.keys.names())})


@router.get("/admin/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    from deepserve.server.openapi import openapi_document

    return JSONResponse(openapi_document(request.app))
