"""DeepSeek-V2 and V3 against transformers' own implementations, on tiny random checkpoints.

The variants cover every routing method (greedy, group_limited_greedy, noaux_tc with a non-zero
e_score_correction_bias), q_lora_rank on and off, first_k_dense_replace 0 and 1, YaRN with both
mscale corrections, and both rope layouts. Logits must match in float32 on ragged prompts (the
expanded form on fresh prompts, the absorbed form over the latent cache for a cached prefix), and
greedy generations token for token with prefix caching, chunked prefill and forced preemption.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from deepserve import LLM, SamplingParams
from deepserve.config import EngineArgs
from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput
from deepserve.forward_context import forward_context
from deepserve.runner.input_batch import prepare_inputs
from deepserve.runner.model_runner import ModelRunner
from tests.conftest import save_checkpoint
from tests.models.test_dense_models import ENGINE_SETTINGS, assert_same_greedy, hf_greedy

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, max_position_embeddings=256,
    initializer_range=0.1,  # larger than the default, so attention is far from uniform
)
# V2-Lite's YaRN (mscale = mscale_all_dim: only the softmax scale changes) and one where they differ
# (cos and sin are scaled too).
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
YARN_UNEVEN = dict(YARN, mscale=1.0, mscale_all_dim=0.8)
VARIANTS = {
    "v2-greedy-no-qlora": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=None, topk_method="greedy", n_shared_experts=2, first_k_dense_replace=1)),
    "v2-group-limited-qlora-yarn": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.0, rope_parameters=YARN)),
    "v3-noaux-qlora-yarn": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=24, topk_method="noaux_tc", n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, rope_parameters=YARN_UNEVEN)),
    "v3-neox-no-qlora-tied": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=1, first_k_dense_replace=0,
        norm_topk_prob=False, tie_word_embeddings=True)),
}
PROMPTS = [[5, 17, 300, 42, 9], list(range(100, 137)), [7] * 20, list(range(400, 411))]


def make_hf_model(config_cls, model_cls, extra: dict):
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)  # routing scores far apart: no expert choice hangs on rounding
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory, tokenizer):
    model = make_hf_model(*VARIANTS[request.param])
    path = save_checkpoint(model, tokenizer, str(tmp_path_factory.mktemp(request.param)))
    return path, model


def run_step(runner: ModelRunner, requests: list[tuple[Request, int, int]]) -> torch.Tensor:
    """One forward step of (request, start, num_new_tokens); logits of every new token."""
    scheduled = [ScheduledRequest(req, n, start) for req, start, n in requests]
    inputs = prepare_inputs(SchedulerOutput(scheduled), runner.block_size, runner.device)
    with torch.inference_mode(), forward_context(inputs.attn):
        return runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions))


def make_runner(path: str, **kwargs) -> ModelRunner:
    return ModelRunner(EngineArgs(model=path, dtype="float32", device="cpu", **kwargs).create_engine_config())


def with_blocks(runner: ModelRunner, prompts: list[list[int]]) -> list[Request]:
    requests, next_block = [], 0
    for i, ids in enumerate(prompts):
        req = Request(str(i), ids, SamplingParams())
        nb = -(-len(ids) // runner.block_size)
        req.block_ids = list(range(next_block, next_block + nb))
        next_block += nb
        requests.append(req)
    return requests


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


def test_logits_match_transformers(checkpoint):
    path, hf_model = checkpoint
    runner = make_runner(path)
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS)
    logits = run_step(runner, [(r, 0, len(r.prompt_token_ids)) for r in requests])
    for ids, got in zip(PROMPTS, logits.split([len(p) for p in PROMPTS]), strict=True):
        torch.testing.assert_close(got, hf_logits(hf_model, ids), atol=2e-5, rtol=1e-4)


def test_fused_shared_experts_match_transformers(checkpoint, monkeypatch):
    # DEEPSERVE_SHARED_EXPERTS_FUSION: every MoE layer's shared MLP runs as n_shared_experts more experts.
    from deepserve.layers.moe import DeepseekMoE

    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1")
    path, hf_model = checkpoint
    runner = make_runner(path)
    layers = [m for m in runner.model.modules() if isinstance(m, DeepseekMoE)]
    assert layers and all(m.shared_experts is None for m in layers)
    experts = hf_model.config.n_routed_experts + hf_model.config.n_shared_experts
    assert {m.experts.w13.shape[0] for m in layers} == {experts}
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS)
    logits = run_step(runner, [(r, 0, len(r.prompt_token_ids)) for r in requests])
    for ids, got in zip(PROMPTS, logits.split([len(p) for p in PROMPTS]), strict=True):
        torch.testing.assert_close(got, hf_logits(hf_model, ids), atol=2e-5, rtol=1e-4)
    # W2's bandwidth figure: a step reads the fused shared experts every time, as it read their MLP
    from deepserve.bench.latency import weight_bytes_read_per_step

    monkeypatch.delenv("DEEPSERVE_SHARED_EXPERTS_FUSION")
    plain = make_runner(path).model
    assert any(m.shared_experts is not None for m in plain.modules() if isinstance(m, DeepseekMoE))
    assert weight_bytes_read_per_step(runner.model) == pytest.approx(weight_bytes_read_per_step(plain))


def test_fused_qkv_a_matches_transformers(checkpoint, monkeypatch):
    # DEEPSERVE_FUSED_QKV_A: q_a_proj (or q_proj) and kv_a_proj_with_mqa stacked into one linear after loading;
    # the query and the latent are views of its one product.
    from deepserve.models.deepseek_v2 import MultiHeadLatentAttention

    monkeypatch.setenv("DEEPSERVE_FUSED_QKV_A", "1")
    path, hf_model = checkpoint
    runner = make_runner(path)
    layers = [m for m in runner.model.modules() if isinstance(m, MultiHeadLatentAttention)]
    c = hf_model.config
    q_rows = c.q_lora_rank or c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    assert layers and all(m.wqkv_a is not None and m.wkv_a is None for m in layers)
    assert {m.wqkv_a.weight.shape for m in layers} == {(q_rows + c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size)}
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS)
    logits = run_step(runner, [(r, 0, len(r.prompt_token_ids)) for r in requests])
    for ids, got in zip(PROMPTS, logits.split([len(p) for p in PROMPTS]), strict=True):
        torch.testing.assert_close(got, hf_logits(hf_model, ids), atol=2e-5, rtol=1e-4)


def test_cached_prefix_and_mixed_step_match_transformers(checkpoint):
    """Step 1 prefills the first part of every prompt; step 2 mixes sequences that continue over
    their cached latents (absorbed form) with a fresh one (expanded form)."""
    path, hf_model = checkpoint
    runner = make_runner(path)
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS)
    cuts = [3, 20, 0, 10]
    run_step(runner, [(r, 0, c) for r, c in zip(requests, cuts, strict=True) if c])
    logits = run_step(runner, [(r, c, len(r.prompt_token_ids) - c) for r, c in zip(requests, cuts, strict=True)])
    rests = [len(p) - c for p, c in zip(PROMPTS, cuts, strict=True)]
    for ids, cut, got in zip(PROMPTS, cuts, logits.split(rests), strict=True):
        torch.testing.assert_close(got, hf_logits(hf_model, ids)[cut:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("setting", sorted(ENGINE_SETTINGS))
def test_greedy_generation_matches_transformers(checkpoint, setting):
    path, hf_model = checkpoint
    max_tokens = 8
    llm = LLM(path, dtype="float32", device="cpu", **{"num_gpu_blocks_override": 64, **ENGINE_SETTINGS[setting]})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    expected = [hf_greedy(hf_model, ids, max_tokens) for ids in PROMPTS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for _ in range(2):  # the second pass runs on a warm prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for (want, want_logits), out in zip(expected, outputs, strict=True):
            assert_same_greedy(out.outputs[0].token_ids, want, want_logits)
    stats = llm.llm_engine.stats()
    if setting.endswith("forced-preemption"):
        assert stats.num_preemptions_total > 0
    if setting in ("default", "async"):
        assert stats.prefix_cache_hits_total > 0


def test_chunks_over_the_cache_in_expanded_form_match_transformers(checkpoint, monkeypatch):
    # 8-token prefill chunks with the expanded form over the gathered history from 2 new tokens on
    # (by default only chunks of EXPAND_MIN_NEW_TOKENS take it; shorter ones the absorbed form).
    import deepserve.layers.mla as mla_module

    monkeypatch.setattr(mla_module, "EXPAND_MIN_NEW_TOKENS", 2)
    path, hf_model = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outputs, strict=True):
        assert_same_greedy(out.outputs[0].token_ids, *hf_greedy(hf_model, ids, 6))


@pytest.mark.parametrize("dtype, elem", [("float32", 4), ("bfloat16", 2)])
def test_latent_cache_holds_exactly_rank_plus_rope_per_token(checkpoint, dtype, elem):
    path, _ = checkpoint
    runner = make_runner(path, block_size=16) if dtype == "float32" else ModelRunner(
        EngineArgs(model=path, dtype=dtype, device="cpu", block_size=16).create_engine_config())
    per_token_layer = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    expected = per_token_layer * COMMON["num_hidden_layers"] * elem * 16
    assert runner.kv_cache_bytes_per_block() == expected
    runner.allocate_kv_cache(5)
    caches = [layer.kv_cache for layer in runner.attention_layers]
    assert len(caches) == COMMON["num_hidden_layers"]
    assert all(c.shape == (5, 16, per_token_layer) and c.dtype == getattr(torch, dtype) for c in caches)
    assert sum(c.numel() * c.element_size() for c in caches) == 5 * expected


@pytest.mark.parametrize("field, value", [("topk_method", "random_walk"), ("scoring_func", "relu")])
def test_unknown_routing_is_refused_naming_the_field(checkpoint, tmp_path, field, value):
    path, _ = checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(path):
        os.symlink(os.path.join(path, name), bad / name)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config[field] = value
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{field} '{value}' is not supported"):
        make_runner(str(bad))


# (preset, parameters in billions, KV cache bytes per token in bf16) from BENCHMARKS.md
PRESET_SHAPES = [("deepseek-v2-lite", 15.71, 576 * 27 * 2), ("deepseek-llm-7b", 6.91, 480 * 1024),
                 ("r1-distill-qwen-7b", 7.62, 56 * 1024)]


@pytest.mark.parametrize("name, billions, kv_bytes", PRESET_SHAPES)
def test_presets_have_the_published_shapes(name, billions, kv_bytes):
    from deepserve.loader.presets import preset_config
    from deepserve.models.registry import get_model_class

    config = preset_config(name)
    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.005)
    layers = [m for m in model.modules() if hasattr(m, "kv_cache_spec")]
    assert sum(m.kv_cache_spec(torch.bfloat16).bytes_per_token for m in layers) == kv_bytes


def test_preset_needs_dummy_weights():
    from deepserve.loader.presets import resolve_hf_config

    assert resolve_hf_config("deepseek-v3", {"num_hidden_layers": 4}, "dummy").num_hidden_layers == 4
    with pytest.raises(ValueError, match="load_format='dummy'"):
        resolve_hf_config("deepseek-v3")
