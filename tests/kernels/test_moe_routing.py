"""The fused routing kernel (kernels/moe_routing.py) against the torch `route` it replaces on CUDA.

Every routing method on the real models' shapes (V2-Lite, V2, V3) and on edge shapes (one expert per
group, a group count that is not a power of two, all groups kept, more than 256 experts), in fp32 with
the same ids as sets per token and the same weights to 1e-5. Without CUDA the kernel runs in the Triton
interpreter on CPU; each program costs tens of milliseconds there, so the batch sizes stay small and
the whole file runs in seconds.

Random fp32 logits have no exact ties, but a near tie (two choices closer than the kernel's and torch's
rounding differ by) may legitimately resolve either way: `margins` finds those tokens from the
reference's own scores and they are checked for well-formed ids only. Exact ties have a documented
order (lowest expert id first), tested on constructed inputs.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

mr = import_kernels("deepserve.kernels.moe_routing")

from deepserve.layers import moe  # noqa: E402
from deepserve.layers.moe import MoEGate, RoutingConfig, route  # noqa: E402

pytestmark = MARKS
RC = RoutingConfig
NEAR_TIE = 1e-5  # decisions closer than this are not compared (module docstring)

CONFIGS = {
    "v2-lite": RC(64, 6),  # greedy softmax, no renormalization
    "v2": RC(160, 6, "group_limited_greedy", n_group=8, topk_group=3, routed_scaling_factor=16.0),
    "v3": RC(256, 8, "noaux_tc", "sigmoid", n_group=8, topk_group=4, norm_topk_prob=True,
             routed_scaling_factor=2.5),
    "greedy-sigmoid-norm": RC(16, 3, scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "top-1": RC(8, 1),
    "noaux-one-group": RC(8, 2, "noaux_tc", "sigmoid", norm_topk_prob=True),
    "noaux-softmax-groups-of-one": RC(8, 3, "noaux_tc", "softmax", n_group=8, topk_group=3),
    "noaux-three-groups": RC(48, 4, "noaux_tc", "sigmoid", n_group=3, topk_group=2, norm_topk_prob=True),
    "limited-one-group-kept": RC(32, 4, "group_limited_greedy", "sigmoid", n_group=4, topk_group=1),
    "limited-all-groups-kept": RC(32, 5, "group_limited_greedy", n_group=4, topk_group=4, norm_topk_prob=True),
    "kimi-k2-like": RC(384, 8, "noaux_tc", "sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827),
}
MODELS = ("v2-lite", "v2", "v3")


def inputs(tokens: int, cfg: RoutingConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, cfg.num_experts, generator=gen) * 2.0
    bias = torch.randn(cfg.num_experts, generator=gen) * 0.3  # read under noaux_tc only
    return logits.to(DEVICE), bias.to(DEVICE)


def margins(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor) -> torch.Tensor:
    """[T]: per token, how far the closest decision `route` makes (the K-th vs the next expert, the
    topk_group-th vs the next group) is from a tie, in its own fp32 scores."""
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    choice = scores + bias if cfg.topk_method == "noaux_tc" else scores
    inf = torch.full((logits.shape[0],), float("inf"), device=logits.device)
    margin = inf
    if cfg.topk_method != "greedy" and cfg.n_group > 1:
        grouped = choice.view(choice.shape[0], cfg.n_group, -1)
        if cfg.topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        ranked = group_scores.sort(-1, descending=True).values
        if cfg.topk_group < cfg.n_group:
            margin = ranked[:, cfg.topk_group - 1] - ranked[:, cfg.topk_group]
        choice = moe._keep_best_groups(choice, cfg)
    ranked = choice.sort(-1, descending=True).values
    if cfg.top_k < cfg.num_experts:
        gap = ranked[:, cfg.top_k - 1] - ranked[:, cfg.top_k]
        margin = torch.minimum(margin, torch.where(gap.isnan(), inf, gap))  # -inf - -inf: masked out
    return margin


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def check(cfg: RoutingConfig, logits: torch.Tensor, bias: torch.Tensor, block_t: int | None = None) -> None:
    weights, ids = mr.fused_route(logits, cfg, bias, block_t=block_t)
    tokens = logits.shape[0]
    assert weights.shape == ids.shape == (tokens, cfg.top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.is_contiguous() and ids.is_contiguous()
    assert ((ids >= 0) & (ids < cfg.num_experts)).all()
    assert all(len(set(row)) == cfg.top_k for row in ids.tolist()), "K distinct experts per token"
    want_w, want_ids = route(logits.float(), cfg, bias)
    clear = margins(logits.float(), cfg, bias) > NEAR_TIE  # [T]
    assert clear.sum() >= tokens * 0.9, "too many near ties: the comparison would prove little"
    got_w, got_ids = by_id(weights[clear], ids[clear])
    want_w, want_ids = by_id(want_w[clear], want_ids[clear])
    assert torch.equal(got_ids, want_ids), "same experts per token"
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 7, 64] + ([256, 4099] if ON_GPU else []))
@pytest.mark.parametrize("name", MODELS)
def test_model_shapes_match_route(name, tokens):
    cfg = CONFIGS[name]
    check(cfg, *inputs(tokens, cfg, seed=tokens))


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("name", sorted(set(CONFIGS) - set(MODELS)))
def test_edge_configs_match_route(name, tokens):
    cfg = CONFIGS[name]
    check(cfg, *inputs(tokens, cfg, seed=100 + tokens))


@pytest.mark.parametrize("block_t", [1, 2, 4])
def test_tokens_per_program(block_t):
    # block_t 1 is the GPU default; a partial last program (5 tokens) must not write past T.
    cfg = CONFIGS["v3"]
    check(cfg, *inputs(5, cfg, seed=block_t), block_t=block_t)


def test_bf16_and_strided_logits():
    # bf16 logits are upcast exactly, so they route as their fp32 copy; rows of a wider buffer read right.
    cfg = CONFIGS["v2"]
    logits, bias = inputs(9, cfg, seed=3)
    check(cfg, logits.bfloat16(), bias)
    wide = torch.zeros(9, 2 * cfg.num_experts, device=DEVICE)
    wide[:, : cfg.num_experts] = logits
    check(cfg, wide[:, : cfg.num_experts], bias)


def test_exact_ties_go_to_the_lowest_expert():
    # All logits equal: every choice ties, so the lowest ids, best first; with groups the lowest groups.
    flat = torch.zeros(2, 16, device=DEVICE)
    _, ids = mr.fused_route(flat, RC(16, 3), None)
    assert ids.tolist() == [[0, 1, 2]] * 2
    cfg = RC(16, 3, "noaux_tc", "sigmoid", n_group=4, topk_group=2)
    _, ids = mr.fused_route(flat, cfg, torch.zeros(16, device=DEVICE))
    assert ids.tolist() == [[0, 1, 2]] * 2
    # Experts 9 and 4 tie for the last place: 4 wins; group 3 ties group 1 for the second: group 1 wins.
    logits = torch.tensor([[0.0, 0, 0, 0, 1, 0, 0, 0, 5, 1, 0, 0, 1, 0, 0, 0]], device=DEVICE)
    _, ids = mr.fused_route(logits, RC(16, 2, "group_limited_greedy", n_group=4, topk_group=2), None)
    assert ids.tolist() == [[8, 4]]


@pytest.mark.parametrize("name, shared", [("v3", 1), ("v2-lite", 2), ("greedy-sigmoid-norm", 3)])
def test_fused_shared_experts_follow_the_picks(name, shared):
    # Shared experts fused as experts (layers/moe.py DeepseekMoE): S more columns after the K picks, ids
    # X .. X + S - 1 with weight 1, the picks' weights unchanged (renormalized and scaled without them).
    cfg = CONFIGS[name]
    logits, bias = inputs(7, cfg, seed=shared)
    weights, ids = mr.fused_route(logits, cfg, bias, shared=shared)
    plain_w, plain_ids = mr.fused_route(logits, cfg, bias)
    assert weights.shape == ids.shape == (7, cfg.top_k + shared) and weights.is_contiguous()
    assert torch.equal(ids[:, : cfg.top_k], plain_ids) and torch.equal(weights[:, : cfg.top_k], plain_w)
    assert ids[:, cfg.top_k:].tolist() == [list(range(cfg.num_experts, cfg.num_experts + shared))] * 7
    assert torch.equal(weights[:, cfg.top_k:], torch.ones(7, shared, device=DEVICE))
    want_w, want_ids = route(logits.float(), cfg, bias, shared)
    assert torch.equal(want_ids[:, cfg.top_k:].to(ids.device), ids[:, cfg.top_k:])
    assert torch.equal(want_w[:, cfg.top_k:], weights[:, cfg.top_k:])
    with pytest.raises(ValueError, match="shared experts is more than 16"):
        mr.fused_route(logits, cfg, bias, shared=17 - cfg.top_k)


def test_no_tokens():
    weights, ids = mr.fused_route(torch.zeros(0, 64, device=DEVICE), CONFIGS["v2-lite"], None)
    assert weights.shape == ids.shape == (0, 6)


def test_gate_takes_the_kernel_on_cuda_only():
    # MoEGate's routing is, bit for bit, the kernels' on CUDA and `route`'s elsewhere.
    cfg = CONFIGS["v3"]
    torch.manual_seed(0)
    gate = MoEGate(32, cfg).to(DEVICE)
    gate.weight.data.normal_(0, 0.5)
    gate.e_score_correction_bias.data.normal_(0, 0.3)
    x = torch.randn(6, 32, device=DEVICE, dtype=torch.bfloat16)
    # on CUDA the logits of up to ROUTER_GEMV_MAX_TOKENS tokens come from router_logits too
    logits = mr.router_logits(x, gate.weight) if ON_GPU else torch.nn.functional.linear(x.float(), gate.weight)
    want = (mr.fused_route if ON_GPU else route)(logits, cfg, gate.e_score_correction_bias)
    for got, expected in zip(gate(x), want, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("t, h, dtype, stride", [(1, 2048, torch.bfloat16, 2048), (3, 200, torch.float32, 256),
                                                  (16, 2500, torch.float16, 2500), (5, 7168, torch.bfloat16, 7168)])
def test_router_logits_match_the_float32_linear(t, h, dtype, stride):
    gen = torch.Generator().manual_seed(h)
    weight = torch.randn(24, h, generator=gen).to(DEVICE)
    rows = torch.randn(t, stride, generator=gen).to(DEVICE, dtype)
    x = rows[:, :h]  # rows of a wider buffer when stride > h
    got = mr.router_logits(x, weight)
    want = torch.nn.functional.linear(x.float(), weight)
    assert got.dtype == torch.float32 and got.shape == (t, 24)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    assert mr.router_logits(x[:0], weight).shape == (0, 24)
    with pytest.raises(ValueError, match="float32 weight"):
        mr.router_logits(x, weight.half())


def test_router_selection(monkeypatch):
    # The kernel unless switched off or past its limits; looked up once per config.
    moe._fused_router.cache_clear()
    try:
        assert moe._fused_router(CONFIGS["v3"]) is mr.fused_route
        assert moe._fused_router(RC(1024, 8)) is None
        assert moe._fused_router(CONFIGS["v3"], 8) is mr.fused_route and moe._fused_router(CONFIGS["v3"], 9) is None
        monkeypatch.setenv("DEEPSERVE_FUSED_ROUTING", "0")
        assert moe._fused_router(CONFIGS["v2"]) is None
    finally:
        moe._fused_router.cache_clear()


@pytest.mark.parametrize("bad, message", [
    (dict(logits=lambda t: t[:, :-1]), r"\[T, 64\]"),
    (dict(logits=lambda t: t[None]), r"\[T, 64\]"),
    (dict(logits=lambda t: t.double()), "dtype"),
    (dict(logits=lambda t: torch.zeros(4, 128, device=t.device)[:, ::2]), "contiguous"),
    (dict(bias=lambda b: None), "needs e_score_correction_bias"),
    (dict(bias=lambda b: b[:-1]), r"bias must be contiguous \[64\]"),
    (dict(bias=lambda b: b.long()), "floating point"),
    (dict(cfg=RC(600, 8)), "more than 512"),
    (dict(cfg=RC(64, 20)), "top_k 20"),
    (dict(block_t=3), "power of two"),
])
def test_rejects_bad_inputs(bad, message):
    cfg = bad.get("cfg", RC(64, 6, "noaux_tc", "sigmoid", n_group=8, topk_group=2))
    logits, bias = inputs(4, cfg, seed=0)
    logits = bad.get("logits", lambda t: t)(logits)
    bias = bad.get("bias", lambda b: b)(bias)
    with pytest.raises(ValueError, match=message):
        mr.fused_route(logits, cfg, bias, block_t=bad.get("block_t"))


@pytest.mark.skipif(ON_GPU, reason="on CUDA the kernel runs")
def test_rejects_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(mr, "INTERPRET", False)  # the kernels are already decorated: only the check sees it
    with pytest.raises(ValueError, match="runs on CUDA"):
        mr.fused_route(torch.zeros(2, 64), CONFIGS["v2-lite"], None)


@pytest.mark.skipif(not ON_GPU, reason="the interpreter's argmax rejects all-NaN rows")
def test_non_finite_logits_keep_ids_in_range():
    # Garbage in, but never an id the expert kernels would read out of bounds with.
    for cfg in (CONFIGS["v2-lite"], CONFIGS["v2"], CONFIGS["v3"]):
        logits, bias = inputs(8, cfg, seed=1)
        logits[0] = float("nan")
        logits[1] = float("inf")
        logits[2, ::3] = float("-inf")
        _, ids = mr.fused_route(logits, cfg, bias)
        assert ((ids >= 0) & (ids < cfg.num_experts)).all()


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
def test_captures_in_a_cuda_graph():
    # Capture fails on any host sync; a replay on new logits routes them.
    cfg = CONFIGS["v3"]
    logits, bias = inputs(32, cfg, seed=7)
    mr.fused_route(logits, cfg, bias)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = mr.fused_route(logits, cfg, bias)
    logits.copy_(inputs(32, cfg, seed=8)[0])
    graph.replay()
    torch.cuda.synchronize()
    want_w, want_ids = route(logits, cfg, bias)
    torch.testing.assert_close(by_id(weights, ids), by_id(want_w, want_ids), rtol=1e-5, atol=1e-6)
