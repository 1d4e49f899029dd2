"""--swap-space: under a GPU cache small enough to force preemption, preempted requests move their KV
to the host tier and back instead of recomputing it; greedy output still equals transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

from deepserve import LLM, SamplingParams
from tests.conftest import save_checkpoint
from tests.models import test_deepseek as deepseek
from tests.models.test_dense_models import COMMON, PROMPTS, assert_same_greedy, hf_greedy

MAX_TOKENS = 10
# 12 blocks of 4 tokens for prompts of up to 37 tokens: requests preempt one another.
TINY_CACHE = dict(num_gpu_blocks_override=12, block_size=4, max_model_len=48)
# One block over both layers: 4 tokens x 2 layers x 2 planes x 2 KV heads x 16 x 4 bytes (float32).
BLOCK_BYTES = 4 * 2 * 2 * 2 * 16 * 4
ROOMY = 64 * BLOCK_BYTES / 2**30  # GiB: every preempted request fits
CRAMPED = 3 * BLOCK_BYTES / 2**30  # GiB: none of them does (each holds at least 4 blocks): all recompute


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    # Weights 15x the default scale, so attention over earlier positions decides the greedy tokens: at the
    # default scale the tokens hardly depend on the cache, and swap-ins that copied nothing passed.
    hf_model = LlamaForCausalLM(LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False,
                                            initializer_range=0.3)).eval()
    return save_checkpoint(hf_model, tokenizer, str(tmp_path_factory.mktemp("swap"))), hf_model


@pytest.fixture(scope="module")
def want(checkpoint):
    return [hf_greedy(checkpoint[1], ids, MAX_TOKENS) for ids in PROMPTS]


def generate(path: str, **settings) -> tuple[list[list[int]], LLM, int]:
    """Greedy outputs, the engine, and how many tokens its steps computed (prefill and decode)."""
    llm = LLM(path, device="cpu", **{"dtype": "float32", **TINY_CACHE, **settings})
    runner = llm.llm_engine.core.runner
    computed = []
    launch = runner.launch  # every step goes through it (execute = wait(launch(...)))

    def counted(out, *args):
        computed.append(sum(s.num_new_tokens for s in out.scheduled))
        return launch(out, *args)

    runner.launch = counted
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm, sum(computed)


# Without recompute each request computes its prompt and every output token but the last, once.
NO_RECOMPUTE = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swapped_requests_match_transformers_without_recompute(checkpoint, want, async_scheduling):
    got, llm, computed = generate(checkpoint[0], swap_space=ROOMY, async_scheduling=async_scheduling)
    for tokens, (want_tokens, want_logits) in zip(got, want, strict=True):
        assert_same_greedy(tokens, want_tokens, want_logits)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.num_swapped_out_blocks_total > 0
    assert stats.num_swapped_in_blocks_total == stats.num_swapped_out_blocks_total
    assert computed == NO_RECOMPUTE
    bm = llm.llm_engine.core.scheduler.block_manager
    # No leak: every host block is free or keeps an evicted prefix block (prefix caching is on).
    assert bm.num_host_blocks == 64 and bm.num_free_host_blocks + len(bm.host_prefix) == 64
    assert bm.num_free_blocks == 12
    off, _, computed_off = generate(checkpoint[0], async_scheduling=async_scheduling)
    assert got == off
    assert computed_off > NO_RECOMPUTE  # the same run without the host tier recomputes


def test_too_small_a_host_tier_falls_back_to_recompute(checkpoint, want):
    got, llm, computed = generate(checkpoint[0], swap_space=CRAMPED)
    for tokens, (want_tokens, want_logits) in zip(got, want, strict=True):
        assert_same_greedy(tokens, want_tokens, want_logits)
    stats = llm.llm_engine.stats()
    assert llm.llm_engine.core.scheduler.block_manager.num_host_blocks == 3
    assert stats.num_preemptions_total > 0 and stats.num_swapped_out_blocks_total == 0
    assert computed > NO_RECOMPUTE


def test_fp8_cache_swaps_its_raw_bytes(checkpoint):
    got, llm, computed = generate(checkpoint[0], swap_space=ROOMY, kv_cache_dtype="fp8")
    assert llm.llm_engine.core.runner.host_tier.layer_view(0).dtype == torch.float8_e4m3fn
    assert llm.llm_engine.stats().num_swapped_in_blocks_total > 0 and computed == NO_RECOMPUTE
    off, _, _ = generate(checkpoint[0], kv_cache_dtype="fp8")
    assert got == off


def test_mla_latent_cache_swaps_without_recompute(tmp_path, tokenizer):
    # DeepSeek-V2's one-plane latent cache [blocks, block_size, C + Dr] through the same host tier.
    hf_model = deepseek.make_hf_model(DeepseekV2Config, DeepseekV2ForCausalLM,
                                      deepseek.VARIANTS["v2-group-limited-qlora-yarn"][2])
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path / "v2"))
    got, llm, computed = generate(path, swap_space=2**-10)
    for tokens, ids in zip(got, PROMPTS, strict=True):
        assert_same_greedy(tokens, *hf_greedy(hf_model, ids, MAX_TOKENS))
    assert llm.llm_engine.stats().num_swapped_in_blocks_total > 0 and computed == NO_RECOMPUTE
    for settings in (dict(dtype="bfloat16"), dict(kv_cache_dtype="fp8")):
        got, llm, computed = generate(path, swap_space=2**-10, **settings)
        assert llm.llm_engine.stats().num_swapped_in_blocks_total > 0 and computed == NO_RECOMPUTE
        roomy, _, _ = generate(path, num_gpu_blocks_override=64, **settings)  # never preempted
        assert got == roomy
