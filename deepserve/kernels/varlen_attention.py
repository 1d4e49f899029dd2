"""Causal attention over a ragged batch in one call: the prefill path of every attention front.

Sequence b owns queries q[cu_q[b]:cu_q[b+1]] and keys/values k, v[cu_k[b]:cu_k[b+1]]; its n queries
are the last n of its L keys (query i sits at position L - n + i and sees keys 0 ..= L - n + i), so a
fresh prompt (n == L) and a chunk over a cached prefix (n < L) are one case.

On CUDA this is flash attention's varlen kernel, called by name (`aten::_flash_attention_forward`,
the op behind torch's `varlen_attn` and SDPA's flash backend; causal there is aligned to the last key).
It is not left to SDPA's backend choice: W1's prompts all differ in length, and SDPA's cuDNN backend
made W1 30-40 % slower on that (BENCHMARKS.md has the bisection). One call per step, not one per sequence.
Elsewhere the torch reference runs: per sequence, SDPA with a lower-right causal bias.

Shapes: T total queries, K total keys, H query heads, Hkv key heads (H % Hkv == 0), D head size
(multiple of 8, at most 256 on the flash path), Dv value head size (== D on the flash path).
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepserve.kernels.paged_attention import fused_sdpa


def varlen_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [K, Hkv, D]
    v: torch.Tensor,  # [K, Hkv, Dv]
    cu_q: torch.Tensor,  # [B + 1] int32, on q's device
    cu_k: torch.Tensor,  # [B + 1] int32, on q's device
    cu_q_cpu: list[int],  # the same offsets on the host (the reference and the maxima need no sync)
    cu_k_cpu: list[int],
    scale: float,
) -> torch.Tensor:  # [T, H, Dv]
    if flash_varlen_fits(q, v):
        return flash_varlen(q, k, v, cu_q, cu_k, _max_len(cu_q_cpu), _max_len(cu_k_cpu), scale)
    if q.is_cuda:  # fp32 (the GPU checks' tiny models) or odd head sizes: SDPA, but never cuDNN's backend
        with sdpa_kernel(NOT_CUDNN):
            return varlen_attention_ref(q, k, v, cu_q_cpu, cu_k_cpu, scale)
    return varlen_attention_ref(q, k, v, cu_q_cpu, cu_k_cpu, scale)


# SDPA's backends that GPU paths may use: everything but cuDNN's, whose per-shape plans cost W1 30-40 %.
NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def flash_varlen_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flash's varlen kernel takes these inputs: CUDA, fp16/bf16, one head size of at most 256
    that is a multiple of 8 (callers pad a smaller value head, as MLA does)."""
    size = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and v.shape[-1] == size
            and size <= 256 and size % 8 == 0)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Flash attention's varlen forward, causal. Only the schema's positional part (q, k, v, cu_seq_q,
    cu_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask) and `scale` are passed: the same in
    torch 2.11 (run on the H200) and 2.13 (its schema); later keywords (window sizes, a block table)
    vary between releases and keep their defaults."""
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16), "flash takes fp16/bf16"
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash takes one head size for q, k and v"
    assert q.shape[1] % k.shape[1] == 0, "query heads must be a multiple of key heads"
    assert cu_q.dtype == cu_k.dtype == torch.int32
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
    )[0]
    return out  # [T, H, D]


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int],
                         scale: float) -> torch.Tensor:
    """The torch reference: one SDPA call per sequence (`fused_sdpa`)."""
    out = q.new_empty(*q.shape[:2], v.shape[-1])
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out[qs] = fused_sdpa(q[qs], k[ks], v[ks], scale, group)
    return out


def _max_len(cu: list[int]) -> int:
    return max(b - a for a, b in zip(cu, cu[1:], strict=False))
