"""The int4 routed experts at decode on the tensor cores: int4_mma_gemv.py's GEMV run once per assignment.

At a few tokens each assignment (token, expert slot) has its own expert, so fused_moe's tl.dot tiles (16
sorted rows, one of them real) spend most of their work on padding (on the H200 V2-Lite's int4 experts took
1,133 µs a one-token step against the bf16 experts' 812; bench/RESULTS.md). Here program (row tile,
assignment a) is int4_mma_gemv.gemv_tile on expert topk_ids[a]'s weight with M = 1, no split-K (the
assignments alone give the grid its programs), writing fp32:
  gate-up  gu[a] = x[a // K_top] @ w13[e]^T          [A, 2I] fp32
           act = silu(gate) * up, rounded to x's dtype (as fused_moe's workspace holds it)
  down     y[a] = act[a] @ w2[e]^T                    [A, H] fp32
  combine  out[t] = sum over slots k in order of topk_weights[t, k] * y[t * K_top + k], rounded once to x's
           dtype (fused_moe rounds each y row, then their sum): moe_sum.sum_slots, deterministic.
Assignments to a skipped expert (id E under expert parallelism: most of a token's, at 8 ranks 7 in 8) are
programs that return at once, and are left out of the sum. The grid comes from shapes only: CUDA-graph safe.
Numerics: int4_mma_gemv's (the zero point subtracted exactly, each 128-input block's sum scaled in fp32), not
fused_moe_int4_ref's bf16-rounded weights; the tests hold both to the dequantized reference.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from deepserve import envs
from deepserve.kernels import int4_mma_gemv, pdl
from deepserve.kernels.elementwise import silu_and_mul
from deepserve.kernels.int4_mma_gemv import BLOCK_INPUTS, TILE_ROWS, gemv_tile
from deepserve.kernels.mma_gemv_common import LAUNCH_DEPENDENTS, WAIT, grid_dependency
from deepserve.kernels.moe_sum import sum_slots

# Which path a call takes: this one streams an expert's weight once per assignment (token, slot), fused_moe's tiles once
# per expert hit, but at a few tokens an expert the tiles (16-row tiles, mostly padding) move each byte ~3x slower. So
# this path while assignments <= MMA_HITS_RATIO x the experts that many uniform draws hit on average
# (expected_experts_hit), and at most MAX_ASSIGNMENTS (0: off). bench/int4_moe_mma_probe.py on the H200 (µs a call in a
# CUDA graph, this path against the tiles; bench/RESULTS.md, fifth session of 2026-12-04): V2-Lite (64 experts, 6 a
# token) 1.64-2.53x faster at 1-16 tokens, even at 32 (1.04x: 192 assignments, ratio 3.2, past the line); V3's 256
# experts (8 a token) 1.53-2.36x faster at 1-32 tokens (ratio <= 1.6); V3-sized experts but only 16 of them: 1.51x at 4
# tokens (ratio 2.3), 0.78x at 8 (ratio 4.0). MAX_ASSIGNMENTS stays 24 (V2-Lite AWQ W2 TPOT 3.46 -> 2.92 ms): raising it
# to 256 (the most timed) read W1 +2.2 % in one A/B, and no clear change at 8 and 16 concurrent requests on dummy
# weights, whose router sends a step's tokens to few experts (the tiles' best case; the ratio assumes uniform draws).
# Under expert parallelism every assignment counts against the cap (a skipped one's programs return at once; counting
# only the local ones would need the ids on the host, which a CUDA graph cannot wait for) and the ratio is not applied
# (mma_moe_pays).
MAX_ASSIGNMENTS = int(envs.DEEPSERVE_INT4_MOE_MMA_MAX_ASSIGNMENTS)
MMA_HITS_RATIO = 3.0
# Warps a program, taking the 128-input blocks of its K in turn (gemv_tile): DEEPSERVE_INT4_MOE_MMA_WARPS, 2 by default.
# On one H200 (bench/RESULTS.md, 2026-12-05 and 2026-12-05b): at one token V2-Lite's experts took 28.2 µs a call with
# one warp, 21.2 with two, 18.7 with four (bench/int4_moe_mma_probe.py --warps), at four tokens one was best (47.4
# against 49.2); in the engine two warps read V2-Lite AWQ W2 TPOT 2.26 -> 2.06 ms, W1 -0.2 % (one A/B).
NUM_WARPS = int(envs.DEEPSERVE_INT4_MOE_MMA_WARPS)
if NUM_WARPS not in (1, 2, 4, 8):
    raise ValueError(f"DEEPSERVE_INT4_MOE_MMA_WARPS must be 1, 2, 4 or 8, got {NUM_WARPS}")


def expected_experts_hit(assignments: int, num_experts: int) -> float:
    """The experts that `assignments` uniform draws from num_experts hit, on average: E (1 - (1 - 1/E)^A)."""
    return num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** assignments) if num_experts > 0 else 0.0


def mma_moe_pays(assignments: int, num_experts: int | None) -> bool:
    """Whether this path beats the tiles at that many assignments over num_experts (the rule above; shapes only,
    so a CUDA graph's size decides it once). num_experts None (expert parallelism): the cap alone. There the
    ratio would need every rank's experts, not this rank's (a rank's share of the assignments over its share
    of the hits is the whole layer's ratio), and fused_moe sees only its own."""
    if not 0 < assignments <= MAX_ASSIGNMENTS:
        return False
    return num_experts is None or assignments <= MMA_HITS_RATIO * expected_experts_hit(assignments, num_experts)


def mma_moe_supported(x: torch.Tensor, bits: int, group13: int, group2: int, g_idx13, g_idx2, hidden: int,
                      inter: int, assignments: int, num_experts: int | None) -> bool:
    """Whether the experts of this call take int4_moe_mma: where it pays (mma_moe_pays), on a Hopper GPU (not
    under Triton's interpreter), bf16 / fp16 x with contiguous 16-byte aligned rows, and what the tensor-core
    GEMV needs of both products (int4_mma_gemv.mma_gemv_supported's rules, one token each): 4-bit codes, no act
    order, groups and the inputs (H, I) multiples of 128."""
    if not mma_moe_pays(assignments, num_experts) or bits != 4 or g_idx13 is not None or g_idx2 is not None:
        return False
    if any(v % BLOCK_INPUTS for v in (group13, group2, hidden, inter)):
        return False
    if int4_mma_gemv.INTERPRET or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    aligned = x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    return aligned and int4_mma_gemv._is_hopper(x.device)


def int4_moe_mma(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, operands13: tuple, operands2: tuple) -> torch.Tensor:
    """fused_moe's int4 contract (inputs checked there; mma_moe_supported must hold): x [T, H], w13 int32
    [E, 2I, H/8], w2 int32 [E, H, I/8], operands (scales, zeros, g_idx None, group) of each, topk_ids [T, K]
    (E: an assignment to leave out) -> [T, H] in x's dtype."""
    (t, h), (num_experts, two_i, _), top_k = x.shape, w13.shape, topk_ids.shape[1]
    assignments = t * top_k
    ids = topk_ids.reshape(-1)
    gu = torch.empty(assignments, two_i, dtype=torch.float32, device=x.device)
    _launch(x, w13, operands13, ids, gu, top_k, num_experts, t)
    act = silu_and_mul(gu, out_dtype=x.dtype, tokens=t)  # [A, I]
    y = torch.empty(assignments, h, dtype=torch.float32, device=x.device)
    _launch(act, w2, operands2, ids, y, 1, num_experts, t)
    return sum_slots(y, top_k, topk_weights, topk_ids, num_experts, out_dtype=x.dtype)


def _launch(a: torch.Tensor, w: torch.Tensor, operands: tuple, ids: torch.Tensor, out: torch.Tensor,
            rows_per_a: int, num_experts: int, tokens: int) -> None:
    # out [A, N] fp32: row a = a's row a // rows_per_a @ expert ids[a]'s weight^T
    scales, zeros, _, group = operands
    n, k = w.shape[1], a.shape[1]
    on = pdl.wanted(a, tokens, mla_moe=True)
    _int4_moe_mma_kernel[(triton.cdiv(n, TILE_ROWS), out.shape[0])](
        a, w, scales, zeros, out, ids, num_experts, n, k, rows_per_a, a.stride(0), w.stride(0), w.stride(1),
        scales.stride(0), scales.stride(1), GROUP=group, F16=a.dtype == torch.float16, NUM_WARPS=NUM_WARPS,
        PDL=on, num_warps=NUM_WARPS, **pdl.launch_options(on))


@gluon.jit
def _int4_moe_mma_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, ids_ptr, E, N, K, rows_per_a, stride_xm, stride_qe,
                         stride_qn, stride_se, stride_sn, GROUP: gl.constexpr, F16: gl.constexpr,
                         NUM_WARPS: gl.constexpr, PDL: gl.constexpr = False):
    # Program (row tile, assignment): out[assignment, tile rows] = x[assignment // rows_per_a] @ w[expert]^T
    # in fp32 (gemv_tile with one split: its "workspace" is the output row; M = 1, as a runtime value).
    # A skipped assignment (another rank's expert) does nothing: its output row stays unwritten, and neither
    # the SiLU's row of it nor sum_slots (which leaves id E out) reads anything into the result.
    tile, slot = gl.program_id(0), gl.program_id(1)
    if PDL:  # kernels/pdl.py: the next launch may start now (at decode sizes every program is resident at once);
        # the expert's weights depend on the routing, so nothing is read before the wait
        grid_dependency(tile, LAUNCH_DEPENDENTS)
        grid_dependency(tile, WAIT)
    expert = gl.load(ids_ptr + slot)
    if expert < E:
        e64 = expert.to(gl.int64)
        x_row = x_ptr + (slot // rows_per_a).to(gl.int64) * stride_xm
        one = rows_per_a * 0 + 1
        gemv_tile(x_row, q_ptr + e64 * stride_qe, s_ptr + e64 * stride_se, z_ptr + e64 * stride_se,
                  out_ptr + slot.to(gl.int64) * N, out_ptr, out_ptr, ids_ptr, one, N, K, K // 128, stride_xm,
                  stride_qn, stride_sn, tile, 0, 1, GROUP, F16, False, False, NUM_WARPS, 1, True, False)
