"""DeepSeek tool-call parsers: split the model's tool-call markup out of its text as OpenAI tool calls.

The markup, as DeepSeek's chat templates render an assistant's calls (and as the models write them):

  V3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
       \\n<｜tool▁call▁begin｜>...the next call...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  V3.1 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
       <｜tool▁call▁begin｜>...the next call...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(each second line follows its first directly). Between two calls DeepSeek-V3's published chat template
writes one "\\n"; V3.1's writes nothing (its tool prompt asks for calls chained without separators).
Format.call_gap holds that text; the parsers skip whatever stands between two calls, and the grammars
(tool_grammar.py) write exactly the gap there, and nothing else anywhere between the markers.

Text before the first `<｜tool▁calls▁begin｜>` is the message's content. Everything after it is calls.

Streaming-safe in the way of server/reasoning.py: text that ends in a prefix of a marker is held back
until the next piece shows whether the marker completes, so neither content nor arguments ever carry
half a marker. The non-streamed response is built with the same class (feed everything, then flush),
so a streamed call reassembles into exactly the non-streamed one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from deepserve.chat_markup import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

V3_ARGS_OPEN = "\n```json\n"
V3_ARGS_CLOSE = "\n```"


@dataclass(frozen=True)
class Format:
    """Where a call's name and arguments sit between CALL_BEGIN and CALL_END."""

    name: str
    type_prefix: str  # written before SEP (V3: "function"); the name follows SEP
    args_open: str  # between the name and the arguments
    args_close: str  # between the arguments and CALL_END
    call_gap: str  # what the model's chat template writes between one call's CALL_END and the next CALL_BEGIN

    def head_end(self) -> str:
        """What ends the name."""
        return self.args_open


V3 = Format("deepseek_v3", "function" + SEP, V3_ARGS_OPEN, V3_ARGS_CLOSE, "\n")
V31 = Format("deepseek_v31", "", SEP, "", "")
PARSERS = {f.name: f for f in (V3, V31)}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallSplitter:
    """Feeds on output text; returns (content delta, tool-call deltas in OpenAI's streaming shape)."""

    fmt: Format
    calls: list[ToolCall] = field(default_factory=list)
    _state: str = "content"  # content | between | head | args | done
    _held: str = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = self._feed(text)
        return content, _merged(deltas)

    def _feed(self, text: str) -> tuple[str, list[dict]]:
        buf, self._held = self._held + text, ""
        content, deltas = "", []
        while True:
            if self._state == "content":
                i = buf.find(CALLS_BEGIN)
                if i < 0:
                    keep = _partial_suffix(buf, CALLS_BEGIN)
                    content += buf[:len(buf) - keep]
                    self._held = buf[len(buf) - keep:]
                    return content, deltas
                content += buf[:i]
                buf, self._state = buf[i + len(CALLS_BEGIN):], "between"
            elif self._state == "between":  # expecting CALL_BEGIN or CALLS_END; anything else (V3's "\\n"
                # between calls, stray text) is dropped
                i, j = buf.find(CALL_BEGIN), buf.find(CALLS_END)
                if j >= 0 and (i < 0 or j < i):
                    self._state = "done"
                    return content, deltas
                if i < 0:
                    self._held = buf[len(buf) - max(_partial_suffix(buf, CALL_BEGIN),
                                                    _partial_suffix(buf, CALLS_END)):]
                    return content, deltas
                buf, self._state = buf[i + len(CALL_BEGIN):], "head"
            elif self._state == "head":  # type prefix and name, up to what opens the arguments
                i = buf.find(self.fmt.head_end())
                if i < 0:
                    self._held = buf
                    return content, deltas
                name = buf[:i].removeprefix(self.fmt.type_prefix).strip()
                call = ToolCall(new_call_id(), name)
                self.calls.append(call)
                deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
                buf, self._state = buf[i + len(self.fmt.head_end()):], "args"
            elif self._state == "args":
                end = self.fmt.args_close + CALL_END
                i = buf.find(end)
                piece = buf[:i] if i >= 0 else buf[:len(buf) - _partial_suffix(buf, end)]
                if piece:
                    self.calls[-1].arguments += piece
                    deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
                if i < 0:
                    self._held = buf[len(piece):]
                    return content, deltas
                buf, self._state = buf[i + len(end):], "between"
            else:  # done: whatever follows the calls is not part of the message
                return content, deltas

    def flush(self) -> tuple[str, list[dict]]:
        """At the end of the output: held-back text goes where it was heading (an unfinished marker is
        just text); an unfinished call's name is dropped, unfinished arguments are kept as they are."""
        held, self._held = self._held, ""
        if self._state == "content":
            return held, []
        if self._state == "args" and held:
            self.calls[-1].arguments += held
            return "", [{"index": len(self.calls) - 1, "function": {"arguments": held}}]
        return "", []


def _merged(deltas: list[dict]) -> list[dict]:
    """One delta per call: a call's argument fragments follow its first delta in one chunk."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"] and "id" not in d:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append(d)
    return out


def split_tool_calls(text: str, parser: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a finished output."""
    s = ToolCallSplitter(PARSERS[parser])
    c1, _ = s.feed(text)
    c2, _ = s.flush()
    return c1 + c2, s.calls
