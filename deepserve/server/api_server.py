"""The FastAPI app and the uvicorn runner: TLS/mTLS, SIGHUP key reload, SIGTERM drain, exit codes.

Lifecycle: the port opens at once (/health 200, /ready 503 "loading") while the engine core process
starts; /ready turns 200 when it is up. SIGTERM (or SIGINT) drains: /ready and new requests answer
503, in-flight requests run up to --shutdown-timeout, then the server stops and exits 0. A second
signal (or the timeout) ends the requests still running at once, each with a 503 "shutting down"
(an error event on a stream), and the server still shuts the engine down cleanly and exits 0; a third
signal exits without that. If the engine process dies, open streams end with an error event, /health
answers 503 and the server exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from deepserve.engine.core_process import parent_log_level
from deepserve.heap import freeze_startup_heap
from deepserve.server.errors import APIError, error_body
from deepserve.server.httpio import HeaderLimitMiddleware
from deepserve.server.memory import TrimAfterLargeBodies
from deepserve.server.routes import require_key, router
from deepserve.server.state import ServerState
from deepserve.server.timeouts import (
    BodyTimeoutMiddleware,
    RequestReadTimeout,
    default_protocol_class,
    header_timeout_protocol,
)

logger = logging.getLogger(__name__)
EXIT_ENGINE_DEAD = 1


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        install_sighup(state)
        task = asyncio.create_task(_start_engine(state))
        yield
        task.cancel()
        await state.engine.shutdown()
        if state.audit is not None:
            state.audit.close()

    # No /docs or /openapi.json: every route is an authorized API route or an explicit probe.
    app = FastAPI(title="deepserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(require_key)])
    app.router.redirect_slashes = False  # "/metrics/" is not "/metrics": no redirect dance before auth
    app.state.server = state
    app.include_router(router)
    app.add_middleware(HeaderLimitMiddleware, max_bytes=state.settings.max_header_bytes)
    app.add_middleware(BodyTimeoutMiddleware, timeout=state.settings.request_read_timeout)
    app.add_middleware(TrimAfterLargeBodies, run_off_loop=state.off_loop)
    _install_error_handlers(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestReadTimeout)
    async def read_timeout(request: Request, _: RequestReadTimeout) -> JSONResponse:
        timeout = request.app.state.server.settings.request_read_timeout
        return JSONResponse(error_body(408, f"the request body did not arrive within {timeout:g} s "
                                            "(--request-read-timeout)", code="request_timeout"),
                            status_code=408, headers={"Connection": "close"})

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, _: ClientDisconnect) -> Response:
        # Nobody reads the answer: one line, not a traceback (2,000 such clients wrote 17.5 MB of them).
        logger.info("client %s went away before its request body arrived (%s %s)",
                    request.client.host if request.client else "?", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal server error ({type(e).__name__})"), status_code=500)


def install_sighup(state: Any) -> None:
    """SIGHUP: reload the key file, and reopen the audit log (after logrotate renamed it). Run by the
    event loop between callbacks, never inside an audit write. `state`: the server's or the router's (each
    has `keys` and `audit`)."""
    def on_sighup() -> None:
        problem = state.keys.reload()
        if state.audit is not None:
            state.audit.reopen()
            logger.info("audit log reopened: %s", state.audit.path)
            if state.keys.path:  # a key file to reload: record whether it took
                state.audit.admin(None, "SIGHUP key reload", "signal", 200 if problem is None else 422,
                                  error=problem)

    if hasattr(signal, "SIGHUP"):
        with contextlib.suppress(RuntimeError, ValueError):  # not the main thread
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_sighup)
    if _take_early_sighup():
        # Once, however many came: the key file may have changed while we loaded, so reload, not drop it.
        logger.info("applying the SIGHUP received during start-up")
        on_sighup()


_early_sighup = False  # a SIGHUP came between defer_sighup() and install_sighup()


def defer_sighup() -> None:
    """Called first by `deepserve serve` and `deepserve router`: until install_sighup replaces it, a SIGHUP
    is recorded for install_sighup to apply instead of ending the process (its default action). Loading a
    model takes minutes, and docs/deploy.md has operators SIGHUP every pod after a key change."""
    def record(signum: int, frame: object) -> None:
        global _early_sighup
        _early_sighup = True

    if hasattr(signal, "SIGHUP"):
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGHUP, record)
            # Restart interrupted system calls, as asyncio's handler does: the loading code need not expect EINTR.
            signal.siginterrupt(signal.SIGHUP, False)


def _take_early_sighup() -> bool:
    global _early_sighup
    taken, _early_sighup = _early_sighup, False
    return taken


async def _start_engine(state: ServerState) -> None:
    def on_dead(reason: str) -> None:
        logger.error("engine core process died: %s; shutting down", reason)
        if state.request_exit is not None:
            # A moment for open streams to write their error event before connections close.
            asyncio.get_running_loop().call_later(1.0, state.request_exit, EXIT_ENGINE_DEAD)

    state.engine.on_dead = on_dead
    t0 = time.monotonic()
    try:
        await state.engine.start()
    except Exception as e:
        state.load_error = str(e)
        on_dead(str(e))
        return
    freeze_startup_heap("API server")
    state.loaded = True
    s = state.settings
    logger.info("engine ready in %.1fs; serving %s at %s://%s:%d/v1", time.monotonic() - t0, state.model_names,
                "https" if s.ssl_certfile else "http", s.host, s.port)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM/SIGINT drain first instead of closing the listener at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the
        # process would die by the signal instead of exiting 0.
        self._signals += 1
        if self._loop is None or self._signals > 2:
            self.stop_now(force=True)  # uvicorn cancels what still runs
        elif self._signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self._loop.call_soon_threadsafe(self._end_requests, "a second signal")

    def _start_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain())  # referenced, so never collected

    def _end_requests(self, why: str) -> None:
        """End the requests still running (503 each) and stop. Their tasks then finish on their own
        and the lifespan shutdown stops the engine; a forced exit would cancel both mid-flight."""
        self.state.draining = True
        if n := self.state.engine.abort_all(f"{why} ended it"):
            logger.warning("%s: ended %d unfinished requests", why, n)
        self.stop_now()

    def request_exit(self, code: int) -> None:
        self.exit_code = code
        self.stop_now()

    def stop_now(self, force: bool = False) -> None:
        self.should_exit = True
        self.force_exit = self.force_exit or force

    async def _drain(self) -> None:
        st = self.state
        st.draining = True
        timeout = st.settings.shutdown_timeout
        logger.warning("draining: waiting up to %.0fs for %d in-flight requests", timeout, st.in_flight)
        deadline = time.monotonic() + timeout
        while st.in_flight > 0 and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if not self.should_exit:
            self._end_requests("the shutdown timeout")


def uvicorn_config(app: FastAPI, state: ServerState) -> uvicorn.Config:
    s = state.settings
    return uvicorn.Config(
        # uvicorn sets its own loggers' level: the one --log-level gave ours (once "info" whatever it said).
        app, host=s.host, port=s.port, log_level=parent_log_level(), server_header=False,
        ssl_keyfile=s.ssl_keyfile, ssl_certfile=s.ssl_certfile, ssl_ca_certs=s.ssl_ca_certs,
        ssl_cert_reqs=s.ssl_cert_reqs,
        proxy_headers=s.forwarded_allow_ips is not None, forwarded_allow_ips=s.forwarded_allow_ips,
        # Requests that outlive the drain are cancelled (and so aborted in the engine) after this.
        timeout_graceful_shutdown=2, h11_max_incomplete_event_size=4 * s.max_header_bytes,
        http=header_timeout_protocol(default_protocol_class(), s.request_read_timeout, 4 * s.max_header_bytes),
    )


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine starts: a taken port fails fast, in one line
    (ValueError), and no other process can take the port between this check and serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not the default 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY on a
    # transport only when proto is IPPROTO_TCP. Without it every response (headers and body are separate
    # writes) waited for the client's delayed ACK: ~40 ms added to each request on Linux.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart past TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use; pick another with --port") from None
        raise ValueError(f"cannot listen on {host} port {port}: {e.strerror or e}; check --host and --port") \
            from None
    return sock


class _NoProbes(logging.Filter):
    """Keeps /health and /ready out of the access log: a kubelet polls them every few seconds."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and str(args[2]).split("?")[0] in ("/health", "/ready"))


def run_server(state: ServerState, sock: socket.socket | None = None) -> int:
    sock = sock or bind_listener(state.settings.host, state.settings.port)
    app = build_app(state)
    server = DrainingServer(uvicorn_config(app, state), state)
    state.request_exit = server.request_exit
    logging.getLogger("uvicorn.access").addFilter(_NoProbes())
    s = state.settings
    host = f"[{s.host}]" if ":" in s.host else s.host
    logger.info("listening on %s://%s:%d (the engine is loading; /ready turns 200 when it serves)",
                "https" if s.ssl_certfile else "http", host, s.port)
    server.run(sockets=[sock])
    return server.exit_code
