"""Engine outputs → OpenAI JSON: choices, stream deltas, logprobs, usage.

A ChoiceTracker turns one completion's successive cumulative outputs into deltas. While the
completion runs it holds back the last (longest stop string - 1) characters, like the engine's
detokenizer, so a client never receives the start of a stop string that is later cut off.
Non-streaming responses are built from the same deltas, so both paths count tokens alike.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deepserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs
from deepserve.server.reasoning import ReasoningCount, ReasoningSplitter
from deepserve.server.tool_parsers import PARSERS, ToolCallSplitter

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass
class Delta:
    index: int
    content: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    # None at a position without logprobs: the first token of an echoed prompt (nothing predicts it)
    logprobs: list[dict[int, Logprob] | None] | None = None
    text_offset: int = 0  # characters of output before this delta's text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's streaming shape (index, id, function)
    echo: Delta | None = None  # vLLM's echo: the prompt, sent before a completion's first delta (with_echo)


class ChoiceTracker:
    def __init__(self, index: int, holdback: int, reasoning: bool, tool_parser: str | None = None,
                 think_ids: tuple[int | None, int | None] = (None, None)) -> None:
        """think_ids: the ids of <think> and </think> when each is one token (reasoning.marker_ids)."""
        self.index = index
        self.holdback = holdback
        self.splitter = ReasoningSplitter() if reasoning else None
        self.reasoning = ReasoningCount(think_ids)
        self.tools = ToolCallSplitter(PARSERS[tool_parser]) if tool_parser else None
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.tokens

    def advance(self, c: CompletionOutput) -> Delta | None:
        if self.done:
            return None
        final = c.finish_reason is not None
        end = len(c.text) if final else max(self.sent_chars, len(c.text) - self.holdback)
        tokens = len(c.token_ids)
        if c.token_text_ends is not None and not final:
            # Logprobs travel with their tokens' text: the chunk ends at the last token boundary
            # before `end`, and tokens whose text is not all sent yet wait for the next chunk.
            tokens = max(self.sent_tokens, bisect.bisect_right(c.token_text_ends, end))
            end = max(self.sent_chars, c.token_text_ends[tokens - 1] if tokens else 0)
        delta = Delta(self.index, c.text[self.sent_chars:end], text_offset=self.sent_chars,
                      token_ids=c.token_ids[self.sent_tokens:tokens])
        if c.logprobs is not None:
            delta.logprobs = c.logprobs[self.sent_tokens:tokens]
        self.sent_chars, self.sent_tokens = end, tokens
        if self.splitter is not None:
            self.reasoning.add(delta.token_ids, self.splitter.in_reasoning)
            delta.reasoning, delta.content = self.splitter.feed(delta.content)
            if final:
                r, t = self.splitter.flush()
                delta.reasoning, delta.content = delta.reasoning + r, delta.content + t
        if self.tools is not None:  # tool calls are read from the content, after the reasoning
            delta.content, delta.tool_calls = self.tools.feed(delta.content)
            if final:
                t, calls = self.tools.flush()
                delta.content, delta.tool_calls = delta.content + t, delta.tool_calls + calls
        if final:
            self.done = True
            delta.finish_reason, delta.stop_reason = c.finish_reason, c.stop_reason
            if delta.finish_reason == "stop" and self.tools is not None and self.tools.calls:
                delta.finish_reason = "tool_calls"
        elif not (delta.content or delta.reasoning or delta.token_ids or delta.tool_calls):
            return None
        return delta


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _top(position: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda x: x[1].rank)[:n]


def _token_str(lp: Logprob, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"<token {token_id}>"


def _token_bytes(lp: Logprob, token: str) -> list[int]:
    # The token's own bytes: a token ending inside a character decodes to U+FFFD, whose bytes are not its
    return list(lp.decoded_bytes if lp.decoded_bytes is not None else token.encode())


def chat_logprobs(delta: Delta, top_n: int) -> list[dict]:
    out = []
    for tid, pos in zip(delta.token_ids, delta.logprobs or [], strict=False):
        sampled = pos.get(tid) or Logprob(-math.inf)
        tok = _token_str(sampled, tid)
        tops = [{"token": (s := _token_str(lp, t)), "logprob": _lp(lp.logprob), "bytes": _token_bytes(lp, s)}
                for t, lp in _top(pos, top_n)]
        out.append({"token": tok, "logprob": _lp(sampled.logprob), "bytes": _token_bytes(sampled, tok),
                    "top_logprobs": tops})
    return out


def completion_logprobs(delta: Delta, top_n: int, decode: Callable[[int], str] | None = None) -> dict:
    """OpenAI's completion logprobs; a position without logprobs (an echoed prompt's first token) has its
    token spelled by `decode` and null logprobs, as vLLM writes it. An echoed prompt's tokens come first,
    their offsets counted from 0, and the output's go on from where the prompt's tokens end (echo_span)."""
    if delta.echo is not None:
        head = completion_logprobs(delta.echo, top_n, decode)
        span = sum(len(token) for token in head["tokens"])  # echo_span, from the tokens just spelled
        tail = completion_logprobs(dataclasses.replace(delta, echo=None, text_offset=delta.text_offset + span),
                                   top_n, decode)
        return {key: head[key] + tail[key] for key in head}
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = delta.text_offset
    for tid, pos in zip(delta.token_ids, delta.logprobs or [], strict=False):
        if pos is None:
            tok = decode(tid) if decode is not None else f"<token {tid}>"
            tokens.append(tok)
            token_lps.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(tok)
            continue
        sampled = pos.get(tid) or Logprob(-math.inf)
        tok = _token_str(sampled, tid)
        tokens.append(tok)
        token_lps.append(_lp(sampled.logprob))
        top = {_token_str(lp, t): _lp(lp.logprob) for t, lp in _top(pos, top_n)}
        top.setdefault(tok, _lp(sampled.logprob))  # OpenAI lists the sampled token among the top too
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echo_span(echo: Delta, decode: Callable[[int], str] | None = None) -> int:
    """The characters an echoed prompt's tokens spell one after another (a bos token's text included): where
    the output's text_offset goes on from. vLLM counts one running total through the prompt and the output;
    the prompt's text alone (without the bos) would send the offsets back at the output's first token."""
    return sum(len(token) for token in completion_logprobs(echo, 0, decode)["tokens"])


def with_echo(prompt: Delta, delta: Delta) -> Delta:
    """`delta` with the prompt before it (vLLM's echo): the prompt's text before the delta's, and with
    logprobs its tokens' (completion_logprobs)."""
    return dataclasses.replace(delta, echo=prompt)


def completion_text(delta: Delta) -> str:
    return delta.echo.content + delta.content if delta.echo is not None else delta.content


def prompt_logprobs(positions: PromptLogprobs) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first: nothing predicts it) or, by token id,
    the logprob, rank and text of the prompt's own token and of the top k there (-inf clamped, as JSON
    has none)."""
    return [None if pos is None else
            {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in pos.items()}
            for pos in positions]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None) -> dict:
    u: dict = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
               "total_tokens": prompt_tokens + completion_tokens,
               "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u


def sum_usage(usages: list[dict]) -> dict:
    """The usage of several requests answered as one (a completion with several prompts)."""
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    reasoning = [u["completion_tokens_details"]["reasoning_tokens"] for u in usages if "completion_tokens_details" in u]
    return usage(sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages), cached,
                 sum(reasoning) if reasoning else None)


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created or int(time.time()),
            "model": model}


def chat_role_choice(index: int) -> dict:
    """The chunk that opens a streamed chat choice: its role and empty content, nothing generated yet."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
            "stop_reason": None}


def chat_chunk_choice(delta: Delta, top_n: int | None) -> dict:
    d: dict = {}
    if delta.content:
        d["content"] = delta.content
    if delta.reasoning:
        d["reasoning_content"] = delta.reasoning
    if delta.tool_calls:
        d["tool_calls"] = delta.tool_calls
    lps = {"content": chat_logprobs(delta, top_n)} if top_n is not None else None
    return {"index": delta.index, "delta": d, "logprobs": lps, "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason}


def completion_chunk_choice(delta: Delta, top_n: int | None, decode: Callable[[int], str] | None = None) -> dict:
    lps = completion_logprobs(delta, top_n, decode) if top_n is not None else None
    return {"index": delta.index, "text": completion_text(delta), "logprobs": lps,
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}


@dataclass
class Accumulated:
    """A whole choice gathered from its deltas (non-streaming responses)."""

    index: int
    content: str = ""
    reasoning: str = ""
    deltas: list[Delta] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, d: Delta) -> None:
        self.content += d.content
        self.reasoning += d.reasoning
        self.deltas.append(d)
        self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason

    def merged(self) -> Delta:
        merged = Delta(self.index, self.content, self.reasoning)
        for d in self.deltas:
            merged.token_ids += d.token_ids
            if d.logprobs is not None:
                merged.logprobs = (merged.logprobs or []) + d.logprobs
        return merged
