"""Fused MoE kernel and moe_align against their torch references, and the RoutedExperts dispatch.

Two modes, as in test_triton_paged_attention.py: with CUDA every test runs on the GPU (marked `gpu`) over
the full grid; without CUDA the kernels run on CPU under the Triton interpreter over a small grid (the
whole CPU file stays under a minute). To run the interpreter mode on a GPU machine:
`CUDA_VISIBLE_DEVICES= pytest tests/kernels/test_fused_moe.py`.

Inputs are adversarial where the contract allows: routing is skewed (some experts get no token, a few get
most), the kernel's workspaces start as NaN (a row it fails to write shows up in the output), and the
shapes include tiles that do not divide H or I and fewer tokens than one block.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

fm = import_kernels("deepserve.kernels.fused_moe")

from deepserve.layers.moe import MoEGate, RoutedExperts, RoutingConfig  # noqa: E402

pytestmark = MARKS
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
MC = fm.MoEConfig


@pytest.fixture(autouse=True)
def poisoned_workspaces(monkeypatch):
    # Every workspace the kernel should fully write starts as NaN.
    monkeypatch.setattr(fm, "_workspace", lambda rows, cols, like: torch.full(
        (rows, cols), float("nan"), dtype=like.dtype, device=like.device))
    if not ON_GPU:  # the interpreter sorts slowly: larger cases take the torch path, which is tested too
        monkeypatch.setattr(fm, "ALIGN_KERNEL_MAX", 512)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel output (an unwritten row or a masked load that was not)"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def routing(tokens: int, experts: int, k: int, gen: torch.Generator, skewed: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
    # -> topk_weights [T, K] float32, topk_ids [T, K] int64 (K distinct experts per token). Skewed: the
    # upper half of the experts never gets a token (when K allows) and experts 0 and 1 get most.
    scores = torch.randn(tokens, experts, generator=gen)
    if skewed:
        if experts - experts // 2 >= k:
            scores[:, experts // 2:] = float("-inf")
        scores[:, :2] += 2.0
    ids = scores.topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=gen) + 0.1
    return weights.to(DEVICE), ids.to(DEVICE)


def make_case(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
              skewed: bool = True) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    # Scaled so every product is O(1): the relative error then measures rounding, not cancellation.
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    return (x, w13, w2, *routing(tokens, experts, k, gen, skewed))


def check(x, w13, w2, weights, ids, config=None) -> None:
    out = fm.fused_moe(x, w13, w2, weights, ids, config=config)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, fm.fused_moe_ref(x, w13, w2, weights, ids)) < TOLERANCE[x.dtype]


if ON_GPU:
    CASES = [
        (tokens, experts, k, hidden, inter, dtype)
        for tokens in (1, 7, 33, 300) for experts, k in ((4, 1), (16, 2), (64, 6), (64, 8))
        for hidden, inter in ((64, 32), (128, 96), (80, 48)) for dtype in (torch.float32, torch.bfloat16)
    ] + [(257, 64, 6, 256, 176, torch.float16), (2000, 64, 6, 256, 128, torch.bfloat16),
         (3000, 16, 4, 128, 64, torch.bfloat16)]  # the last two: prefill configs, torch-side alignment
else:
    CASES = [
        (1, 4, 2, 32, 16, torch.float32),  # fewer tokens than one block
        (3, 8, 1, 48, 40, torch.bfloat16),  # H and I not multiples of the tile
        (17, 16, 4, 64, 32, torch.float32),
        (33, 64, 8, 32, 48, torch.bfloat16),
        (64, 16, 6, 64, 64, torch.float16),
        (300, 8, 2, 32, 16, torch.float32),  # torch-side alignment
        (150, 64, 8, 32, 16, torch.bfloat16),
    ]


@pytest.mark.parametrize("skewed", [True, False], ids=["skewed", "balanced"])
@pytest.mark.parametrize("tokens,experts,k,hidden,inter,dtype", CASES)
def test_fused_moe_matches_reference(tokens, experts, k, hidden, inter, dtype, skewed):
    check(*make_case(tokens, experts, k, hidden, inter, dtype, seed=tokens * 100 + experts + k, skewed=skewed))


@pytest.mark.parametrize("config", [
    MC(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3),  # the decode default
    MC(block_m=32, block_n=32, block_k=64, group_m=4, num_warps=4, num_stages=4),
    MC(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),  # prefill defaults
    MC(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3),
], ids=lambda c: f"m{c.block_m}-n{c.block_n}-k{c.block_k}-g{c.group_m}")
def test_fused_moe_launch_configs(config):
    # Every regime's tile must be right on one shape: several blocks per expert (the grouped program
    # order, a partial last group), a hot expert, empty experts, tiles that do not divide H or I.
    x, w13, w2, weights, ids = make_case(150, 8, 3, 80, 48, torch.bfloat16, seed=5)
    check(x, w13, w2, weights, ids, config=config)


def test_default_config_regimes():
    # Decode (a handful of tokens per expert) takes the smallest row tile; prefill a large one.
    decode = fm.default_config(256, 6, 64, torch.bfloat16)  # V2-Lite decode: 24 per expert
    assert fm.default_config(1, 6, 64, torch.bfloat16).block_m == 16
    assert decode.block_m <= 32
    assert fm.default_config(8192, 6, 64, torch.bfloat16).block_m >= 64


def test_fused_moe_strided_x_and_no_tokens():
    x, w13, w2, weights, ids = make_case(9, 8, 2, 32, 16, torch.float32, seed=2)
    wide = torch.randn(9, 64, device=DEVICE)
    wide[:, :32] = x
    check(wide[:, :32], w13, w2, weights, ids)  # rows of a larger buffer: stride(0) != H
    assert fm.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("bad, message", [
    (dict(x=lambda t: t.to(torch.float16)), "one dtype"),
    (dict(weights=lambda t: t.half()), "float32"),
    (dict(w2=lambda t: t[:, :, :-1]), "do not match"),
    (dict(x=lambda t: t.t().contiguous().t()), "contiguous"),
    (dict(ids=lambda t: t[:, :1]), r"\[T, K\]"),
])
def test_fused_moe_rejects_bad_inputs(bad, message):
    args = dict(zip(("x", "w13", "w2", "weights", "ids"), make_case(4, 4, 2, 32, 16, torch.float32, seed=1),
                    strict=True))
    args = {name: bad.get(name, lambda t: t)(t) for name, t in args.items()}
    with pytest.raises(ValueError, match=message):
        fm.fused_moe(args["x"], args["w13"], args["w2"], args["weights"], args["ids"])


def check_alignment(ids: torch.Tensor, experts: int, block_m: int,
                    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    # ids equal to `experts` are skipped assignments (another rank's expert): they must appear nowhere.
    sorted_ids, expert_ids, num_padded = (t.cpu() for t in align)
    flat, n = ids.flatten().cpu(), ids.numel()
    kept = torch.arange(n, dtype=torch.int32)[flat < experts]
    counts = torch.bincount(flat[flat < experts], minlength=experts)
    total = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() == fm.padded_size(n, experts, block_m) and sorted_ids.numel() % block_m == 0
    assert expert_ids.numel() == sorted_ids.numel() // block_m and int(num_padded) == total
    real = sorted_ids[:total]
    assert torch.equal(real[real < n].sort().values, kept), "each kept assignment once, no skipped one"
    assert (sorted_ids[total:] == n).all() and (expert_ids[total // block_m:] == -1).all(), "sentinel tail"
    for b, block in enumerate(real.view(-1, block_m)):
        valid = block < n
        assert valid[0] and valid.sum() == valid.cumsum(0)[-1] and not valid[int(valid.sum()):].any(), \
            "a block starts with real assignments, padding only at its end"
        assert (flat[block[valid].long()] == expert_ids[b]).all(), "one expert per block, the one named"
    assert (expert_ids[: total // block_m].diff() >= 0).all(), "runs in expert order"


@pytest.mark.parametrize("tokens,experts,k,block_m", [
    (1, 4, 1, 16), (1, 64, 6, 16), (5, 8, 3, 4), (37, 16, 2, 16), (64, 256, 8, 16), (40, 8, 8, 64),
    (200, 64, 6, 32),
])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_moe_align_invariants(tokens, experts, k, block_m, path):
    gen = torch.Generator().manual_seed(tokens + experts)
    _, ids = routing(tokens, experts, k, gen)
    if path == "kernel":
        align = fm.moe_align(ids, experts, block_m)
    else:
        align = fm._moe_align_torch(ids, experts, block_m, fm.padded_size(ids.numel(), experts, block_m))
    check_alignment(ids, experts, block_m, align)


def skip_others(ids: torch.Tensor, experts: int, gen: torch.Generator) -> torch.Tensor:
    """About half the assignments marked as another rank's (id = experts), as expert parallelism does."""
    others = torch.rand(ids.shape, generator=gen) < 0.5
    return torch.where(others.to(ids.device), experts, ids)


@pytest.mark.parametrize("tokens,experts,k,block_m", [(1, 4, 2, 16), (5, 8, 3, 4), (37, 16, 2, 16), (200, 64, 6, 32)])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_moe_align_leaves_skipped_assignments_out(tokens, experts, k, block_m, path):
    gen = torch.Generator().manual_seed(tokens)
    _, ids = routing(tokens, experts, k, gen)
    ids = skip_others(ids, experts, gen)
    ids[0, 0] = experts  # at least one skip; all of them in another case below
    for case in (ids, torch.full_like(ids, experts)):
        if path == "kernel":
            align = fm.moe_align(case, experts, block_m)
        else:
            align = fm._moe_align_torch(case, experts, block_m, fm.padded_size(case.numel(), experts, block_m))
        check_alignment(case, experts, block_m, align)


@pytest.mark.parametrize("tokens", [1, 9, 300])
def test_fused_moe_skips_other_ranks_assignments(tokens):
    x, w13, w2, weights, ids = make_case(tokens, 16, 4, 48, 32, torch.float32, seed=tokens)
    ids = skip_others(ids, 16, torch.Generator().manual_seed(1))
    out = fm.fused_moe(x, w13, w2, weights, ids, skips=True)
    # The same sum with the skipped assignments' weights zeroed and sent to a real expert.
    zeroed = fm.fused_moe_ref(x, w13, w2, torch.where(ids < 16, weights, 0.0), torch.where(ids < 16, ids, 0))
    assert rel_err(out, zeroed) < TOLERANCE[torch.float32]
    assert rel_err(out, fm.fused_moe_ref(x, w13, w2, weights, ids)) < TOLERANCE[torch.float32]


def test_moe_align_paths_agree():
    # Both paths produce the same bytes: ascending assignment id inside each expert's run.
    gen = torch.Generator().manual_seed(0)
    _, ids = routing(60, 16, 4, gen)
    size = fm.padded_size(ids.numel(), 16, 16)
    for got, want in zip(fm.moe_align(ids, 16, 16), fm._moe_align_torch(ids, 16, 16, size), strict=True):
        assert torch.equal(got, want)


def experts_module(experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, seed: int
                   ) -> tuple[MoEGate, RoutedExperts]:
    torch.manual_seed(seed)
    gate = MoEGate(hidden, RoutingConfig(experts, top_k, norm_topk_prob=True)).to(DEVICE)
    gate.weight.data.normal_(0, 0.5)
    module = RoutedExperts(experts, hidden, inter).to(DEVICE, dtype)
    module.w13.data.normal_(0, hidden**-0.5)
    module.w2.data.normal_(0, inter**-0.5)
    return gate, module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_takes_routed_experts_layout(dtype):
    # The weights exactly as RoutedExperts loads them, routed by the real gate: the kernel equals its
    # batched path (the one every device but CUDA runs).
    gate, module = experts_module(8, 48, 32, 3, dtype, seed=3)
    x = torch.randn(21, 48, device=DEVICE).to(dtype)
    weights, ids = gate(x)
    out = fm.fused_moe(x, module.w13, module.w2, weights, ids)
    assert rel_err(out, module.forward_batched(x, weights, ids)) < TOLERANCE[dtype]


@pytest.mark.skipif(not ON_GPU, reason="the dispatch takes the kernel only on CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_routed_experts_dispatch_on_cuda(tokens):
    gate, module = experts_module(16, 128, 64, 4, torch.bfloat16, seed=tokens)
    x = torch.randn(tokens, 128, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = gate(x)
    out = module(x, weights, ids)
    assert rel_err(out, module.forward_batched(x, weights, ids)) < TOLERANCE[torch.bfloat16]
    assert rel_err(out, module.forward_reference(x, weights, ids)) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
def test_fused_moe_captures_in_a_cuda_graph():
    # Capture fails on any host sync; replay on new routing must match eager.
    x, w13, w2, weights, ids = make_case(32, 64, 6, 128, 64, torch.bfloat16, seed=9)
    fm.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, weights, ids)
    new_weights, new_ids = routing(32, 64, 6, torch.Generator().manual_seed(10), skewed=False)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, fm.fused_moe_ref(x, w13, w2, weights, ids)) < TOLERANCE[torch.bfloat16]
