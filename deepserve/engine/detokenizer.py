"""Incremental detokenization: output token ids in, final text and stream deltas out.

Decoding one token at a time is wrong for byte-level BPE: a token can end inside a multi-byte
UTF-8 character (a Chinese character or an emoji spans 3-4 bytes, often 2-3 tokens), and
decoding it alone gives U+FFFD. So each step decodes a small window — a few already-final tokens
of left context (prefix_offset..read_offset) plus the tokens not yet turned into text — and
keeps the text past the context only when it does not end in U+FFFD; otherwise it waits for the
next token. This is the scheme vLLM's incremental detokenizer uses; the work per token is two
decodes of a few tokens, never a decode of the whole output.

Stop strings are searched in the text each update adds, starting far enough back that a stop
string straddling earlier text is found; as in vLLM, not before the output has more than
min_tokens tokens (text completed by the first min_tokens tokens is never searched on its own).
Streaming deltas hold back the last (longest stop string - 1) characters so a client never sees
the start of a stop string that later matches and is cut off.

The tokenizer is duck-typed (anything with Hugging Face's `decode`); this module imports neither
torch nor transformers, like the rest of the engine package.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context of the first output tokens: SentencePiece-style decoders
# drop the leading space of a sequence's first word, so output must not be decoded on its own.
_PROMPT_CONTEXT_TOKENS = 5


# Where Hugging Face's fast tokenizers define decode (the base class) and _decode (the fast class;
# transformers 4.x and 5.x): there decode of a flat id list with clean-up off is exactly the Rust
# tokenizer's own decode, less the Python argument conversion and dispatch (5.5 -> 2.0 µs a call on our
# CPU machine; the detokenizer makes two calls a token).
_HF_DECODE_OWNERS = {"decode": frozenset({"transformers.tokenization_utils_base"}),
                     "_decode": frozenset({"transformers.tokenization_utils_fast",
                                           "transformers.tokenization_utils_tokenizers"})}


def backend_decode(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The Rust tokenizer's decode when `tokenizer` is a Hugging Face fast tokenizer whose decode path no
    subclass overrides (so both give the same text with clean-up off); None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    for name, modules in _HF_DECODE_OWNERS.items():
        owner = next((c for c in type(tokenizer).__mro__ if name in vars(c)), None)
        if owner is None or owner.__module__ not in modules:
            return None
    return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of one sequence's output tokens.

    Protocol per engine step: `stop = update(new_ids)`; when the request finishes for any reason
    (a matched stop, eos, length, abort) call `get_delta(finished=True)` or `finish()` once, after
    which `output_text` is final. Before that, `output_text` lacks a trailing partial character
    that later tokens may still complete; at finish it is flushed as U+FFFD, exactly as
    `tokenizer.decode(output_ids, skip_special_tokens=...)` renders it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        fast_decode: Callable[[list[int], bool], str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._fast_decode = fast_decode  # backend_decode(tokenizer), found once by the caller
        self.min_tokens = min_tokens
        self._num_tokens = 0  # output tokens seen
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched_stop: str | None = None
        self.num_tokens_at_stop: int | None = None  # output tokens up to the one completing matched_stop
        self._max_stop_len = max(map(len, self.stop), default=0)
        # A held-back suffix can only be cut off when the stop string itself is cut off.
        self._holdback = 0 if include_stop_str_in_output else max(self._max_stop_len - 1, 0)
        self._finished = False

        # Window invariants: text of _ids[:_read_offset] is final (output part already appended);
        # _ids[_prefix_offset:_read_offset] starts and ends on character boundaries and its text
        # is cached in _prefix_text. The tokens after _read_offset have produced no text yet.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends inside a character: its bytes would merge with ours
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)

        # The output text as pieces, joined only when output_text is read, so an update costs
        # O(new text) however long the output is. Positions below count characters.
        self._pieces: list[str] = []
        self._num_chars = 0
        self._num_sent = 0  # characters already returned by get_delta
        # token_text_ends[k]: where output token k's text ends in output_text, for the tokens whose text
        # is final (a token ending inside a character waits for the rest of it). Streams that carry
        # logprobs cut their text at these boundaries, so each chunk's logprobs are its tokens'.
        self.token_text_ends: list[int] = []

    @property
    def output_text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def finished(self) -> bool:
        return self._finished

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append sampled tokens; return the stop string they complete, or None.

        On a match output_text ends right before the stop string (right after it with
        include_stop_str_in_output) and later tokens are ignored: the request is over.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.update() called after finish()")
        if self.matched_stop is not None:
            return None
        parts = []
        pending = 0  # characters in parts
        # One token at a time, so text completed mid-batch is not held back by a partial
        # character at the batch's end.
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._num_tokens += 1
            text = self._decode_next()
            if self._num_tokens <= self.min_tokens:
                self._add_text(text)  # no stop string may end the output yet
            elif text:
                parts.append(text)
                pending += len(text)
            if text or self._read_offset == len(self._ids):  # every token so far has its text
                self._mark_ends(self._num_tokens, self._num_chars + pending)
        return self._append("".join(parts)) if parts else None

    def _mark_ends(self, num_tokens: int, end: int) -> None:
        self.token_text_ends.extend([end] * (num_tokens - len(self.token_text_ends)))

    def finish(self) -> str | None:
        """Flush text still waiting for the rest of a character; idempotent.

        Returns a stop string matched in the flushed text (rare: the text before a dangling
        partial character), which the caller may record as the stop reason."""
        if self._finished:
            return None
        self._finished = True
        if self.matched_stop is not None or self._read_offset == len(self._ids):
            return None
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        stop = self._append(text[len(self._prefix_text) :])
        self._mark_ends(self._num_tokens, self._num_chars)
        return stop

    def get_delta(self, finished: bool) -> str:
        """Text not returned before. While the request runs the last (longest stop string - 1)
        characters stay back; `finished=True` flushes everything (and calls finish())."""
        if finished:
            self.finish()
        final = finished or self.matched_stop is not None
        end = self._num_chars if final else self._num_chars - self._holdback
        if end <= self._num_sent:
            return ""
        delta = self._text_from(self._num_sent)[: end - self._num_sent]
        self._num_sent = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: applied to a window it is not the same as applied
        # to the whole text (it joins across the window's edge), and it corrupts BPE text anyway.
        if self._fast_decode is not None:
            return self._fast_decode(ids, self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_next(self) -> str:
        """Text the window's unread tokens complete, advancing the window; '' to wait."""
        text = self._decode(self._ids[self._prefix_offset :])
        # Nothing new (e.g. a skipped special token), or the text ends inside a character.
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        # Only the window is ever decoded again; drop the ids before it.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _add_text(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._num_chars += len(text)

    def _append(self, text: str) -> str | None:
        """Add text and search it for a stop string; the one matched, or None."""
        if not text:
            return None
        start = self._num_chars
        self._add_text(text)
        if not self.stop:
            return None
        # Earlier text held no stop string (else we would have stopped), so a match ends in the
        # new text and starts at most (its length - 1) characters before it.
        window_start = max(0, start - self._max_stop_len + 1)
        window = self._text_from(window_start)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = window.find(s, max(0, start - window_start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        # The output's tokens end with the one that completes the stop string: later tokens of the same
        # update (several per step under speculative decoding) are not part of it.
        self.num_tokens_at_stop = bisect.bisect_left(self.token_text_ends, window_start + i + len(s)) + 1
        self._truncate(window_start + i + (len(s) if self.include_stop_str_in_output else 0))
        self.matched_stop = s
        return s

    def _text_from(self, start: int) -> str:
        """output_text[start:], touching only the pieces it spans."""
        remaining = self._num_chars - start
        parts = []
        for piece in reversed(self._pieces):
            if remaining <= 0:
                break
            if len(piece) >= remaining:
                parts.append(piece[len(piece) - remaining :])
                break
            parts.append(piece)
            remaining -= len(piece)
        return "".join(reversed(parts))

    def _truncate(self, length: int) -> None:
        drop = self._num_chars - length
        while drop > 0:
            last = self._pieces[-1]
            if len(last) <= drop:
                self._pieces.pop()
                drop -= len(last)
            else:
                self._pieces[-1] = last[: len(last) - drop]
                drop = 0
        self._num_chars = length
        # Tokens whose text the cut removed end at the cut.
        self.token_text_ends = [min(e, length) for e in self.token_text_ends]
        # Hold-back keeps a stop string's first character unsent, so this never cuts sent text.
        assert self._num_sent <= length
