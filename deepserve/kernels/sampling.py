"""Fused sampling for the common case: temperature or greedy, one draw per row, in one pass over
the logits (bf16 or fp32) with no [B, V] temporaries.

A random row takes argmax_v(logits[v] / T + g_v) with g_v ~ Gumbel(0, 1) = -log(-log(u_v)): the
Gumbel-max trick, which draws from softmax(logits / T). It is the torch sampler's exponential race
argmax(softmax(logits / T) / q), q ~ Exp(1), written with q = -log(u). A greedy row takes
argmax(logits). Ties go to the lowest token id, as torch.argmax.

The uniforms come from Triton's Philox generator keyed by (seed, row * V + v); the caller draws a
fresh `seed` from torch's CPU generator each step, so a global seed reproduces a run. Rows that need
anything else (their own seed, top-k/top-p/min-p, penalties, min_tokens) stay on the torch path in
layers/sampler.py, which is also the reference the tests compare this kernel's distribution with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048  # (host-side) vocabulary entries per loop iteration; 8 warps keep 2048 lanes busy
TINY = tl.constexpr(1e-20)  # lower bound on the uniform: -log(-log(0)) would be -inf, a token that can never win


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, temperature_ptr, greedy_ptr, out_ptr, seed, vocab,
                          mask_ptr, mask_stride, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    # One program = one row. Each lane keeps its best score and token over the columns it visits;
    # strict > keeps the lowest column within a lane, tl.min the lowest across lanes.
    row = tl.program_id(0)
    greedy = tl.load(greedy_ptr + row) != 0
    inv_t = 1.0 / tl.load(temperature_ptr + row)  # greedy rows carry 1.0 (sampling_metadata.py)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_MASK:  # structured output: bit v of the row's int32 words says whether token v is allowed
            words = tl.load(mask_ptr + row.to(tl.int64) * mask_stride + cols // 32, mask=mask, other=0)
            x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
        u = tl.maximum(tl.rand(seed, row * vocab + cols), TINY)  # int32 offsets: B * V < 2**31
        score = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(u)))
        better = mask & (score > best)
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_id, vocab), axis=0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, seed: int,
                  allowed_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [B, V]: argmax for greedy rows, a draw from softmax(logits / T)
    for the others. temperature [B] float32 (1.0 on greedy rows), greedy [B] bool. -> [B] int64.
    allowed_bitmask [B, ceil(V / 32)] int32 (structured output): only tokens whose bit is set can win;
    None (every unconstrained step) compiles the kernel without the mask load."""
    batch, vocab = logits.shape
    if allowed_bitmask is not None and (allowed_bitmask.dtype != torch.int32 or allowed_bitmask.stride(1) != 1
                                        or allowed_bitmask.shape != (batch, (vocab + 31) // 32)):
        raise ValueError("allowed_bitmask must be int32 [B, ceil(V / 32)], contiguous along its words")
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    if temperature.shape != (batch,) or temperature.dtype != torch.float32 or not temperature.is_contiguous():
        raise ValueError("temperature must be contiguous float32 [B]")
    if greedy.shape != (batch,) or greedy.dtype != torch.bool or not greedy.is_contiguous():
        raise ValueError("greedy must be contiguous bool [B]")
    if batch * vocab >= 2**31:
        raise ValueError(f"batch x vocab ({batch} x {vocab}) must stay below 2**31 (the generator's offsets)")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        has_mask = allowed_bitmask is not None
        mask = allowed_bitmask if has_mask else out  # never read without HAS_MASK
        _gumbel_argmax_kernel[(batch,)](logits, logits.stride(0), temperature, greedy, out, seed, vocab,
                                        mask, mask.stride(0) if has_mask else 0,
                                        BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)), HAS_MASK=has_mask,
                                        num_warps=8)
    return out
