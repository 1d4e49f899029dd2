"""Attention fronts over the paged KV cache.

`Attention` is the MHA/GQA front (Llama, Qwen2). The model runner allocates each layer's cache from
its `kv_cache_spec()` and binds it to `layer.kv_cache` before the first step; per-step metadata comes
from the forward context. The latent MLA front (DeepSeek-V2/V3) is the second cache layout.

A cache allocated in FP8 (--kv-cache-dtype fp8, `kv_cache_spec`) is the one switch: the layer then stores
k / k_scale and v / v_scale in float8_e4m3fn and reads fp8 * scale (kernels/paged_attention.py). The
scales are float32 buffers, 1.0 unless the checkpoint has `self_attn.k_scale` / `v_scale` tensors
(loader/kv_scales.py); a cache in the model's dtype never reads them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from deepserve import envs
from deepserve.forward_context import AttentionMetadata, get_forward_context
from deepserve.kernels.paged_attention import dequantize_kv, paged_attention_ref, store_kv_ref
from deepserve.kernels.varlen_attention import NOT_CUDNN, varlen_attention
from deepserve.layers.kv_cache_spec import KVCacheSpec
from deepserve.layers.rotary import RotaryEmbedding

# Read once, at import: rope and the cache store in one launch on the GPU path (kernels/rope_kv_store.py),
# bit for bit the Triton rope's numbers; under DEEPSERVE_TRITON_ELEMENTWISE=0 the rope stays torch.compile's.
FUSED_ROPE_KV_STORE = envs.DEEPSERVE_FUSED_ROPE_KV_STORE and envs.DEEPSERVE_TRITON_ELEMENTWISE


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, Hkv, D], bound by the runner
        # An FP8 cache's per-layer scales (float32 whatever the model's dtype; not parameters, so a
        # checkpoint without them is complete).
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(entry_shape=(self.num_kv_heads, self.head_dim), planes=2, dtype=dtype)

    def load_kv_scale(self, which: str, value: float) -> None:
        """A checkpoint's k_scale ("k") or v_scale ("v") of this layer."""
        (self.k_scale if which == "k" else self.v_scale).fill_(value)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, RotaryEmbedding] | None = None) -> torch.Tensor:
        # q: [T, H*D], k/v: [T, Hkv*D] -> [T, H*D]. rope (positions, rotary): q and k are not yet rotated;
        # rotated here, on the GPU path with DEEPSERVE_FUSED_ROPE_KV_STORE in the cache store's launch.
        meta = get_forward_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        scales = self.k_scale, self.v_scale
        gpu = uses_gpu_kernels(self.kv_cache)
        if rope is not None and not (gpu and FUSED_ROPE_KV_STORE):
            positions, rotary = rope
            q, k = rotary(positions, q, k)
            rope = None
        if gpu:
            return _attend_cuda(q, k, v, self.kv_cache, meta, self.scale, scales, rope).flatten(1)
        store_kv_ref(k, v, self.kv_cache, meta.slot_mapping, *scales)
        out = paged_attention_ref(q, k, v, self.kv_cache, meta.paged, self.scale, k_scale=self.k_scale,
                                  v_scale=self.v_scale)
        return out.flatten(1)


def uses_gpu_kernels(t: torch.Tensor) -> bool:
    """Whether the attention fronts take their GPU path (Triton kernels, flash varlen) for tensors like
    t; elsewhere the torch references. One place, so a CPU test can run the GPU path's logic."""
    return t.is_cuda


def _attend_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, scales: tuple[torch.Tensor, torch.Tensor],
                 rope: tuple[torch.Tensor, RotaryEmbedding] | None = None) -> torch.Tensor:
    """Decoding sequences take the Triton paged-decode kernel; the others flash attention's varlen
    kernel, one call for the fresh prompts (over this step's keys) and one for the chunks over a cached
    prefix (over their histories, gathered from the cache, where this step's keys are already stored;
    an FP8 cache's are dequantized after the gather). scales: (k_scale, v_scale), read for FP8 only.
    rope: q and k still to rotate, in the store's launch (kernels/rope_kv_store.py)."""
    from deepserve.kernels.triton_paged_attention import paged_decode_attention, store_kv_cache

    k_scale, v_scale = scales
    if rope is not None:
        from deepserve.kernels.rope_kv_store import rope_and_store_kv

        positions, rotary = rope
        q, k = rope_and_store_kv(positions, q, k, v, rotary.cos_sin, rotary.rotary_dim, rotary.interleaved, kv_cache,
                                 meta.slot_mapping, k_scale, v_scale)
    else:
        store_kv_cache(k, v, kv_cache, meta.slot_mapping, k_scale, v_scale)
    if meta.decode_only:
        return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                      max_seq_len=meta.max_seq_len, k_scale=k_scale, v_scale=v_scale)
    out = torch.empty_like(q)
    if meta.decode_token_idx is not None and meta.decode_token_idx.numel():
        rows = meta.decode_token_idx
        out[rows] = paged_decode_attention(
            q[rows], kv_cache, meta.block_tables[meta.decode_seq_idx], meta.seq_lens[meta.decode_seq_idx],
            scale, max_seq_len=meta.max_seq_len, k_scale=k_scale, v_scale=v_scale,
        )
    if meta.prefill_seqs_cpu is None:  # metadata without the prefill groups: the per-sequence reference
        with sdpa_kernel(NOT_CUDNN):
            return paged_attention_ref(q, k, v, kv_cache, meta.paged, scale, out=out, k_scale=k_scale,
                                       v_scale=v_scale)
    if meta.prefill_fresh is not None:
        g = meta.prefill_fresh
        out[g.rows] = varlen_attention(q[g.rows], k[g.rows], v[g.rows], g.cu_q, g.cu_k, g.cu_q_cpu, g.cu_k_cpu, scale)
    for g in meta.prefill_cached:
        flat = kv_cache.flatten(1, 2)  # [2, slots, Hkv, D]
        keys = dequantize_kv(flat[0, g.kv_slots], k_scale, q.dtype)  # [Kg, Hkv, D]; no copy unless FP8
        values = dequantize_kv(flat[1, g.kv_slots], v_scale, q.dtype)
        out[g.rows] = varlen_attention(q[g.rows], keys, values, g.cu_q, g.cu_k, g.cu_q_cpu, g.cu_k_cpu, scale)
    return out
