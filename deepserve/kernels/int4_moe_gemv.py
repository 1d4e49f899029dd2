"""The int4 fused MoE at decode: the routed experts as GEMVs, one program per (assignment, output tile).

At a few tokens each assignment (token, expert slot) has its own expert, so fused_moe's tl.dot tiles
(16 sorted rows, one valid) spend most of their work on padding, and the int4 unpacking feeds a tensor
core for one row. Here no sorting is needed: program (a, n tile) reads expert topk_ids[a]'s packed rows
and runs kernels/int4_tile.gemv_rows over K, like the linear GEMV (kernels/int4_gemv.py):
  gate-up  act[a, n] = silu(x[a // K_top] . w1[e, n]) * (x[a // K_top] . w3[e, n]), rounded to x's dtype
           (fused_moe's workspace holds it so)
  down     y[a, h] = topk_weights[a] * (act[a] . w2[e, h]), in x's dtype
and the K_top slots of a token are summed in slot order (as fused_moe does): deterministic.
Assignments to a skipped expert (id E under expert parallelism) load expert 0's codes and store nothing;
their y rows start at zero. Grids are sized on the host from shapes only: CUDA-graph safe.
Program order: the assignments of one output tile are adjacent, so tokens routed to the same expert
read its tile from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepserve.kernels.int4_gemv import Int4GemvConfig
from deepserve.kernels.int4_tile import gemv_rows
from deepserve.kernels.moe_sum import sum_slots


def int4_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, bits: int, operands13: tuple, operands2: tuple, act: torch.Tensor,
                  y: torch.Tensor, cfg: Int4GemvConfig) -> torch.Tensor:
    """fused_moe's int4 contract (inputs checked there): x [T, H], w13 int32 [E, 2I, H/pack], w2 int32
    [E, H, I/pack], operands (scales, zeros, g_idx or None, group) of each, workspaces act [T*K, I] and
    y [T*K, H] in x's dtype (y zeroed where assignments may be skipped) -> [T, H] in x's dtype."""
    t, e, top_k = x.shape[0], w13.shape[0], topk_ids.shape[1]
    assignments = t * top_k
    if cfg.split_k > 1:
        raise ValueError(f"int4 MoE GEMV: split_k must be 0 or 1 (the epilogue needs whole sums), got {cfg.split_k}")
    ids = topk_ids.reshape(-1).to(torch.int32)
    for a, w, out, ops, gated in ((x, w13, act, operands13, True), (act, w2, y, operands2, False)):
        scales, zeros, g_idx, group = ops
        n, k = out.shape[1], a.shape[1]
        _moe_gemv_kernel[(assignments * triton.cdiv(n, cfg.block_n),)](
            a, w, scales, zeros, scales if g_idx is None else g_idx, ids, topk_weights, out,
            assignments, n, k, e, a.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(1),
            0 if g_idx is None else g_idx.stride(0), out.stride(0),
            ROWS_PER_A=top_k if gated else 1, GATED=gated, MUL_WEIGHT=not gated, BITS=bits, GROUP=group,
            HAS_G_IDX=g_idx is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
            FACTORED=cfg.factored, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return sum_slots(y, top_k) if top_k > 1 else y


# The assignment count changes every step: one compile serves all of them.
@triton.jit(do_not_specialize=["A"])
def _moe_gemv_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, g_ptr, ids_ptr, tw_ptr, c_ptr, A, N, K, E, stride_am, stride_qe, stride_qn,
    stride_se, stride_sn, stride_ge, stride_cm, ROWS_PER_A: tl.constexpr, GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FACTORED: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # Program (assignment, n tile): c[assignment, n tile] from a's row assignment // ROWS_PER_A and expert
    # ids[assignment]'s weight rows n (and N + n, the up rows, when GATED).
    pid = tl.program_id(0)
    assignment, pid_n = pid % A, pid // A
    expert = tl.load(ids_ptr + assignment)
    real = expert < E
    expert64 = tl.where(real, expert, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = (cols % N).to(tl.int64)  # rows past N wrap around for the loads; the store masks them
    a_row = a_ptr + (assignment // ROWS_PER_A).to(tl.int64) * stride_am
    q_cols = q_ptr + expert64 * stride_qe + n64 * stride_qn
    s_cols = s_ptr + expert64 * stride_se + n64 * stride_sn
    z_cols = z_ptr + expert64 * stride_se + n64 * stride_sn
    g_row = g_ptr + expert64 * stride_ge
    k_tiles = tl.cdiv(K, BLOCK_K)
    out = gemv_rows(a_row, q_cols, s_cols, z_cols, g_row, 0, k_tiles, K, BITS, GROUP, HAS_G_IDX, BLOCK_N,
                    BLOCK_K, EVEN_K, FACTORED, PREFETCH, False, False)  # the magic loop: linears only, untimed here
    if GATED:  # the up rows follow the N gate rows
        up = gemv_rows(a_row, q_cols + N * stride_qn, s_cols + N * stride_sn, z_cols + N * stride_sn, g_row, 0,
                       k_tiles, K, BITS, GROUP, HAS_G_IDX, BLOCK_N, BLOCK_K, EVEN_K, FACTORED, PREFETCH, False,
                       False)
        out = out / (1.0 + tl.exp(-out)) * up  # silu(gate) * up in fp32
    if MUL_WEIGHT:
        out = out * tl.load(tw_ptr + assignment)
    tl.store(c_ptr + assignment.to(tl.int64) * stride_cm + cols, out.to(c_ptr.dtype.element_ty),
             mask=(cols < N) & (cols * 0 + expert < E))  # [BLOCK_N]: real assignments only
