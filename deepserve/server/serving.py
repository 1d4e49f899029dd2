"""/v1/completions and /v1/chat/completions: validate, admit, generate, respond.

Admission order: accepting (not draining, engine alive) → per-IP limit → body → schema → model
scope → tokenize and context length → per-key limits (reserve) → global wait queue. Anything that
fails is a 4xx/503 naming the cause and costs the key nothing. Once admitted, exactly one
`Generation.finish()` runs (idempotent) however the request ends, which settles the reservation,
records metrics and usage, and writes the audit record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepserve.engine.grammar import GrammarError
from deepserve.engine.outputs import CompletionOutput, RequestOutput
from deepserve.server import openai_format as f
from deepserve.server import protocol as p
from deepserve.server.auth import ApiKey
from deepserve.server.errors import APIError, bad_request
from deepserve.server.httpio import ClientGone, incoming_request_id, read_body, unless_disconnected
from deepserve.server.ratelimit import Admission
from deepserve.server.state import ServerState
from deepserve.server.structured import structured_outputs_of
from deepserve.server.tools import OutputReading, output_grammar, output_reading, plan_chat


@dataclass
class Generation:
    st: ServerState
    key: ApiKey
    model: str
    endpoint: str
    request_id: str
    prompt_text: str | None
    prompt_tokens: int
    admission: Admission
    arrival: float
    client: str
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    finished: bool = False
    reads: OutputReading = field(default_factory=OutputReading)
    upstream_id: str | None = None  # the caller's X-Request-ID (e.g. a router's), audited beside ours

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        total = sum(len(c.token_ids) for c in out.outputs)
        new = total - self.completion_tokens
        self.cached_tokens = out.num_cached_tokens
        if out.finished:  # also when nothing was generated (an abort, a prompt-only scoring request)
            self.finish_reasons = [c.finish_reason or "abort" for c in out.outputs]
        # A scoring request's answer (prompt_only: its outputs hold no tokens) counts as its first token.
        answered = out.finished and self.first_token_at is None and "abort" not in self.finish_reasons
        if new <= 0 and not answered:
            return
        m = self.st.metrics
        if self.first_token_at is None:
            self.first_token_at = now
            m.ttft.observe(now - self.arrival)
            self.st.queue.leave(self.prompt_tokens)
            if (qt := self.st.engine.queue_time(self.request_id)) is not None:
                m.queue_time.observe(qt)
        else:
            for _ in range(new):
                m.itl.observe((now - self.last_token_at) / new)
        self.last_token_at, self.completion_tokens = now, total

    def finish(self, outcome: str, status: int = 200) -> None:
        if self.finished:
            return
        self.finished = True
        st = self.st
        st.in_flight -= 1
        if self.first_token_at is None:
            st.queue.leave(self.prompt_tokens)
        st.limiter.settle(self.admission, self.prompt_tokens + self.completion_tokens)
        latency = time.monotonic() - self.arrival
        if outcome == "ok":
            st.metrics.e2e.observe(latency)
        st.record(self.key.name, outcome, self.prompt_tokens, self.completion_tokens, self.finish_reasons,
                  request_id=self.request_id, model=self.model, endpoint=self.endpoint, client=self.client,
                  status=status, latency_s=round(latency, 6), prompt=self.prompt_text,
                  **upstream_field(self.upstream_id))


class _EventStream(StreamingResponse):
    """A client can vanish before the body iterator's first step, when its `finally` cannot run;
    this `finally` releases the admission then (finish() is idempotent, abort() too)."""

    def __init__(self, content: Any, gens: list[Generation], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.gens = gens

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for gen in self.gens:
                if not gen.finished:
                    gen.st.engine.abort(gen.request_id)
                    gen.finish("aborted", 499)


def client_addr(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def chat_prompt(st: ServerState, req: p.ChatCompletionRequest, template_kwargs: dict[str, Any] | None = None,
                add_special_tokens: bool = False) -> tuple[str, list[int]]:
    from deepserve.loader.tokenizer import apply_chat_template

    tok = st.engine.tokenizer
    try:
        text = apply_chat_template(tok, [template_message(m) for m in req.messages], **(template_kwargs or {}))
    except Exception as e:  # jinja2 raises its own TemplateError for e.g. non-alternating roles
        raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
    # The template wrote bos already; /tokenize may ask for the tokenizer's special tokens on top.
    return text, list(tok.encode(text, add_special_tokens=add_special_tokens))


def template_message(m: p.ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it. Content stays None where the client sent none: DeepSeek's
    templates tell an assistant's tool-call turn by its `content is none`."""
    if m.content is None:
        content = None if m.tool_calls else ""
    else:
        content = m.content if isinstance(m.content, str) else "\n".join(t.text for t in m.content)
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.tool_calls:
        msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (its longest vocabulary entry), cached on the
    tokenizer: a text of n characters has at least n / this many tokens, known without tokenizing."""
    cached = getattr(tokenizer, "_deepserve_max_token_chars", None)
    if cached is None:
        cached = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        with contextlib.suppress(AttributeError):
            tokenizer._deepserve_max_token_chars = cached
    return cached


def _check_text_length(st: ServerState, chars: int, chat: bool) -> None:
    """A 400 before tokenizing for a text too long for the context whatever its tokens: tokenizing a
    3 MB prompt took 12-94 s of CPU (bench: issue 21) only to refuse it."""
    at_least = chars // max_token_chars(st.engine.tokenizer)
    if at_least > st.engine.max_model_len:
        raise bad_request(f"This model's maximum context length is {st.engine.max_model_len} tokens. However, "
                          f"your {'messages hold' if chat else 'prompt holds'} {chars} characters, at least "
                          f"{at_least} tokens. Please reduce the length of the "
                          f"{'messages' if chat else 'prompt'}.", param="messages" if chat else "prompt",
                          code="context_length_exceeded")


def _chat_chars(req: p.ChatCompletionRequest) -> int:
    """Characters the template will at least write: contents, tool-call arguments, tool definitions."""
    chars = sum(len(m.content) if isinstance(m.content, str) else sum(len(t.text) for t in m.content or [])
                for m in req.messages)
    chars += sum(len(c.function.arguments) for m in req.messages for c in m.tool_calls or [])
    if req.tools and p.tool_choice_of(req) != "none":
        chars += sum(len(json.dumps(t.function.parameters or {})) for t in req.tools)
    return chars


def _completion_prompt(st: ServerState, req: p.CompletionRequest) -> tuple[str | None, list[int]]:
    prompt = p.single_prompt(req)
    if isinstance(prompt, str):
        return prompt, list(st.engine.tokenizer.encode(prompt))
    return None, list(prompt)


def _prepare(st: ServerState, req: Any, chat: bool, rid: str) -> tuple[str | None, list[int], list, OutputReading]:
    """Prompt text, prompt ids, the engine's core requests and how to read the output; raises APIError(400)."""
    if chat:
        _check_text_length(st, _chat_chars(req), chat)
    elif isinstance(p.single_prompt(req), str):
        _check_text_length(st, len(p.single_prompt(req)), chat)
    plan = plan_chat(st.settings, req) if chat else None
    text, ids = chat_prompt(st, req, plan.template_kwargs) if chat else _completion_prompt(st, req)
    # Without max_tokens chat may run to the end of the context; completions stop at 16 (as OpenAI and
    # vLLM do), or sooner when the context has less room, and the engine reports a full context.
    default = None if chat else max(1, min(p.COMPLETION_MAX_TOKENS, st.engine.max_model_len - len(ids)))
    params = p.to_sampling_params(req, default)
    origin = structured_outputs_of(req)[1]
    if chat:
        params.structured_outputs, origin = output_grammar(st.engine.tokenizer, req, plan, text)
        if plan.tool_parser is not None:  # the markers must reach the parser even where they are special
            params.skip_special_tokens = False
    if params.max_tokens is not None and params.max_tokens > st.engine.max_model_len:
        field = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
        raise bad_request(f"{field} must be <= the model's maximum context length "
                          f"({st.engine.max_model_len}), got {params.max_tokens}", field)
    reads = output_reading(st.settings, req, plan, text) if chat else OutputReading()
    try:
        return text, ids, st.engine.prepare(rid, ids, params), reads
    except GrammarError as e:  # the schema, regex or grammar does not compile: name the field that sent it
        raise bad_request(f"{origin}: {e}", param=origin) from None
    except ValueError as e:
        if "context length" in str(e):
            why = str(e)
            if p.scores_prompt_only(req):  # the user asked for no tokens: say where the one comes from
                why += (" (echo with max_tokens 0 still samples one token, which is dropped: the prompt may hold "
                        "at most the maximum context length - 1 tokens)")
            raise bad_request(why, param="messages" if chat else "prompt", code="context_length_exceeded") from None
        raise invalid_request(str(e), chat) from None


def invalid_request(message: str, chat: bool) -> APIError:
    """A 400 for what the engine refused: the field its message names, else the prompt."""
    return bad_request(message, param=p.field_named_in(message) or ("messages" if chat else "prompt"))


async def admit(request: Request, chat: bool) -> tuple[Any, list[Generation], list[list]]:
    """Everything before the engine; raises APIError (recorded as a rejection) or returns the run: one
    Generation (and its core requests) per prompt. A completion with several prompts (protocol.split_prompts)
    runs each as its own request `<id>-<i>`, admitted, limited, metered and audited as a request of its own;
    every prompt is checked before any is admitted, and a refusal of any admits none."""
    arrival = time.monotonic()
    st: ServerState = request.app.state.server
    key: ApiKey = request.state.api_key
    endpoint, client, rid = ("chat" if chat else "completions"), client_addr(request), uuid.uuid4().hex
    upstream = incoming_request_id(request)
    admitted: list[Admission] = []
    try:
        st.check_accepting()
        st.limiter.check_ip(client, st.settings.ip_requests_per_minute)
        raw = await read_body(request, st.settings.max_body_bytes)
        # Parsing, the chat template and tokenizing run on a worker thread: the event loop keeps
        # answering /health, /ready and streams whatever one large request costs.
        req = await st.off_loop(p.parse_body, raw, p.ChatCompletionRequest if chat else p.CompletionRequest,
                                st.settings.limits)
        model = st.resolve_model(req.model, key)
        parts = [req] if chat else p.split_prompts(req)
        ids_of = [rid] if len(parts) == 1 else [f"{rid}-{i}" for i in range(len(parts))]
        prepared = [await st.off_loop(_prepare_part, st, part, chat, part_id, len(parts) > 1, i)
                    for i, (part, part_id) in enumerate(zip(parts, ids_of, strict=True))]
        admitted = st.limiter.admit_many(key, [len(ids) + core_requests[0].sampling_params.max_tokens * req.n
                                               for _, ids, core_requests, _ in prepared])
        st.queue.enter(sum(len(ids) for _, ids, _, _ in prepared), len(prepared))
    except APIError as e:
        for adm in admitted:  # the queue refused: the prompts give their reservations back
            st.limiter.unreserve(adm)
        st.record(key.name, f"rejected_{e.status}", request_id=rid, endpoint=endpoint, client=client,
                  status=e.status, error=e.message, **upstream_field(upstream))
        e.headers.setdefault("x-request-id", rid)  # the id the audit log holds for this refusal
        raise
    st.in_flight += len(prepared)
    gens = [Generation(st, key, model, endpoint, part_id, text, len(ids), adm, arrival, client, reads=reads,
                       upstream_id=upstream)
            for part_id, (text, ids, _, reads), adm in zip(ids_of, prepared, admitted, strict=True)]
    return req, gens, [core_requests for _, _, core_requests, _ in prepared]


def upstream_field(upstream_id: str | None) -> dict[str, str]:
    """The audit record's `upstream_request_id`, present only when a caller sent one."""
    return {} if upstream_id is None else {"upstream_request_id": upstream_id}


def _prepare_part(st: ServerState, req: Any, chat: bool, rid: str, batched: bool,
                  index: int) -> tuple[str | None, list[int], list, OutputReading]:
    """_prepare for one prompt of a batch, its 400s naming the prompt (prompt.<index>)."""
    try:
        return _prepare(st, req, chat, rid)
    except APIError as e:
        if not batched or e.param != "prompt":
            raise
        raise bad_request(f"prompt {index}: {e.message}", param=f"prompt.{index}", code=e.code) from None


def _nothing_generated(c: CompletionOutput) -> CompletionOutput:
    # "length": max_tokens 0 was reached; an abort stays an abort.
    reason = None if c.finish_reason is None else "abort" if c.finish_reason == "abort" else "length"
    return CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None, reason, None,
                            [] if c.token_text_ends is not None else None)


async def prompt_only(agen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A scoring request's outputs (echo with max_tokens 0, protocol.scores_prompt_only): the engine
    samples one token to compute the prompt's logprobs; it is dropped here, as vLLM drops it, so the
    choice is the echoed prompt alone and the usage counts no completion tokens."""
    async for out in agen:
        yield dataclasses.replace(out, outputs=[_nothing_generated(c) for c in out.outputs])


async def run_request(request: Request, chat: bool) -> Response:
    from deepserve.server.streaming import response_id, stream_events

    req, gens, core_requests = await admit(request, chat)
    if req.stream:
        agens = [_generate(g, req, c) for g, c in zip(gens, core_requests, strict=True)]
        headers = {**gens[-1].admission.headers, "x-request-id": response_id(gens), "Cache-Control": "no-cache"}
        return _EventStream(stream_events(gens, req, agens, chat), gens, media_type="text/event-stream",
                            headers=headers)
    return await _collect_all(request, req, gens, core_requests, chat)


def _generate(gen: Generation, req: Any, core_requests: list) -> AsyncIterator[RequestOutput]:
    agen = gen.st.engine.generate(gen.request_id, gen.prompt_text, core_requests)
    return prompt_only(agen) if p.scores_prompt_only(req) else agen


async def _collect_all(request: Request, req: Any, gens: list[Generation], core_requests: list[list],
                       chat: bool) -> Response:
    """The answer not streamed (streaming.stream_events streams it): one request's body, or for a completion
    with several prompts their requests side by side in the engine and one body whose choices are prompt i's n
    choices at indices i * n .. i * n + n - 1 (OpenAI's order), with the usage summed. Any prompt's failure
    fails the request and ends the others (audited as aborted); a client gone ends them all (499)."""
    from deepserve.server.streaming import collect, end_parts, response_id

    tasks: list[asyncio.Future] = []

    async def everything() -> list[dict]:
        tasks.extend(asyncio.ensure_future(collect(g, req, _generate(g, req, c), chat))
                     for g, c in zip(gens, core_requests, strict=True))
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    try:
        bodies = await unless_disconnected(request, everything())
    except BaseException as e:
        if isinstance(e, ClientGone):
            end_parts(gens, "aborted", 499)
            return Response(status_code=499)
        code = getattr(e, "code", None)
        if code == "server_stopping":  # the shutdown ended them, as it ends streams: aborted, not failed
            end_parts(gens, "aborted", e.status)
        else:  # the engine's death ends every part, none failed alone: all errors, as the stream records them
            failed = [] if code == "engine_dead" else [
                i for i, t in enumerate(tasks) if t.done() and not t.cancelled() and t.exception() is not None]
            end_parts(gens, "error", getattr(e, "status", 500), failed)
        if isinstance(e, APIError):
            e.headers.setdefault("x-request-id", response_id(gens))
        raise
    for g in gens:
        g.finish("ok")
    rid = response_id(gens)
    if len(bodies) == 1:
        return JSONResponse(bodies[0], headers={**gens[0].admission.headers, "x-request-id": rid})
    body = f.envelope("text_completion", rid, gens[0].model)
    body["choices"] = [{**c, "index": i * req.n + c["index"]} for i, b in enumerate(bodies) for c in b["choices"]]
    body["usage"] = f.sum_usage([b["usage"] for b in bodies])
    return JSONResponse(body, headers={**gens[-1].admission.headers, "x-request-id": rid})
