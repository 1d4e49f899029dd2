"""ServerState: what every route shares — settings, keys, limits, the engine, metrics, audit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

from deepserve.server.async_llm import AsyncLLM
from deepserve.server.audit import AuditLog
from deepserve.server.auth import ApiKey, KeyStore
from deepserve.server.errors import APIError, unavailable
from deepserve.server.metrics import Metrics
from deepserve.server.ratelimit import RateLimiter, WaitQueue
from deepserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ServerState:
    def __init__(self, settings: ServerSettings, engine: AsyncLLM, model_names: list[str]) -> None:
        self.settings = settings
        self.engine = engine
        self.model_names = model_names
        self.keys = KeyStore(settings.api_keys_file, tuple(settings.api_keys))
        self.limiter = RateLimiter()
        self.queue = WaitQueue(settings.max_waiting_requests, settings.max_waiting_tokens)
        self.metrics = Metrics(model_names[0])
        self.audit = AuditLog(settings.audit_log, settings.audit_log_prompts) if settings.audit_log else None
        self.usage: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.loaded = False
        self.draining = False
        self.load_error: str | None = None
        self.in_flight = 0  # admitted generation requests not yet finished
        self.request_exit: Callable[[int], None] | None = None  # set by the runner: stop with this code
        # CPU work of a request (JSON, chat template, tokenizer) runs here, off the event loop; two
        # threads on any machine: the tokenizer's Rust code releases the GIL, the rest is short.
        self._cpu = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="deepserve-prepare")
        self.utility_gate = asyncio.Semaphore(1)  # /tokenize, /detokenize: one of the two threads at most
        engine.on_stats = self.metrics.update_engine
        if not self.keys.configured:
            logger.warning("no API keys configured: every route except /health and /ready answers 401; "
                           "start with --api-key KEY or --api-keys keys.yaml")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    @property
    def dead_reason(self) -> str | None:
        return self.engine.dead_reason or self.load_error

    def check_accepting(self) -> None:
        if self.draining:  # the same code as the requests its shutdown ends: a client can tell it from load
            raise APIError(503, "the server is shutting down; retry on another replica", code="server_stopping",
                           headers={"Retry-After": "5"})
        if self.dead_reason is not None:
            raise APIError(503, f"the engine is not running: {self.dead_reason}", code="engine_dead")
        if not self.loaded:
            raise unavailable("the model is still loading; retry shortly", retry_after=5)

    def readiness(self) -> tuple[bool, str]:
        if self.dead_reason is not None:
            return False, f"engine dead: {self.dead_reason}"
        if self.draining:
            return False, "draining"
        if not self.loaded:
            return False, "loading"
        if self.engine.stalled(self.settings.engine_stall_timeout):
            return False, f"engine made no progress for {self.settings.engine_stall_timeout:.0f}s"
        return True, "ready"

    def resolve_model(self, requested: str | None, key: ApiKey) -> str:
        name = requested or self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. Served: {self.allowed_models(key)}",
                           param="model", code="model_not_found")
        if not key.may_use(name):
            raise APIError(403, f"key '{key.name}' may not use model `{name}`", param="model",
                           code="model_not_allowed")
        return name

    def allowed_models(self, key: ApiKey) -> list[str]:
        return [m for m in self.model_names if key.may_use(m)]

    def record(self, key_name: str, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0,
               finish_reasons: list[str] | None = None, **audit: Any) -> None:
        u = self.usage[key_name]
        u["requests"] += 1
        u[f"outcome_{outcome}"] += 1
        u["prompt_tokens"] += prompt_tokens
        u["completion_tokens"] += completion_tokens
        self.metrics.record_finished(key_name, outcome, finish_reasons or [], prompt_tokens, completion_tokens)
        if self.audit is not None:
            self.audit.write(key=key_name, outcome=outcome, prompt_tokens=prompt_tokens,
                             completion_tokens=completion_tokens, finish_reasons=finish_reasons or [], **audit)
