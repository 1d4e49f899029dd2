"""DeepSeek-R1 reasoning parser: splits `<think>…</think>` out of the text as reasoning_content.

R1 writes its reasoning first and closes it with `</think>`; newer R1 chat templates put the opening
`<think>` into the prompt, so the output may or may not start with it. Everything before `</think>`
is reasoning, everything after is content; with no `</think>` at all (the budget ran out while
thinking) the whole text is reasoning.

Streaming-safe: a delta that ends in a prefix of a tag (`</th`) is held back until the next delta
shows whether the tag completes, so a client never sees half a tag in either field.
"""

from __future__ import annotations

import contextlib
from typing import Any

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1",)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self) -> None:
        self.in_reasoning = True
        self._at_start = True
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of output text."""
        if not self.in_reasoning:
            return "", text
        buf = self._held + text
        self._held = ""
        if self._at_start:
            if START.startswith(buf):  # could still become the opening tag
                self._held = buf
                return "", ""
            self._at_start = False
            buf = buf.removeprefix(START)
        i = buf.find(END)
        if i >= 0:
            self.in_reasoning = False
            return buf[:i], buf[i + len(END):]
        keep = _partial_suffix(buf, END)
        if keep:
            self._held = buf[-keep:]
            buf = buf[:-keep]
        return buf, ""

    def flush(self) -> tuple[str, str]:
        """Whatever is held back, at the end of the output (an unfinished tag is just text)."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def marker_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """The ids of `<think>` and `</think>` where each is one token of the tokenizer (DeepSeek's, the R1
    distills' and the demo's are), else None; looked up once per tokenizer."""
    cached = getattr(tokenizer, "_deepserve_think_ids", None)
    if cached is None:
        cached = tuple(_one_token(tokenizer, tag) for tag in (START, END))
        with contextlib.suppress(AttributeError):
            tokenizer._deepserve_think_ids = cached
    return cached


def _one_token(tokenizer: Any, text: str) -> int | None:
    # An unknown token converts to the unknown token's id (or None): only an id that spells `text` back is its.
    token_id = tokenizer.convert_tokens_to_ids(text)
    return token_id if token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == text else None


class ReasoningCount:
    """usage.completion_tokens_details.reasoning_tokens, as vLLM counts them: the output tokens inside the
    reasoning section, neither `<think>` nor `</think>` included, the same tokens a thinking_token_budget
    bounds (server/tool_grammar.py), so a budget of N reads at most N. The output starts in the section,
    as ReasoningSplitter reads it: a leading `<think>` token is its marker and `</think>` ends it.

    Counted by token id when each marker is one token; otherwise (a tokenizer that spells them in pieces)
    every token of an output piece that begins inside the section is counted, which includes the pieces of
    `</think>`."""

    def __init__(self, think_ids: tuple[int | None, int | None] = (None, None)) -> None:
        self.start_id, self.end_id = think_ids
        self.tokens = 0
        self._seen = 0  # output tokens looked at
        self._over = False

    def add(self, token_ids: list[int], in_reasoning: bool) -> None:
        """The piece's new token ids; `in_reasoning`: the splitter's state before the piece's text."""
        if self.end_id is None:
            self.tokens += len(token_ids) if in_reasoning else 0
            return
        for tid in token_ids:
            first, self._seen = self._seen == 0, self._seen + 1
            if self._over:
                return
            if tid == self.end_id:
                self._over = True
            elif not (first and tid == self.start_id):
                self.tokens += 1


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output; None for an empty part."""
    s = ReasoningSplitter()
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return (r1 + r2) or None, (c1 + c2) or None
