"""Split-K, shared by the GEMMs that split their K loop over several programs when the output tiles alone
cannot fill the GPU (decode sizes): how many splits, where a program's partial goes, and the ordered sum of
the partials. fp8.py (W8A8), fp8_gemv.py, int4.py and int4_gemv.py import it; it imports none of them.

Each split writes fp32 into its slice of a [split_k, M, N] workspace, and the slices are added in split
order, so the result does not depend on scheduling (deterministic). Who adds them:
  sum_splits      a kernel of its own after the GEMM (the W8A8 and int4 tile kernels; the decode GEMVs with
                  DEEPSERVE_SPLIT_K_FUSED_SUM=0);
  store_split     with FUSED (the decode GEMVs, kernels/fp8_gemv.py and kernels/int4_gemv.py, by default):
                  the program that completes an output tile adds its partials. Each
                  program counts itself in the tile's slot of a per-device counter array (tile_locks) after
                  its partial is stored; the one that brings the count to split_k is the last, so every
                  partial is in memory, and it sums them in split order (the same additions as sum_splits,
                  bit for bit), writes the output and puts the count back to 0 for the next launch (a CUDA
                  graph replays with the same counters). On one H200 the separate sum was 120 launches of
                  ~3.6 µs in a one-token step of DeepSeek-LLM-7B (bench/decode_profile.sh, bench/RESULTS.md).
                  Invariant: GEMVs that share a device's counters never run concurrently (one stream).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepserve import envs

MIN_K_TILES_PER_SPLIT = 4  # so each split's loop still has loads to pipeline
MAX_SPLIT_K = 16
# Read once, at import (a launch must not reread the environment); INTERPRET: Triton's CPU interpreter,
# which runs programs one after another and has no inline PTX (the fences below are skipped there).
FUSED_SUM = envs.DEEPSERVE_SPLIT_K_FUSED_SUM
INTERPRET = envs.TRITON_INTERPRET
LOCK_SLOTS = 1 << 16  # output tiles one fused launch may have; more fall back to sum_splits
_tile_locks: dict[torch.device, torch.Tensor] = {}


def split_count(tiles: int, k_tiles: int, num_sms: int) -> int:
    """Splits along K that bring tiles * splits to about one program per SM, each split keeping
    MIN_K_TILES_PER_SPLIT iterations or more."""
    if tiles >= num_sms:
        return 1
    return max(1, min(triton.cdiv(num_sms, tiles), k_tiles // MIN_K_TILES_PER_SPLIT, MAX_SPLIT_K))


@functools.cache
def sm_count(device: torch.device) -> int:
    # On CPU (the interpreter tests) the H200's count, so tests walk the GPU's decisions.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@triton.jit
def store_tile(c_ptr, bias_ptr, acc, pid_m, pid_n, split, M, N, stride_cm, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    # PARTIAL: fp32 into slice `split` of the [split_k, M, N] workspace (the bias is added once, when
    # the splits are summed); otherwise bias, cast, out [M, N].
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    if PARTIAL:
        tl.store(c_ptr + split.to(tl.int64) * M * N + offsets, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offsets, acc.to(c_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """partials [S, M, N] fp32 -> out [M, N] (contiguous) = their sum in split order (+ bias): the
    result does not depend on scheduling."""
    numel, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(numel, block),)](
        partials, out, out if bias is None else bias, numel, out.shape[1], partials.shape[0],
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


@triton.jit(do_not_specialize=["numel", "split_k"])
def _sum_splits_kernel(ws_ptr, out_ptr, bias_ptr, numel, N, split_k, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(ws_ptr + s * numel + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def tile_locks(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's int32 tile counters (all 0 between launches) for a fused split sum over `tiles` output
    tiles, or None: the fused sum is off, the tiles exceed LOCK_SLOTS, or the counters would first be made
    inside a CUDA-graph capture (the warm-up forward before each capture makes them; a capture that came
    first falls back to sum_splits rather than allocate from the graph's pool)."""
    if not FUSED_SUM or tiles > LOCK_SLOTS:
        return None
    if device.type == "cuda" and device.index is None:  # one key per GPU, however the device was named
        device = torch.device("cuda", torch.cuda.current_device())
    locks = _tile_locks.get(device)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        locks = _tile_locks[device] = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=device)
    return locks


def fused_sum(device: torch.device, tiles: int, workspace: torch.Tensor,
              split: bool = True) -> tuple[torch.Tensor, dict]:
    """For a launch whose kernel ends in store_split (workspace: its [split_k, M, N] partials): its lock
    argument (the counters, or the unread workspace when the sum is not fused) and its constexprs
    FUSED_SUM, INTERPRETED and MAX_SPLITS. Without FUSED_SUM the caller runs sum_splits after the launch
    (split False: one split, nothing to sum)."""
    locks = tile_locks(device, tiles) if split else None
    splits = workspace.shape[0] if locks is not None else 1  # unread when not fused: one compile
    return (workspace if locks is None else locks), {"FUSED_SUM": locks is not None, "INTERPRETED": INTERPRET,
                                                     "MAX_SPLITS": triton.next_power_of_2(splits)}


@triton.jit
def store_split(ws_ptr, out_ptr, bias_ptr, lock_ptr, acc, tile, rows, cols, split, split_k, M, N,
                HAS_BIAS: tl.constexpr, FUSED: tl.constexpr, INTERPRETED: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Split `split`'s fp32 partial acc [len(rows), len(cols)] of output tile `tile` (rows of M, cols of N)
    into the [split_k, M, N] workspace at ws_ptr. FUSED: the program that completes the tile then writes
    out [M, N] = the tile's partials summed in split order (+ bias), in out's dtype (module docstring);
    otherwise sum_splits does, after the launch. MAX_SPLITS >= split_k (a constexpr): the sum's loop is
    unrolled so all its loads are in flight at once (with a loop over split_k, one L2 round trip per split,
    the FP8 GEMVs took 2.5 µs a call more than unfused on the H200; unrolled, 2.0: bench/RESULTS.md)."""
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    slice_size = M.to(tl.int64) * N
    tl.store(ws_ptr + split * slice_size + offsets, acc, mask=mask)
    if FUSED:
        _fence_gpu(split, INTERPRETED)  # each thread's stores before the count (the producer's fence)
        tl.debug_barrier()  # every thread's partial stored before the one counting atomic
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:  # the other split_k - 1 partials are in memory
            _fence_gpu(split, INTERPRETED)
            total = tl.zeros_like(acc)
            for s in tl.static_range(MAX_SPLITS):  # L2 reads (.cg): this SM's L1 may hold an older launch's lines
                live = mask & ((offsets * 0 + s) < split_k)  # as a tensor: a mask must be one
                total += tl.load(ws_ptr + s * slice_size + offsets, mask=live, other=0.0,
                                 cache_modifier=".cg")  # a split past split_k adds 0.0: the sum is unchanged
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch (or graph replay)


@triton.jit
def _fence_gpu(anchor, INTERPRETED: tl.constexpr):
    # fence.acq_rel.gpu in every thread (a scalar op runs in each); `anchor` only gives the asm an operand.
    if not INTERPRETED:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [anchor], dtype=tl.int32,
                                  is_pure=False, pack=1)
