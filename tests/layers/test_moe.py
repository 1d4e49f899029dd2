"""DeepSeekMoE: routing against transformers' routers, the grouped-by-expert implementation against
the token-by-token reference, and the config checks."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from deepserve.layers.moe import DeepseekMoE, MoEGate, RoutedExperts, RoutingConfig, route
from deepserve.layers.quantization import warn_once

ROUTINGS = {
    "greedy-softmax": RoutingConfig(16, 4),
    "greedy-sigmoid-norm": RoutingConfig(16, 3, scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "group-limited": RoutingConfig(16, 3, "group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0),
    "noaux-tc": RoutingConfig(16, 4, "noaux_tc", "sigmoid", n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5),
    "noaux-tc-one-group": RoutingConfig(8, 2, "noaux_tc", "sigmoid", norm_topk_prob=True),
    "top-1": RoutingConfig(8, 1, scoring_func="softmax"),
}


def sorted_routes(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_softmax_routing_matches_transformers_v2(method):
    torch.manual_seed(0)
    config = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, topk_method=method,
                              n_group=4, topk_group=2, routed_scaling_factor=16.0)
    hf = DeepseekV2TopkRouter(config)
    hf.weight.data.normal_(0, 0.5)
    x = torch.randn(37, 32)
    _, want_w, want_ids = hf(x)
    cfg = RoutingConfig.from_hf(config)
    got_w, got_ids = route(torch.nn.functional.linear(x, hf.weight), cfg)
    torch.testing.assert_close(sorted_routes(got_w, got_ids), sorted_routes(want_w, want_ids))


@pytest.mark.parametrize("norm", [True, False])
def test_noaux_tc_matches_transformers_v3(norm):
    torch.manual_seed(0)
    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=norm, routed_scaling_factor=2.5)
    hf = DeepseekV3TopkRouter(config)
    hf.weight.data.normal_(0, 0.5)
    hf.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(37, 32)
    _, want_w, want_ids = hf(x)
    cfg = RoutingConfig.from_hf(config)
    assert (cfg.topk_method, cfg.scoring_func) == ("noaux_tc", "sigmoid")
    got_w, got_ids = route(torch.nn.functional.linear(x, hf.weight), cfg, hf.e_score_correction_bias)
    torch.testing.assert_close(sorted_routes(got_w, got_ids), sorted_routes(want_w, want_ids))


def test_bias_chooses_but_does_not_weigh():
    cfg = RoutingConfig(4, 1, "noaux_tc", "sigmoid")
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, cfg, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0]])))


def test_group_limit_keeps_experts_inside_the_best_groups():
    cfg = RoutingConfig(8, 2, "group_limited_greedy", n_group=4, topk_group=1)
    # group 2 (experts 4, 5) holds the single best expert, so both picks come from it
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 4.0, 0.0, 1.0, 1.0]])
    _, ids = route(logits, cfg)
    assert sorted(ids[0].tolist()) == [4, 5]


@pytest.mark.parametrize("name", sorted(ROUTINGS))
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_grouped_experts_match_token_by_token_reference(name, num_tokens):
    cfg = ROUTINGS[name]
    torch.manual_seed(num_tokens)
    gate = MoEGate(24, cfg)
    gate.weight.data.normal_(0, 0.5)
    if gate.e_score_correction_bias is not None:
        gate.e_score_correction_bias.data.normal_(0, 0.3)
    experts = RoutedExperts(cfg.num_experts, 24, 10)
    experts.w13.data.normal_(0, 0.3)
    experts.w2.data.normal_(0, 0.3)
    x = torch.randn(num_tokens, 24)
    weights, ids = gate(x)
    assert ids.shape == (num_tokens, cfg.top_k) and len(set(ids[0].tolist())) == cfg.top_k
    torch.testing.assert_close(experts(x, weights, ids), experts.forward_reference(x, weights, ids))


def test_expert_weights_load_per_expert_or_fused():
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 6, 8)  # transformers' fused [X, 2I, E]
    down = torch.randn(4, 8, 6)  # [X, E, I]
    fused, per_expert = RoutedExperts(4, 8, 6), RoutedExperts(4, 8, 6)
    fused.w13.weight_loader(fused.w13, gate_up)
    fused.w2.weight_loader(fused.w2, down)
    for e in range(4):
        per_expert.w13.weight_loader(per_expert.w13, gate_up[e, :6], (e, 0))
        per_expert.w13.weight_loader(per_expert.w13, gate_up[e, 6:], (e, 1))
        per_expert.w2.weight_loader(per_expert.w2, down[e], e)
    assert torch.equal(fused.w13, per_expert.w13) and torch.equal(fused.w2, per_expert.w2)
    assert torch.equal(fused.w13, gate_up)


def test_shared_experts_add_to_routed():
    torch.manual_seed(0)
    moe = DeepseekMoE(16, 8, 2, RoutingConfig(4, 2))
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(5, 16)
    weights, ids = moe.gate(x)
    want = moe.experts.forward_reference(x, weights, ids) + moe.shared_experts(x)
    torch.testing.assert_close(moe(x), want)


def random_moe(num_shared: int, inter: int = 8, quant=None) -> DeepseekMoE:
    torch.manual_seed(num_shared)
    moe = DeepseekMoE(16, inter, num_shared, RoutingConfig(4, 2, routed_scaling_factor=2.5), quant)
    for p in moe.parameters():
        if p.is_floating_point() and p.dtype != torch.float8_e4m3fn:
            p.data.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize("num_shared", [1, 2])
def test_fused_shared_experts_equal_the_shared_mlp(num_shared, monkeypatch):
    # DEEPSERVE_SHARED_EXPERTS_FUSION: after loading, the shared MLP becomes num_shared more experts every
    # token picks with weight 1 (ids 4 .. 4 + num_shared - 1); the layer's output does not change.
    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1")
    moe = random_moe(num_shared)
    x = torch.randn(5, 16)
    want = moe(x)
    weights, ids = moe.gate(x)
    moe.fuse_loaded_weights()
    assert moe.shared_experts is None and moe.experts.num_shared_fused == num_shared
    assert moe.experts.w13.shape == (4 + num_shared, 16, 16) and moe.experts.w2.shape == (4 + num_shared, 16, 8)
    fused_w, fused_ids = moe.gate(x, num_shared)
    assert torch.equal(fused_ids[:, :2], ids) and torch.equal(fused_w[:, :2], weights)
    assert fused_ids[:, 2:].tolist() == [list(range(4, 4 + num_shared))] * 5
    assert torch.equal(fused_w[:, 2:], torch.ones(5, num_shared))
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe.experts.forward_reference(x, fused_w, fused_ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interprets the kernels on CPU tensors (Triton compiles "
                    "them on a GPU machine, which refuses CPU tensors); the GPU runs them in bench/gpu_check.py")
def test_fused_shared_experts_through_the_kernels(monkeypatch):
    # What a GPU runs, in Triton's interpreter: the routing kernel's shared columns and the fused MoE kernel over
    # the routed and shared experts together equal the layer with its shared MLP.
    pytest.importorskip("triton")
    from deepserve.kernels.fused_moe import fused_moe
    from deepserve.kernels.moe_routing import fused_route

    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1")
    moe = random_moe(2, inter=32)
    x = torch.randn(3, 16)
    want = moe(x)
    moe.fuse_loaded_weights()
    weights, ids = fused_route(torch.nn.functional.linear(x, moe.gate.weight), moe.gate.cfg, shared=2)
    assert ids[:, 2:].tolist() == [[4, 5]] * 3
    got = moe.experts.forward_fused(fused_moe, x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA caching allocator's segments")
def test_fusing_shared_experts_strands_no_gpu_memory(monkeypatch):
    # absorb_shared replaces w13 and then w2 with larger copies; w2's new tensor fits inside w13's old one. Had
    # the caching allocator carved it from there, the rest of that segment would stay reserved without a
    # tensor: memory the KV cache's sizing does not see (a V3 FP8 slice ran out of memory that way).
    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1")
    moe = DeepseekMoE(1024, 2048, 1, RoutingConfig(4, 2)).to("cuda", torch.bfloat16)  # w13 32 MiB, w2 16 MiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    moe.fuse_loaded_weights()
    assert moe.shared_experts is None and moe.experts.w13.shape[0] == 5
    # Whole free segments (the shared MLP's freed weights) go back here; a piece of a segment that still
    # holds a tensor cannot. Without this call the H200 read 20 MiB more (2026-12-05b call C): one freed
    # segment. Without the fix, by the allocator's rules, w2's new 20 MiB is cut from w13's old 32 MiB and
    # 12 MiB stay behind.
    torch.cuda.empty_cache()
    stranded = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert stranded <= before + 2**20, (before, stranded)


def test_shared_experts_stay_an_mlp_without_the_switch(monkeypatch):
    monkeypatch.delenv("DEEPSERVE_SHARED_EXPERTS_FUSION", raising=False)
    moe = random_moe(2)
    moe.fuse_loaded_weights()
    assert moe.shared_experts is not None and moe.experts.w13.shape[0] == 4


@pytest.mark.parametrize("num_shared, inter", [(1, 96), (2, 128), (2, 96)])
def test_fused_shared_fp8_experts_equal_the_shared_mlp(num_shared, inter, monkeypatch, caplog):
    # DeepSeek-V3's FP8 blocks: the shared MLP's 128 x 128 blocks and scales cut into experts (one shared expert
    # of partial blocks is taken whole; several are cut on block boundaries, and where 128 does not divide the
    # experts' size the layer keeps its MLP and says why).
    from deepserve.kernels import fp8_ref
    from deepserve.layers.quantization import Fp8Config

    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1")
    block, hidden = (128, 128), 16
    moe = DeepseekMoE(hidden, inter, num_shared, RoutingConfig(4, 2), Fp8Config(weight_block=block))
    torch.manual_seed(inter)
    moe.gate.weight.data.normal_(0, 0.3)

    def quantized(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_ref.quantize_weight_block(torch.randn(rows, cols) * 0.3, block)

    for e in range(4):
        for member in (0, 1):
            q, sc = quantized(inter, hidden)
            moe.experts.w13.weight_loader(moe.experts.w13, q, (e, member))
            moe.experts.w13_scale_inv.weight_loader(moe.experts.w13_scale_inv, sc, (e, member))
        q, sc = quantized(hidden, inter)
        moe.experts.w2.weight_loader(moe.experts.w2, q, e)
        moe.experts.w2_scale_inv.weight_loader(moe.experts.w2_scale_inv, sc, e)
    up, down = moe.shared_experts.w13, moe.shared_experts.w2
    members = [quantized(num_shared * inter, hidden) for _ in range(2)]  # gate_proj, up_proj as shipped
    up.weight.data.copy_(torch.cat([q for q, _ in members]))
    up.weight_scale_inv.data.copy_(torch.cat([sc for _, sc in members]))
    q, sc = quantized(hidden, num_shared * inter)
    down.weight.data.copy_(q)
    down.weight_scale_inv.data.copy_(sc)
    x = torch.randn(5, hidden)
    want = moe(x)
    warn_once.cache_clear()  # said once a process: clear what earlier tests said
    with caplog.at_level("WARNING", logger="deepserve.layers.quantization"):
        moe.fuse_loaded_weights()
    if inter % 128 and num_shared > 1:
        assert moe.shared_experts is not None and moe.experts.w13.shape[0] == 4
        assert "not a multiple of 128" in caplog.text
        torch.testing.assert_close(moe(x), want)
        return
    assert moe.shared_experts is None and moe.experts.w13.dtype == torch.float8_e4m3fn
    assert moe.experts.w13_scale_inv.shape[0] == moe.experts.w2_scale_inv.shape[0] == 4 + num_shared
    got = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_one_all_reduce_per_moe_layer(monkeypatch):
    # Under tensor parallelism the routed and shared experts' partial sums are added on each rank and
    # all-reduced once (they were reduced separately: two collectives per MoE layer).
    import deepserve.layers.linear as linear
    import deepserve.layers.moe as moe_module

    calls = []

    def counting(x):
        calls.append(tuple(x.shape))
        return x

    monkeypatch.setattr(moe_module, "tp_all_reduce", counting)
    monkeypatch.setattr(linear, "tp_all_reduce", counting)
    torch.manual_seed(0)
    moe = DeepseekMoE(16, 8, 2, RoutingConfig(4, 2))
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(5, 16)
    out = moe(x)
    assert calls == [(5, 16)]
    weights, ids = moe.gate(x)
    torch.testing.assert_close(out, moe.experts.partial(x, weights, ids) + moe.shared_experts(x))


@pytest.mark.parametrize("kwargs, field", [
    (dict(topk_method="sinkhorn"), "topk_method"),
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(topk_method="noaux_tc", n_group=3), "n_group"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=5), "topk_group"),
    (dict(topk_method="group_limited_greedy", n_group=8, topk_group=1), "num_experts_per_tok"),
])
def test_bad_routing_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RoutingConfig(16, 4, **kwargs)


@pytest.mark.parametrize("inter", [96, 256])
def test_fp8_experts_cpu_path_equals_the_fused_kernel_and_its_reference(inter):
    if torch.cuda.is_available():
        pytest.skip("interprets the fused kernel on CPU tensors (compiled Triton on a GPU machine refuses them); the "
                    "GPU runs it in tests/kernels/test_fused_moe_fp8.py")
    # The layer's CPU path (expert by expert, dequantizing per call) against fused_moe_fp8_ref and the
    # fused Triton kernel (interpreted on CPU), on block-quantized weights loaded per expert.
    pytest.importorskip("triton")
    from deepserve.kernels import fp8_ref
    from deepserve.kernels.fused_moe import fused_moe, fused_moe_fp8_ref
    from deepserve.layers.quantization import Fp8Config

    torch.manual_seed(0)
    num_experts, hidden, block = 4, 200, (128, 128)
    experts = RoutedExperts(num_experts, hidden, inter, tp_rank=0, tp_size=1, quant=Fp8Config(weight_block=block))
    for e in range(num_experts):
        for member in (0, 1):
            q, s = fp8_ref.quantize_weight_block(torch.randn(inter, hidden) * (e + 1) * 0.05, block)
            experts.w13.weight_loader(experts.w13, q, (e, member))
            experts.w13_scale_inv.weight_loader(experts.w13_scale_inv, s, (e, member))
        q, s = fp8_ref.quantize_weight_block(torch.randn(hidden, inter), block)
        experts.w2.weight_loader(experts.w2, q, e)
        experts.w2_scale_inv.weight_loader(experts.w2_scale_inv, s, e)
    x = torch.randn(5, hidden, dtype=torch.bfloat16)
    weights, ids = torch.rand(5, 2), torch.stack([torch.randperm(num_experts)[:2] for _ in range(5)])
    want = fused_moe_fp8_ref(x, experts.w13, experts.w13_scale_inv, experts.w2, experts.w2_scale_inv, weights,
                             ids, block)
    got = experts.partial_batched(x, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
    fused = experts.forward_fused(fused_moe, x, weights, ids)
    torch.testing.assert_close(fused.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
