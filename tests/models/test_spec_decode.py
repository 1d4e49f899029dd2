"""N-gram speculative decoding end to end on a tiny random Llama: greedy output equals transformers' (and
the engine's without speculation) under prefix hits, chunked prefill and forced preemption; penalties,
logprobs, stop tokens and min_tokens agree with the engine without speculation; seeded sampling replays;
many seeded samples with and without speculation agree by chi-square, and not with a biased acceptor."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepserve import LLM, SamplingParams
from deepserve.layers.rejection_sampler import RejectionSampler
from tests.conftest import save_checkpoint
from tests.models.test_dense_models import COMMON, PROMPTS, assert_same_greedy, hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 10
# The repeating prompt gives drafts from the first decode step on.
SPEC_PROMPTS = PROMPTS + [[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]]
SETTINGS = {
    "default": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-tiny-budget": dict(max_num_batched_tokens=8),
    "forced-preemption": dict(num_gpu_blocks_override=12, block_size=4, max_model_len=48),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    # At this weight scale greedy outputs fall into short cycles after a few tokens: drafts get both
    # accepted and rejected (at the default scale every output repeats one token; at 0.3 none repeats).
    hf_model = LlamaForCausalLM(LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False,
                                            initializer_range=0.08)).eval()
    return save_checkpoint(hf_model, tokenizer, str(tmp_path_factory.mktemp("spec"))), hf_model


def llm(path: str, speculative: bool = True, **settings) -> LLM:
    return LLM(path, dtype="float32", device="cpu", speculative_config=NGRAM if speculative else None,
               **{"num_gpu_blocks_override": 64, **settings})


def generate(engine: LLM, params, prompts=SPEC_PROMPTS):
    return engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_with_ngram_drafts_matches_transformers(checkpoint, setting):
    path, hf_model = checkpoint
    engine = llm(path, **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second pass runs on a warm prefix cache
        for ids, out in zip(SPEC_PROMPTS, generate(engine, params), strict=True):
            want, want_logits = hf_greedy(hf_model, ids, MAX_TOKENS)
            assert_same_greedy(out.outputs[0].token_ids, want, want_logits)
            assert len(out.outputs[0].token_ids) == MAX_TOKENS and out.outputs[0].finish_reason == "length"
    stats = engine.llm_engine.stats()
    drafted, accepted = stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total
    assert 0 < accepted < drafted  # drafts were both kept and thrown away
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0  # every block back, none leaked
    assert not engine.llm_engine.core.async_scheduling
    if setting == "forced-preemption":
        assert stats.num_preemptions_total > 0
    if setting == "default":
        assert stats.prefix_cache_hits_total > 0


def test_speculation_changes_the_step_count_not_the_tokens(checkpoint):
    path, _ = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    steps = {}
    outputs = {}
    for spec in (False, True):
        engine = llm(path, spec)
        count = [0]
        step = engine.llm_engine.core.step

        def counted(step=step, count=count):
            count[0] += 1
            return step()

        engine.llm_engine.core.step = counted
        outputs[spec] = [o.outputs[0].token_ids for o in generate(engine, params, [SPEC_PROMPTS[-1]])]
        steps[spec] = count[0]
    assert outputs[True] == outputs[False]
    assert steps[True] < steps[False]


def test_penalties_logprobs_stops_and_min_tokens_agree_without_speculation(checkpoint):
    path, _ = checkpoint
    prompts = SPEC_PROMPTS
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base = generate(llm(path, False), greedy, prompts)
    stop_at = base[-1].outputs[0].token_ids[4]  # a token the repeating prompt's output reaches
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at]),
    ]
    params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at], min_tokens=6))
    prompts = prompts + [prompts[-1]]
    want = generate(llm(path, False), params, prompts)
    got = generate(llm(path, True), params, prompts)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
        if w.outputs[0].logprobs:
            for we, ge in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert set(we) == set(ge)
                for t in we:
                    assert abs(we[t].logprob - ge[t].logprob) < 1e-4 and we[t].rank == ge[t].rank
    assert got[4].outputs[0].finish_reason == "stop" and got[4].outputs[0].token_ids[-1] == stop_at
    assert len(got[5].outputs[0].token_ids) >= 6


def test_seeded_sampling_replays(checkpoint):
    path, _ = checkpoint
    engine = llm(path)
    params = [SamplingParams(temperature=1.0, top_k=5, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s) for s in (1, 2)]
    first = [o.outputs[0].token_ids for o in generate(engine, params, [SPEC_PROMPTS[-1]] * 2)]
    # Again, alone and beside an unseeded request: the same tokens.
    again = [o.outputs[0].token_ids for o in generate(llm(path), [params[1], SamplingParams(temperature=1.0)],
                                                      [SPEC_PROMPTS[-1], SPEC_PROMPTS[0]])]
    assert again[0] == first[1]
    assert first[0] != first[1]


def chi_square_same_distribution(a: list[int], b: list[int]) -> float:
    """p-value of Pearson's chi-square test that two samples of tokens share one distribution
    (a 2 x C contingency table; categories seen fewer than 5 times together are pooled)."""
    tokens = sorted(set(a) | set(b))
    table = torch.tensor([[a.count(t), b.count(t)] for t in tokens], dtype=torch.float64)  # [C, 2]
    small = table.sum(1) < 5
    if small.any():
        table = torch.cat([table[~small], table[small].sum(0, keepdim=True)])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


SAMPLES = 300
LENGTH = 4
# After this prompt the sampled tokens keep to a handful per position (the first three: 248, 346 and
# 496, about 1/3 each), and the prompt's own cycle drafts some of them: drafts get accepted and rejected.
DIST_PROMPT = [7] * 16 + [248, 197, 463, 248, 197, 463]


def seeded_samples(engine: LLM) -> list[tuple[int, ...]]:
    # top_k = 3: a tiny vocabulary at each position.
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=LENGTH, ignore_eos=True, seed=s)
              for s in range(SAMPLES)]
    return [tuple(o.outputs[0].token_ids) for o in generate(engine, params, [DIST_PROMPT] * SAMPLES)]


@pytest.fixture(scope="module")
def plain_samples(checkpoint):
    return seeded_samples(llm(checkpoint[0], False))


def test_sampled_distribution_with_speculation_matches_without(checkpoint, plain_samples):
    engine = llm(checkpoint[0])
    spec = seeded_samples(engine)
    stats = engine.llm_engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    for position in range(LENGTH):
        p = chi_square_same_distribution([s[position] for s in plain_samples], [s[position] for s in spec])
        assert p > 1e-3, (position, p)


def test_the_distribution_check_fails_with_a_biased_acceptor(checkpoint, plain_samples):
    engine = llm(checkpoint[0])
    # An acceptor that trusts every draft (the unit test in tests/layers also catches a subtler sqrt(p)).
    engine.llm_engine.core.runner.rejection_sampler = RejectionSampler(acceptance_probability=torch.ones_like)
    spec = seeded_samples(engine)
    p_values = [chi_square_same_distribution([s[i] for s in plain_samples], [s[i] for s in spec])
                for i in range(LENGTH)]
    assert min(p_values) < 1e-4, p_values


def test_stop_strings_agree_without_speculation(checkpoint):
    # A stop string inside a verify step's several tokens ends the text where it would one token at a time.
    path, _ = checkpoint
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    text = generate(llm(path, False), greedy, [SPEC_PROMPTS[2]])[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    want, got = (generate(llm(path, spec), params, [SPEC_PROMPTS[2]])[0].outputs[0] for spec in (False, True))
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, want.finish_reason, want.stop_reason)
    assert want.finish_reason == "stop" and stop not in want.text
    # and the tokens too: none of a verify step's tokens after the one completing the stop string
    assert got.token_ids == want.token_ids
