"""Decode W4A16 on the tensor cores: a GEMV for 1-8 tokens in which every warp feeds `mma.sync` straight from
the packed words it loaded, with no shared memory and no register shuffles. Written in Gluon (Triton's
explicit-layout dialect), so each thread's data is exactly where the instruction expects it.

Why: the CUDA-core GEMV (int4_gemv.py) spends ~8 instructions a weight byte on unpacking and multiply-adds
and is bound by instructions, not bytes (bench/RESULTS.md, ncu on the H200). Here a warp's mma multiplies 16
output rows by 8 token columns over 16 inputs in one instruction, so per 32-bit word of 8 codes a thread
spends ~7 instructions unpacking (3 shifts, 4 lop3 that place two codes under bf16 128.0's exponent: the
pair (128 + q_i, 128 + q_{i+4}), exact) and 4 subtracting the zero point (bf16x2, exact: small integers).

The layout trick (int4_mma_ref.py has it in torch): a dot product does not change when its inputs are
permuted, as long as the weights and the activations are permuted alike. mma.m16n8k16's A fragment gives
lane (g, t) = (lane / 4, lane % 4) rows g and g + 8 at "virtual" inputs 2t, 2t + 1, 2t + 8, 2t + 9, and its
B fragment the same inputs of token column g. We let lane t of every row hold physical words 4t .. 4t + 3 of
the 128-input block (one 16-byte load a row), and put word j's code pairs (0, 4), (1, 5) at the virtual
inputs of the j-th pair of mmas and (2, 6), (3, 7) at the second; the activations are loaded in the same
lane order and their pairs rearranged to (x0, x4), (x1, x5), ... by one byte permute each. Every lane uses
the same rule, so each mma sums 16 real products of matching weight and input.

Numerics: A = q - z exactly (bf16 or fp16 small integers), products exact, accumulated in fp32 by the
tensor cores over one 128-input block, then y += s * that (s the group's fp16 scale, in fp32): the factored
numerics of int4_gemv.py (not rounded to the activation dtype per weight), tested against the same reference.
Groups must be a multiple of 128 (one scale per block), 4-bit codes, no act order, K a multiple of 128:
mma_gemv_supported says; the others take int4_gemv.py.

The tiled layout (TILED; tile_words / tile_scales, made once after loading by layers/int4.tiled_for_mma_gemv
on Hopper): the same words, rearranged so that each 16-row tile's 128-input block is 256 contiguous words in
lane order (a warp's round is one 1 KB read instead of 16 rows' 64-byte pieces), each word's nibbles in the
order 0, 2, 4, 6, 1, 3, 5, 7 (a lop3 then yields (q_2i, q_2i+1), the activations' own pairs: no prmt), and
per tile and group the two rows' scales and zero points of a lane in one 8-byte load. The other int4
kernels read it too (int4_tile.row_starts), so a layer keeps one copy.

Measured on one H200 (bench/gemv_probe.py; bench/RESULTS.md, fourth and fifth sessions of 2026-12-03): a
DeepSeek-LLM-7B step's int4 GEMVs at one token, row layout 1.89-1.91 ms, tiled 1.70-1.71 (one-warp
programs, 16 an SM), the CUDA-core GEMV 2.48-2.52; LLM-7B AWQ W2 TPOT 2.77 ms (row) and 2.56 (tiled) in the
int4 gate, on different machines. Still ~1.8 TB/s: Nsight Compute sees DRAM at 42-47 % and 35-54 % of the
warps' cycles waiting on loads. Tried and slower (removed): cp.async staging 3-6 rounds ahead; two blocks a
warp a round; the zero point subtracted once a block through an extra mma of the activations' sums (11 fewer
instructions a round, a longer mma chain); a register cap of 128 (ptxas then keeps the next round's loads
ahead of the mmas, it sinks them at its own 64 registers, but the programs no longer fit one wave).

Work split: a program is NUM_WARPS warps on 16 output rows; its warps take the 128-input blocks of its
K split in turn (block first + warp, + NUM_WARPS, ...), their partials are added across warps at the end,
and split-K partials are summed in split order by the last program of the row tile (the same protocol as
split_k.store_split, written here for Gluon), so results do not depend on scheduling. Where the tiles alone
keep the SMs busy (mma_gemv_common.one_split_warps) a launch has one split of up to 8-warp programs that
store their tiles themselves: no workspace, fence or counter. Measured on one H200 (bench/gemv_split_probe.py,
second session of 2026-12-04): a 7B step's int4 GEMVs ~1.46 ms against split-K's 1.71 at one token, V2-Lite's
MLA and shared-expert projections 566 µs against 803; LLM-7B AWQ W2 TPOT 2.56 -> 2.34 ms, V2-Lite AWQ 2.81 ->
2.56 (same-machine A/B). At one token, weights of 16 MB or more take int4_tma_gemv.py instead (the copy engine
stages the words and scales; LLM-7B AWQ W2 TPOT 2.34 -> 2.29 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from deepserve import envs
from deepserve.kernels import pdl
from deepserve.kernels.int4_mma_asm import BLOCK_INPUTS, _block  # a program's output rows: one mma tile (TILE_ROWS)
from deepserve.kernels.int4_tma_gemv import tma_launch, tma_supported
from deepserve.kernels.mma_gemv_common import (
    ONE_SPLIT,
    TILE_ROWS,
    activations_fit,
    finish_splits,
    is_hopper,
    launch_shape,
    split4,
    split16,
    split_buffers,
    store_tile_split,
)
from deepserve.kernels.split_k import sm_count

ROWS = gl.constexpr(TILE_ROWS)  # TILE_ROWS, for the kernels
KB = gl.constexpr(BLOCK_INPUTS)
INTERPRET = envs.TRITON_INTERPRET  # read once, at import
TMA_STAGES = int(envs.DEEPSERVE_INT4_TMA_GEMV_STAGES)  # read once, at import: the configs' defaults
TMA_PDL = int(envs.DEEPSERVE_INT4_TMA_GEMV_PDL)


@gluon.jit(do_not_specialize=["M", "blocks_per_split"])
def _int4_mma_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, ws_ptr, out_ptr, bias_ptr, lock_ptr, M, N, K,
                          blocks_per_split, stride_xm, stride_qn, stride_sn, GROUP: gl.constexpr,
                          F16: gl.constexpr, HAS_BIAS: gl.constexpr, FUSED_SUM: gl.constexpr,
                          NUM_WARPS: gl.constexpr, MAX_SPLITS: gl.constexpr, PREFETCH: gl.constexpr,
                          TILED: gl.constexpr, DIRECT: gl.constexpr):
    gemv_tile(x_ptr, q_ptr, s_ptr, z_ptr, ws_ptr, out_ptr, bias_ptr, lock_ptr, M, N, K, blocks_per_split, stride_xm,
              stride_qn, stride_sn, gl.program_id(0), gl.program_id(1), gl.num_programs(1), GROUP, F16, HAS_BIAS,
              FUSED_SUM, NUM_WARPS, MAX_SPLITS, PREFETCH, TILED, DIRECT)


@gluon.jit
def gemv_tile(x_ptr, q_ptr, s_ptr, z_ptr, ws_ptr, out_ptr, bias_ptr, lock_ptr, M, N, K, blocks_per_split, stride_xm,
              stride_qn, stride_sn, tile, split, split_k, GROUP: gl.constexpr, F16: gl.constexpr,
              HAS_BIAS: gl.constexpr, FUSED_SUM: gl.constexpr, NUM_WARPS: gl.constexpr, MAX_SPLITS: gl.constexpr,
              PREFETCH: gl.constexpr, TILED: gl.constexpr, DIRECT: gl.constexpr = False):
    """One program's work: output rows [tile * 16, + 16) of x [M, K] @ the weight, over split `split`'s
    128-input blocks (of split_k), into the workspace / out as store_tile_split says (int4_moe_mma.py runs it
    on one expert's weight)."""
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NUM_WARPS, 1], [1, 0])  # [warp, lane]: one each
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])  # 4 words a lane
    L16: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])  # 16 x pairs
    warp = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, L))[:, None]  # [W, 1]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L))[None, :]  # [1, 32]
    g = lane // 4
    row_a = (tile * ROWS + g) % N  # rows past N wrap (loads in bounds; the store masks them)
    row_b = (tile * ROWS + g + 8) % N
    warp4 = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L4)))[:, None, None]
    lane4 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L4)))[None, :, None]
    item4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L4)))[None, None, :]
    lane16 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L16)))[None, :, None]
    item16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L16)))[None, None, :]
    # word offsets of lane t's 4 words in a block's row, and of its 16 activation pairs (x as int32 pairs)
    if TILED:  # tile_words: the tile's block b is words b * 256 .. + 255, rows g's, then rows g + 8's, by lane
        words_a = tile.to(gl.int64) * (K // 8 * ROWS) + lane4 * 4 + item4 + warp4 * 0
        words_b = words_a + 128
    else:
        words_a = ((tile * ROWS + lane4 // 4) % N).to(gl.int64) * stride_qn + (lane4 % 4) * 4 + item4 + warp4 * 0
        words_b = ((tile * ROWS + lane4 // 4 + 8) % N).to(gl.int64) * stride_qn + (lane4 % 4) * 4 + item4 + warp4 * 0
    # tile_scales: the tile's group is 8 lanes' (s_a, s_b, z_a, z_b) at (tile * groups + group) * 32 + 4 g
    sz4 = (tile.to(gl.int64) * (K // GROUP) + warp4 * 0) * 32 + (lane4 // 4) * 4 + item4
    tok16 = lane16 // 4
    x_off = tok16.to(gl.int64) * (stride_xm // 2) + (lane16 % 4) * 16 + item16
    x_ok = (tok16 < M) & (item16 >= 0)
    x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    y0 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y1 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y2 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y3 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    k_blocks = K // KB
    first = split * blocks_per_split
    last = gl.minimum(first + blocks_per_split, k_blocks)
    warp16 = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L16)))[:, None, None]
    rows_a, rows_b = row_a.to(gl.int64) * stride_sn, row_b.to(gl.int64) * stride_sn
    if PREFETCH:  # the next round's loads issued before this round's mmas (register double buffering)
        wa4, wb4, xv, sa, sb, za, zb = _load_block(first, last, warp, warp4, warp16, q_ptr, words_a, words_b,
                                                   x_words, x_off, x_ok, s_ptr, z_ptr, rows_a, rows_b, sz4, GROUP,
                                                   F16, TILED)
        for b in range(first, last, NUM_WARPS):
            nwa4, nwb4, nxv, nsa, nsb, nza, nzb = _load_block(
                b + NUM_WARPS, last, warp, warp4, warp16, q_ptr, words_a, words_b, x_words, x_off, x_ok, s_ptr,
                z_ptr, rows_a, rows_b, sz4, GROUP, F16, TILED)
            y0, y1, y2, y3 = _mma_block(y0, y1, y2, y3, wa4, wb4, xv, sa, sb, za, zb, b + warp < last, L, F16,
                                        TILED)
            wa4, wb4, xv, sa, sb, za, zb = nwa4, nwb4, nxv, nsa, nsb, nza, nzb
    else:
        for b in range(first, last, NUM_WARPS):
            wa4, wb4, xv, sa, sb, za, zb = _load_block(b, last, warp, warp4, warp16, q_ptr, words_a, words_b,
                                                       x_words, x_off, x_ok, s_ptr, z_ptr, rows_a, rows_b, sz4,
                                                       GROUP, F16, TILED)
            y0, y1, y2, y3 = _mma_block(y0, y1, y2, y3, wa4, wb4, xv, sa, sb, za, zb, b + warp < last, L, F16,
                                        TILED)
    # y0, y1: row g, tokens 2t, 2t + 1; y2, y3: row g + 8, the same tokens. Sum the warps' blocks.
    store_tile_split(gl.sum(y0, axis=0), gl.sum(y1, axis=0), gl.sum(y2, axis=0), gl.sum(y3, axis=0), ws_ptr,
                     out_ptr, bias_ptr, lock_ptr, tile, split, split_k, M, N, HAS_BIAS, FUSED_SUM, MAX_SPLITS, L,
                     DIRECT)


@gluon.jit
def _load_block(b, last, warp, warp4, warp16, q_ptr, words_a, words_b, x_words, x_off, x_ok, s_ptr, z_ptr,
                rows_a, rows_b, sz4, GROUP: gl.constexpr, F16: gl.constexpr, TILED: gl.constexpr):
    """Round b's loads for every warp (block b + warp, clamped to the split's last: a warp past the end
    reloads it and _mma_block adds nothing): the two rows' words [W, 32, 4], the activation pairs
    [W, 32, 16] and the two rows' scales and 128 + zero points (1024 + for fp16) [W, 32] fp32."""
    kb4 = gl.minimum(b + warp4, last - 1)
    step: gl.constexpr = 16 * ROWS if TILED else 16  # words from a block to the next, of the tile / of a row
    wa4 = gl.load(q_ptr + words_a + kb4 * step)
    wb4 = gl.load(q_ptr + words_b + kb4 * step)
    xv = gl.load(x_words + x_off + gl.minimum(b + warp16, last - 1) * 64, mask=x_ok, other=0)
    magic = 1024.0 if F16 else 128.0
    if TILED:  # one 8-byte load a lane
        W: gl.constexpr = warp4.shape[0]
        L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [W, 1], [1, 0])  # the kernel's [warp, lane]
        sa, sb, za, zb = split4(gl.load(s_ptr + sz4 + (kb4 * KB) // GROUP * 32).to(gl.float32), L)
        za, zb = za + magic, zb + magic
    else:
        grp = (gl.minimum(b + warp, last - 1) * KB) // GROUP
        sa = gl.load(s_ptr + rows_a + grp).to(gl.float32)
        sb = gl.load(s_ptr + rows_b + grp).to(gl.float32)
        za = gl.load(z_ptr + rows_a + grp).to(gl.float32) + magic
        zb = gl.load(z_ptr + rows_b + grp).to(gl.float32) + magic
    return wa4, wb4, xv, sa, sb, za, zb


@gluon.jit
def _mma_block(y0, y1, y2, y3, wa4, wb4, xv, sa, sb, za, zb, live, L: gl.constexpr, F16: gl.constexpr,
               TILED: gl.constexpr):
    """y + one round's 128-input block per warp: four mma pairs into fresh fp32 accumulators, then scaled."""
    wa, wb, x = split4(wa4, L), split4(wb4, L), split16(xv, L)
    zero = gl.zeros(sa.shape, gl.float32, L)
    acc = (zero, zero, zero, zero)
    acc = _block(acc, wa[0], wb[0], x, za, zb, 0, F16, TILED)
    acc = _block(acc, wa[1], wb[1], x, za, zb, 1, F16, TILED)
    acc = _block(acc, wa[2], wb[2], x, za, zb, 2, F16, TILED)
    acc = _block(acc, wa[3], wb[3], x, za, zb, 3, F16, TILED)
    # a warp past its split's end multiplied a duplicate block: add nothing (not 0 * it, which could be NaN)
    return (y0 + gl.where(live, sa * acc[0], 0.0), y1 + gl.where(live, sa * acc[1], 0.0),
            y2 + gl.where(live, sb * acc[2], 0.0), y3 + gl.where(live, sb * acc[3], 0.0))


_is_hopper = is_hopper  # a module global, so tests can stand in for a Hopper GPU


def mma_gemv_supported(x, bits: int, group: int, g_idx, k: int) -> bool:
    """Whether w4a16_mma_gemv takes this product: 1-8 tokens of bf16 / fp16 on a Hopper GPU (not under
    Triton's interpreter), 4-bit codes, no act order, groups and K multiples of 128, x's rows 16-byte aligned
    (it is read as int32 pairs, 16 bytes a load)."""
    if INTERPRET or not activations_fit(x):
        return False
    return _is_hopper(x.device) and bits == 4 and g_idx is None and group % BLOCK_INPUTS == 0 and \
        k % BLOCK_INPUTS == 0


def require_supported(x, bits: int, group: int, g_idx, k: int) -> None:
    """mma_gemv_supported or a ValueError naming what it needs (a caller that asked for this kernel)."""
    if not mma_gemv_supported(x, bits, group, g_idx, k):
        raise ValueError(f"int4 mma gemv: needs 1-8 bf16 / fp16 tokens with 16-byte aligned rows on a Hopper GPU, "
                         f"4-bit codes without act order, groups and K multiples of {BLOCK_INPUTS}; got x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}, {bits} bits, group {group} (pass config=None "
                         "to let int4.w4a16_matmul choose a kernel)")


@dataclass(frozen=True)
class Int4MmaGemvConfig:
    """The defaults are the fastest of bench/gemv_probe.py's variants on the H200 (DeepSeek-LLM-7B's four
    shapes, one token, per-step sum; bench/RESULTS.md). Row layout: 2 warps, 8 programs an SM, prefetching
    1,871-1,912 µs; 4 warps with 4 programs an SM 1,962-1,977; 8 warps 2,456; cp.async staging 2,036-2,546;
    two blocks a warp a round 2,063; one-warp programs 2,020. tile_words' layout (TILED_CONFIG): one-warp
    programs, 16 an SM 1,697-1,710 (2 warps, 8 an SM: 1,723-1,756)."""
    num_warps: int = 2
    programs_per_sm: int = 8  # the split count aims at this many programs an SM
    prefetch: bool = True  # load the next round's block before this round's mmas (register double buffering)
    split_k: int = 0  # 0: launch_shape's choice; n > 0: n splits of num_warps (one: each program stores its tile)
    one_split: bool = ONE_SPLIT  # with split_k 0: one split of one_split_warps' programs where it applies
    tma_stages: int = TMA_STAGES  # tiled, groups of 128: rounds the copy engine stages ahead (int4_tma_gemv); 0 off
    tma_pdl: int = TMA_PDL  # with tma_stages: 1 launch early (programmatic dependence: weights asked for before
    # waiting on the previous kernel), 2 also let the next launch start early, 3 after its loop, 0 plain launches


TILED_CONFIG = Int4MmaGemvConfig(num_warps=1, programs_per_sm=16)


def mma_launch_shape(n: int, k: int, cfg: Int4MmaGemvConfig, num_sms: int) -> tuple[int, int]:
    """(warps a program, K splits) for an [N, K] weight: mma_gemv_common.launch_shape over its 128-input blocks."""
    return launch_shape(n, k // BLOCK_INPUTS, cfg.num_warps, cfg.programs_per_sm, cfg.split_k, cfg.one_split, num_sms)


def w4a16_mma_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group: int, bias: torch.Tensor | None, cfg: Int4MmaGemvConfig | None = None,
                   tiled: bool = False) -> torch.Tensor:
    """x [M <= 8, K] @ the int4 weight -> [M, N] in x's dtype; mma_gemv_supported must hold. The weight in
    int4_ref.py's layout (qweight [N, K / 8] int32, scales / zeros [N, K / group] fp16) or, tiled, in
    tile_words' and tile_scales' (zeros unused: tile_scales holds them)."""
    cfg = cfg or (TILED_CONFIG if tiled else Int4MmaGemvConfig())
    (m, k), n = x.shape, qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    warps, splits = mma_launch_shape(n, k, cfg, sm_count(x.device))
    blocks_per_split = triton.cdiv(k // BLOCK_INPUTS, splits)
    tiles = triton.cdiv(n, TILE_ROWS)
    ws, locks, consts = split_buffers(out, splits, tiles)
    # The small kernels around it take programmatic dependence (kernels/pdl.py): mode 3, and any size takes the
    # copy engine, but only inside a graph capture: an eager launch encodes its copy descriptors on the host
    # (int4_tma_gemv), which a one-token step without graphs (--enforce-eager, tensor parallelism) would pay for
    # every small GEMV.
    chained = pdl.wanted(x, m)
    any_size = chained and torch.cuda.is_current_stream_capturing()
    if tiled and cfg.tma_stages > 0 and tma_supported(group, n, k, m, any_size):  # weights by the copy engine
        tma_launch(x, qweight, scales, out, bias, warps, splits, cfg.tma_stages, ws, locks, consts,
                   cfg.tma_pdl or (3 if chained else 0))
    else:
        _int4_mma_gemv_kernel[(tiles, splits)](
            x, qweight, scales, scales if tiled else zeros, ws, out, out if bias is None else bias, locks, m, n, k,
            blocks_per_split, x.stride(0), qweight.stride(0), scales.stride(0), GROUP=group,
            F16=x.dtype == torch.float16, HAS_BIAS=bias is not None, NUM_WARPS=warps, PREFETCH=cfg.prefetch,
            TILED=tiled, num_warps=warps, **consts)
    finish_splits(ws, out, bias, consts)
    return out


# tile_words' nibble order: nibble p of a word holds code NIBBLE_CODES[p] (AWQ's order, as it happens)
NIBBLE_CODES = (0, 2, 4, 6, 1, 3, 5, 7)


def tiles_apply(bits: int, group: int, g_idx, n: int, k: int) -> bool:
    """Whether a weight can take tile_words' layout: what the mma GEMV needs of it (4-bit, no act order,
    groups and K multiples of 128), whole groups (the layout steps K / group groups a tile: a group wider than
    this rank's K, e.g. group_size -1 on a row-parallel shard, does not fit) and whole 16-row tiles."""
    return bits == 4 and g_idx is None and group % BLOCK_INPUTS == 0 and k % BLOCK_INPUTS == 0 and \
        k % group == 0 and n % TILE_ROWS == 0


def tile_words(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K / 8] (int4_ref's layout; tiles_apply holds) -> the same words, same shape, in the order
    the mma GEMV's lanes read them: each 16-row tile's 128-input block is 256 contiguous words (rows 0-7's,
    then rows 8-15's; row g's words 4t .. 4t + 3 at lane 4 g + t), so a warp's round is one 1 KB read, and
    each word's nibbles hold codes NIBBLE_CODES (pairs (q_2i, q_2i+1) come out of one lop3 each)."""
    n, kw = qweight.shape
    out = torch.zeros_like(qweight)
    for p, code in enumerate(NIBBLE_CODES):
        out |= ((qweight >> (4 * code)) & 0xF) << (4 * p)
    t = out.reshape(n // TILE_ROWS, 2, 8, kw // 16, 4, 4)  # tile, half, g, block, t, word
    return t.permute(0, 3, 1, 2, 4, 5).contiguous().reshape(n, kw)


def tile_scales(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """scales, zeros [N, G] fp16 -> [N / 16, G, 8, 4] fp16: per tile and group, for g = 0..7 (scale of row g,
    scale of row g + 8, zero of row g, zero of row g + 8): one 8-byte load a lane."""
    n, groups = scales.shape
    s, z = (t.reshape(n // TILE_ROWS, 2, 8, groups).permute(0, 3, 2, 1) for t in (scales, zeros))
    return torch.cat([s, z], dim=3).contiguous()
