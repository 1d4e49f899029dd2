"""Multi-head latent attention over the paged latent cache: the torch reference.

Cache layout per layer: kv_cache [num_blocks, block_size, C + Dr] — per token the normalized
compressed kv (C = kv_lora_rank values) followed by the roped key (Dr = qk_rope_head_dim values).
There is no head axis: every head reads the same entry, so attention over the cache is multi-query
attention whose key is the whole entry and whose value is its first C values.
A sequence's token at position p lives in block block_table[p // block_size], row p % block_size.
The reference runs on CPU and GPU; the GPU kernels are tested against it.
An FP8 cache holds each entry as entry / kv_scale in float8_e4m3fn, one scale per layer for the whole
entry (kernels/paged_attention.py: quantize_kv, dequantize_kv).

Shapes: T new tokens, H heads, C kv_lora_rank, Dr qk_rope_head_dim, Dk = qk_nope_head_dim + Dr,
Dv v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from deepserve.kernels.paged_attention import KVScale, PagedLayout, copy_rows_, dequantize_kv, quantize_kv
from deepserve.kernels.varlen_attention import NOT_CUDNN, varlen_attention


def store_latent_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     kv_scale: KVScale = 1.0) -> None:
    # kv_c: [T, C], k_pe: [T, Dr], slot_mapping: [T]; kv_scale counts only for an FP8 cache
    assert kv_c.shape[-1] + k_pe.shape[-1] == kv_cache.shape[-1], "cache entry must be kv_lora_rank + rope dim"
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [slots, C + Dr]
    copy_rows_(flat, slot_mapping, quantize_kv(torch.cat([kv_c, k_pe], dim=-1), kv_scale, kv_cache.dtype))


def mla_attention_ref(
    q_latent: torch.Tensor,  # [T, H, C]: q_nope with W_UK folded in
    q_pe: torch.Tensor,  # [T, H, Dr]: roped
    kv_cache: torch.Tensor,  # [num_blocks, block_size, C + Dr], this step's entries already stored
    layout: PagedLayout,
    scale: float,
    kv_scale: KVScale = 1.0,  # an FP8 cache's scale; others ignore it
) -> torch.Tensor:  # [T, H, C]: attention-weighted latents, W_UV still to apply
    """The absorbed form: scores are q_latent·c + q_pe·k_pe over every cached token of the sequence."""
    query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, C + Dr]
    out = q_latent.new_empty(q_latent.shape)
    with sdpa_kernel(NOT_CUDNN):  # on the GPU too: never cuDNN's per-shape plans (varlen_attention)
        _absorbed_per_sequence(query, kv_cache, layout, scale, out, kv_scale)
    return out


def _absorbed_per_sequence(query: torch.Tensor, kv_cache: torch.Tensor, layout: PagedLayout, scale: float,
                           out: torch.Tensor, kv_scale: KVScale) -> None:
    num_heads, rank = out.shape[1], out.shape[2]
    for b in range(layout.num_seqs):
        start, end = layout.query_start_loc[b], layout.query_start_loc[b + 1]
        seq_len, num_new = layout.seq_lens[b], end - start
        entries = dequantize_kv(gather_latent(kv_cache, layout.block_tables[b], seq_len, layout.block_size),
                                kv_scale, query.dtype)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, C + Dr]
        k = entries[None, None]  # [1, 1, L, C + Dr]: one key head shared by all H
        v = k[..., :rank]  # [1, 1, L, C]
        # New token i sits at position seq_len - num_new + i and sees keys 0 ..= that position.
        mask = torch.ones(num_new, seq_len, dtype=torch.bool, device=query.device).tril(seq_len - num_new)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads > 1)
        out[start:end] = o[0].transpose(0, 1)  # [n, H, C]


def mla_prefill_ref(
    q: torch.Tensor,  # [T, H, Dk]: q_nope and roped q_pe
    k: torch.Tensor,  # [T, H, Dk]: k_nope expanded by W_UK and the shared roped k_pe
    v: torch.Tensor,  # [T, H, Dv]: expanded by W_UV
    cu: torch.Tensor,  # [B + 1] int32: sequence b owns rows cu[b]:cu[b+1], all of them new
    cu_cpu: list[int],  # the same on the host
    scale: float,
) -> torch.Tensor:  # [T, H, Dv]
    """The expanded form for sequences with nothing cached before this step: causal attention within
    each sequence's new tokens, all sequences in one call (`mla_varlen_attention`)."""
    assert cu_cpu[-1] == q.shape[0] == k.shape[0], "the expanded form here needs sequences without cached context"
    return mla_varlen_attention(q, k, v, cu, cu, cu_cpu, cu_cpu, scale)


def mla_sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The expanded form for one sequence: its n new queries q [n, H, Dk] over its L keys k [L, H, Dk]
    and values v [L, H, Dv], the last n keys being the queries' own -> [n, H, Dv]. offsets: [0, n, 0, L]
    int32 on q's device, when the caller has them there already (else copied here)."""
    n, length = q.shape[0], k.shape[0]
    if offsets is None:
        offsets = torch.tensor([0, n, 0, length], dtype=torch.int32).to(q.device, non_blocking=True)
    return mla_varlen_attention(q, k, v, offsets[:2], offsets[2:], [0, n], [0, length], scale)


def mla_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         cu_q_cpu: list[int], cu_k_cpu: list[int], scale: float) -> torch.Tensor:
    """The expanded form over a ragged batch (`varlen_attention`): q [T, H, Dk], k [K, H, Dk],
    v [K, H, Dv] -> [T, H, Dv]. Flash needs one head size for q, k and v (Dk 192 > Dv 128 in V2/V3):
    zero columns appended to v add zero columns to the output, which are cut off."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    return varlen_attention(q, k, v, cu_q, cu_k, cu_q_cpu, cu_k_cpu, scale)[..., :dv]


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """The seq_len cache entries of one sequence, in position order: [seq_len, C + Dr], as stored (an FP8
    cache's still quantized: dequantize_kv)."""
    num_blocks = -(-seq_len // block_size)
    return kv_cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]
