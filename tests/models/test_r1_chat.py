"""DeepSeek-R1's chat convention through LLM.chat: the template opens the reasoning with <think>,
and the reasoning parser splits a completion at </think>."""

from __future__ import annotations

import copy

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from deepserve import LLM, SamplingParams
from deepserve.server.reasoning import split_reasoning
from tests.conftest import save_checkpoint

# Written for this test in the shape of R1's template: system text first, user/assistant turns,
# and a generation prompt that opens the reasoning block.
R1_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def test_r1_template_through_llm_chat(tmp_path, tokenizer):
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=256,
    )
    tokenizer = copy.deepcopy(tokenizer)  # the fixture is shared by the whole session
    tokenizer.chat_template = R1_TEMPLATE
    path = save_checkpoint(DeepseekV3ForCausalLM(config), tokenizer, str(tmp_path))
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=32)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out.prompt.endswith("<｜User｜>2+2?<｜Assistant｜><think>\n")
    assert out.prompt.startswith("<｜begin▁of▁sentence｜>Be brief.")
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    assert len(out.outputs[0].token_ids) == 5


def test_reasoning_is_split_at_the_closing_tag():
    assert split_reasoning("Four, since 2+2=4.</think>\n\n4") == ("Four, since 2+2=4.", "\n\n4")
    reasoning, content = split_reasoning("still thinking")
    assert reasoning == "still thinking" and not content
