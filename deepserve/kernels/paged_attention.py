"""Paged attention over an MHA/GQA KV cache: the torch reference.

Cache layout per layer: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V).
A sequence's token at position p lives in block block_table[p // block_size], row p % block_size.
The reference runs on CPU and GPU; the Triton kernels of the GPU fast path are tested against it.

FP8 cache (--kv-cache-dtype fp8): the cache holds float8_e4m3fn and each layer a float32 scale per plane
(k_scale, v_scale; MLA one for its entry). Stored: value / scale saturated to ±448; read: fp8 * scale in
fp32 (`quantize_kv`, `dequantize_kv`). Any other cache dtype is the model's and is copied as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant

from deepserve.kernels.fp8_ref import FP8, FP8_MAX


class PagedLayout(NamedTuple):
    """Where a flat batch's sequences live: sequence b owns query rows query_start_loc[b]:[b+1] and has
    seq_lens[b] tokens in the cache (this step's included), in blocks block_tables[b]."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    query_start_loc: list[int]  # [B + 1], on the host
    seq_lens: list[int]  # [B], on the host

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


KVScale = torch.Tensor | float  # a float32 scalar tensor on the cache's device (a layer's), or a number


def quantize_kv(x: torch.Tensor, scale: KVScale, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: FP8 caches hold x / scale saturated to ±448 (in fp32, rounded to
    nearest even by the cast); others x in their dtype, the scale unused."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, scale: KVScale, dtype: torch.dtype) -> torch.Tensor:
    """Cache entries x read back in `dtype`: FP8 ones as x * scale in fp32; others only cast."""
    if x.dtype != FP8:
        return x.to(dtype)
    return x.float().mul_(scale).to(dtype)  # one float32 temporary: histories can be 8k keys x every head


def copy_rows_(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """dst[slots] = src along dim 0 (index_copy_), for FP8 rows too: torch's CPU index_copy_ has no FP8
    kernel, so those are copied as their bytes (exact)."""
    if dst.dtype == FP8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, slots, src)


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scale: KVScale = 1.0, v_scale: KVScale = 1.0) -> None:
    # key, value: [T, Hkv, D]; slot_mapping: [T]; the scales count only for an FP8 cache
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])  # [2, slots, Hkv, D]
    copy_rows_(flat[0], slot_mapping, quantize_kv(key, k_scale, kv_cache.dtype))
    copy_rows_(flat[1], slot_mapping, quantize_kv(value, v_scale, kv_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]: this step's keys (already stored in the cache too)
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    layout: PagedLayout,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D], written in full
    k_scale: KVScale = 1.0,  # an FP8 cache's scales (dequantize_kv); others ignore them
    v_scale: KVScale = 1.0,
) -> torch.Tensor:  # [T, H, D]
    """Per sequence, one SDPA call in the layout its fused (flash) kernels accept (`fused_sdpa`): a
    sequence with nothing cached attends causally over this step's keys (unquantized, whatever the
    cache holds); one with a cached prefix gathers its keys from the cache and attends with the causal
    mask aligned to the last key."""
    out = torch.empty_like(query) if out is None else out
    group = query.shape[1] // key.shape[1]
    for b in range(layout.num_seqs):
        start, end = layout.query_start_loc[b], layout.query_start_loc[b + 1]
        seq_len = layout.seq_lens[b]
        if seq_len == end - start:  # nothing cached before: plain causal attention over this step's keys
            k, v = key[start:end].to(query.dtype), value[start:end].to(query.dtype)
        else:
            k, v = _gather(kv_cache, layout.block_tables[b], seq_len, layout.block_size)
            k, v = dequantize_kv(k, k_scale, query.dtype), dequantize_kv(v, v_scale, query.dtype)
        out[start:end] = fused_sdpa(query[start:end], k, v, scale, group)
    return out


def fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: int = 1) -> torch.Tensor:
    """Causal attention of one sequence's n new queries over its L keys, the last n of which are the
    queries' own positions (query i sits at position L - n + i and sees keys 0 ..= L - n + i).
    q [n, H, D], k [L, H / group, D], v [L, H / group, Dv] -> [n, H, Dv].

    SDPA picks a fused kernel only for 4-D inputs; 3-D ones (what this once passed) silently take the
    math path, which materializes every score. So the inputs go in as [1, heads, tokens, dim]. Flash
    takes n == L (is_causal, grouped heads native); a cached prefix (n < L) takes the lower-right-aligned
    causal bias, which SDPA runs on flash too, with the key heads repeated (that path has no grouped form).
    """
    n, length = q.shape[0], k.shape[0]
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, tokens, dim]
    if n == length:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        if group > 1:
            k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=lower_right_causal(n, length), scale=scale)
    return o[0].transpose(0, 1)  # [n, H, Dv]


def lower_right_causal(n: int, length: int) -> CausalBias:
    """torch's lower-right causal bias for n queries over `length` keys, without the storage that
    `causal_lower_right(n, length)` allocates: that tensor subclass takes its constructor's arguments
    as a shape, an uninitialized [2, n, length] fp32 host tensor per call (gigabytes at long
    contexts), though SDPA only reads the variant and the two lengths."""
    bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0))
    bias.variant, bias.seq_len_q, bias.seq_len_kv = CausalVariant.LOWER_RIGHT, n, length
    return bias


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, nb, block_size, Hkv, D]
    blocks = blocks.flatten(1, 2)[:, :seq_len]  # [2, seq_len, Hkv, D]
    return blocks[0], blocks[1]
