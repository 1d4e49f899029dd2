"""The host prefix tier (--swap-space with prefix caching): under a GPU cache too small to keep a prompt's
blocks, the blocks evicted to the host are found again by the next request with that prompt, loaded back,
and not prefilled again; greedy output still equals transformers'. Llama (GQA, key/value planes) and
DeepSeek-V2 (MLA latent cache); float32 against transformers, bf16 and FP8 caches against the same prompt
served from a GPU cache large enough to keep it (the same cached-prefix path over the same bytes)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

from deepserve import LLM, SamplingParams
from tests.conftest import save_checkpoint
from tests.models import test_deepseek as deepseek
from tests.models.test_dense_models import COMMON, assert_same_greedy, hf_greedy

MAX_TOKENS = 10
PROMPT = list(range(100, 133))  # 33 tokens: 8 full blocks of 4 can be hits, the last token is computed
FILLER = list(range(300, 338))  # 38 tokens + 10 outputs: all 12 GPU blocks, so every block of PROMPT goes
TINY = dict(num_gpu_blocks_override=12, block_size=4, max_model_len=48)
ROOMY_HOST = 2**-10  # GiB: hundreds of host blocks for these models
MODELS = {
    # Weights at 0.3: the greedy tokens depend on the cached keys and values (a load that copied the
    # wrong bytes changes them).
    "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False,
                                                      initializer_range=0.3)).eval(),
    "deepseek-v2": lambda: deepseek.make_hf_model(DeepseekV2Config, DeepseekV2ForCausalLM,
                                                   deepseek.VARIANTS["v2-group-limited-qlora-yarn"][2]),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    hf_model = MODELS[request.param]()
    return save_checkpoint(hf_model, tokenizer, str(tmp_path_factory.mktemp(request.param))), hf_model


def serve_prompt_twice(path: str, **settings) -> tuple[list[list[int]], list[int], LLM]:
    """PROMPT, then FILLER, then PROMPT again, one at a time: the outputs of both PROMPT runs, the tokens
    each step of the second PROMPT run computed, and the engine."""
    llm = LLM(path, device="cpu", **settings)
    runner, computed = llm.llm_engine.core.runner, []
    launch = runner.launch  # every step goes through it

    def counted(out, *args):
        computed.append(sum(s.num_new_tokens for s in out.scheduled))
        return launch(out, *args)

    runner.launch = counted
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = []
    for prompt in (PROMPT, FILLER, PROMPT):
        computed.clear()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        outputs.append(list(out))
    return [outputs[0], outputs[2]], list(computed), llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prefix_evicted_to_the_host_is_loaded_back_not_prefilled(checkpoint, async_scheduling):
    path, hf_model = checkpoint
    (first, second), computed, llm = serve_prompt_twice(path, dtype="float32", swap_space=ROOMY_HOST,
                                                        async_scheduling=async_scheduling, **TINY)
    want, want_logits = hf_greedy(hf_model, PROMPT, MAX_TOKENS)
    assert_same_greedy(first, want, want_logits)
    assert second == first
    stats = llm.llm_engine.stats()
    assert stats.prefix_cache_host_hits_total == 32  # all 8 full blocks came back from the host
    assert stats.prefix_cache_host_stores_total >= 8
    assert computed[0] == 1  # the prefill of the second run: only the token after the 8 blocks
    assert sum(computed) == 1 + MAX_TOKENS - 1
    # Without the host tier the same second run prefills the whole prompt again.
    _, computed_off, llm_off = serve_prompt_twice(path, dtype="float32", async_scheduling=async_scheduling, **TINY)
    assert computed_off[0] == len(PROMPT) and llm_off.llm_engine.stats().prefix_cache_host_hits_total == 0


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("float32", "fp8")])
def test_host_hits_over_bf16_and_fp8_caches_equal_gpu_hits(checkpoint, dtype, kv_cache_dtype):
    # The bytes go to the host and back unchanged: the second run equals one whose prefix never left the GPU.
    path, _ = checkpoint
    settings = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    outputs, computed, llm = serve_prompt_twice(path, swap_space=ROOMY_HOST, **TINY, **settings)
    assert llm.llm_engine.stats().prefix_cache_host_hits_total == 32 and computed[0] == 1
    roomy, computed_gpu, llm_gpu = serve_prompt_twice(path, num_gpu_blocks_override=64, block_size=4,
                                                      max_model_len=48, **settings)
    assert computed_gpu[0] == 1 and llm_gpu.llm_engine.stats().prefix_cache_host_hits_total == 0
    assert outputs == roomy
