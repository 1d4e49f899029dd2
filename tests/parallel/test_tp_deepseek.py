"""DeepSeek-V2 / V3 under TP=2: MLA heads split with the latent cache replicated, MoE experts split
along their intermediate size; greedy tokens equal one process's."""

from __future__ import annotations

import gc

import pytest
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from deepserve.layers.moe import DeepseekMoE
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import VARIANTS, make_hf_model
from tests.parallel.conftest import GREEDY, PROMPTS, greedy_tokens, make_llm, shutdown

CASES = {
    "v2-group-limited-qlora-yarn": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "v3-neox-no-qlora-tied": (DeepseekV3Config, DeepseekV3ForCausalLM),
}


@pytest.mark.parametrize("variant", sorted(CASES))
def test_deepseek_tp2_matches_single_process(variant, tmp_path, tokenizer):
    path = save_checkpoint(make_hf_model(*VARIANTS[variant]), tokenizer, str(tmp_path))
    assert greedy_tokens(path, 2) == greedy_tokens(path, 1)


def test_fused_shared_experts_tp2_match_single_process(tmp_path, tokenizer, monkeypatch):
    # DEEPSERVE_SHARED_EXPERTS_FUSION under TP=2: each rank cuts its half of the shared MLP (2 x 32 units: 32 a
    # rank) into two experts of its 16-unit routed shards; the ranks' sums still add up to the whole layer.
    variant = "v2-greedy-no-qlora"  # two shared experts
    path = save_checkpoint(make_hf_model(*VARIANTS[variant]), tokenizer, str(tmp_path))
    want = greedy_tokens(path, 1)
    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1")  # the workers inherit it
    llm = make_llm(path, 2)
    try:
        model = llm.llm_engine.core.runner.runner.model  # rank 0's
        layers = [m for m in model.modules() if isinstance(m, DeepseekMoE)]
        assert layers and all(m.shared_experts is None and m.experts.w13.shape[:2] == (8 + 2, 2 * 16) for m in layers)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        shutdown(llm)
        del llm
        gc.collect()
