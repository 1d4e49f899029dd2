"""The fused MoE's int4 path (W4A16 experts, kernels/fused_moe.py) against fused_moe_int4_ref, and
RoutedExperts with int4 experts dispatching to it. Interpreter on CPU (tiny shapes), the GPU where there is
one. Scales differ in magnitude per expert, row and group, so a mixed-up expert, row, group or nibble
shows far past the tolerance; workspaces start as NaN (tests/kernels/test_fused_moe.py's fixture)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.kernels.test_fused_moe import poisoned_workspaces, rel_err, routing  # noqa: F401
from tests.kernels.triton_setup import DEVICE, MARKS, import_kernels

fm = import_kernels("deepserve.kernels.fused_moe")

from deepserve.kernels import int4_ref  # noqa: E402
from deepserve.kernels.int4_gemv import Int4GemvConfig  # noqa: E402

pytestmark = MARKS
SMALL = fm.MoEConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def int4_experts(experts: int, rows: int, k: int, bits: int, group: int, act_order: bool, gen: torch.Generator):
    """(codes int32 [E, rows, K/pack], scales, zeros [E, rows, G], g_idx [E, K] or None)."""
    groups = -(-k // group)
    codes = torch.randint(0, 2**bits, (experts, rows, k), generator=gen)
    scales = (10 ** (torch.rand(experts, rows, groups, generator=gen) * 2 - 1) / 2**bits).half()
    zeros = torch.randint(0, 2**bits, (experts, rows, groups), generator=gen).half()
    g_idx = None
    if act_order:
        g_idx = torch.stack([torch.randperm(k, generator=gen) // group for _ in range(experts)]).to(torch.int32)
    return int4_ref.pack_rows(codes, bits), scales, zeros, g_idx


def make_case(tokens, experts, k, hidden, inter, bits, group, act_order, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    w13, s13, z13, g13 = int4_experts(experts, 2 * inter, hidden, bits, group, act_order, gen)
    w2, s2, z2, g2 = int4_experts(experts, hidden, inter, bits, group, act_order, gen)
    on = (lambda t: None if t is None else t.to(DEVICE))
    int4 = fm.Int4Experts(bits, on(s13), on(z13), on(s2), on(z2), group, group, on(g13), on(g2))
    weights, ids = routing(tokens, experts, k, gen)
    return x, on(w13), on(w2), weights, ids, int4


@pytest.mark.parametrize("tokens,bits,group,act_order", [(1, 4, 32, False), (7, 4, 16, True), (20, 8, 32, False)])
def test_int4_experts_match_the_reference(tokens, bits, group, act_order):
    x, w13, w2, weights, ids, int4 = make_case(tokens, 8, 2, 64, 48, bits, group, act_order, seed=tokens)
    got = fm.fused_moe(x, w13, w2, weights, ids, SMALL, int4=int4)
    want = fm.fused_moe_int4_ref(x, w13, w2, weights, ids, int4)
    assert rel_err(got, want) < 1e-4, rel_err(got, want)


def test_skipped_assignments_contribute_nothing():
    x, w13, w2, weights, ids, int4 = make_case(5, 8, 2, 64, 32, 4, 32, False, seed=3)
    ids[0, 1] = 8  # another rank's expert (expert parallelism)
    got = fm.fused_moe(x, w13, w2, weights, ids, SMALL, skips=True, int4=int4)
    want = fm.fused_moe_int4_ref(x, w13, w2, weights, ids, int4)
    assert rel_err(got, want) < 1e-4


GEMV = Int4GemvConfig(block_n=16, block_k=32, num_stages=2)  # the decode GEMVs (kernels/int4_moe_gemv.py)


@pytest.mark.parametrize("factored,prefetch", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("tokens,bits,group,act_order", [(1, 4, 32, False), (4, 4, 16, True), (5, 8, 32, False),
                                                         (3, 4, 8, False)])
def test_int4_expert_gemvs_match_the_reference(tokens, bits, group, act_order, factored, prefetch):
    # groups of 32 = block_k (a scale per K step), 16 and 8 (a scale per word), act order (per input)
    x, w13, w2, weights, ids, int4 = make_case(tokens, 8, 2, 64, 48, bits, group, act_order, seed=tokens)
    got = fm.fused_moe(x, w13, w2, weights, ids, replace(GEMV, factored=factored, prefetch=prefetch), int4=int4)
    want = fm.fused_moe_int4_ref(x, w13, w2, weights, ids, int4)
    assert rel_err(got, want) < 1e-4, rel_err(got, want)


def test_int4_expert_gemvs_with_a_partial_k_step_and_half_precision():
    # H 80 and I 40: both GEMMs end on a partial K step of 32 (masked)
    x, w13, w2, weights, ids, int4 = make_case(3, 8, 2, 80, 40, 4, 16, False, seed=9)
    x = x.half()
    got = fm.fused_moe(x, w13, w2, weights, ids, GEMV, int4=int4)
    want = fm.fused_moe_int4_ref(x.float(), w13, w2, weights, ids, int4)
    assert got.dtype == torch.float16 and rel_err(got, want) < 2e-3, rel_err(got, want)


def test_int4_expert_gemvs_skip_other_ranks_experts():
    x, w13, w2, weights, ids, int4 = make_case(5, 8, 2, 64, 32, 4, 32, False, seed=3)
    ids[0, 1] = 8  # another rank's expert (expert parallelism)
    got = fm.fused_moe(x, w13, w2, weights, ids, GEMV, skips=True, int4=int4)
    want = fm.fused_moe_int4_ref(x, w13, w2, weights, ids, int4)
    assert rel_err(got, want) < 1e-4


def test_int4_expert_gemvs_catch_a_wrong_zero_point():
    x, w13, w2, weights, ids, int4 = make_case(2, 8, 2, 64, 64, 4, 32, False, seed=4)
    want = fm.fused_moe_int4_ref(x, w13, w2, weights, ids, int4)
    zeros = int4.w2_zeros.clone()
    zeros[:, :, 1] += 1  # the second group of every expert's down rows, one code off
    got = fm.fused_moe(x, w13, w2, weights, ids, GEMV, int4=replace(int4, w2_zeros=zeros))
    assert rel_err(got, want) > 1e-2


def test_int4_expert_gemvs_refuse_split_k():
    x, w13, w2, weights, ids, int4 = make_case(1, 4, 1, 64, 32, 4, 32, False, seed=1)
    with pytest.raises(ValueError, match="split_k"):
        fm.fused_moe(x, w13, w2, weights, ids, replace(GEMV, split_k=2), int4=int4)


def test_int4_weights_without_their_scales_are_refused():
    x, w13, w2, weights, ids, _ = make_case(2, 4, 1, 64, 32, 4, 32, False, seed=1)
    with pytest.raises(ValueError, match="Int4Experts"):
        fm.fused_moe(x, w13, w2, weights, ids, SMALL)


def test_routed_experts_dispatch_int4_to_the_fused_kernel(monkeypatch):
    # RoutedExperts.forward_fused hands its int4 storage to the kernel: equal to its own torch path.
    from deepserve.layers.moe import RoutedExperts
    from deepserve.layers.quantization import Int4Config
    from deepserve.loader.checkpoint import init_dummy_weights

    experts = RoutedExperts(8, 64, 32, tp_rank=0, tp_size=1, quant=Int4Config("gptq", 4, 16, False, True))
    init_dummy_weights(experts, seed=0, scale=0.5)
    experts = experts.to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen).to(DEVICE)
    weights, ids = routing(6, 8, 2, gen)
    got = experts.forward_fused(lambda *a, **kw: fm.fused_moe(*a, **kw, config=SMALL), x, weights, ids)
    assert rel_err(got, experts.partial_batched(x, weights, ids)) < 1e-4
