"""Fused mixture-of-experts: routed SwiGLU experts as two Triton grouped GEMMs over expert-sorted tokens.

Weights (the layout layers/moe.py RoutedExperts loads): w13 [E, 2I, H], per expert the I gate (w1) rows
then the I up (w3) rows; w2 [E, H, I]. Every expert's last dimension is contiguous.

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])),  e = topk_ids[t, k]

1. `moe_align` sorts the T*K (token, slot) assignments by expert and pads each expert's run to a multiple
   of block_m with the sentinel T*K, so every block of block_m sorted assignments belongs to one expert.
   Assignment a is token a // K, slot a % K. Output sizes are worst cases known from shapes alone, and the
   padded total stays on the device: no host sync, so the whole call can be captured in a CUDA graph.
2. Gate-up GEMM, one program per (block, tile of I): gathers the block's x rows, multiplies by the gate and
   the up tile of the block's expert (two accumulators over one x tile), writes silu(gate) * up to
   act [T*K, I] at the assignment's row.
3. Down GEMM, one program per (block, tile of H): act rows times w2[e], times the routing weight, written
   to y [T*K, H] at the assignment's row.
4. out = moe_sum.sum_slots(y, K), y.view(T, K, H).sum(1) in one launch: a fixed-order reduction, so the
   result is deterministic (no atomics).

Expert parallelism: an id equal to E (one past this rank's last expert) marks an assignment to an expert
on another rank. `moe_align` leaves it out, so no GEMM touches it, and its y row stays zero (`skips=True`
zero-fills y). Routing another rank's assignments to a real expert with weight 0 instead would make that
expert compute all of them; selecting only this rank's assignments would need their count on the host.

Every assignment appears exactly once in the sorted order and each program writes all its valid rows, so
act and y are torch.empty (y zeroed with skips): sentinel rows are masked and never stored.

FP8 (W8A8, DeepSeek-V3/R1's block-scaled experts; numerics of kernels/fp8_ref.py): w13 and w2 are
float8_e4m3fn with one float32 factor per bn x bk weight block (w13_scale [E, 2 ceil(I/bn), ceil(H/bk)],
the gate member's rows then the up member's; w2_scale [E, ceil(H/bn), ceil(I/bk)]). The activations (x,
and silu(gate) * up after rounding to x's dtype) are quantized per token and group of bk columns. Each
k-step's fp8 product (at most bk long) is scaled by its two factors into an fp32 accumulator: the tensor
cores' reduced-precision fp8 accumulation then never spans more than one group. Where activations get
quantized is a tile choice (MoEConfig.prequantize, default_fp8_config says which regime takes which):
  in the GEMMs  each program quantizes the bf16 a-tile it loads (block_k == bk: one tile row is one group).
                No launch beyond the bf16 path's, but a block's x rows are quantized once per N tile of I,
                and act once per N tile of H: cheap on the CUDA cores beside a weight stream (decode),
                a real cost beside fp8 tensor cores running flat out (prefill).
  once          x by one separate kernel, act in the gate-up epilogue (block_n == bk: one output tile row
                is one act group), written as fp8 + scales: each value quantized once, and the a-tiles
                the GEMMs load are half the bytes. One extra launch (prefill pays it gladly).

Shapes: T tokens, H hidden size, E experts (this rank's copy), I intermediate size (this rank's share),
K experts per token, N = T*K assignments, P padded assignment count (a multiple of block_m).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels import fp8_ref, int4_ref, int4_tile, pdl
from deepserve.kernels.int4_gemv import Int4GemvConfig, default_moe_gemv_config
from deepserve.kernels.int4_moe_gemv import int4_moe_gemv
from deepserve.kernels.int4_moe_mma import int4_moe_mma, mma_moe_supported
from deepserve.kernels.int4_tile import dequantize_tile
from deepserve.kernels.moe_sum import sum_slots

# Triton decides at decoration, when the module is imported; a launch must not reread the environment.
INTERPRET = envs.TRITON_INTERPRET
# fp8_ref's quantization constants, as constexprs a kernel may read (a plain Python global it may not).
FP8_MAX = tl.constexpr(fp8_ref.FP8_MAX)
AMAX_FLOOR = tl.constexpr(fp8_ref.AMAX_FLOOR)
INV_FP8_MAX = tl.constexpr(fp8_ref.INV_FP8_MAX)  # the device's scale (fp8_ref.py says why)
# How int4 codes leave their words in the expert GEMMs (kernels/int4_tile.py).
RESHAPE_UNPACK = tl.constexpr(int4_tile.RESHAPE_UNPACK)
# Int4 experts for at most this many tokens run as GEMVs (kernels/int4_moe_gemv.py) instead of the tiles;
# 0, the default until measured on the H200 (bench/check_int4.py --variants): never. Read once, at import.
INT4_GEMV_MAX_TOKENS = int(envs.DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS)


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of both grouped GEMMs. block_n is the output tile: gate-up programs compute block_n gate and
    block_n up columns (two accumulators), down programs block_n hidden columns."""

    block_m: int  # sorted assignments per program: one expert per block, so the alignment unit too
    block_n: int
    block_k: int
    group_m: int  # consecutive blocks that walk the same weight tiles (L2 reuse when an expert has many)
    num_warps: int
    num_stages: int
    # FP8 only: quantize x in a separate kernel and act in the gate-up epilogue (needs block_n == bk)
    # instead of in every GEMM program (needs block_k == bk). Module docstring, "FP8".
    prequantize: bool = False


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoEConfig:
    """Guessed for the H200, to be tuned with bench/check_fused_moe.py.

    What decides the tile is the mean number of assignments per expert, T*K/E: decode (V2-Lite T <= 256:
    <= 24 per expert) is a weight stream, so the smallest tl.dot row tile (16) wastes the least padding
    and many narrow N tiles keep every SM loading; prefill (thousands of tokens: hundreds per expert) is
    compute-bound, so larger M tiles reuse each weight tile over more rows."""
    if dtype == torch.float32:  # tests only: fp32 tiles are twice the bytes
        return MoEConfig(block_m=16, block_n=32, block_k=32, group_m=8, num_warps=4, num_stages=2)
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)
    if per_expert <= 256:
        return MoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)
    return MoEConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3)


def default_fp8_config(num_tokens: int, top_k: int, num_experts: int, group_k: int = 128) -> MoEConfig:
    """Tiles for FP8 weights with bk = group_k (128 for DeepSeek), by assignments per expert, as
    measured on the H200 (bench/check_fp8_moe.py, gate FP8 run 1: the fastest variant of each case).
    Activations quantized once (prequantize) won everywhere, in-GEMM quantization lost up to 3x at
    decode; 16 x 128 tiles with 8 warps up to 16 assignments per expert (V3 T <= 256: 118 us at T = 1
    against bf16's 169), 32 x 128 to about 28 (V2-Lite T = 256), 64 x 128 beyond (V3 T = 1024).
    block_n = bk: the gate-up epilogue quantizes its act groups."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return MoEConfig(block_m=16, block_n=group_k, block_k=group_k, group_m=1, num_warps=8, num_stages=4,
                         prequantize=True)
    if per_expert <= 28:
        return MoEConfig(block_m=32, block_n=group_k, block_k=group_k, group_m=4, num_warps=8, num_stages=3,
                         prequantize=True)
    return MoEConfig(block_m=64, block_n=group_k, block_k=group_k, group_m=8, num_warps=8, num_stages=4,
                     prequantize=True)


def padded_size(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Worst-case P: only experts that get an assignment pad (at most min(E, N) of them, each by at
    most block_m - 1), rounded up to whole blocks so the kernels read sorted ids without a mask."""
    worst = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] (ids in [0, num_experts], num_experts = skip; unchecked: checking would sync) ->
    sorted_token_ids [P] int32: assignment ids grouped by expert (ascending expert, ascending id inside
        one), each expert's run padded with the sentinel T*K to a multiple of block_m; the tail past the
        real total is sentinel too;
    expert_ids [P / block_m] int32: the expert of each block, -1 for blocks past the real total;
    num_padded [1] int32: the real padded total (a multiple of block_m), on the device.
    Up to ALIGN_KERNEL_MAX assignments (decode) one Triton program does it all: one launch instead of
    about twenty small torch ops, which would cost more than the experts' weight stream at T = 1.
    Skipped assignments (id num_experts) appear nowhere in sorted_token_ids."""
    n = topk_ids.numel()
    size = padded_size(n, num_experts, block_m)
    if n > ALIGN_KERNEL_MAX:
        return _moe_align_torch(topk_ids, num_experts, block_m, size)
    ids = topk_ids.reshape(-1)  # [N], a view when contiguous
    block_n = max(triton.next_power_of_2(n), 16)
    max_size = padded_size(block_n, num_experts, block_m)  # any N of this bucket
    sorted_ids = torch.empty(size, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    on = pdl.wanted(ids, topk_ids.shape[0], mla_moe=True)  # kernels/pdl.py, DEEPSERVE_PDL_MLA_MOE
    _moe_align_kernel[(1,)](
        ids, sorted_ids, expert_ids, num_padded, n, size, num_experts,
        BLOCK_N=block_n, BLOCK_E=max(triton.next_power_of_2(num_experts), 16), BLOCK_M=block_m,
        # Loop trip counts are constexpr bounds for any N of this power-of-two bucket, not functions of
        # the runtime size: one compile per bucket (and Triton 3.6's interpreter cannot range over a
        # runtime int, triton-lang/triton#9171).
        SLOT_TILES=triton.cdiv(max_size, block_n), BLOCK_TILES=triton.cdiv(max_size // block_m, block_n),
        PDL=on, num_warps=8 if n > 1024 else 4, **pdl.launch_options(on),
    )
    return sorted_ids, expert_ids, num_padded


ALIGN_KERNEL_MAX = 4096  # one program sorts at most this many assignments in registers


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assign, size, num_experts,
                      BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                      SLOT_TILES: tl.constexpr, BLOCK_TILES: tl.constexpr, PDL: tl.constexpr = False):
    # One program; phases that write a slot another thread wrote or reads are separated by barriers
    # (a barrier also orders the block's global memory accesses).
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    offs = tl.arange(0, BLOCK_N)
    num_blocks = size // BLOCK_M
    for tile in range(SLOT_TILES):  # SLOT_TILES * BLOCK_N >= size
        tl.store(sorted_ids_ptr + tile * BLOCK_N + offs, num_assign, mask=tile * BLOCK_N + offs < size)
    for tile in range(BLOCK_TILES):  # BLOCK_TILES * BLOCK_N >= num_blocks
        tl.store(expert_ids_ptr + tile * BLOCK_N + offs, -1, mask=tile * BLOCK_N + offs < num_blocks)
    ids = tl.load(ids_ptr + offs, mask=offs < num_assign, other=0).to(tl.int32)  # [BLOCK_N]
    valid = (offs < num_assign) & (ids < num_experts)  # id num_experts: another rank's expert, skipped
    counts = tl.histogram(ids, BLOCK_E, mask=valid)  # [BLOCK_E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_start = tl.cumsum(padded, 0) - padded  # [BLOCK_E]
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    tl.debug_barrier()
    # Each expert with assignments marks its first block; a running max then carries the mark over the
    # rest of its run (runs are in expert order, so the latest mark is the largest).
    experts = tl.arange(0, BLOCK_E)
    tl.store(expert_ids_ptr + padded_start // BLOCK_M, experts, mask=counts > 0)
    # Sort (expert, assignment) keys; the i-th sorted assignment is the (i - first[e])-th of expert e.
    keys = tl.sort(tl.where(valid, ids * BLOCK_N + offs, BLOCK_E * BLOCK_N))  # [BLOCK_N], invalid last
    expert = tl.minimum(keys // BLOCK_N, BLOCK_E - 1)
    first = tl.gather(tl.cumsum(counts, 0) - counts, expert, 0)  # [BLOCK_N]
    kept = keys < BLOCK_E * BLOCK_N  # in sorted order: the valid keys come first
    tl.store(sorted_ids_ptr + tl.gather(padded_start, expert, 0) + offs - first, keys % BLOCK_N, mask=kept)
    tl.debug_barrier()
    carry = -1
    for tile in range(BLOCK_TILES):
        block = tile * BLOCK_N + offs
        marks = tl.load(expert_ids_ptr + block, mask=block < num_blocks, other=-1)
        owner = tl.maximum(tl.associative_scan(marks, 0, _max_combine), carry)
        carry = tl.max(owner, 0)
        tl.store(expert_ids_ptr + block, tl.where(block * BLOCK_M < total, owner, -1), mask=block < num_blocks)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def _moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int, size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # moe_align's contract from device-side torch ops, for prefill sizes (no bincount: on CUDA it reads
    # the max id on the host). Skipped assignments count as a last expert E whose run is not padded and
    # whose slots all go to one spare position past the end, cut off.
    flat = topk_ids.flatten().long()  # [N]
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E + 1]: integer adds, so order-independent
    padded = (counts + block_m - 1) // block_m * block_m  # [E + 1]
    padded[num_experts] = 0
    padded_end = padded.cumsum(0)  # [E + 1]: one past each expert's padded run
    order = flat.argsort(stable=True)  # [N]: assignment ids by expert
    sorted_expert = flat[order]  # [N]
    first = counts.cumsum(0) - counts  # [E + 1]: each expert's first position in `order`
    rank = torch.arange(n, device=device) - first[sorted_expert]  # [N]: position inside the expert's run
    dest = (padded_end - padded)[sorted_expert] + rank  # [N]: slot in the padded order
    dest = torch.where(sorted_expert < num_experts, dest, size)
    sorted_ids = torch.full((size + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size, block_m, device=device)  # [P / block_m]
    # The run holding a block start is the first expert whose end lies beyond it; empty runs never match.
    ends = padded_end[:num_experts]  # [E]
    expert_ids = torch.searchsorted(ends, block_start, right=True)  # [P / block_m], E past the end
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids[:size], expert_ids, ends[-1:].to(torch.int32)


# Arguments that change with the token count are not specialized on (divisible by 16, equal to 1): that
# would compile the same code again for new batch sizes and buy nothing (they only bound masks and the
# program order).
@triton.jit(do_not_specialize=["num_valid", "num_m_blocks"])
def _fused_moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    a_scale_ptr, b_scale_ptr, c_scale_ptr, b_zero_ptr, g_idx_ptr,
    num_valid, rows_per_a, num_m_blocks, stride_am, stride_be, stride_bn, stride_cm,
    stride_asm, stride_bse, stride_bsn, stride_csm, stride_ge,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, FP8: tl.constexpr, QUANTIZE_A: tl.constexpr, QUANTIZE_C: tl.constexpr,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, ROUND_C: tl.constexpr, FP8_ROUND_IN_FP32: tl.constexpr,
    INT4: tl.constexpr, BITS: tl.constexpr, GROUP_Q: tl.constexpr, HAS_G_IDX: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # c[r] = f(a[r // rows_per_a] @ b[e].T) for the block's valid assignments r, e its expert.
    # Gate-up: a = x [T, H], rows_per_a = K, b = w13 [E, 2N, H], f = silu(gate) * up over b's row halves.
    # Down: a = act [N_assign, I], rows_per_a = 1, b = w2 [E, N, I], f = routing weight * product.
    # Last dimensions of a, b, c and the scales are contiguous (the wrapper checks).
    # FP8 (all switches constexpr: the bf16 kernel compiles none of it): b fp8 with block scales
    # b_scale [E, cdiv(b rows, GROUP_N), cdiv(K, GROUP_K)]; a fp8 with group scales a_scale [a rows,
    # cdiv(K, GROUP_K)], or QUANTIZE_A: a in x's dtype, quantized here tile by tile. QUANTIZE_C: c is fp8
    # and gets its group scales in c_scale [c rows, cdiv(N, BLOCK_N)] (BLOCK_N is the next GEMM's group).
    # ROUND_C: x's dtype, which c's values are rounded to (before their quantization under QUANTIZE_C).
    # INT4 (W4A16, int4_ref's layout): b holds packed codes [E, rows, K / (32 / BITS)], b_scale and b_zero
    # [E, rows, groups] fp16 (GROUP_Q inputs a group), g_idx [E, K] under act order (HAS_G_IDX).
    # PDL (kernels/pdl.py): every read, the alignment's outputs first, comes after the wait; the trigger after
    # the main loop. A program past the real total returns at once, which counts as its trigger.
    pdl.wait(PDL)
    pid_m, pid_n = _tile_ids(num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the real total: the worst-case grid's spare blocks
        return
    assign = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = assign < num_valid  # sentinel padding is never loaded nor stored
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # int64: E * 2I * H passes 2^31 for V3
    a_index = (assign // rows_per_a).to(tl.int64)  # [BLOCK_M]
    a_rows = a_ptr + a_index * stride_am  # [BLOCK_M] pointers
    # Columns wrap modulo N so every weight load is in bounds; the store masks the wrapped ones.
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    b_cols = b_ptr + expert * stride_be + offs_n.to(tl.int64) * stride_bn  # [BLOCK_N] pointers
    if INT4:
        sz = expert * stride_bse + offs_n.to(tl.int64) * stride_bsn  # [BLOCK_N] offsets of each row's groups
        acc = _expert_tile_int4(a_rows, b_cols, row_ok, N * stride_bn, b_scale_ptr + sz, b_zero_ptr + sz,
                                N * stride_bsn, g_idx_ptr + expert * stride_ge, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                GATED, BITS, GROUP_Q, HAS_G_IDX, DOT_PRECISION, DOT_UPCAST)
    elif FP8:
        b_scales = b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn  # [BLOCK_N] pointers
        acc = _expert_tile_fp8(a_rows, b_cols, row_ok, N * stride_bn, a_scale_ptr + a_index * stride_asm,
                               b_scales, (N + GROUP_N - 1) // GROUP_N * stride_bsn, K, BLOCK_M, BLOCK_N,
                               BLOCK_K, GROUP_K, GATED, QUANTIZE_A, FP8_ROUND_IN_FP32)
    else:
        acc = _expert_tile(a_rows, b_cols, row_ok, N * stride_bn, K, BLOCK_M, BLOCK_N, BLOCK_K, GATED,
                           DOT_PRECISION, DOT_UPCAST)  # [BLOCK_M, BLOCK_N] fp32
    pdl.trigger(PDL)
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + assign, mask=row_ok, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + assign.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    if QUANTIZE_C:
        _store_fp8_groups(c_ptrs, c_scale_ptr + assign.to(tl.int64) * stride_csm + pid_n, acc, row_ok, cols < N,
                          ROUND_C, FP8_ROUND_IN_FP32)
    else:
        if FP8_ROUND_IN_FP32:  # the interpreter's bf16 cast truncates; the GPU's rounds to nearest even
            acc = _round_to(acc, ROUND_C, FP8_ROUND_IN_FP32)  # (ROUND_C is c's dtype here)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


@triton.jit
def _tile_ids(num_m_blocks, num_n_tiles, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M consecutive blocks take each N tile in turn, so when an expert owns several
    # blocks (prefill) its weight tile is read from L2 by all of them. Spare blocks come last.
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _expert_tile(a_rows, b_cols, row_ok, up_offset, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    # sum over K of a[BLOCK_M rows] x b[BLOCK_N rows]^T in fp32; GATED: silu(that) * (same with the rows
    # up_offset further on), sharing each a tile between the two products.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    EVEN_K: tl.constexpr = K % BLOCK_K == 0  # every real shape: no K mask, so loads stay vectorized
    for k in range(0, K, BLOCK_K):  # K is constexpr: the trip count is known at compile time
        k_ok = offs_k < K - k
        a = _load_a(a_rows[:, None] + (k + offs_k)[None, :], row_ok, k_ok, EVEN_K)  # [BLOCK_M, BLOCK_K]
        b_ptrs = b_cols[None, :] + (k + offs_k)[:, None]  # [BLOCK_K, BLOCK_N]
        acc = _mma(a, _load_b(b_ptrs, k_ok, EVEN_K), acc, DOT_PRECISION, DOT_UPCAST)
        if GATED:
            acc_up = _mma(a, _load_b(b_ptrs + up_offset, k_ok, EVEN_K), acc_up, DOT_PRECISION, DOT_UPCAST)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    return acc


@triton.jit
def _expert_tile_int4(a_rows, b_cols, row_ok, up_offset, s_cols, z_cols, up_s_offset, g_row, K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                      BITS: tl.constexpr, GROUP_Q: tl.constexpr, HAS_G_IDX: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    # _expert_tile with int4 b: each weight tile dequantized in registers (int4_tile.py) and rounded to
    # a's dtype before the dot; the up rows' codes lie up_offset further on, their scales up_s_offset.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k
        a = _load_a(a_rows[:, None] + (k + offs_k)[None, :], row_ok, k_ok, EVEN_K)  # [BLOCK_M, BLOCK_K]
        w = dequantize_tile(b_cols, s_cols, z_cols, g_row, k + offs_k, k, K, BITS, GROUP_Q, HAS_G_IDX, BLOCK_K,
                            BLOCK_N, EVEN_K, RESHAPE_UNPACK)
        acc = _mma(a, w.to(a.dtype), acc, DOT_PRECISION, DOT_UPCAST)
        if GATED:
            w = dequantize_tile(b_cols + up_offset, s_cols + up_s_offset, z_cols + up_s_offset, g_row, k + offs_k,
                                k, K, BITS, GROUP_Q, HAS_G_IDX, BLOCK_K, BLOCK_N, EVEN_K, RESHAPE_UNPACK)
            acc_up = _mma(a, w.to(a.dtype), acc_up, DOT_PRECISION, DOT_UPCAST)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    return acc


@triton.jit
def _expert_tile_fp8(a_rows, b_cols, row_ok, up_offset, a_scales, b_scales, up_scale_offset, K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
                     GATED: tl.constexpr, QUANTIZE_A: tl.constexpr, FP8_ROUND_IN_FP32: tl.constexpr):
    # _expert_tile with fp8 b: each k-step's fp8 product times a's row scales and b's column scales,
    # summed in fp32 (BLOCK_K divides GROUP_K, so one k-step lies in one group). a_scales [BLOCK_M]:
    # pointers to each row's group-0 scale (read unless QUANTIZE_A); b_scales [BLOCK_N]: to each
    # column's k-group-0 scale; the up rows' scales lie up_scale_offset further on.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k
        group = k // GROUP_K
        a = _load_a(a_rows[:, None] + (k + offs_k)[None, :], row_ok, k_ok, EVEN_K)  # [BLOCK_M, BLOCK_K]
        if QUANTIZE_A:  # BLOCK_K == GROUP_K: each row of the tile is one group (masked rows quantize to 0)
            a, a_scale = _quantize_rows(a.to(tl.float32), FP8_ROUND_IN_FP32)
        else:
            a_scale = tl.load(a_scales + group, mask=row_ok, other=0.0)  # [BLOCK_M]
        b_ptrs = b_cols[None, :] + (k + offs_k)[:, None]  # [BLOCK_K, BLOCK_N]
        scale = a_scale[:, None] * tl.load(b_scales + group)[None, :]  # [BLOCK_M, BLOCK_N]
        acc += tl.dot(a, _load_b(b_ptrs, k_ok, EVEN_K)) * scale
        if GATED:
            scale_up = a_scale[:, None] * tl.load(b_scales + up_scale_offset + group)[None, :]
            acc_up += tl.dot(a, _load_b(b_ptrs + up_offset, k_ok, EVEN_K)) * scale_up
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    return acc


@triton.jit
def _quantize_rows(v, FP8_ROUND_IN_FP32: tl.constexpr):
    # v [R, G] fp32, one group per row -> (fp8 [R, G], scale [R] fp32), bit for bit
    # fp8_ref.quantize_per_token_group_ref on the device the tensors are on. FP8_ROUND_IN_FP32 is set
    # exactly when the interpreter runs (CPU tensors: torch divides, IEEE); compiled, the tensors are
    # CUDA's, where torch scales by 1/448's fp32 reciprocal. Triton's fp32 `/` is approximate: div_rn.
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), AMAX_FLOOR)  # [R]
    if FP8_ROUND_IN_FP32:
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    else:
        scale = amax * INV_FP8_MAX
    q = tl.math.div_rn(v, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if FP8_ROUND_IN_FP32:
        q = _round_to_e4m3(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _round_to_e4m3(v):
    # The interpreter's fp32 -> fp8 cast drops the carry of a round-up (126.06 becomes 64, not 128) and
    # rounds ties away: round to e4m3's grid here (nearest even), after which its cast is exact. The
    # grid step is 2^(e - 3) for exponent e, at least e4m3's smallest normal exponent -6 (biased 121);
    # adding and subtracting 1.5 * 2^23 steps rounds to whole steps in fp32's own nearest-even rounding.
    exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = ((tl.maximum(exponent, 121) - 3) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0
    return (v + magic) - magic


@triton.jit
def _round_to(v, DTYPE: tl.constexpr, FP8_ROUND_IN_FP32: tl.constexpr):
    # v fp32 rounded to DTYPE ("bf16", "fp16", "": none), still fp32.
    if DTYPE == "bf16":
        if FP8_ROUND_IN_FP32:  # the interpreter's fp32 -> bf16 cast truncates: round to nearest even first
            bits = v.to(tl.int32, bitcast=True)
            v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        v = v.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == "fp16":
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _store_fp8_groups(c_ptrs, scale_ptrs, acc, row_ok, col_ok, ROUND_C: tl.constexpr,
                      FP8_ROUND_IN_FP32: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] fp32, each row one group of the next GEMM's a: rounded to x's dtype (as the
    # bf16 path stores act), quantized, stored as fp8 with its scale. Wrapped columns (copies of real
    # ones, maybe of another group) are kept out of the amax.
    v = tl.where(col_ok[None, :], _round_to(acc, ROUND_C, FP8_ROUND_IN_FP32), 0.0)
    q, scale = _quantize_rows(v, FP8_ROUND_IN_FP32)
    tl.store(c_ptrs, q, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(scale_ptrs, scale, mask=row_ok)


@triton.jit(do_not_specialize=["rows"])
def _quantize_groups_kernel(x_ptr, q_ptr, scale_ptr, rows, stride_xm, stride_qm, stride_sm, K: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, FP8_ROUND_IN_FP32: tl.constexpr,
                            PDL: tl.constexpr = False):
    # One program per BLOCK_ROWS rows and one group of GROUP columns of x [rows, K].
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = (r < rows)[:, None] & (cols < K)[None, :]
    r64 = r.to(tl.int64)
    v = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_rows(v, FP8_ROUND_IN_FP32)
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(scale_ptr + r64 * stride_sm + group, scale, mask=r < rows)


@triton.jit
def _load_a(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    # The row mask is constant along the contiguous K axis, so it does not stop vector loads; a K mask would.
    if EVEN_K:
        a = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return a


@triton.jit
def _load_b(ptrs, k_ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        b = tl.load(ptrs)
    else:
        b = tl.load(ptrs, mask=k_ok[:, None], other=0.0)
    return b


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:  # the interpreter multiplies 16-bit floats as raw integers: do it in fp32 there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"fused_moe: {message}")


def _check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, pack: int = 1) -> None:
    # pack > 1: int4 / int8 experts, each int32 of w13 / w2 holding `pack` inputs
    _require(x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, "x [T, H], w13 [E, 2I, H], w2 [E, H, I]")
    (t, h), (e, two_i, _) = x.shape, w13.shape
    _require(w13.shape[2] * pack == h and two_i % 2 == 0 and tuple(w2.shape) == (e, h, two_i // 2 // pack),
             f"weights {tuple(w13.shape)} / {tuple(w2.shape)} do not match x {tuple(x.shape)}")
    _require(x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {x.dtype}")
    _require(w13.dtype == w2.dtype and w13.dtype in (x.dtype, fp8_ref.FP8, torch.int32),
             "x, w13 and w2 must share one dtype (or w13 and w2 be float8_e4m3fn, or int32 int4 codes)")
    _require(x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1,
             "the last dimension of x, w13 and w2 must be contiguous")
    _require(topk_ids.dim() == 2 and topk_ids.shape[0] == t and topk_weights.shape == topk_ids.shape,
             "topk_weights and topk_ids must both be [T, K]")
    _require(topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(),
             "topk_weights must be contiguous float32")
    _require(not topk_ids.is_floating_point(), "topk_ids must be integers")
    _require(len({x.device, w13.device, w2.device, topk_weights.device, topk_ids.device}) == 1,
             "all inputs must be on one device")


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                  w2_scale: torch.Tensor | None, block: tuple[int, int]) -> None:
    # FP8 weights: the block scales as DeepSeek ships them (module docstring, "FP8").
    _require(w13_scale is not None and w2_scale is not None, "float8_e4m3fn weights need w13_scale and w2_scale")
    (e, two_i, h), (bn, bk) = w13.shape, block
    inter = two_i // 2
    _require(bn > 0 and bk >= 16 and bk & (bk - 1) == 0, f"block {block}: bk must be a power of two >= 16")
    want13 = (e, 2 * triton.cdiv(inter, bn), triton.cdiv(h, bk))
    want2 = (e, triton.cdiv(h, bn), triton.cdiv(inter, bk))
    _require(tuple(w13_scale.shape) == want13 and tuple(w2_scale.shape) == want2,
             f"scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} for block {block}: want {want13} / {want2}")
    _require(w13_scale.dtype == torch.float32 and w2_scale.dtype == torch.float32, "scales must be float32")
    _require(w13_scale.stride(2) == 1 and w2_scale.stride(2) == 1,
             "the last dimension of the scales must be contiguous")
    _require(w13_scale.device == w13.device and w2_scale.device == w13.device, "scales must be on the weights' device")


def _check_fp8_config(cfg: MoEConfig, block: tuple[int, int]) -> None:
    bk = block[1]
    _require(bk % cfg.block_k == 0, f"block_k {cfg.block_k} must divide bk {bk}: a k-step in one scale group")
    if cfg.prequantize:
        _require(cfg.block_n == bk, f"prequantize needs block_n == bk {bk}: a gate-up tile row is one act group")
    else:
        _require(cfg.block_k == bk, f"quantizing in the GEMMs needs block_k == bk {bk}: a tile row is one group")


def _dot_options(dtype: torch.dtype) -> dict[str, object]:
    # fp32 inputs: "ieee", not the tf32 default, so fp32 matches the reference to 1e-5.
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=dtype != torch.float32 and INTERPRET)


@dataclass(frozen=True)
class _Fp8Operands:
    """What an FP8 GEMM launch adds to the bf16 one (kernel comment)."""

    b_scale: torch.Tensor  # [E, ceil(b rows / bn), ceil(k / bk)] weight block scales
    block: tuple[int, int]  # (bn, bk)
    a_scale: torch.Tensor | None = None  # [a rows, ceil(k / bk)] when a is fp8 already, else a is quantized here
    c_scale: torch.Tensor | None = None  # [c rows, ceil(n / bk)]: c is fp8, quantized in the epilogue
    round_to: torch.dtype | None = None  # the dtype c's values are rounded to (x's): before QUANTIZE_C


@dataclass(frozen=True)
class Int4Experts:
    """What int4 / int8 experts add to fused_moe (kernels/int4_ref.py's layout; w13 and w2 are then the
    int32 codes [E, 2I, H/pack] and [E, H, I/pack]): fp16 scales and zero points per row and group,
    the groups' widths, and g_idx under act order."""

    bits: int
    w13_scales: torch.Tensor  # [E, 2I, groups of H]
    w13_zeros: torch.Tensor
    w2_scales: torch.Tensor  # [E, H, groups of I]
    w2_zeros: torch.Tensor
    group13: int
    group2: int
    w13_g_idx: torch.Tensor | None = None  # [E, H] int32
    w2_g_idx: torch.Tensor | None = None  # [E, I] int32

    def operands(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        return (getattr(self, f"{which}_scales"), getattr(self, f"{which}_zeros"), getattr(self, f"{which}_g_idx"),
                getattr(self, f"group{which[1:]}"))


def _check_int4(w13: torch.Tensor, w2: torch.Tensor, int4: Int4Experts | None) -> None:
    _require(int4 is not None, "int32 (int4 / int8) weights need int4=Int4Experts(...)")
    for which, w in (("w13", w13), ("w2", w2)):
        scales, zeros, g_idx, _ = int4.operands(which)
        _require(scales.dtype == zeros.dtype == torch.float16 and scales.shape == zeros.shape
                 and scales.shape[:2] == w.shape[:2] and scales.is_contiguous() and zeros.is_contiguous(),
                 f"{which} scales and zeros must be contiguous fp16 [E, rows, groups]")
        k = w.shape[2] * (32 // int4.bits)
        _require(g_idx is None or (g_idx.dtype == torch.int32 and tuple(g_idx.shape) == (w.shape[0], k)
                                   and g_idx.is_contiguous()), f"{which} g_idx must be contiguous int32 [E, K]")


def _int4_arguments(int4: Int4Experts | None, which: str, unused: torch.Tensor) -> tuple[list, int, dict]:
    """-> (scale, zero, g_idx pointers; the g_idx stride; constexprs) of a launch."""
    if int4 is None:
        return [unused, unused, unused], 0, dict(INT4=False, BITS=4, GROUP_Q=1, HAS_G_IDX=False)
    scales, zeros, g_idx, group = int4.operands(which)
    return ([scales, zeros, unused if g_idx is None else g_idx], 0 if g_idx is None else g_idx.stride(0),
            dict(INT4=True, BITS=int4.bits, GROUP_Q=group, HAS_G_IDX=g_idx is not None))


_ROUND_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "", None: ""}


def _fp8_arguments(fp8: _Fp8Operands | None, unused: torch.Tensor) -> tuple[list, list, dict[str, object]]:
    """-> (scale pointers, scale strides, constexprs) of a launch; `unused` fills the bf16 path's slots."""
    if fp8 is None:
        return [unused] * 3, [0] * 4, dict(FP8=False, QUANTIZE_A=False, QUANTIZE_C=False, GROUP_N=1, GROUP_K=1,
                                           ROUND_C="", FP8_ROUND_IN_FP32=False)
    a_scale = unused if fp8.a_scale is None else fp8.a_scale
    c_scale = unused if fp8.c_scale is None else fp8.c_scale
    strides = [0 if fp8.a_scale is None else a_scale.stride(0), fp8.b_scale.stride(0), fp8.b_scale.stride(1),
               0 if fp8.c_scale is None else c_scale.stride(0)]
    return [a_scale, fp8.b_scale, c_scale], strides, dict(
        FP8=True, QUANTIZE_A=fp8.a_scale is None, QUANTIZE_C=fp8.c_scale is not None, GROUP_N=fp8.block[0],
        GROUP_K=fp8.block[1], ROUND_C=_ROUND_NAMES[fp8.round_to], FP8_ROUND_IN_FP32=INTERPRET)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
            align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows_per_a: int, gated: bool,
            cfg: MoEConfig, fp8: _Fp8Operands | None = None, int4: Int4Experts | None = None,
            which: str = "w13") -> None:
    # c [N_assign, n] gets the block products; n = b's rows (halved when gated), k = a's columns.
    sorted_ids, expert_ids, num_padded = align
    n, k = c.shape[1], a.shape[1]
    num_m_blocks = expert_ids.numel()
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    scale_ptrs, scale_strides, fp8_options = _fp8_arguments(fp8, topk_weights)
    int4_ptrs, stride_ge, int4_options = _int4_arguments(int4, which, topk_weights)
    if int4 is not None:  # the int4 scales take the weight-scale slot (pointer and strides)
        scale_ptrs[1] = int4_ptrs[0]
        scale_strides[1:3] = [int4_ptrs[0].stride(0), int4_ptrs[0].stride(1)]
    on = pdl.wanted(a, topk_weights.shape[0], mla_moe=True)  # the step's tokens (kernels/pdl.py)
    _fused_moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_padded, *scale_ptrs, *int4_ptrs[1:],
        c.shape[0], rows_per_a, num_m_blocks, a.stride(0), b.stride(0), b.stride(1), c.stride(0), *scale_strides,
        stride_ge, N=n, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        GATED=gated, MUL_WEIGHT=not gated, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_dot_options(a.dtype), **fp8_options, **int4_options, PDL=on, **pdl.launch_options(on),
    )


QUANTIZE_BLOCK_ROWS = 16  # rows per program of the separate activation quantization


def _quantize_groups(x: torch.Tensor, group: int, like_q: torch.Tensor, like_scale: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale [M, ceil(K/group)] float32): fp8_ref.quantize_per_token_group_ref
    in one launch (workspaces shaped after like_q / like_scale's dtypes)."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    x_q, scale = _workspace(m, k, like_q), _workspace(m, groups, like_scale)
    on = pdl.wanted(x, m, mla_moe=True)  # kernels/pdl.py: x's rows are the step's tokens
    _quantize_groups_kernel[(triton.cdiv(m, QUANTIZE_BLOCK_ROWS), groups)](
        x, x_q, scale, m, x.stride(0), x_q.stride(0), scale.stride(0), K=k, GROUP=group,
        BLOCK_ROWS=QUANTIZE_BLOCK_ROWS, FP8_ROUND_IN_FP32=INTERPRET, PDL=on, num_warps=4,
        **pdl.launch_options(on))
    return x_q, scale


def _workspace(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    # Uninitialized: every row is written (module docstring). Tests replace this with a NaN fill.
    return torch.empty(rows, cols, dtype=like.dtype, device=like.device)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoEConfig | None = None, skips: bool = False, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] = (128, 128), int4: Int4Experts | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_weights [T, K] float32,
    topk_ids [T, K] -> [T, H] in x's dtype: the routed experts' weighted sum (module docstring).
    skips: topk_ids may hold E, an assignment to leave out (expert parallelism: another rank's expert).
    FP8 weights (float8_e4m3fn w13 and w2) come with w13_scale [E, 2 ceil(I/bn), ceil(H/bk)] and w2_scale
    [E, ceil(H/bn), ceil(I/bk)] for block = (bn, bk): W8A8, fused_moe_fp8_ref's numerics.
    Int4 weights (int32 codes w13 [E, 2I, H/pack], w2 [E, H, I/pack]) come with int4=Int4Experts: W4A16,
    fused_moe_int4_ref's numerics; their config may be an Int4GemvConfig (the decode GEMVs,
    kernels/int4_moe_gemv.py), else the tiles' MoEConfig.
    fp32 accumulation; no host sync (CUDA-graph safe); deterministic."""
    if w13.dtype == torch.int32:
        _check_int4(w13, w2, int4)
        _check_inputs(x, w13, w2, topk_weights, topk_ids, pack=32 // int4.bits)
        return _int4_experts(x, w13, w2, topk_weights, topk_ids, config, skips, int4)
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    fp8 = w13.dtype == fp8_ref.FP8
    if fp8:
        _check_scales(w13, w2, w13_scale, w2_scale, block)
    else:
        _require(w13_scale is None and w2_scale is None, "scales go with float8_e4m3fn weights only")
    (t, h), (e, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    if t == 0:
        return x.new_empty(0, h)
    cfg = config or (default_fp8_config(t, k, e, block[1]) if fp8
                     else default_config(t, k, e, x.dtype))
    if fp8:
        _check_fp8_config(cfg, block)
    align = moe_align(topk_ids, e, cfg.block_m)
    if fp8:
        y = _fp8_experts(x, w13, w2, w13_scale, w2_scale, topk_weights, align, cfg, block, skips)
    else:
        act = _workspace(t * k, two_i // 2, x)  # [N, I]
        _launch(x, w13, act, topk_weights, align, rows_per_a=k, gated=True, cfg=cfg)
        y = _output(t * k, h, x, skips)
        _launch(act, w2, y, topk_weights, align, rows_per_a=1, gated=False, cfg=cfg)
    return sum_slots(y, k) if k > 1 else y  # fixed-order sum over the K slots


def _int4_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, config: MoEConfig | Int4GemvConfig | None, skips: bool,
                  int4: Int4Experts) -> torch.Tensor:
    """Both GEMMs with int4 weights dequantized in registers: the bf16 path's tiles and workspaces, or
    at decode (an Int4GemvConfig, or at most INT4_GEMV_MAX_TOKENS tokens) one GEMV per assignment."""
    (t, h), (e, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    if t == 0:
        return x.new_empty(0, h)
    if config is None and mma_moe_supported(x, int4.bits, int4.group13, int4.group2, int4.w13_g_idx, int4.w2_g_idx,
                                            h, two_i // 2, t * k, None if skips else e):
        return int4_moe_mma(x, w13, w2, topk_weights, topk_ids, int4.operands("w13"), int4.operands("w2"))
    if config is None and t <= INT4_GEMV_MAX_TOKENS:
        config = default_moe_gemv_config()
    if isinstance(config, Int4GemvConfig):
        return int4_moe_gemv(x, w13, w2, topk_weights, topk_ids, int4.bits, int4.operands("w13"),
                             int4.operands("w2"), _workspace(t * k, two_i // 2, x), _output(t * k, h, x, skips),
                             config)
    cfg = config or default_config(t, k, e, x.dtype)
    _require(cfg.block_k % (32 // int4.bits) == 0, f"block_k {cfg.block_k} must hold whole int32 words")
    align = moe_align(topk_ids, e, cfg.block_m)
    act = _workspace(t * k, two_i // 2, x)  # [N, I]
    _launch(x, w13, act, topk_weights, align, rows_per_a=k, gated=True, cfg=cfg, int4=int4, which="w13")
    y = _output(t * k, h, x, skips)
    _launch(act, w2, y, topk_weights, align, rows_per_a=1, gated=False, cfg=cfg, int4=int4, which="w2")
    return sum_slots(y, k) if k > 1 else y


def _output(rows: int, cols: int, x: torch.Tensor, skips: bool) -> torch.Tensor:
    # y [N, H]: skipped assignments' rows are never written, so they start at zero.
    return torch.zeros(rows, cols, dtype=x.dtype, device=x.device) if skips else _workspace(rows, cols, x)


def _fp8_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                 w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                 align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cfg: MoEConfig, block: tuple[int, int],
                 skips: bool) -> torch.Tensor:
    """Both GEMMs with FP8 weights -> y [N, H] in x's dtype (module docstring, "FP8")."""
    (t, h), k, inter, bk = x.shape, topk_weights.shape[1], w2.shape[2], block[1]
    y = _output(t * k, h, x, skips)
    if cfg.prequantize:
        x_q, x_scale = _quantize_groups(x, bk, w13, w13_scale)  # [T, H] fp8, [T, ceil(H/bk)]
        act = _workspace(t * k, inter, w13)  # [N, I] fp8
        act_scale = _workspace(t * k, triton.cdiv(inter, bk), w13_scale)  # [N, ceil(I/bk)]
        _launch(x_q, w13, act, topk_weights, align, rows_per_a=k, gated=True, cfg=cfg,
                fp8=_Fp8Operands(w13_scale, block, a_scale=x_scale, c_scale=act_scale, round_to=x.dtype))
        _launch(act, w2, y, topk_weights, align, rows_per_a=1, gated=False, cfg=cfg,
                fp8=_Fp8Operands(w2_scale, block, a_scale=act_scale, round_to=x.dtype))
    else:
        act = _workspace(t * k, inter, x)  # [N, I] in x's dtype, quantized by the down GEMM's programs
        _launch(x, w13, act, topk_weights, align, rows_per_a=k, gated=True, cfg=cfg,
                fp8=_Fp8Operands(w13_scale, block, round_to=x.dtype))
        _launch(act, w2, y, topk_weights, align, rows_per_a=1, gated=False, cfg=cfg,
                fp8=_Fp8Operands(w2_scale, block, round_to=x.dtype))
    return y


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """What fused_moe must equal: expert by expert, in fp32, cast to x's dtype at the end; ids past the
    last expert (skips) contribute nothing."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in [e for e in topk_ids.unique().tolist() if e < w13.shape[0]]:
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)  # [n] each
        xe, w13e = x[rows].float(), w13[e].float()  # [n, H], [2I, H]
        act = torch.nn.functional.silu(xe @ w13e[:inter].T) * (xe @ w13e[inter:].T)  # [n, I]
        out.index_add_(0, rows, (act @ w2[e].float().T) * topk_weights[rows, slots, None])  # [n, H]
    return out.to(x.dtype)


def fused_moe_fp8_ref(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """What fused_moe must equal with FP8 weights (and the CPU path): expert by expert in fp32 with the
    weights dequantized, x quantized per token and bk-group, silu(gate) * up rounded to x's dtype and
    quantized the same way; cast to x's dtype at the end; ids past the last expert contribute nothing.
    x [T, H], w13 [E, 2I, H] fp8, w13_scale [E, 2 ceil(I/bn), ceil(H/bk)], w2 [E, H, I] fp8,
    w2_scale [E, ceil(H/bn), ceil(I/bk)], topk_weights / topk_ids [T, K] -> [T, H]."""
    inter, bk = w13.shape[1] // 2, block[1]
    gate_rows = triton.cdiv(inter, block[0])  # w13_scale's gate rows, then the up rows
    xa = fp8_ref.dequantize_per_token_group(*fp8_ref.quantize_per_token_group_ref(x, bk), bk)  # [T, H]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in [e for e in topk_ids.unique().tolist() if e < w13.shape[0]]:
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)  # [n] each
        w1 = fp8_ref.dequantize_weight_block(w13[e, :inter], w13_scale[e, :gate_rows], block)  # [I, H]
        w3 = fp8_ref.dequantize_weight_block(w13[e, inter:], w13_scale[e, gate_rows:], block)  # [I, H]
        act = (torch.nn.functional.silu(xa[rows] @ w1.T) * (xa[rows] @ w3.T)).to(x.dtype)  # [n, I]
        act = fp8_ref.dequantize_per_token_group(*fp8_ref.quantize_per_token_group_ref(act, bk), bk)
        w2e = fp8_ref.dequantize_weight_block(w2[e], w2_scale[e], block)  # [H, I]
        out.index_add_(0, rows, (act @ w2e.T) * topk_weights[rows, slots, None])  # [n, H]
    return out.to(x.dtype)


def fused_moe_int4_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, int4: Int4Experts) -> torch.Tensor:
    """What fused_moe must equal with int4 weights: each expert's weights dequantized (int4_ref) and rounded
    to x's dtype, then fused_moe_ref."""
    def weights(which: str, codes: torch.Tensor) -> torch.Tensor:
        scales, zeros, g_idx, group = int4.operands(which)
        return torch.stack([int4_ref.dequantize(codes[e], scales[e], zeros[e], int4.bits, group,
                                                None if g_idx is None else g_idx[e]) for e in range(codes.shape[0])])

    return fused_moe_ref(x, weights("w13", w13).to(x.dtype), weights("w2", w2).to(x.dtype), topk_weights, topk_ids)
