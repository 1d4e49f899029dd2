"""The int4 tensor-core decode GEMV (int4_mma_gemv.py) with its weights staged through shared memory by the
copy engine (TMA): one thread of a program asks for STAGES rounds of the tile's words and scales ahead, each
round's copy completing on an mbarrier, so a program keeps STAGES x NUM_WARPS KB of weights in flight however
the compiler schedules the warps' own loads.

Why: the register-loaded kernel has about one 1 KB round a warp in flight (ptxas sinks the next round's loads
below the mmas), ~16-24 KB an SM, and streams a 7B step's shapes at ~2-2.4 TB/s (bench/RESULTS.md).
Measured on one H200 (bench/gemv_tma_probe.py; bench/RESULTS.md, third session of 2026-12-04): bytes in flight
were not what held it back. Two stages were the fastest (three to eight slower, on every shape); the large
weights gain a few % at one token (LLM-7B's gate_up 18.6 against 19.9 µs a call), the small ones and several
tokens lose (tma_supported keeps them on the register kernel); LLM-7B AWQ W2 TPOT 2.34 -> 2.29 ms (same-machine
A/B). Launched with programmatic dependence (PDL: the prologue's copies before griddepcontrol.wait) it was
faster in the probe's chains of GEMVs but not in the engine's decode graph (replay 2.148 ms against 2.121
without), so it is off by default (DEEPSERVE_INT4_TMA_GEMV_PDL). What that graph lacked: kernels around the
GEMVs that take part. With DEEPSERVE_PDL (kernels/pdl.py) the small kernels do, and every one-token GEMV of
groups of 128 comes here, launched early and letting the next launch start after its loop (PDL 3).

Same work split, mma and numerics as int4_mma_gemv's tiled layout (its _block asm, store_tile_split), only
where the words and scales come from differs: round i of a program is its warps' blocks first + i * NUM_WARPS
+ warp, one [NUM_WARPS, 256] box of tile_words (viewed [N / 16 * K / 128, 256], a row a tile's block) and one
[scale_rows, 32] box of tile_scales (viewed [N / 16 * G, 32]; groups of 128, so a block's row in both). Boxes
that reach past the split read the next tile's blocks (or zeros past the end): those warps add nothing. The
activations are read from global memory as before (the same few KB for every program: cache hits).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from deepserve.kernels.int4_mma_asm import BLOCK_INPUTS, _block
from deepserve.kernels.mma_gemv_common import (
    LAUNCH_DEPENDENTS,
    TILE_ROWS,
    WAIT,
    _cta_barrier,
    grid_dependency,
    split4,
    split16,
    store_tile_split,
)

KB = gl.constexpr(BLOCK_INPUTS)
WORDS = 16 * TILE_ROWS  # int32 words of a tile's 128-input block (tile_words)
SCALES = 2 * TILE_ROWS  # fp16 of a tile's group (tile_scales: 8 lanes' scale a, scale b, zero a, zero b)
WORDS_C, SCALES_C = gl.constexpr(WORDS), gl.constexpr(SCALES)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # Triton 3.9's name / 3.6's


@gluon.constexpr_function
def _scale_layout(warps):
    """[W, 32] fp16 of a round's tile_scales rows, lane (g, t) holding items 4g .. 4g + 3 (the 4 lanes t alike)."""
    warp_bases = [[1 << i, 0] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]], lane_bases=[[0, 0], [0, 0], [0, 4], [0, 8], [0, 16]],
                                      warp_bases=warp_bases, block_bases=[], shape=[warps, SCALES])


@gluon.jit
def _to_lanes(v, P: gl.constexpr, L: gl.constexpr):
    """[W, 8] (lane (g, t) holding item g, lanes t alike) -> [W, 32] in L (lane 4g + t holds item g)."""
    v = gl.convert_layout(v, gl.SliceLayout(2, P), assert_trivial=True)
    full = gl.expand_dims(v, 2) + gl.zeros([v.shape[0], 8, 4], gl.float32, P)
    return gl.convert_layout(gl.reshape(full, [v.shape[0], 32]), L, assert_trivial=True)


@gluon.jit
def _issue(w_desc, s_desc, wbuf, sbuf, bars, stage, row, pred):
    # one round's words and scales into `stage`, completing on its barrier (one thread issues; pred: a round left)
    bar = bars.index(stage)
    mbarrier.expect(bar, w_desc.block_type.nbytes + s_desc.block_type.nbytes, pred=pred)
    _tma_load(w_desc, [row, 0], bar, wbuf.index(stage), pred=pred)
    _tma_load(s_desc, [row, 0], bar, sbuf.index(stage), pred=pred)


@gluon.jit(do_not_specialize=["M", "blocks_per_split"])
def _int4_tma_gemv_kernel(x_ptr, w_desc, s_desc, ws_ptr, out_ptr, bias_ptr, lock_ptr, M, N, K, blocks_per_split,
                          stride_xm, F16: gl.constexpr, HAS_BIAS: gl.constexpr, FUSED_SUM: gl.constexpr,
                          NUM_WARPS: gl.constexpr, MAX_SPLITS: gl.constexpr, STAGES: gl.constexpr,
                          DIRECT: gl.constexpr, PDL: gl.constexpr = 0):
    tile, split, split_k = gl.program_id(0), gl.program_id(1), gl.num_programs(1)
    if PDL == 2:  # the next launch (if it asked for programmatic dependence) may start its own prologue now
        grid_dependency(tile, LAUNCH_DEPENDENTS)
    L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NUM_WARPS, 1], [1, 0])  # [warp, lane]
    LW: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NUM_WARPS, 1], [1, 0])  # words 4l.. and 128 + 4l..
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    L16: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    P: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [NUM_WARPS, 1, 1], [2, 1, 0])  # [warp, g, t]
    LS: gl.constexpr = _scale_layout(NUM_WARPS)
    warp16 = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L16)))[:, None, None]
    lane16 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L16)))[None, :, None]
    item16 = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L16)))[None, None, :]
    tok16 = lane16 // 4
    x_off = tok16.to(gl.int64) * (stride_xm // 2) + (lane16 % 4) * 16 + item16
    x_ok = (tok16 < M) & (item16 >= 0)
    x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    warp = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, L))[:, None]
    magic = 1024.0 if F16 else 128.0
    k_blocks = K // KB
    first = split * blocks_per_split
    last = gl.minimum(first + blocks_per_split, k_blocks)
    rounds = gl.cdiv(last - first, NUM_WARPS)
    row0 = tile * k_blocks + first  # the tile's block `first`: a row of both views

    wbuf = gl.allocate_shared_memory(gl.int32, [STAGES, NUM_WARPS, WORDS_C], w_desc.layout)
    # the scales' box has at least 2 rows (scale_rows): a copy's destination must be 128-byte aligned
    sbuf = gl.allocate_shared_memory(gl.float16, [STAGES] + s_desc.block_type.shape, s_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):
        _issue(w_desc, s_desc, wbuf, sbuf, bars, s, row0 + s * NUM_WARPS, s < rounds)
    if PDL:  # launched early (programmatic dependence): the weights are on their way; x and out wait here for
        # the previous kernel to finish (its memory visible), so nothing it reads or writes is touched before
        grid_dependency(tile, WAIT)

    y0 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y1 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y2 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    y3 = gl.zeros([NUM_WARPS, 32], gl.float32, L)
    for i in range(rounds):
        stage = i % STAGES
        b = first + i * NUM_WARPS
        xv = gl.load(x_words + x_off + gl.minimum(b + warp16, last - 1) * 64, mask=x_ok, other=0)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        words = wbuf.index(stage).load(LW)
        sz = sbuf.index(stage).slice(0, NUM_WARPS).load(LS).to(gl.float32)
        _cta_barrier()  # every warp has read the stage before the copy engine refills it
        _issue(w_desc, s_desc, wbuf, sbuf, bars, stage, row0 + (i + STAGES) * NUM_WARPS, i + STAGES < rounds)
        wa4, wb4 = gl.split(gl.permute(gl.reshape(words, [NUM_WARPS, 2, 32, 4]), [0, 2, 3, 1]))
        wa = split4(gl.convert_layout(wa4, L4, assert_trivial=True), L)
        wb = split4(gl.convert_layout(wb4, L4, assert_trivial=True), L)
        s01, s23 = gl.split(gl.reshape(sz, [NUM_WARPS, 8, 2, 2]))  # items (0, 2) and (1, 3)
        sa, za = gl.split(s01)
        sb, zb = gl.split(s23)
        sa, sb = _to_lanes(sa, P, L), _to_lanes(sb, P, L)
        za, zb = _to_lanes(za, P, L) + magic, _to_lanes(zb, P, L) + magic
        x = split16(xv, L)
        zero = gl.zeros([NUM_WARPS, 32], gl.float32, L)
        acc = (zero, zero, zero, zero)
        acc = _block(acc, wa[0], wb[0], x, za, zb, 0, F16, True)
        acc = _block(acc, wa[1], wb[1], x, za, zb, 1, F16, True)
        acc = _block(acc, wa[2], wb[2], x, za, zb, 2, F16, True)
        acc = _block(acc, wa[3], wb[3], x, za, zb, 3, F16, True)
        live = b + warp < last  # a warp past the split's end read another tile's block: add nothing
        y0 += gl.where(live, sa * acc[0], 0.0)
        y1 += gl.where(live, sa * acc[1], 0.0)
        y2 += gl.where(live, sb * acc[2], 0.0)
        y3 += gl.where(live, sb * acc[3], 0.0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    if PDL == 3:  # after the loop: the next launch's programs take no slot from a program with rounds left
        grid_dependency(tile, LAUNCH_DEPENDENTS)
    store_tile_split(gl.sum(y0, axis=0), gl.sum(y1, axis=0), gl.sum(y2, axis=0), gl.sum(y3, axis=0), ws_ptr,
                     out_ptr, bias_ptr, lock_ptr, tile, split, split_k, M, N, HAS_BIAS, FUSED_SUM, MAX_SPLITS, L,
                     DIRECT)


# Where the register-loaded kernel stays: on one H200 (bench/gemv_tma_probe.py; bench/RESULTS.md, third session
# of 2026-12-04, call 5), two stages, one token, each GEMV after a small kernel writing x, this kernel was faster
# on DeepSeek-LLM-7B's gate_up (45 MB of codes; 19.8 against 21.9 µs a pair) and down (22.5 MB; 12.9 / 13.5),
# even on its qkv (25 MB; 12.5 / 12.6), slower on its o (8 MB; 7.9 / 7.6) and on V2-Lite's projections as a whole
# (0.6-5.8 MB; its step 763 against 734 µs, though kv_a was even and the shared down faster); at 4 tokens it lost
# on LLM-7B's qkv and down too (not looked into). Nothing was measured between 8 and 22 MB: 16 is a cut in that gap.
TMA_MIN_BYTES = 16 << 20
TMA_MAX_TOKENS = 1


def tma_supported(group: int, n: int, k: int, m: int, chained: bool = False) -> bool:
    """Whether x [M, K] @ a tiled [N, K] weight takes this kernel: one scale row a block (groups of 128), at
    most TMA_MAX_TOKENS tokens and at least TMA_MIN_BYTES of codes, or any size when `chained` (launched with
    programmatic dependence among small kernels that take part too, kernels/pdl.py: on one H200 a
    DeepSeek-LLM-7B-like int4 step with every GEMV on this kernel so launched was the fastest variant,
    bench/pdl_chain_probe.py, bench/RESULTS.md)."""
    return group == BLOCK_INPUTS and m <= TMA_MAX_TOKENS and (chained or n * k // 2 >= TMA_MIN_BYTES)


def scale_rows(warps: int) -> int:
    """Rows of a round's scales box: one a warp, at least 2 (128 bytes: the copy engine writes to shared memory at
    128-byte aligned addresses, so each stage of the scales must span a multiple of that; a 1-warp program reads
    one row more, of the next block, unused)."""
    return max(warps, 2)


class _Base:
    """What a TensorDescriptor needs of its tensor (the address, the dtype), without holding the tensor: a cached
    descriptor must not keep a freed weight alive. A later tensor at the same address with the same shape gets
    the same descriptor, which describes it exactly."""

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self._ptr


_WORDS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
_SCALES_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@functools.lru_cache(maxsize=1024)
def _descriptors(q_ptr: int, s_ptr: int, n: int, k: int, warps: int) -> tuple:
    # built once per weight and width: two descriptors took ~10 µs of host time a call on the sandbox's CPU, paid
    # every decode step without graphs
    rows = n // TILE_ROWS * (k // BLOCK_INPUTS)
    return (TensorDescriptor(_Base(q_ptr, torch.int32), [rows, WORDS], [WORDS, 1], [warps, WORDS], _WORDS_LAYOUT),
            TensorDescriptor(_Base(s_ptr, torch.float16), [rows, SCALES], [SCALES, 1], [scale_rows(warps), SCALES],
                             _SCALES_LAYOUT))


def tma_launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bias, warps: int,
               splits: int, stages: int, ws: torch.Tensor, locks: torch.Tensor, consts: dict, pdl: int = 0) -> None:
    """One launch over tile_words (int32 [N, K / 8]) / tile_scales (fp16) (tma_supported; the caller picked warps,
    splits and buffers as for int4_mma_gemv's kernel)."""
    (m, k), n = x.shape, qweight.shape[0]
    if stages < 1 or qweight.dtype != torch.int32 or scales.dtype != torch.float16:
        raise ValueError(f"int4 TMA gemv: needs stages >= 1 (DEEPSERVE_INT4_TMA_GEMV_STAGES), int32 words and fp16 "
                         f"scales; got {stages}, {qweight.dtype}, {scales.dtype}")
    w_desc, s_desc = _descriptors(qweight.data_ptr(), scales.data_ptr(), n, k, warps)
    tiles = triton.cdiv(n, TILE_ROWS)
    _int4_tma_gemv_kernel[(tiles, splits)](
        x, w_desc, s_desc, ws, out, out if bias is None else bias, locks, m, n, k,
        triton.cdiv(k // BLOCK_INPUTS, splits), x.stride(0), F16=x.dtype == torch.float16, HAS_BIAS=bias is not None,
        NUM_WARPS=warps, STAGES=stages, PDL=pdl, num_warps=warps, launch_pdl=pdl > 0, **consts)
