"""TP=2 and TP=4 give the same greedy tokens as one process, through LLM(...), on CPU with gloo."""

from __future__ import annotations

import pytest

from deepserve import SamplingParams
from tests.parallel.conftest import greedy_tokens, make_llm, shutdown


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_gqa_matches_single_process(llama_path, tp):
    # tp=4 > num_key_value_heads=2: each kv head is replicated on two ranks.
    assert greedy_tokens(llama_path, tp) == greedy_tokens(llama_path, 1)


def test_qwen2_biases_tied_matches_single_process(qwen2_path):
    assert greedy_tokens(qwen2_path, 2) == greedy_tokens(qwen2_path, 1)


def test_chunked_prefill_and_prefix_cache_under_tp(llama_path):
    # Several steps per prompt (chunks of 8 tokens) and a shared prefix hit the cache on every rank.
    prompts = [list(range(100, 137)), list(range(100, 130)) + [3, 4]]
    kwargs = dict(max_num_batched_tokens=8, max_model_len=64)
    assert greedy_tokens(llama_path, 2, prompts, **kwargs) == greedy_tokens(llama_path, 1, prompts, **kwargs)


def test_ngram_speculative_decoding_under_tp(llama_path):
    # Verify steps (the last token and its drafts as decode rows) reach every rank in the step message.
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = make_llm(llama_path, 2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.stats().spec_decode_num_draft_tokens_total > 0
    finally:
        shutdown(llm)
    want = make_llm(llama_path, 1).generate(prompts, params, use_tqdm=False)
    assert got == [list(o.outputs[0].token_ids) for o in want]
