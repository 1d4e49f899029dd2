from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from deepserve.demo import CORPUS, SPECIAL_TOKENS, train_bpe_tokenizer
from deepserve.engine.detokenizer import IncrementalDetokenizer

REPO = Path(__file__).resolve().parents[2]
# Characters the training corpus never saw are spelled byte by byte, so they split across tokens.
WORDS = " ".join(CORPUS).split() + "龘 鱻 你好 世界 模型 🚀 🦀 👩‍💻 🇯🇵 😊😊 naïve Ω≈ç√ e\u0301".split()


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(CORPUS, 1000, SPECIAL_TOKENS)


def random_text(rng: random.Random, n_words: int) -> str:
    return "".join(rng.choice(["", " ", " ", "\n"]) + rng.choice(WORDS) for _ in range(n_words))


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None) -> list[str]:
    """Feed ids in chunks of 1-3 (one at a time without rng); return every delta, the last at finish."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3) if rng else 1
        stopped = detok.update(ids[i : i + n])
        i += n
        if stopped:
            break
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return deltas


def test_splits_characters_across_tokens(tok):
    # The property the random tests rely on: some tokens end inside a character.
    ids = tok.encode("龘🚀", add_special_tokens=False)
    assert len(ids) > 2
    assert tok.decode(ids[:1]).endswith("\ufffd")


@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_equals_full_decode(tok, seed):
    rng = random.Random(seed)
    prompt = tok.encode(random_text(rng, 5))
    ids = tok.encode(random_text(rng, rng.randint(1, 40)), add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, rng)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in full
    assert detok.output_text == full
    assert "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(30))
def test_random_token_ids_equal_full_decode(tok, seed, skip_special_tokens):
    # Arbitrary ids: stray bytes, special tokens, and output that may end inside a character.
    rng = random.Random(1000 + seed)
    prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
    ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, rng)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == full
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_partial_character_is_held_back_until_complete(tok):
    ids = tok.encode("go 🦀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    seen = []
    for i in ids:
        detok.update([i])
        seen.append(detok.output_text)
        assert "\ufffd" not in detok.get_delta(finished=False)
    assert seen[-1] == "go 🦀"
    assert all(s in ("go", "go ", "go 🦀") for s in seen)


def test_partial_character_flushed_at_finish(tok):
    # Cut off mid-emoji (e.g. by max_tokens): the final text is what a full decode shows.
    ids = tok.encode("ok 🦀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [])
    detok.update(ids)
    streamed = detok.get_delta(finished=False)
    assert streamed.startswith("ok") and "\ufffd" not in streamed
    streamed += detok.get_delta(finished=True)
    assert streamed == detok.output_text == tok.decode(ids)
    assert streamed.endswith("\ufffd")


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("the cache is full STOP and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    results = [detok.update([i]) for i in ids]
    hit = results.index("STOP")
    assert [r for r in results if r] == ["STOP"]
    # The match needed several tokens, and it ended the output.
    assert "STOP" not in tok.decode(ids[hit : hit + 1])
    assert detok.output_text == "the cache is full "
    assert detok.matched_stop == "STOP"
    assert detok.get_delta(finished=True) == "the cache is full "


def test_stop_string_starting_in_earlier_updates(tok):
    ids = tok.encode("the scheduler hands out a budget", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["hands out a"])
    results = [detok.update([i]) for i in ids]
    assert results.count("hands out a") == 1
    assert detok.output_text == "the scheduler "


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_min_tokens_holds_stop_strings_back(tok, chunk):
    # vLLM's rule: a stop string ends the output only once it has more than min_tokens tokens; one
    # completed by the first min_tokens tokens stays in the text, the next occurrence stops it.
    ids = tok.encode("go STOP then more STOP tail", add_special_tokens=False)
    first_stop_end = next(n for n in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:n]))
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], min_tokens=first_stop_end)
    results = [detok.update(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert [r for r in results if r] == ["STOP"]
    assert detok.output_text == "go STOP then more "
    plain = IncrementalDetokenizer(tok, [], stop=["STOP"], min_tokens=first_stop_end - 1)
    plain.update(ids)
    assert plain.output_text == "go "  # one token fewer: the first STOP completes after min_tokens


def test_include_stop_str_in_output(tok):
    ids = tok.encode("tokens per second</end> trailing", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["</end>"], include_stop_str_in_output=True)
    deltas = stream(detok, ids)
    assert detok.output_text == "tokens per second</end>"
    assert "".join(deltas) == "tokens per second</end>"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["gamma", "beta gamma", "a b"])
    assert detok.update(ids) == "a b"
    assert detok.output_text == "alph"


def test_stop_string_in_prompt_is_not_matched(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("say STOP"), stop=["STOP"])
    assert detok.update(tok.encode(" and go", add_special_tokens=False)) is None
    assert detok.output_text == " and go"


def test_streaming_holds_back_possible_stop_prefix(tok):
    ids = tok.encode("the batch ST is STO then STOP here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    sent = ""
    for i in ids:
        if detok.update([i]):
            break
        sent += detok.get_delta(finished=False)
        # Hold back len("STOP") - 1 characters, and never anything the stop would cut.
        assert len(sent) == max(0, len(detok.output_text) - 3)
    assert "ST is STO" in sent  # released once later text showed they were not a stop
    sent += detok.get_delta(finished=True)
    assert sent == detok.output_text == "the batch ST is STO then "


def test_hold_back_released_at_finish_without_match(tok):
    ids = tok.encode("ends with ST", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    detok.update(ids)
    first = detok.get_delta(finished=False)
    assert first == "ends with"
    assert detok.get_delta(finished=True) == " ST"
    assert detok.get_delta(finished=True) == ""


def test_tokens_after_stop_are_ignored_and_update_after_finish_fails(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["cache"])
    assert detok.update(tok.encode("the cache", add_special_tokens=False)) == "cache"
    assert detok.update(tok.encode(" more", add_special_tokens=False)) is None
    assert detok.output_text == "the "
    detok.finish()
    with pytest.raises(RuntimeError):
        detok.update([5])


def test_work_per_token_is_a_small_window(tok):
    class CountingTokenizer:
        def __init__(self):
            self.calls, self.longest = 0, 0

        def decode(self, ids, **kwargs):
            self.calls += 1
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, **kwargs)

    counting = CountingTokenizer()
    ids = tok.encode(" ".join(CORPUS), add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, tok.encode("prompt"), stop=["<|im_end|>"])
    for i in ids:
        detok.update([i])
        detok.get_delta(finished=False)
    detok.get_delta(finished=True)
    assert detok.output_text == " ".join(CORPUS)
    assert counting.calls <= 2 * len(ids) + 2
    assert counting.longest <= 8


def test_engine_module_imports_no_torch_or_transformers():
    code = (
        "import sys, deepserve.engine.detokenizer; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("seed", range(20))
def test_token_text_ends_are_where_each_prefix_of_tokens_ends(tok, seed):
    # transformers' own decode of the first k tokens is the reference: where it ends in a whole character,
    # token k-1's text end is that text's length; in the middle of one, the token's text is not final yet.
    rng = random.Random(seed)
    ids = tok.encode(random_text(rng, rng.randint(1, 30)), add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(random_text(rng, 3)))
    for k in range(1, len(ids) + 1):
        detok.update(ids[k - 1:k])
        ends = detok.token_text_ends
        assert ends == sorted(ends) and len(ends) <= k
        prefix = tok.decode(ids[:k], skip_special_tokens=True)
        if not prefix.endswith("\ufffd"):
            assert len(ends) == k and ends[-1] == len(prefix) and detok.output_text == prefix
    detok.finish()
    assert len(detok.token_text_ends) == len(ids) and detok.token_text_ends[-1] == len(detok.output_text)


def test_token_text_ends_stop_at_a_stop_string_cut(tok):
    ids = tok.encode("paged attention stores keys", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["stores"])
    for tid in ids:
        if detok.update([tid]):
            break
    assert detok.output_text == "paged attention "
    assert max(detok.token_text_ends) == len("paged attention ")


def test_a_step_of_several_tokens_is_cut_at_the_one_completing_a_stop_string(tok):
    # A speculative verify step hands the front end several tokens at once; those after the token that
    # completes a stop string are not output (their text is already cut), nor are their logprobs.
    from deepserve.engine.core import EngineCoreOutput, EngineCoreRequest
    from deepserve.engine.processors import OutputProcessor
    from deepserve.sampling_params import SamplingParams

    ids = tok.encode("paged attention stores keys and values", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["stores"])
    keep = next(k for k in range(1, len(ids) + 1) if detok.update(ids[k - 1:k]))  # one at a time: the reference
    assert keep < len(ids)
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=50, stop=["stores"], logprobs=0)
    proc.add_request("r", None, [EngineCoreRequest("r", [1, 2], params, [], 0.0)])
    lps = [[(t, -0.5 - i, 1)] for i, t in enumerate(ids)]
    (out,), to_abort = proc.process([EngineCoreOutput("r", list(ids), new_logprobs=lps)])
    c = out.outputs[0]
    assert c.text == "paged attention " and c.finish_reason == "stop" and to_abort == ["r"]
    assert c.token_ids == ids[:keep] and len(c.logprobs) == keep
    assert abs(c.cumulative_logprob - sum(-0.5 - i for i in range(keep))) < 1e-9


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_eos_that_ends_a_request_adds_no_text(tok, skip_special):
    # Tool calling decodes with skip_special_tokens off (the call markers must reach the parser); the eos
    # that ends an answer must still not show up in its text, as it does not by default.
    from deepserve.engine.core import EngineCoreOutput, EngineCoreRequest
    from deepserve.engine.processors import OutputProcessor
    from deepserve.sampling_params import SamplingParams

    eos = tok.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    ids = tok.encode("paged attention", add_special_tokens=False)
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=50, skip_special_tokens=skip_special)
    proc.add_request("r", None, [EngineCoreRequest("r", [1, 2], params, [eos], 0.0)])
    (out,), _ = proc.process([EngineCoreOutput("r", ids + [eos], finish_reason="stop")])
    c = out.outputs[0]
    assert c.text == "paged attention" and c.token_ids == ids + [eos]
    # A special token that does not end the request keeps its text where special tokens are kept.
    proc.add_request("s", None, [EngineCoreRequest("s", [1, 2], params, [], 0.0)])
    (out,), _ = proc.process([EngineCoreOutput("s", ids + [eos], finish_reason="length")])
    assert out.outputs[0].text == "paged attention" + ("" if skip_special else SPECIAL_TOKENS[0])


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decode_fast_path_gives_transformers_text(tok, skip):
    # The API server decodes through the tokenizers library directly (2 calls a token; transformers'
    # Python wrapper cost ~70 % of that): same text as tokenizer.decode with clean-up off, special tokens
    # and characters split across tokens included, token by token as the detokenizer runs.
    from deepserve.engine.detokenizer import backend_decode

    fast = backend_decode(tok)
    assert fast is not None
    rng = random.Random(3)
    specials = tok.convert_tokens_to_ids(SPECIAL_TOKENS[:2])
    for _ in range(200):
        ids = tok.encode(random_text(rng, rng.randint(1, 6)), add_special_tokens=False)
        ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        window = ids[rng.randint(0, len(ids) - 1):]
        assert fast(window, skip) == tok.decode(window, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    ids = tok.encode(random_text(rng, 30), add_special_tokens=False)
    prompt = tok.encode(random_text(rng, 5))
    plain = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    quick = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, fast_decode=fast)
    assert stream(plain, ids, random.Random(5)) == stream(quick, ids, random.Random(5))


def test_no_fast_path_where_a_tokenizer_decodes_its_own_way(tok):
    from deepserve.engine.detokenizer import backend_decode

    class OwnDecode(type(tok)):  # a subclass that overrides decode: its text may differ from the backend's
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    mine = OwnDecode.__new__(OwnDecode)
    mine.__dict__.update(tok.__dict__)
    assert backend_decode(mine) is None

    class DuckTyped:  # anything with a decode method, no Rust backend
        def decode(self, ids, **kwargs):
            return " ".join(map(str, ids))

    assert backend_decode(DuckTyped()) is None
