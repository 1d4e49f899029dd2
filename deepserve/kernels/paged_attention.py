"""Paged attention over an MHA/GQA KV cache: the torch reference.

Cache layout per layer: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V).
A sequence's token at position p lives in block block_table[p // block_size], row p % block_size.
The reference runs on CPU and GPU; the Triton kernels of the GPU fast path are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepserve.runner.forward_context import AttentionMetadata


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # key, value: [T, Hkv, D]; slot_mapping: [T]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])  # [2, slots, Hkv, D]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]: this step's keys (already stored in the cache too)
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    seqs: list[int] | None = None,  # which sequences to compute (default: all)
    out: torch.Tensor | None = None,  # [T, H, D]: rows of other sequences are left as they are
) -> torch.Tensor:  # [T, H, D]
    out = torch.empty_like(query) if out is None else out
    gqa = query.shape[1] != key.shape[1]
    for b in range(meta.num_seqs) if seqs is None else seqs:
        start, end = meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1]
        seq_len = meta.seq_lens_cpu[b]
        num_new = end - start
        q = query[start:end].transpose(0, 1)  # [H, n, D]
        if seq_len == num_new:  # nothing cached before: plain causal attention over this step's keys
            k, v, mask = key[start:end], value[start:end], None
        else:
            k, v = _gather(kv_cache, meta.block_tables[b], seq_len, meta.block_size)
            # New token i sits at position seq_len - num_new + i and sees keys 0 ..= that position.
            mask = torch.ones(num_new, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - num_new)
        o = F.scaled_dot_product_attention(
            q, k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa,
        )  # [H, n, D]
        out[start:end] = o.transpose(0, 1)
    return out


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, nb, block_size, Hkv, D]
    blocks = blocks.flatten(1, 2)[:, :seq_len]  # [2, seq_len, Hkv, D]
    return blocks[0], blocks[1]
