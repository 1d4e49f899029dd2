"""Stream deltas from cumulative outputs: stop-string hold-back, reasoning split, logprob shapes."""

from __future__ import annotations

import math

from deepserve.engine.outputs import CompletionOutput, Logprob
from deepserve.server.openai_format import (
    Accumulated,
    ChoiceTracker,
    Delta,
    chat_logprobs,
    completion_logprobs,
    completion_text,
    echo_span,
    prompt_logprobs,
    usage,
    with_echo,
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


def test_reasoning_tokens_are_those_between_the_markers():
    """vLLM's count, the tokens a thinking_token_budget bounds: neither <think> (a leading one) nor </think>,
    nor anything after it, even when one piece brings several tokens. It used to count the closing token,
    so a budget of N read N + 1 (N + 2 with the <think> the grammar writes)."""
    START, END = 90, 91
    for pieces, reasoning in [
        ([("<think>", [START]), ("<think>ab", [START, 1, 2]), ("<think>ab</think>", [START, 1, 2, END]),
          ("<think>ab</think>yes", [START, 1, 2, END, 3])], 2),
        ([("ab", [1, 2]), ("ab</think>yes", [1, 2, END, 3]), ("ab</think>yes!", [1, 2, END, 3, 4])], 2),
        ([("a</think>b<think>c", [1, END, 2, START, 3])], 1),  # the section ends once
        ([("abc", [1, 2, 3])], 3),  # cut off while thinking: all of it
    ]:
        t = ChoiceTracker(0, holdback=0, reasoning=True, think_ids=(START, END))
        acc = Accumulated(0)
        for text, ids in pieces:
            if d := t.advance(out(text, ids)):
                acc.add(d)
        acc.add(t.advance(out(*pieces[-1], finish="length")))
        assert t.reasoning_tokens == reasoning, pieces
        assert "</think>" not in acc.reasoning


def test_echo_puts_the_prompt_and_its_logprobs_first():
    # The prompt's tokens spell "<s>Hi you" where its text is "Hi you": the offsets are one running total of the
    # tokens' lengths through prompt and output, as vLLM counts them (the output's first at 3 + 2 + 4 = 9, not
    # back at the text's 6), as a stream's later chunks give them too (echo_span).
    you = {8: Logprob(-0.5, 2, " you"), 9: Logprob(-0.2, 1, " me")}
    prompt = Delta(0, "Hi you", token_ids=[6, 7, 8], logprobs=[None, {7: Logprob(-0.7, 1, "Hi")}, you])
    output = Delta(0, " there", token_ids=[5], logprobs=[{5: Logprob(-1.0, 1, " there")}], text_offset=0)
    echoed = with_echo(prompt, output)
    assert completion_text(echoed) == "Hi you there"
    lps = completion_logprobs(echoed, 1, decode=lambda tid: {6: "<s>"}[tid])
    assert lps == {"tokens": ["<s>", "Hi", " you", " there"], "token_logprobs": [None, -0.7, -0.5, -1.0],
                   "top_logprobs": [None, {"Hi": -0.7}, {" me": -0.2, " you": -0.5}, {" there": -1.0}],
                   "text_offset": [0, 3, 5, 9]}
    assert echo_span(prompt, decode=lambda tid: {6: "<s>"}[tid]) == 9
    assert prompt_logprobs(prompt.logprobs[1:] + [{3: Logprob(-math.inf, 4, "z")}]) == [
        {"7": {"logprob": -0.7, "rank": 1, "decoded_token": "Hi"}},
        {"8": {"logprob": -0.5, "rank": 2, "decoded_token": " you"},
         "9": {"logprob": -0.2, "rank": 1, "decoded_token": " me"}},
        {"3": {"logprob": -9999.0, "rank": 4, "decoded_token": "z"}}]
    assert prompt_logprobs([None]) == [None]


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


def _stream_with_logprobs(tok, text: str, stop: tuple[str, ...] = ()) -> tuple[list, str]:
    """Deltas of a stream that carries logprobs, fed one token a step through the engine's detokenizer,
    and the final text."""
    from deepserve.engine.detokenizer import IncrementalDetokenizer
    from deepserve.engine.token_bytes import TokenBytes

    ids = tok.encode(text, add_special_tokens=False)
    detok, spell = IncrementalDetokenizer(tok, [], stop=stop), TokenBytes(tok)
    holdback = max((len(s) for s in stop), default=1) - 1
    tracker, deltas, lps = ChoiceTracker(0, holdback, reasoning=False), [], []
    for i, tid in enumerate(ids):
        lps.append({tid: Logprob(-1.0, 1, tok.decode([tid]), spell(tid, tok.decode([tid])))})
        stopped = detok.update([tid])
        final = stopped is not None or i == len(ids) - 1
        if final:
            detok.finish()
        c = CompletionOutput(0, detok.output_text, ids[:i + 1], -1.0, list(lps), "stop" if final else None,
                             None, list(detok.token_text_ends))
        if d := tracker.advance(c):
            deltas.append(d)
        if final:
            return deltas, detok.output_text
    raise AssertionError("unreachable")


def test_each_streamed_chunk_carries_the_logprobs_of_its_own_text():
    # Byte-level tokens that end inside a character (CJK, emoji) have no text of their own until the
    # character completes: their logprobs must travel with the chunk whose text holds that character.
    from deepserve.demo import CORPUS, SPECIAL_TOKENS, train_bpe_tokenizer

    tok = train_bpe_tokenizer(CORPUS, 1000, SPECIAL_TOKENS)
    text = "深度求索 builds 🚀✨ models; 注意力 is all you need. 🚀"
    for stop in [(), ("STOP",)]:  # with a stop string, chunks also hold back the last 3 characters
        deltas, final = _stream_with_logprobs(tok, text, stop)
        assert "".join(d.content for d in deltas) == final == text
        partial = 0
        for d in deltas:
            spelled = [chat_logprobs(d, 0)[k]["bytes"] for k in range(len(d.token_ids))]
            assert b"".join(bytes(b) for b in spelled) == d.content.encode()
            partial += sum("\ufffd" in lp[t].decoded_token for t, lp in zip(d.token_ids, d.logprobs, strict=True))
        assert partial > 0  # the case this test is about occurred
