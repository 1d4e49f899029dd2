"""DeepSeek-R1 reasoning parser: splits `<think>…</think>` out of the text as reasoning_content.

R1 writes its reasoning first and closes it with `</think>`; newer R1 chat templates put the opening
`<think>` into the prompt, so the output may or may not start with it. Everything before `</think>`
is reasoning, everything after is content; with no `</think>` at all (the budget ran out while
thinking) the whole text is reasoning.

Streaming-safe: a delta that ends in a prefix of a tag (`</th`) is held back until the next delta
shows whether the tag completes, so a client never sees half a tag in either field.
"""

from __future__ import annotations

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


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output; None for an empty part."""
    s = ReasoningSplitter()
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return (r1 + r2) or None, (c1 + c2) or None
