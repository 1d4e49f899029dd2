"""Turning a request's cumulative outputs into a JSON body (collect) or server-sent events.

A stream ends with `data: [DONE]`, or — when the engine dies or refuses the request mid-stream — with
one `data: {"error": ...}` event (which the openai client raises as APIError) and no [DONE]. A chunk
is sent only when it carries something: text, reasoning, the role, a finish reason or logprobs; while
text is held back (a possible stop string, a partial character) nothing is sent.
If the client goes away the generator is cancelled and its `finally` aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from deepserve.engine.outputs import RequestOutput
from deepserve.server import openai_format as f
from deepserve.server import protocol as p
from deepserve.server.async_llm import EngineDeadError, RequestFailedError, ServerStoppingError
from deepserve.server.errors import APIError, error_body
from deepserve.server.httpio import SSE_DONE, sse
from deepserve.server.reasoning import marker_ids
from deepserve.server.serving import Generation, invalid_request

logger = logging.getLogger(__name__)


def _trackers(gen: Generation, req: Any, chat: bool) -> list[f.ChoiceTracker]:
    longest = max((len(s) for s in p.stop_list(req)), default=0)
    holdback = 0 if req.include_stop_str_in_output else max(longest - 1, 0)
    reads = gen.reads  # completions: the default, plain text
    think_ids = marker_ids(gen.st.engine.tokenizer) if reads.reasoning else (None, None)
    return [f.ChoiceTracker(i, holdback, reads.reasoning, reads.tool_parser, think_ids) for i in range(req.n)]


def _echo(gen: Generation, req: Any, out: RequestOutput) -> f.Delta | None:
    """What vLLM's `echo` puts before each completion: the prompt's text (a token-id prompt decoded), its
    tokens and, with logprobs, their logprobs (the engine computed them: protocol.num_prompt_logprobs)."""
    if not getattr(req, "echo", False):
        return None
    text = gen.prompt_text
    if text is None:
        text = gen.st.engine.tokenizer.decode(out.prompt_token_ids)
    lps = out.prompt_logprobs if req.logprobs is not None else None
    return f.Delta(0, text, token_ids=list(out.prompt_token_ids), logprobs=lps)


def _decoder(gen: Generation) -> Callable[[int], str]:
    """Spells a token that has no logprobs (an echoed prompt's first): its own text."""
    tokenizer = gen.st.engine.tokenizer
    return lambda token_id: tokenizer.decode([token_id])


def _deltas(trackers: list[f.ChoiceTracker], out: RequestOutput) -> list[f.Delta]:
    deltas = []
    for c in out.outputs:
        if (d := trackers[c.index].advance(c)) is not None:
            deltas.append(d)
    return deltas


def _usage(gen: Generation, trackers: list[f.ChoiceTracker]) -> dict:
    reasoning = sum(t.reasoning_tokens for t in trackers) if trackers[0].splitter else None
    return f.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, reasoning)


def _dead(e: EngineDeadError) -> APIError:
    return APIError(503, f"the engine failed while generating: {e}", code="engine_dead")


def _stopping(e: ServerStoppingError) -> APIError:
    return APIError(503, f"the server is shutting down: {e}", code="server_stopping")


def _refused(e: RequestFailedError, chat: bool) -> APIError:
    if e.invalid:
        return invalid_request(str(e), chat)
    return APIError(500, f"the engine could not run this request: {e}")


async def collect(gen: Generation, req: Any, agen: AsyncIterator[RequestOutput], chat: bool) -> dict:
    trackers = _trackers(gen, req, chat)
    acc = [f.Accumulated(i) for i in range(req.n)]
    last: RequestOutput | None = None
    try:
        async for out in agen:
            last = out
            gen.observe(out)
            for d in _deltas(trackers, out):
                acc[d.index].add(d)
    except EngineDeadError as e:
        raise _dead(e) from None
    except RequestFailedError as e:
        raise _refused(e, chat) from None
    except ServerStoppingError as e:
        raise _stopping(e) from None
    top_n = p.num_logprobs(req)
    body = f.envelope("chat.completion" if chat else "text_completion", gen.request_id, gen.model)
    # vLLM's places: a chat response's prompt_logprobs beside its choices, a completion's in each choice.
    prompt_lps = f.prompt_logprobs(last.prompt_logprobs) if last and last.prompt_logprobs is not None else None
    if chat:
        body["choices"] = [_chat_choice(a, top_n, trackers) for a in acc]
    else:
        echo = _echo(gen, req, last) if last is not None else None
        body["choices"] = [_completion_choice(a, top_n, echo, prompt_lps, _decoder(gen)) for a in acc]
    body["usage"] = _usage(gen, trackers)
    if chat and prompt_lps is not None:
        body["prompt_logprobs"] = prompt_lps
    return body


def _chat_choice(a: f.Accumulated, top_n: int | None, trackers: list[f.ChoiceTracker]) -> dict:
    tracker = trackers[a.index]
    message: dict = {"role": "assistant", "content": a.content}
    if tracker.splitter is not None:
        message = {"role": "assistant", "content": a.content or None, "reasoning_content": a.reasoning or None}
    if tracker.tools is not None and tracker.tools.calls:
        message["content"] = a.content or None
        message["tool_calls"] = [call.to_openai() for call in tracker.tools.calls]
    lps = {"content": f.chat_logprobs(a.merged(), top_n)} if top_n is not None else None
    return {"index": a.index, "message": message, "logprobs": lps, "finish_reason": a.finish_reason,
            "stop_reason": a.stop_reason}


def _completion_choice(a: f.Accumulated, top_n: int | None, echo: f.Delta | None, prompt_lps: list | None,
                       decode: Callable[[int], str]) -> dict:
    merged = a.merged() if echo is None else f.with_echo(echo, a.merged())
    lps = f.completion_logprobs(merged, top_n, decode) if top_n is not None else None
    choice = {"index": a.index, "text": f.completion_text(merged), "logprobs": lps, "finish_reason": a.finish_reason,
              "stop_reason": a.stop_reason}
    if prompt_lps is not None:
        choice["prompt_logprobs"] = prompt_lps
    return choice


async def _merged(agens: list[AsyncIterator[RequestOutput]], failed: list[int]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(part, output) from each part's outputs as they come; one part is iterated directly (no task, no queue).
    An exception of any part is raised here, its index appended to `failed` first; closing this generator
    cancels the parts still running."""
    if len(agens) == 1:
        try:
            async for out in agens[0]:
                yield 0, out
        except Exception:
            failed.append(0)
            raise
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, agen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in agen:
                queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, agen)) for i, agen in enumerate(agens)]
    try:
        running = len(tasks)
        while running:
            i, out, error = await queue.get()
            if error is not None:
                failed.append(i)
                raise error
            if out is None:
                running -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()


async def stream_events(gens: list[Generation], req: Any, agens: list[AsyncIterator[RequestOutput]],
                        chat: bool) -> AsyncIterator[bytes]:
    """The events of one request, or of a completion with several prompts (one part each): part i's choice j
    is sent as index i * n + j, and the usage is the parts' sum."""
    trackers = [_trackers(gen, req, chat) for gen in gens]
    top_n = p.num_logprobs(req)
    opts = req.stream_options or p.StreamOptions()
    base = f.envelope("chat.completion.chunk" if chat else "text_completion", response_id(gens), gens[0].model)
    started = [[False] * req.n for _ in gens]
    echo: list[f.Delta | None] = [None] * len(gens)  # with echo: each part's prompt, before its choices' first text
    echo_span = [0] * len(gens)
    decode = _decoder(gens[0])
    failed: list[int] = []  # the part whose failure ends the stream
    try:
        async for i, out in _merged(agens, failed):
            gens[i].observe(out)
            for d in _deltas(trackers[i], out):
                first = not started[i][d.index]
                if chat and first:  # a choice opens with its role alone, as OpenAI's and vLLM's streams do
                    started[i][d.index] = True
                    yield sse(_with_usage({**base, "choices": [f.chat_role_choice(d.index + i * req.n)]}, opts,
                                          gens, trackers))
                    first = False
                if not ((first and not chat and req.echo) or d.content or d.reasoning or d.tool_calls
                        or d.finish_reason or top_n is not None):
                    continue  # text held back: an empty delta tells the client nothing
                started[i][d.index] = True
                if chat:
                    choice = f.chat_chunk_choice(d, top_n)
                else:
                    if req.echo:  # the prompt's logprobs are all in by the first token
                        if echo[i] is None:
                            echo[i] = _echo(gens[i], req, out)
                            echo_span[i] = f.echo_span(echo[i], decode)  # the output's offsets go on from here
                        d = f.with_echo(echo[i], d) if first else dataclasses.replace(
                            d, text_offset=d.text_offset + echo_span[i])
                    choice = f.completion_chunk_choice(d, top_n, decode)
                choice["index"] += i * req.n
                yield sse(_with_usage({**base, "choices": [choice]}, opts, gens, trackers))
        if opts.include_usage:
            yield sse({**base, "choices": [], "usage": _total_usage(gens, trackers)})
        for gen in gens:
            gen.finish("ok")  # before [DONE]: a client that reads metrics or usage next sees this request
        yield SSE_DONE
    except (EngineDeadError, RequestFailedError) as e:
        err = _dead(e) if isinstance(e, EngineDeadError) else _refused(e, chat)
        end_parts(gens, "error", err.status, None if isinstance(e, EngineDeadError) else failed)
        yield sse(err.body())
    except ServerStoppingError as e:
        err = _stopping(e)
        end_parts(gens, "aborted", err.status)
        yield sse(err.body())
    except Exception as e:  # headers are sent: the error can only travel as an event
        logger.exception("stream %s failed", base["id"])
        end_parts(gens, "error", 500, failed)
        yield sse(error_body(500, f"internal server error ({type(e).__name__})"))
    finally:
        # Reached with requests unfinished only when the client went away (the task was cancelled):
        # abort them in the engine now; nothing here may await.
        end_parts(gens, "aborted", 499)


def end_parts(gens: list[Generation], outcome: str, status: int, failed: list[int] | None = None) -> None:
    """Aborts in the engine and finishes each part not yet finished (the others of a failed part run on
    otherwise; abort and finish are idempotent). With `failed` (the parts that failed; empty or None: not
    known, or all of them) the others are audited as aborted, with the response's status: they did not fail,
    another prompt of their request did."""
    for i, gen in enumerate(gens):
        if not gen.finished:
            gen.st.engine.abort(gen.request_id)
            gen.finish(outcome if not failed or i in failed else "aborted", status)


def _with_usage(chunk: dict, opts: p.StreamOptions, gens: list[Generation],
                trackers: list[list[f.ChoiceTracker]]) -> dict:
    """A chunk with stream_options' usage field: the running total under continuous_usage_stats, else null."""
    if opts.include_usage:
        chunk["usage"] = _total_usage(gens, trackers) if opts.continuous_usage_stats else None
    return chunk


def _total_usage(gens: list[Generation], trackers: list[list[f.ChoiceTracker]]) -> dict:
    if len(gens) == 1:
        return _usage(gens[0], trackers[0])
    return f.sum_usage([_usage(gen, t) for gen, t in zip(gens, trackers, strict=True)])


def response_id(gens: list[Generation]) -> str:
    """The id a response carries: its request's, or for several prompts the id their `<id>-<i>` share."""
    return gens[0].request_id if len(gens) == 1 else gens[0].request_id.rsplit("-", 1)[0]
