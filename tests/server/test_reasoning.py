"""DeepSeek-R1 reasoning split: same result however the text is cut into stream deltas."""

from __future__ import annotations

import pytest

from deepserve.server.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    ("<think>plan a</think>answer", ("plan a", "answer")),
    ("plan a</think>\n\nanswer", ("plan a", "\n\nanswer")),  # template put <think> in the prompt
    ("still thinking", ("still thinking", None)),  # budget ran out mid-thought
    ("<think></think>just answer", (None, "just answer")),
    ("a < b </th is not a tag</think>ok </think> stays", ("a < b </th is not a tag", "ok </think> stays")),
    ("<thin", ("<thin", None)),
    ("", (None, None)),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_whole_text(text, expected):
    assert split_reasoning(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_every_two_way_and_char_split_streams_the_same(text, expected):
    pieces_options = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in pieces_options:
        s = ReasoningSplitter()
        reasoning = content = ""
        for piece in pieces:
            r, c = s.feed(piece)
            assert "</think>" not in r + c or "stays" in text
            reasoning, content = reasoning + r, content + c
        r, c = s.flush()
        assert ((reasoning + r) or None, (content + c) or None) == expected, pieces


def test_partial_tag_is_held_back():
    s = ReasoningSplitter()
    assert s.feed("abc</th") == ("abc", "")
    assert s.feed("ink>x") == ("", "x")
    assert not s.in_reasoning


def test_a_continued_message_s_own_markers_say_whether_its_reasoning_is_open():
    # continue_final_message: the prompt ends inside the assistant's message, so its last marker decides (without
    # continuing, only how the prompt ends: a generation prompt after an earlier closed turn leaves it to the model)
    from deepserve.server.tools import prompt_thinking

    history = "<｜User｜>q<｜Assistant｜><think>a</think>b<｜User｜>q2<｜Assistant｜>"
    assert prompt_thinking(history + "<think>hmm</think>The answer is", continuing=True) == "closed"
    assert prompt_thinking(history + "<think>hmm, so", continuing=True) == "open"
    assert prompt_thinking(history + "The answer is", continuing=True) == "closed"
    assert prompt_thinking(history) is None and prompt_thinking(history + "<think>\n") == "open"
    assert prompt_thinking(history + "</think>") == "closed"
