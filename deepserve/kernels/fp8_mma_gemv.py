"""FP8 weights at decode sizes on the tensor cores: x [M <= 8, K] (bf16 / fp16, not quantized) times an FP8
(e4m3) weight [N, K] with per-channel or block scales, a GEMV in which every warp widens the weight bytes it
loaded into the 16-bit type of x and feeds `mma.sync` straight from those registers (no shared memory, no
shuffles). Written in Gluon, like int4_mma_gemv.py, whose scheme it follows.

Why: fp8_gemv.py multiplies on the CUDA cores (~2.7 TB/s of weight on DeepSeek-LLM-7B's shapes at one token)
and is taken for one token only, as above that the W8A8 path was faster; W8A8 itself quantizes the activations
and streams slowly at 2-8 tokens (bench/RESULTS.md). Here a warp's mma multiplies 16 rows by 8 token columns
over 16 inputs in one instruction, so 1-8 tokens cost about the same; what remains is the widening, 2
instructions a weight: cvt.rn.f16x2.e4m3x2 (two weights to f16, exact: every e4m3 value is an f16), and for
bf16 models two cvt.f32.f16 and one cvt.rn.bf16x2.f32 a pair (exact: 3 mantissa bits fit bf16's 7, the
exponents its range). fp16 models multiply the f16 pair as it is.

Layout (no permutation needed): lane (g, t) = (lane / 4, lane % 4) holds, of each row g and g + 8 and each
round of 16 * WORDS inputs, the 4-byte words 4t .. 4t + 3 of every 16-word chunk (WORDS / 4 chunks: one
16-byte load a chunk), so the 4 lanes of a row read its round's bytes contiguously. mma.m16n8k16 gives lane
(g, t) "virtual" inputs 2t, 2t + 1 and 2t + 8, 2t + 9 of its A rows and B column g; the i-th word column's
mma puts the word's bytes (w0, w1) at the first pair and (w2, w3) at the second, and token g's activations of
the same 4 inputs, loaded in the same lane order, are the B registers as they come (pairs of x's halves).
Each mma then sums 16 real products of matching weight and input: the dot product does not depend on the
order of its terms.

Numerics: products of the exact weight and x, summed in fp32 by the tensor cores. Per-channel: the row's
scale multiplies the sum once, at the end. Block scales (DeepSeek-V3: 128 x 128): every round sums into fresh
accumulators and adds scale * them (a 16-row tile lies in one block row; BLOCK_K divides the block's K).
Like fp8_gemv.py, more exact than the W8A8 path (activations not rounded to e4m3); fp8_ref's dequantized
weight times x is the reference. fp8_mma_ref.py replays the kernel's asm and offsets in torch for the CPU
tests; bench/fp8_gemv_probe.py (and tests/kernels/test_fp8_mma_gemv.py on a Hopper GPU) checks the kernel
on the GPU.

Measured on one H200 (bench/fp8_gemv_probe.py; bench/RESULTS.md, sixth session of 2026-12-03): a
DeepSeek-LLM-7B step's FP8 GEMVs (per-channel) 2.18-2.20 ms at one token against fp8_gemv's 2.22-2.23, and
2.23 / 2.23 / 2.26 at 2 / 4 / 8 tokens against the W8A8 path's 3.18 / 2.80 / 2.76; DeepSeek-V3's dense shapes
(128 x 128 blocks) 3.06 TB/s against fp8_gemv's 2.71. A line through its times for LLM-7B's o and gate_up
shapes reads ~4.0 TB/s plus ~6 µs a call (cuBLAS's bf16 GEMV the same way: ~4.0 TB/s plus ~4.5 µs): the fixed
cost a call, not the streaming, keeps the small layers far from the bandwidth, and is the next thing to cut.
As in the int4 kernel, ptxas sinks the prefetched round's loads to the end of the loop (SASS), so a warp has
about one round in flight; more warps an SM or L2 prefetches ahead did not help, nor did programmatic
dependent launch (the first weights loaded before griddepcontrol.wait): some of V3's small projections 4-15 %
faster, its dense gate_up 40 % slower, LLM-7B's step 3 % slower (bench/RESULTS.md).

Work split (int4_mma_gemv.py's): a program is NUM_WARPS warps on one 16-row tile; its warps take the rounds
of its K split in turn; split-K partials are summed in split order by the tile's last program
(mma_gemv_common.store_tile_split), so results do not depend on scheduling. Where the tiles alone keep the
SMs busy (mma_gemv_common.one_split_warps), one split of up to 8-warp programs that store their tiles
themselves (one H200, bench/gemv_split_probe.py: a 7B step's per-channel GEMVs ~1.94 ms against 2.15 at one
token; LLM-7B `-q fp8` W2 TPOT 2.98 -> 2.82 ms, same-machine A/B; V3's slice unchanged, 2.52 / 2.51).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from deepserve import envs
from deepserve.kernels import pdl
from deepserve.kernels.mma_gemv_common import (
    LAUNCH_DEPENDENTS,
    ONE_SPLIT,
    TILE_ROWS,
    WAIT,
    activations_fit,
    finish_splits,
    grid_dependency,
    is_hopper,
    launch_shape,
    split4,
    split8,
    split16,
    split_buffers,
    store_tile_split,
)
from deepserve.kernels.split_k import sm_count

ROWS = gl.constexpr(TILE_ROWS)
BLOCK_K = 128  # K must be a multiple of this (every round whole; DeepSeek's scale blocks are 128 wide)
INTERPRET = envs.TRITON_INTERPRET  # read once, at import


def _widen_bf16(word: str, lo: str, hi: str) -> str:
    """PTX: the 4 e4m3 bytes of `word` -> bf16 pairs lo = (byte 0, byte 1), hi = (bytes 2, 3), exactly."""
    return f"""
        mov.b32 {{q0, q1}}, {word};
        cvt.rn.f16x2.e4m3x2 p, q0;
        mov.b32 {{h0, h1}}, p;
        cvt.f32.f16 f0, h0;
        cvt.f32.f16 f1, h1;
        cvt.rn.bf16x2.f32 {lo}, f1, f0;
        cvt.rn.f16x2.e4m3x2 p, q1;
        mov.b32 {{h0, h1}}, p;
        cvt.f32.f16 f0, h0;
        cvt.f32.f16 f1, h1;
        cvt.rn.bf16x2.f32 {hi}, f1, f0;"""


def _widen_f16(word: str, lo: str, hi: str) -> str:
    """PTX: the 4 e4m3 bytes of `word` -> f16 pairs lo = (byte 0, byte 1), hi = (bytes 2, 3), exactly."""
    return f"""
        mov.b32 {{q0, q1}}, {word};
        cvt.rn.f16x2.e4m3x2 {lo}, q0;
        cvt.rn.f16x2.e4m3x2 {hi}, q1;"""


def _word_asm(dtype: str) -> str:
    """One word column of a round for one lane: $4 / $5 the word of rows g / g + 8 (4 consecutive inputs),
    $6 / $7 token g's activations of those inputs as pairs, the accumulators in $8..$11 and out $0..$3."""
    widen, mma = (_widen_bf16, "bf16.bf16") if dtype == "bf16" else (_widen_f16, "f16.f16")
    return ("{\n        .reg .b16 q0, q1, h0, h1;\n        .reg .b32 p, a0, a1, a2, a3;\n        .reg .f32 f0, f1;"
            + widen("$4", "a0", "a2") + widen("$5", "a1", "a3") + f"""
        mma.sync.aligned.m16n8k16.row.col.f32.{mma}.f32 {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{$6, $7}},
            {{$8, $9, $10, $11}};
        }}""")


WORD_ASM_BF16 = gl.constexpr(_word_asm("bf16"))
WORD_ASM_F16 = gl.constexpr(_word_asm("f16"))


@dataclass(frozen=True)
class Fp8MmaGemvConfig:
    """A launch's shape. words: 4-byte words a lane reads of each of its two rows a round (4: 64 inputs a round,
    one 16-byte load a row; 8: 128 inputs, two). The defaults are the fastest of bench/fp8_gemv_probe.py's
    variants on one H200 (bench/RESULTS.md): other shapes of the same 16 warps an SM (1 warp a program, 16
    programs an SM; 4, 4) no faster; 32 warps an SM, 256-input rounds and prefetch.global.L2 1-8 rounds ahead
    slower; evict-first 3 % faster on DeepSeek-V3's shapes, even on LLM-7B's."""
    num_warps: int = 2
    programs_per_sm: int = 8  # the split count aims at this many programs an SM
    words: int = 8
    prefetch: bool = True  # load the next round before this round's mmas (register double buffering)
    evict_first: bool = True  # weight loads marked evict-first in L2 (read once; x and the partials stay)
    split_k: int = 0  # 0: launch_shape's choice; n > 0: n splits of num_warps (one: each program stores its tile)
    one_split: bool = ONE_SPLIT  # with split_k 0: one split of one_split_warps' programs where it applies


DEFAULT_CONFIG = Fp8MmaGemvConfig()


@gluon.jit
def _word(acc, wa, wb, xl, xh, F16: gl.constexpr):
    """acc (4 [W, 32] fp32) + one word column's mma (_word_asm)."""
    asm: gl.constexpr = WORD_ASM_F16 if F16 else WORD_ASM_BF16
    return gl.inline_asm_elementwise(
        asm, "=f,=f,=f,=f,r,r,r,r,f,f,f,f", [wa, wb, xl, xh, acc[0], acc[1], acc[2], acc[3]],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)


@gluon.jit(do_not_specialize=["M", "rounds_per_split"])
def _fp8_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, ws_ptr, out_ptr, bias_ptr, lock_ptr, M, N, K, rounds_per_split,
                         stride_xm, stride_wn, stride_sn, stride_sk, GROUP_N: gl.constexpr, GROUP_K: gl.constexpr,
                         PER_CHANNEL: gl.constexpr, F16: gl.constexpr, HAS_BIAS: gl.constexpr,
                         FUSED_SUM: gl.constexpr, NUM_WARPS: gl.constexpr, MAX_SPLITS: gl.constexpr,
                         PREFETCH: gl.constexpr, WORDS: gl.constexpr, EVICT: gl.constexpr, DIRECT: gl.constexpr,
                         PDL: gl.constexpr = False):
    # w_ptr / x_ptr read as int32: the weight's words [N, K / 4] (stride_wn in words), x's pairs.
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NUM_WARPS, 1], [1, 0])  # [warp, lane]: one each
    LW: gl.constexpr = gl.BlockedLayout([1, 1, WORDS], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    LX: gl.constexpr = gl.BlockedLayout([1, 1, 2 * WORDS], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    RI: gl.constexpr = 16 * WORDS  # inputs a round
    tile, split = gl.program_id(0), gl.program_id(1)
    warp = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, L))[:, None]  # [W, 1]
    warpw = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LW)))[:, None, None]
    lanew = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LW)))[None, :, None]
    itemw = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))[None, None, :]
    warpx = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))[:, None, None]
    lanex = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))[None, :, None]
    itemx = gl.arange(0, 2 * WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))[None, None, :]
    # lane (g, t)'s words of a round's row: 4t .. 4t + 3 of each 16-word chunk; rows past N wrap (in bounds)
    in_round = (itemw // 4) * 16 + (lanew % 4) * 4 + itemw % 4 + warpw * 0
    words_a = ((tile * ROWS + lanew // 4) % N).to(gl.int64) * stride_wn + in_round
    words_b = ((tile * ROWS + lanew // 4 + 8) % N).to(gl.int64) * stride_wn + in_round
    # token g's activation pairs of the same inputs: pairs 8t .. 8t + 7 of each 32-pair chunk
    tokx = lanex // 4
    x_off = tokx.to(gl.int64) * (stride_xm // 2) + (itemx // 8) * 32 + (lanex % 4) * 8 + itemx % 8
    x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    w_words = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    scale_row = s_ptr + ((tile * ROWS) // GROUP_N).to(gl.int64) * stride_sn  # block scales: the tile's row
    lane0 = gl.arange(0, 32, layout=gl.SliceLayout(0, L))[None, :] * 0  # [1, 32] zeros: a [W, 32] broadcast
    y0 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y1 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y2 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y3 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    rounds = K // RI
    first = split * rounds_per_split
    last = gl.minimum(first + rounds_per_split, rounds)
    if PREFETCH:  # the next round's loads issued before this round's mmas
        # PDL (launched with programmatic dependence, kernels/pdl.py): the first round's weights and scale are
        # asked for before waiting on the previous kernel; x, the workspace and out only after
        if PDL:
            wa, wb = _load_words(first, last, warpw, w_words, words_a, words_b, RI, EVICT)
            s = _load_scale(first, last, warp, lane0, scale_row, stride_sk, RI, GROUP_K, PER_CHANNEL)
            grid_dependency(tile, WAIT)
            xv = _load_x(first, last, warpx, x_words, x_off, tokx, M, RI)
        else:
            wa, wb, xv, s = _load_round(first, last, warp, lane0, warpw, warpx, w_words, words_a, words_b, x_words,
                                        x_off, tokx, M, scale_row, stride_sk, RI, GROUP_K, PER_CHANNEL, EVICT)
        for r in range(first, last, NUM_WARPS):
            nwa, nwb, nxv, ns = _load_round(r + NUM_WARPS, last, warp, lane0, warpw, warpx, w_words, words_a,
                                            words_b, x_words, x_off, tokx, M, scale_row, stride_sk, RI, GROUP_K,
                                            PER_CHANNEL, EVICT)
            y0, y1, y2, y3 = _mma_round(y0, y1, y2, y3, wa, wb, xv, s, L, F16, PER_CHANNEL, WORDS)
            wa, wb, xv, s = nwa, nwb, nxv, ns
    else:
        if PDL:
            grid_dependency(tile, WAIT)
        for r in range(first, last, NUM_WARPS):
            wa, wb, xv, s = _load_round(r, last, warp, lane0, warpw, warpx, w_words, words_a, words_b, x_words,
                                        x_off, tokx, M, scale_row, stride_sk, RI, GROUP_K, PER_CHANNEL, EVICT)
            y0, y1, y2, y3 = _mma_round(y0, y1, y2, y3, wa, wb, xv, s, L, F16, PER_CHANNEL, WORDS)
    if PDL:  # after the loop: the next launch's programs take no slot from a program with rounds left
        grid_dependency(tile, LAUNCH_DEPENDENTS)
    y0, y1, y2, y3 = gl.sum(y0, axis=0), gl.sum(y1, axis=0), gl.sum(y2, axis=0), gl.sum(y3, axis=0)
    if PER_CHANNEL:  # y0, y1: row g (tokens 2t, 2t + 1); y2, y3: row g + 8
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
        s_a = gl.load(s_ptr + ((tile * ROWS + lane // 4) % N) * stride_sn)
        s_b = gl.load(s_ptr + ((tile * ROWS + lane // 4 + 8) % N) * stride_sn)
        y0, y1, y2, y3 = y0 * s_a, y1 * s_a, y2 * s_b, y3 * s_b
    store_tile_split(y0, y1, y2, y3, ws_ptr, out_ptr, bias_ptr, lock_ptr, tile, split, gl.num_programs(1), M, N,
                     HAS_BIAS, FUSED_SUM, MAX_SPLITS, L, DIRECT)


@gluon.jit
def _load_round(r, last, warp, lane0, warpw, warpx, w_words, words_a, words_b, x_words, x_off, tokx, M, scale_row,
                stride_sk, RI: gl.constexpr, GROUP_K: gl.constexpr, PER_CHANNEL: gl.constexpr, EVICT: gl.constexpr):
    """Round r's loads for every warp (round r + warp; a warp past the split's last round reloads that round's
    weights with its activations read as zeros, so it adds nothing): the two rows' words [W, 32, WORDS], the
    activation pairs [W, 32, 2 WORDS] and the round's block scale [W, 32] (per channel: zeros, unused)."""
    wa, wb = _load_words(r, last, warpw, w_words, words_a, words_b, RI, EVICT)
    xv = _load_x(r, last, warpx, x_words, x_off, tokx, M, RI)
    return wa, wb, xv, _load_scale(r, last, warp, lane0, scale_row, stride_sk, RI, GROUP_K, PER_CHANNEL)


@gluon.jit
def _load_words(r, last, warpw, w_words, words_a, words_b, RI: gl.constexpr, EVICT: gl.constexpr):
    """_load_round's weight words of the two rows (constants: loadable before a programmatic wait)."""
    rw = gl.minimum(r + warpw, last - 1)
    wa = gl.load(w_words + words_a + rw * (RI // 4), eviction_policy=EVICT)
    wb = gl.load(w_words + words_b + rw * (RI // 4), eviction_policy=EVICT)
    return wa, wb


@gluon.jit
def _load_scale(r, last, warp, lane0, scale_row, stride_sk, RI: gl.constexpr, GROUP_K: gl.constexpr,
                PER_CHANNEL: gl.constexpr):
    """_load_round's block scale (a constant; per channel: zeros, unused)."""
    if PER_CHANNEL:
        return (warp + lane0).to(gl.float32) * 0.0
    return gl.load(scale_row + ((gl.minimum(r + warp, last - 1) * RI) // GROUP_K) * stride_sk + lane0)


@gluon.jit
def _load_x(r, last, warpx, x_words, x_off, tokx, M, RI: gl.constexpr):
    """_load_round's activation pairs (zeros for a warp past the split's last round)."""
    rx = r + warpx
    return gl.load(x_words + x_off + rx * (RI // 2), mask=(tokx < M) & (rx < last), other=0)


@gluon.jit
def _mma_round(y0, y1, y2, y3, wa, wb, xv, s, L: gl.constexpr, F16: gl.constexpr, PER_CHANNEL: gl.constexpr,
               WORDS: gl.constexpr):
    """y + one round per warp: WORDS mmas, into y itself (per channel: scaled at the end) or into fresh
    accumulators that the round's block scale multiplies."""
    if WORDS == 8:
        a, b, x = split8(wa, L), split8(wb, L), split16(xv, L)
    else:
        a, b, x = split4(wa, L), split4(wb, L), split8(xv, L)
    if PER_CHANNEL:
        acc = (y0, y1, y2, y3)
    else:
        zero = gl.zeros(y0.shape, gl.float32, L)
        acc = (zero, zero, zero, zero)
    for i in gl.static_range(WORDS):
        acc = _word(acc, a[i], b[i], x[2 * i], x[2 * i + 1], F16)
    if PER_CHANNEL:
        return acc[0], acc[1], acc[2], acc[3]
    return y0 + s * acc[0], y1 + s * acc[1], y2 + s * acc[2], y3 + s * acc[3]


_is_hopper = is_hopper  # a module global, so tests can stand in for a Hopper GPU


def mma_gemv_supported(x: torch.Tensor, w_q: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether fp8_mma_gemv takes this product: 1-8 tokens of bf16 / fp16 with 16-byte aligned rows on a Hopper
    GPU (not under Triton's interpreter), a contiguous e4m3 weight with K a multiple of 128, and block scales
    (if any) whose blocks hold whole 16-row tiles and whole 128-input rounds."""
    if INTERPRET or not activations_fit(x):
        return False
    if w_q.dtype != torch.float8_e4m3fn or w_q.stride(1) != 1 or w_q.stride(0) % 16 or w_q.data_ptr() % 16:
        return False
    return w_q.shape[0] > 0 and _shape_fits(w_q.shape[1], block) and _is_hopper(x.device)


def _shape_fits(k: int, block: tuple[int, int] | None) -> bool:
    # whole 128-input rounds; a block scale constant over a 16-row tile and a round
    return k > 0 and k % BLOCK_K == 0 and (block is None or (block[0] % TILE_ROWS == 0 and block[1] % BLOCK_K == 0))


def mma_launch_shape(n: int, k: int, cfg: Fp8MmaGemvConfig, num_sms: int) -> tuple[int, int]:
    """(warps a program, K splits) for an [N, K] weight: mma_gemv_common.launch_shape over its rounds."""
    rounds = k // (16 * cfg.words)
    return launch_shape(n, rounds, cfg.num_warps, cfg.programs_per_sm, cfg.split_k, cfg.one_split, num_sms)


def fp8_mma_gemv(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                 bias: torch.Tensor | None = None, cfg: Fp8MmaGemvConfig | None = None) -> torch.Tensor:
    """x [M <= 8, K] -> [M, N] in x's dtype; mma_gemv_supported must hold. block (bn, bk): scale is the weight's
    scale_inv [ceil(N / bn), ceil(K / bk)] float32; block None: scale is per output channel [N] float32."""
    cfg = cfg or DEFAULT_CONFIG
    (m, k), n = x.shape, w_q.shape[0]
    if cfg.words not in (4, 8):
        raise ValueError(f"fp8 mma gemv: words must be 4 or 8, got {cfg.words}")
    if not _shape_fits(k, block):
        raise ValueError(f"fp8 mma gemv: K must be a multiple of {BLOCK_K} and scale blocks whole 16-row tiles and "
                         f"{BLOCK_K}-input rounds, got K {k}, block {block}")
    want = (n,) if block is None else (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"fp8 mma gemv: the scale must be float32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    warps, splits = mma_launch_shape(n, k, cfg, sm_count(x.device))
    rounds_per_split = triton.cdiv(k // (16 * cfg.words), splits)
    tiles = triton.cdiv(n, TILE_ROWS)
    ws, locks, consts = split_buffers(out, splits, tiles)
    group_n, group_k = block if block is not None else (TILE_ROWS, BLOCK_K)  # unread per channel
    chained = pdl.wanted(x, m)  # the small kernels around it take programmatic dependence (kernels/pdl.py)
    _fp8_mma_gemv_kernel[(tiles, splits)](
        x, w_q, scale, ws, out, out if bias is None else bias, locks, m, n, k, rounds_per_split,
        x.stride(0), w_q.stride(0) // 4, scale.stride(0), scale.stride(-1), GROUP_N=group_n, GROUP_K=group_k,
        PER_CHANNEL=block is None, F16=x.dtype == torch.float16, HAS_BIAS=bias is not None,
        NUM_WARPS=warps, PREFETCH=cfg.prefetch, WORDS=cfg.words,
        EVICT="evict_first" if cfg.evict_first else "", PDL=chained, num_warps=warps, **consts,
        **pdl.launch_options(chained))
    finish_splits(ws, out, bias, consts)
    return out
