"""Pieces the tensor-core decode GEMVs (int4_mma_gemv.py, fp8_mma_gemv.py) share, in Gluon: a lane's loaded
vector split into the single registers inline asm takes, the fused split-K store of one 16-row mma tile, and
the GPU check. Both kernels give lane (g, t) = (lane / 4, lane % 4) of a warp rows g and g + 8 of a 16-row
tile and tokens 2t, 2t + 1 of the mma's accumulator (mma.m16n8k16's C fragment).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from deepserve import envs
from deepserve.kernels.split_k import MAX_SPLIT_K, fused_sum, sum_splits

ONE_SPLIT = envs.DEEPSERVE_MMA_GEMV_ONE_SPLIT  # read once, at import: the configs' default (launch_shape)
TILE_ROWS = 16  # output rows of one mma tile
MAX_TOKENS = 8  # mma.m16n8k16's N: token columns a launch
ROWS = gl.constexpr(TILE_ROWS)
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.9 renamed thread_barrier
WAIT = gl.constexpr("griddepcontrol.wait;")  # for grid_dependency (programmatic dependence, kernels/pdl.py)
LAUNCH_DEPENDENTS = gl.constexpr("griddepcontrol.launch_dependents;")


@gluon.jit
def grid_dependency(anchor, op: gl.constexpr):
    """One grid dependency instruction (WAIT or LAUNCH_DEPENDENTS; an asm with side effects: kept in place)."""
    gl.inline_asm_elementwise(op + "\n\tmov.b32 $0, $1;", "=r,r", [anchor], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def split4(v, L: gl.constexpr):
    """[W, 32, 4] (4 values a thread) -> its 4 [W, 32] slices, each pinned to L (no data moves)."""
    a, b = gl.split(gl.reshape(v, [v.shape[0], 32, 2, 2]))  # a: items 0, 2; b: items 1, 3
    v0, v2 = gl.split(a)
    v1, v3 = gl.split(b)
    return (gl.convert_layout(v0, L, assert_trivial=True), gl.convert_layout(v1, L, assert_trivial=True),
            gl.convert_layout(v2, L, assert_trivial=True), gl.convert_layout(v3, L, assert_trivial=True))


@gluon.jit
def split8(v, L: gl.constexpr):
    """[W, 32, 8] (8 values a thread) -> its 8 [W, 32] slices in order, each pinned to L (no data moves)."""
    a, b = gl.split(gl.reshape(v, [v.shape[0], 32, 4, 2]))  # items 2i / 2i + 1
    e0, e1 = split4(a, L), split4(b, L)
    return (e0[0], e1[0], e0[1], e1[1], e0[2], e1[2], e0[3], e1[3])


@gluon.jit
def split16(v, L: gl.constexpr):
    """[W, 32, 16] (16 values a thread) -> its 16 [W, 32] slices in order, each pinned to L (no data moves)."""
    w: gl.constexpr = v.shape[0]
    a, b = gl.split(gl.reshape(v, [w, 32, 8, 2]))  # items 2i / 2i + 1
    a0, a1 = gl.split(gl.reshape(a, [w, 32, 4, 2]))  # items 4i / 4i + 2
    b0, b1 = gl.split(gl.reshape(b, [w, 32, 4, 2]))  # items 4i + 1 / 4i + 3
    return _interleave16(split4(a0, L), split4(b0, L), split4(a1, L), split4(b1, L))


@gluon.jit
def _interleave16(e0, e1, e2, e3):
    # e_r[i] is item 4i + r: the 16 items in order
    return (e0[0], e1[0], e2[0], e3[0], e0[1], e1[1], e2[1], e3[1], e0[2], e1[2], e2[2], e3[2],
            e0[3], e1[3], e2[3], e3[3])


@gluon.jit
def store_tile_split(y0, y1, y2, y3, ws_ptr, out_ptr, bias_ptr, lock_ptr, tile, split, split_k, M, N,
                     HAS_BIAS: gl.constexpr, FUSED: gl.constexpr, MAX_SPLITS: gl.constexpr, L: gl.constexpr,
                     DIRECT: gl.constexpr = False):
    """Lane (g, t)'s four sums (rows g / g + 8 of the tile, tokens 2t / 2t + 1) into split `split` of the
    [split_k, M, N] fp32 workspace; FUSED: the tile's last program adds the splits in order (+ bias) into
    out (split_k.store_split's protocol). DIRECT (a launch of one split): the sums (+ bias) straight into
    out, in its dtype: no workspace, fence or counter (the same values the fused sum of one split writes)."""
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L))
    g, t = lane // 4, lane % 4
    rows = tile * ROWS + g
    slice_size = M.to(gl.int64) * N
    base = ws_ptr + split * slice_size
    offs = (
        (2 * t).to(gl.int64) * N + rows, (2 * t + 1).to(gl.int64) * N + rows,
        (2 * t).to(gl.int64) * N + rows + 8, (2 * t + 1).to(gl.int64) * N + rows + 8)
    oks = ((2 * t < M) & (rows < N), (2 * t + 1 < M) & (rows < N), (2 * t < M) & (rows + 8 < N),
           (2 * t + 1 < M) & (rows + 8 < N))
    if DIRECT:
        bias_a, bias_b = _tile_bias(bias_ptr, rows, N, HAS_BIAS, L)
        dtype = out_ptr.dtype.element_ty
        gl.store(out_ptr + offs[0], (y0 + bias_a).to(dtype), mask=oks[0])
        gl.store(out_ptr + offs[1], (y1 + bias_a).to(dtype), mask=oks[1])
        gl.store(out_ptr + offs[2], (y2 + bias_b).to(dtype), mask=oks[2])
        gl.store(out_ptr + offs[3], (y3 + bias_b).to(dtype), mask=oks[3])
    else:
        gl.store(base + offs[0], y0, mask=oks[0])
        gl.store(base + offs[1], y1, mask=oks[1])
        gl.store(base + offs[2], y2, mask=oks[2])
        gl.store(base + offs[3], y3, mask=oks[3])
        if FUSED:
            _fence_gpu(split)  # each thread's stores before the count (the producer's fence)
            _cta_barrier()  # every thread's partial stored before the one counting atomic
            arrived = gl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:  # the other split_k - 1 partials are in memory
                _fence_gpu(split)
                bias_a, bias_b = _tile_bias(bias_ptr, rows, N, HAS_BIAS, L)
                _sum_into(ws_ptr, out_ptr, offs[0], oks[0], bias_a, slice_size, split_k, MAX_SPLITS)
                _sum_into(ws_ptr, out_ptr, offs[1], oks[1], bias_a, slice_size, split_k, MAX_SPLITS)
                _sum_into(ws_ptr, out_ptr, offs[2], oks[2], bias_b, slice_size, split_k, MAX_SPLITS)
                _sum_into(ws_ptr, out_ptr, offs[3], oks[3], bias_b, slice_size, split_k, MAX_SPLITS)
                gl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch (or graph replay)


@gluon.jit
def _tile_bias(bias_ptr, rows, N, HAS_BIAS: gl.constexpr, L: gl.constexpr):
    # the bias of rows g and g + 8 (fp32), or zeros
    bias_a = gl.zeros([32], gl.float32, gl.SliceLayout(0, L))
    bias_b = gl.zeros([32], gl.float32, gl.SliceLayout(0, L))
    if HAS_BIAS:
        bias_a = gl.load(bias_ptr + rows % N).to(gl.float32)
        bias_b = gl.load(bias_ptr + (rows + 8) % N).to(gl.float32)
    return bias_a, bias_b


@gluon.jit
def _sum_into(ws_ptr, out_ptr, offs, ok, bias, slice_size, split_k, MAX_SPLITS: gl.constexpr):
    # out[offs] = the splits' partials added in split order (+ bias); L2 reads (.cg), unrolled
    total = bias * 0.0
    for s in gl.static_range(MAX_SPLITS):
        total += gl.load(ws_ptr + s * slice_size + offs, mask=ok & (s < split_k), other=0.0, cache_modifier=".cg")
    gl.store(out_ptr + offs, (total + bias).to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _fence_gpu(anchor):
    gl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [anchor], dtype=gl.int32,
                              is_pure=False, pack=1)


@functools.cache
def is_hopper(device: torch.device) -> bool:
    # sub.bf16x2 needs sm_90; measured on the H200 only, so newer GPUs keep the other kernels for now
    return torch.cuda.get_device_capability(device)[0] == 9


def activations_fit(x: torch.Tensor) -> bool:
    """What both GEMVs need of x [M, K]: 1-8 tokens of bf16 / fp16 on CUDA, rows contiguous and 16-byte aligned
    (read as int32 pairs, 16 bytes a load)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and 1 <= x.shape[0] <= MAX_TOKENS and \
        x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


def split_count(rounds: int, n: int, num_warps: int, programs_per_sm: int, num_sms: int, split_k: int = 0) -> int:
    """Splits of a weight's `rounds` K steps so the programs (one a 16-row tile and split) come to about
    programs_per_sm an SM, each split keeping at least one round a warp, at most split_k.MAX_SPLIT_K (the fused
    sum unrolls over them); split_k > 0 asks for that many instead (at most one a round). Rounded so no split
    is empty."""
    tiles = triton.cdiv(n, TILE_ROWS)
    if split_k > 0:
        want = min(split_k, rounds, MAX_SPLIT_K)
    else:
        want = max(1, min(triton.cdiv(programs_per_sm * num_sms, tiles), rounds // num_warps or 1, MAX_SPLIT_K))
    return triton.cdiv(rounds, triton.cdiv(rounds, want))


# One-split launches (one_split_warps): measured with bench/gemv_split_probe.py on one H200 (bench/RESULTS.md,
# second session of 2026-12-04): 8-warp programs were the fastest or near it on the small int4 shapes (V2-Lite's,
# LLM-7B's o and down); where 8 warps would exceed ~24 an SM (LLM-7B's qkv, gate_up) fewer warps were faster
# (4 and 2); fewer than ~6 warps an SM over a long K (V3's kv_a and q_a: 36 and 96 tiles, 56 rounds) lost to split-K.
ONE_SPLIT_MAX_WARPS = 8
ONE_SPLIT_MAX_WARPS_PER_SM = 24
ONE_SPLIT_MIN_WARPS_PER_SM = 6


def one_split_warps(n: int, rounds: int, num_sms: int) -> int:
    """Warps of a one-split program (one a 16-row tile, splitting its `rounds` K steps among its warps and
    storing the tile itself) for an N-row weight, or 0 where split-K launches are faster: the most warps up to
    ONE_SPLIT_MAX_WARPS that keep the launch within ONE_SPLIT_MAX_WARPS_PER_SM an SM, taken when that is at
    least ONE_SPLIT_MIN_WARPS_PER_SM an SM or K is short (at most two rounds a warp)."""
    tiles = triton.cdiv(n, TILE_ROWS)
    warps = ONE_SPLIT_MAX_WARPS
    while warps > 1 and tiles * warps > ONE_SPLIT_MAX_WARPS_PER_SM * num_sms:
        warps //= 2
    if tiles * warps >= ONE_SPLIT_MIN_WARPS_PER_SM * num_sms or rounds <= 2 * warps:
        return warps
    return 0


def launch_shape(n: int, rounds: int, num_warps: int, programs_per_sm: int, split_k: int, one_split: bool,
                 num_sms: int) -> tuple[int, int]:
    """(warps a program, K splits) of a GEMV launch over an N-row weight of `rounds` K steps: an explicit
    split_k as asked (with num_warps); else one split of one_split_warps' programs where it applies (and
    one_split is on); else split_count's split-K with num_warps."""
    if split_k == 0 and one_split:
        warps = one_split_warps(n, rounds, num_sms)
        if warps:
            return warps, 1
    return num_warps, split_count(rounds, n, num_warps, programs_per_sm, num_sms, split_k)


def split_buffers(out: torch.Tensor, splits: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A launch's workspace, lock argument and constexprs (FUSED_SUM, MAX_SPLITS, DIRECT) for `splits` K splits
    of out [M, N]'s tiles: one split stores straight into out (DIRECT; nothing else is read); more take the
    [splits, M, N] fp32 workspace and the fused sum (or sum_splits after the launch: finish_splits)."""
    if splits == 1:
        return out, out, {"FUSED_SUM": False, "MAX_SPLITS": 1, "DIRECT": True}
    ws = torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)
    locks, fused = fused_sum(out.device, tiles, ws)
    return ws, locks, {"FUSED_SUM": fused["FUSED_SUM"], "MAX_SPLITS": fused["MAX_SPLITS"], "DIRECT": False}


def finish_splits(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, consts: dict) -> None:
    """After a launch with split_buffers' arguments: the splits' sum when the kernel did not write out itself."""
    if not consts["FUSED_SUM"] and not consts["DIRECT"]:
        sum_splits(ws, out, bias)
