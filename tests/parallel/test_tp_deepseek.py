"""DeepSeek-V2 / V3 under TP=2: MLA heads split with the latent cache replicated, MoE experts split
along their intermediate size; greedy tokens equal one process's."""

from __future__ import annotations

import pytest
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from tests.conftest import save_checkpoint
from tests.models.test_deepseek import VARIANTS, make_hf_model
from tests.parallel.conftest import greedy_tokens

CASES = {
    "v2-group-limited-qlora-yarn": (DeepseekV2Config, DeepseekV2ForCausalLM),
    "v3-neox-no-qlora-tied": (DeepseekV3Config, DeepseekV3ForCausalLM),
}


@pytest.mark.parametrize("variant", sorted(CASES))
def test_deepseek_tp2_matches_single_process(variant, tmp_path, tokenizer):
    path = save_checkpoint(make_hf_model(*VARIANTS[variant]), tokenizer, str(tmp_path))
    assert greedy_tokens(path, 2) == greedy_tokens(path, 1)
