"""DeepSeek tool-call parsers on hand-written markup (the formats of DeepSeek-V3's and V3.1's published chat
templates), whole and streamed: every split of the text into two pieces, and one character at a time."""

from __future__ import annotations

import json

import pytest

from deepserve import demo
from deepserve.engine.outputs import CompletionOutput
from deepserve.loader.tokenizer import apply_chat_template
from deepserve.server.openai_format import Accumulated, ChoiceTracker
from deepserve.server.tool_parsers import PARSERS, ToolCallSplitter, split_tool_calls

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "CET"}'),
         ("noop", "{}")]


def v3(content: str, calls: list[tuple[str, str]], gap: str = "\n") -> str:
    """V3's template writes "\n" between two calls."""
    body = gap.join(f"{CB}function{SEP}{name}\n```json\n{args}\n```{CE}" for name, args in calls)
    return f"{content}{B}{body}{E}"


def v3_chained(content: str, calls: list[tuple[str, str]]) -> str:
    return v3(content, calls, gap="")


def v31(content: str, calls: list[tuple[str, str]], gap: str = "") -> str:
    """V3.1's template chains the calls without anything between them."""
    return f"{content}{B}{gap.join(f'{CB}{name}{SEP}{args}{CE}' for name, args in calls)}{E}"


def v31_spaced(content: str, calls: list[tuple[str, str]]) -> str:
    return v31(content, calls, gap="\n")


CASES = [
    ("deepseek_v3", v3, "Let me check. ", CALLS),
    ("deepseek_v3", v3, "", CALLS[:1]),
    ("deepseek_v3", v3, "", CALLS[1:]),
    ("deepseek_v3", v3_chained, "", CALLS),  # a model that leaves the newline out
    ("deepseek_v31", v31, "Checking <｜tool", CALLS),  # content that starts like a marker but is not one
    ("deepseek_v31", v31, "", CALLS[1:]),
    ("deepseek_v31", v31_spaced, "", CALLS),  # unasked-for newlines between calls (auto) are skipped
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


@pytest.mark.parametrize("parser,render", [("deepseek_v31", v31), ("deepseek_v3", v3)])
def test_reasoning_then_calls_through_the_response_builder(parser, render):
    """V3.1 with thinking on: the prompt opened <think>, the output is reasoning, </think>, then the calls.
    Read by the server's own ChoiceTracker (reasoning split first, then the calls), the text cut at every
    point: the reasoning lands in reasoning_content, the calls in tool_calls, nothing in content."""
    reasoning = "The user wants Paris; call both </th tools."
    text = reasoning + "</think>" + render("", CALLS[:2])
    for i in range(len(text) + 1):
        tracker, got = ChoiceTracker(0, holdback=0, reasoning=True, tool_parser=parser), Accumulated(0)
        for cut, finish in ((i, None), (len(text), "stop")):
            if d := tracker.advance(CompletionOutput(0, text[:cut], list(range(cut)), finish_reason=finish)):
                got.add(d)
        assert (got.reasoning, got.content, got.finish_reason) == (reasoning, "", "tool_calls"), i
        assert _calls_of(got.deltas) == CALLS[:2], i


def _calls_of(deltas) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in (tc for delta in deltas for tc in delta.tool_calls):
        if "id" in d:
            calls[d["index"]] = [d["function"]["name"], ""]
        calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(calls[k]) for k in sorted(calls)]


def test_demo_template_writes_v3s_parallel_calls():
    """The demo's chat template renders an assistant's calls as DeepSeek-V3's does: one "\\n" between two
    calls (the text v3() writes here), and the deepseek_v3 parser reads them back."""
    tok = demo.train_bpe_tokenizer(demo.CORPUS, demo.VOCAB_SIZE, demo.SPECIAL_TOKENS, demo.MARKER_TOKENS)
    tok.chat_template = demo.CHAT_TEMPLATE
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate(CALLS)]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    text = apply_chat_template(tok, messages, add_generation_prompt=False)
    turn = text.split(demo.ASSISTANT, 1)[1].removesuffix(demo.EOS)
    assert turn == v3("", CALLS)
    assert [(c.name, c.arguments) for c in split_tool_calls(turn, "deepseek_v3")[1]] == CALLS
