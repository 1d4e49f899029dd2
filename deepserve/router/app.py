"""The router's FastAPI app and runner. Routes, and the roles each one needs (deny by default, as
the server: a path missing from ROUTER_ROUTE_ROLES answers 403 to every key):

    GET  /health, /ready               public; /ready is 200 while at least one backend is in rotation
    GET  /v1/models                    admin, user: a backend's model list, filtered by the key's scope
    GET  /v1/models/{model}            admin, user: one model's card from that list (404 if not in it)
    POST /v1/completions               admin, user
    POST /v1/chat/completions          admin, user
    GET  /metrics                      admin, metrics
    GET  /admin/backends               admin: every backend's health, drain state, requests in flight
    POST /admin/backends/drain         admin: {"url": URL}: no new requests to it (in-flight ones finish)
    POST /admin/backends/undrain       admin: {"url": URL}: back into rotation
    GET  /admin/usage                  admin: per-key counts through this router
    POST /admin/keys/reload            admin: re-read --api-keys (SIGHUP does the same)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deepserve.router.pool import Backend
from deepserve.router.proxy import backend_headers, forward, open_upstream
from deepserve.router.state import RouterSettings, RouterState
from deepserve.server.api_server import _install_error_handlers, bind_listener, install_sighup
from deepserve.server.auth import authorize
from deepserve.server.errors import APIError, bad_request
from deepserve.server.httpio import HeaderLimitMiddleware
from deepserve.server.metrics import CONTENT_TYPE
from deepserve.server.routes import answer_key_reload
from deepserve.server.serving import client_addr
from deepserve.server.timeouts import default_protocol_class, header_timeout_protocol

logger = logging.getLogger(__name__)
MAX_HEADER_BYTES = 16 << 10  # as the server's --max-header-bytes default
HEADER_TIMEOUT_S = 30.0  # as the server's --request-read-timeout default: headers must arrive by then
_API = frozenset({"admin", "user"})
_ADMIN = frozenset({"admin"})
ROUTER_ROUTE_ROLES: dict[str, frozenset[str]] = {
    "/v1/models": _API,
    "/v1/models/{model:path}": _API,
    "/v1/completions": _API,
    "/v1/chat/completions": _API,
    "/metrics": frozenset({"admin", "metrics"}),
    "/admin/backends": _ADMIN,
    "/admin/backends/drain": _ADMIN,
    "/admin/backends/undrain": _ADMIN,
    "/admin/usage": _ADMIN,
    "/admin/keys/reload": _ADMIN,
}
routes = APIRouter()


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def require_key(request: Request) -> None:
    st = _state(request)
    route = request.scope.get("route")
    auth_headers = [v.decode("latin-1") for k, v in request.scope["headers"] if k == b"authorization"]
    try:
        request.state.api_key = authorize(st.keys, getattr(route, "path", None), auth_headers, ROUTER_ROUTE_ROLES)
    except APIError as e:
        if st.audit is not None:
            st.audit.write(key=getattr(e, "key_name", None), outcome=f"denied_{e.status}", endpoint=request.url.path,
                           client=client_addr(request), status=e.status, error=e.message)
        raise


@routes.get("/health")
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@routes.get("/ready")
async def ready(request: Request) -> JSONResponse:
    n = len(_state(request).pool.in_rotation())
    return JSONResponse({"status": "ready" if n else "no backend in rotation", "backends_in_rotation": n},
                        status_code=200 if n else 503)


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await forward(request, "/v1/completions", chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await forward(request, "/v1/chat/completions", chat=True)


@routes.get("/v1/models")
async def models(request: Request) -> Response:
    return await _models(request)


@routes.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> Response:
    """One model's card, taken from a backend's list (so any OpenAI-compatible backend serves it)."""
    return await _models(request, model)


async def _models(request: Request, name: str | None = None) -> Response:
    """A backend's model list filtered by the key's scope; with `name`, that model's card or a 404."""
    st = _state(request)
    up = await open_upstream(st, "GET", "/v1/models", None, backend_headers(st, request, "models"), False, None)
    up.backend.outstanding -= 1
    if up.response.status != 200:
        return Response(up.content, status_code=up.response.status, media_type="application/json")
    doc = json.loads(up.content)
    key = request.state.api_key
    doc["data"] = [m for m in doc.get("data", []) if key.may_use(str(m.get("id")))]
    if name is None:
        return JSONResponse(doc)
    for card in doc["data"]:
        if card.get("id") == name:
            return JSONResponse(card)
    raise APIError(404, f"The model `{name}` does not exist. Served: {[m.get('id') for m in doc['data']]}",
                   param="model", code="model_not_found")


@routes.get("/admin/backends")
async def backends(request: Request) -> JSONResponse:
    return JSONResponse({"backends": [b.describe() for b in _state(request).pool.backends.values()]})


async def _set_drained(request: Request, drained: bool) -> JSONResponse:
    """Drain or undrain a backend; audited whether it took or was refused."""
    st = _state(request)
    try:
        b = await _backend_named(request, st)
    except APIError as e:
        if st.audit is not None:
            st.audit.admin(request.state.api_key.name, request.url.path, client_addr(request), e.status,
                           error=e.message)
        raise
    b.drained = drained
    logger.warning("backend %s %s by an admin", b.url, "drained" if drained else "undrained")
    if st.audit is not None:
        st.audit.admin(request.state.api_key.name, request.url.path, client_addr(request), 200, backend=b.url)
    return JSONResponse(b.describe())


async def _backend_named(request: Request, st: RouterState) -> Backend:
    """The backend a drain/undrain body names ({"url": ...}), or a 400/404 that says what to send."""
    try:
        url = json.loads(await request.body()).get("url")
    except (ValueError, AttributeError, RecursionError):
        url = None
    if not isinstance(url, str):
        raise bad_request('send {"url": "<backend URL as GET /admin/backends lists it>"}', param="url")
    b = st.pool.get(url)
    if b is None:
        raise APIError(404, f"no backend {url!r}; known: {sorted(st.pool.backends)}", param="url",
                       code="backend_not_found")
    return b


@routes.post("/admin/backends/drain")
async def drain(request: Request) -> JSONResponse:
    return await _set_drained(request, True)


@routes.post("/admin/backends/undrain")
async def undrain(request: Request) -> JSONResponse:
    return await _set_drained(request, False)


@routes.get("/admin/usage")
async def usage(request: Request) -> JSONResponse:
    return JSONResponse({"keys": _state(request).usage})


@routes.post("/admin/keys/reload")
async def reload_keys(request: Request) -> JSONResponse:
    return answer_key_reload(_state(request), request)  # the server's answer, audit and all


def build_app(st: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        install_sighup(st)  # the key file and the audit log, as the server does
        client = st.open_client()
        await st.pool.refresh_dns()
        await asyncio.gather(*(st.pool.probe(client, b) for b in list(st.pool.backends.values())))
        checker = asyncio.create_task(st.pool.run_checks(client))
        if (problem := await st.quota.reachable()) is not None:
            logger.warning("the quota store (--redis-url) cannot be reached (%s): keys with a rate limit get %s "
                           "until it can (--quota-redis-down %s)", problem,
                           "no global limit" if st.settings.quota_redis_down == "open" else "503",
                           st.settings.quota_redis_down)
        backends = list(st.pool.backends.values())
        logger.info("router listening on http://%s:%d: %d backend(s), %d in rotation; global quotas: %s",
                    st.settings.host, st.settings.port, len(backends), sum(b.in_rotation for b in backends),
                    "Redis" if st.settings.redis_url else "none (no --redis-url)")
        yield
        checker.cancel()
        await client.close()
        await st.quota.close()
        if st.audit is not None:
            st.audit.close()

    app = FastAPI(title="deepserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(require_key)])
    app.router.redirect_slashes = False
    app.state.router = st
    app.include_router(routes)
    app.add_middleware(HeaderLimitMiddleware, max_bytes=MAX_HEADER_BYTES)
    _install_error_handlers(app)
    return app


def run_router(settings: RouterSettings) -> int:
    sock = bind_listener(settings.host, settings.port)
    st = RouterState(settings)
    config = uvicorn.Config(build_app(st), host=settings.host, port=settings.port, log_level="warning",
                            server_header=False, access_log=False, timeout_graceful_shutdown=30,
                            http=header_timeout_protocol(default_protocol_class(), HEADER_TIMEOUT_S,
                                                         4 * MAX_HEADER_BYTES))
    uvicorn.Server(config).run(sockets=[sock])
    return 0
