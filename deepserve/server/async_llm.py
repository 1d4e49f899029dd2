"""AsyncLLM: the engine as the API server sees it — tokenize, send to the engine core process,
detokenize, and hand each request its cumulative outputs as an async stream.

Each request keeps only its latest RequestOutput (outputs are cumulative), so a slow client costs
one object, not a growing queue. A request abandoned by its consumer is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from deepserve.config import EngineArgs, EngineConfig
from deepserve.engine.core import EngineCoreOutput, EngineCoreRequest
from deepserve.engine.core_process import EngineCoreClient, SpawnedCore, StepOutputs, spawn_core_process
from deepserve.engine.outputs import RequestOutput
from deepserve.engine.processors import InputProcessor, OutputProcessor
from deepserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine core refused or dropped this one request; it and the engine carry on serving others.
    `invalid`: the request was at fault (a 400), not the engine (a 500)."""

    def __init__(self, message: str, invalid: bool) -> None:
        super().__init__(message)
        self.invalid = invalid


class ServerStoppingError(RuntimeError):
    """The server is shutting down and ended this request before it finished (a 503)."""


@dataclass
class _Stream:
    core_ids: list[str]
    event: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None
    queue_time: float | None = None


class AsyncLLM:
    def __init__(self, config: EngineConfig, tokenizer: Any, eos_ids: frozenset[int], core: SpawnedCore) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(config, tokenizer, eos_ids)
        self.input_processor.warm_grammars()  # while the engine core process starts
        self.output_processor = OutputProcessor(tokenizer)
        self.client = EngineCoreClient(core, self._on_outputs, self._on_dead)
        self.streams: dict[str, _Stream] = {}
        self._parent_of: dict[str, str] = {}
        self.stats: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.stopping: str | None = None  # set by abort_all: the server is shutting down
        self.on_stats: Callable[[dict[str, Any]], None] | None = None
        self.on_dead: Callable[[str], None] | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        """Spawn the engine core process first, then build this process's config and tokenizer while the
        child imports and loads: the two start-ups overlap instead of adding up. The child gets the
        resolved model path (the demo model written once, here), so both read the same checkpoint; a
        failure here stops the child."""
        from deepserve.loader.tokenizer import load_eos_token_ids, load_tokenizer

        args = dataclasses.replace(args, model=args.model_path())
        core = spawn_core_process(dataclasses.asdict(args))
        try:
            config = args.create_engine_config()
            tokenizer = load_tokenizer(config.model.tokenizer)
            return cls(config, tokenizer, load_eos_token_ids(config.model.model, tokenizer), core)
        except BaseException:
            core.kill()
            raise

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    async def start(self) -> None:
        await self.client.start()

    def kill_if_unstarted(self) -> None:
        """Stops an engine process the server never connected to (it failed before its lifespan ran)."""
        self.client.kill_if_unconnected()

    async def shutdown(self) -> None:
        await self.client.shutdown()

    def prepare(self, request_id: str, prompt: list[int], params: SamplingParams) -> list[EngineCoreRequest]:
        """Validate against the model (context length, vocabulary); raises ValueError."""
        return self.input_processor.process(request_id, prompt, params)

    async def generate(self, request_id: str, prompt: str | None,
                       core_requests: list[EngineCoreRequest]) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.stopping is not None:  # admitted before abort_all, first iterated after it
            raise ServerStoppingError(self.stopping)
        stream = _Stream([r.request_id for r in core_requests])
        self.streams[request_id] = stream
        for cid in stream.core_ids:
            self._parent_of[cid] = request_id
        self.output_processor.add_request(request_id, prompt, core_requests)
        self.client.add(core_requests)
        finished = False
        try:
            while not finished:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise stream.error
                out = stream.latest
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
            self._forget(request_id)

    def queue_time(self, request_id: str) -> float | None:
        stream = self.streams.get(request_id)
        return stream.queue_time if stream else None

    def abort(self, request_id: str) -> None:
        """Idempotent and never awaits: callable from the `finally` of a cancelled task."""
        if self.dead_reason is None:
            self.client.abort(self.output_processor.abort_request(request_id))
        self._forget(request_id)

    def abort_all(self, reason: str) -> int:
        """End every open request now with ServerStoppingError(reason) and abort it in the engine, and
        refuse (the same way) every generate() not yet started; how many were ended. The streams finish
        at once, without waiting for the engine. A request whose final result is in but not yet read
        keeps it."""
        self.stopping = reason
        ended = 0
        for request_id, stream in list(self.streams.items()):
            if stream.latest is not None and stream.latest.finished:
                continue
            if stream.error is None:
                stream.error = ServerStoppingError(reason)
                stream.event.set()
            self.abort(request_id)
            ended += 1
        return ended

    def _forget(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        for cid in stream.core_ids if stream else ():
            self._parent_of.pop(cid, None)

    def stalled(self, timeout: float) -> bool:
        """Requests are waiting but the engine has sent nothing for `timeout` seconds."""
        return bool(self.streams) and time.monotonic() - self.client.last_message > timeout

    def _on_outputs(self, msg: StepOutputs) -> None:
        for cid, why in msg.failed.items():
            # The request's generate() raises this, and its `finally` aborts any siblings (n > 1).
            stream = self.streams.get(self._parent_of.get(cid, ""))
            if stream is not None and stream.error is None:
                stream.error = RequestFailedError(str(why.get("error")), bool(why.get("invalid")))
                stream.event.set()
        outputs = [EngineCoreOutput.from_dict(d) for d in msg.outputs]
        for cid, seconds in msg.queue_times.items():
            stream = self.streams.get(self._parent_of.get(cid, ""))
            if stream is not None and stream.queue_time is None:
                stream.queue_time = seconds
        request_outputs, stopped = self.output_processor.process(outputs)
        self.client.abort(stopped)  # a stop string ended them: free their KV blocks now
        for out in request_outputs:
            stream = self.streams.get(out.request_id)
            if stream is not None:
                stream.latest = out
                stream.event.set()
        self.stats = msg.stats
        if self.on_stats is not None:
            self.on_stats(msg.stats)

    def _on_dead(self, reason: str) -> None:
        self.dead_reason = reason
        for stream in self.streams.values():
            stream.error = EngineDeadError(reason)
            stream.event.set()
        if self.on_dead is not None:
            self.on_dead(reason)
