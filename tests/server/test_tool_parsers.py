"""DeepSeek tool-call parsers on hand-written markup (the formats of DeepSeek-V3's and V3.1's published chat
templates), whole and streamed: every split of the text into two pieces, and one character at a time."""

from __future__ import annotations

import json

import pytest

from deepserve.server.tool_parsers import PARSERS, ToolCallSplitter, split_tool_calls

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "CET"}'),
         ("noop", "{}")]


def v3(content: str, calls: list[tuple[str, str]]) -> str:
    body = "".join(f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}" for name, args in calls)
    return f"{content}{B}{body}{E}"


def v31(content: str, calls: list[tuple[str, str]]) -> str:
    return f"{content}{B}{''.join(f'{CB}{name}{SEP}{args}{CE}' for name, args in calls)}{E}"


CASES = [
    ("deepseek_v3", v3, "Let me check. ", CALLS),
    ("deepseek_v3", v3, "", CALLS[:1]),
    ("deepseek_v31", v31, "Checking <｜tool", CALLS),  # content that starts like a marker but is not one
    ("deepseek_v31", v31, "", CALLS[1:]),
]


def _stream(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[list[dict]]]:
    s = ToolCallSplitter(PARSERS[parser])
    content, calls, chunks = "", {}, []
    for piece in [*pieces, None]:
        text, deltas = s.feed(piece) if piece is not None else s.flush()
        content += text
        chunks.append(deltas)
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())], chunks


@pytest.mark.parametrize("parser,render,content,calls", CASES)
def test_whole_text(parser, render, content, calls):
    got_content, got_calls = split_tool_calls(render(content, calls), parser)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for c in got_calls:
        json.loads(c.arguments)
        assert c.id.startswith("call_") and c.to_openai()["function"]["name"] == c.name


@pytest.mark.parametrize("parser,render,content,calls", CASES)
def test_every_split_point(parser, render, content, calls):
    text = render(content, calls)
    for i in range(len(text) + 1):
        got = _stream(parser, [text[:i], text[i:]])
        assert got[:2] == (content, calls), i


@pytest.mark.parametrize("parser,render,content,calls", CASES)
def test_one_character_at_a_time(parser, render, content, calls):
    text = render(content, calls)
    got_content, got_calls, chunks = _stream(parser, list(text))
    assert (got_content, got_calls) == (content, calls)
    # No fragment ever carries a piece of a marker.
    for deltas in chunks:
        for d in deltas:
            assert "｜" not in d["function"]["arguments"] and "```" not in d["function"]["arguments"]


def test_text_without_calls_is_all_content():
    text = "Plain answer with a < and a <｜ and ``` inside."
    for parser in PARSERS:
        assert _stream(parser, list(text))[:2] == (text, [])


def test_unfinished_call_keeps_its_arguments():
    text = v3("", CALLS[:1])[: -len(f"\n```{CE}{E}")]  # the output ran out of tokens mid-arguments
    content, calls, _ = _stream("deepseek_v3", [text[:40], text[40:]])
    assert content == "" and calls == [("get_weather", CALLS[0][1])]
