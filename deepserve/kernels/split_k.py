"""Split-K, shared by the GEMMs that split their K loop over several programs when the output tiles alone
cannot fill the GPU (decode sizes): how many splits, where a program's partial goes, and the ordered sum of
the partials. fp8.py (W8A8), fp8_gemv.py, int4.py and int4_gemv.py import it; it imports none of them.

Each split writes fp32 into its slice of a [split_k, M, N] workspace (no atomics), and sum_splits adds
the slices in split order, so the result does not depend on scheduling (deterministic).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MIN_K_TILES_PER_SPLIT = 4  # so each split's loop still has loads to pipeline
MAX_SPLIT_K = 16


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
