"""Stream deltas from cumulative outputs: stop-string hold-back, reasoning split, logprob shapes."""

from __future__ import annotations

import math

from deepserve.engine.outputs import CompletionOutput, Logprob
from deepserve.server.openai_format import (
    Accumulated,
    ChoiceTracker,
    chat_logprobs,
    completion_logprobs,
    usage,
)


def out(text: str, ids: list[int], finish: str | None = None, logprobs=None) -> CompletionOutput:
    return CompletionOutput(0, text, ids, None, logprobs, finish)


def test_holdback_never_sends_what_a_stop_string_cuts():
    t = ChoiceTracker(0, holdback=2, reasoning=False)  # stop string "END"
    sent = []
    for cumulative, ids in [("Hello", [1]), ("Hello EN", [1, 2])]:
        if d := t.advance(out(cumulative, ids)):
            sent.append(d.content)
    assert "".join(sent) == "Hello "  # "EN" held back: it may be the start of "END"
    d = t.advance(out("Hello ", [1, 2, 3], finish="stop"))  # "END" matched and cut off
    assert "".join(sent) + d.content == "Hello " and d.finish_reason == "stop"
    assert t.advance(out("Hello ", [1, 2, 3], finish="stop")) is None  # done: nothing more


def test_reasoning_tracker_counts_thinking_tokens():
    t = ChoiceTracker(0, holdback=0, reasoning=True)
    acc = Accumulated(0)
    for text, ids in [("<think>a", [1]), ("<think>ab</th", [1, 2]), ("<think>ab</think>", [1, 2, 3]),
                      ("<think>ab</think>yes", [1, 2, 3, 4])]:
        if d := t.advance(out(text, ids)):
            acc.add(d)
    acc.add(t.advance(out("<think>ab</think>yes", [1, 2, 3, 4], finish="length")))
    assert (acc.reasoning, acc.content, t.reasoning_tokens) == ("ab", "yes", 3)
    assert acc.merged().token_ids == [1, 2, 3, 4]


def test_logprob_shapes():
    pos = {5: Logprob(-0.1, 1, "hi"), 6: Logprob(-2.0, 2, " x"), 7: Logprob(-math.inf, 3, "z")}
    t = ChoiceTracker(0, 0, False)
    d = t.advance(out("hi", [5], logprobs=[pos]))
    (entry,) = chat_logprobs(d, top_n=3)
    assert entry["token"] == "hi" and entry["bytes"] == [104, 105]
    assert [x["token"] for x in entry["top_logprobs"]] == ["hi", " x", "z"]
    assert entry["top_logprobs"][2]["logprob"] == -9999.0  # JSON has no -inf
    c = completion_logprobs(d, top_n=1)
    assert c == {"tokens": ["hi"], "token_logprobs": [-0.1], "top_logprobs": [{"hi": -0.1}], "text_offset": [0]}


def test_usage_shape():
    assert usage(3, 4, 1, None) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                    "prompt_tokens_details": {"cached_tokens": 1}}
    assert usage(3, 4, 0, 2)["completion_tokens_details"] == {"reasoning_tokens": 2}
