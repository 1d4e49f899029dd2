"""Rope and the KV-cache store of an MHA/GQA layer in one launch (DEEPSERVE_FUSED_ROPE_KV_STORE).

Unfused, a Llama-family layer launches four kernels between its QKV projection and its attention:
elementwise.apply_rope's for q and for k, then triton_paged_attention.store_kv_cache's for k and for v.
On one H200 those were 120 of a one-token decode step's launches for DeepSeek-LLM-7B, ~1.3 µs each
(bench/decode_profile.sh, bench/RESULTS.md). Here one program per (token, head) of q, k and v together:

  q head h        rotated into q_out (elementwise._rope_kernel's arithmetic)
  k head j        rotated into k_out and, the same rounded values, stored at the token's cache slot
  v head j        stored at the token's cache slot

mla_rope_and_store does the same for an MLA layer (q_pe heads rotated; k_pe rotated and, with the normalized
latent, stored as the token's cache entry), one launch instead of two ropes, a cat and the latent store.

Numerics are the unfused path's exactly: the rotation in fp32 rounded to the model's dtype, then for an
FP8 cache that rounded value / scale saturated to ±448 (store_kv_cache's). Tokens whose slot is negative
(padding) are rotated but not stored. k_out is still written: fresh prompts attend over their own keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels import pdl
from deepserve.kernels.elementwise import rotate_head
from deepserve.kernels.fp8_ref import FP8
from deepserve.kernels.triton_paged_attention import store_cache_values

INTERPRET = envs.TRITON_INTERPRET


def rope_and_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_sin: torch.Tensor, rotary_dim: int, interleaved: bool, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """elementwise.apply_rope(positions, q, k, cos_sin, rotary_dim, interleaved) followed by
    store_kv_cache(k_rotated, v, kv_cache, slot_mapping, k_scale, v_scale), in one launch. q [T, H, D],
    k / v [T, Hkv, D] (contiguous last axis), kv_cache [2, num_blocks, block_size, Hkv, D]; returns the
    rotated (q, k) as new tensors. The scales are read for an FP8 cache only."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    _check(positions, q, k, v, cos_sin, rotary_dim, kv_cache, slot_mapping)
    quantize = kv_cache.dtype == FP8
    if quantize and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 cache needs k_scale and v_scale")
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, kv_heads, dim, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half, rest = rotary_dim // 2, dim - rotary_dim
    on = pdl.wanted(q, tokens)
    _rope_kv_store_kernel[(tokens, heads + 2 * kv_heads)](
        positions, q, k, v, cos_sin, q_out, k_out, kv_cache, slot_mapping,
        k_scale if quantize else None, v_scale if quantize else None,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, BLOCK_DIM=triton.next_power_of_2(dim), HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), REST=rest, BLOCK_REST=triton.next_power_of_2(rest) if rest else 1,
        INTERLEAVED=interleaved, PAGE_SIZE=kv_cache.shape[2], QUANTIZE=quantize, INTERPRET=INTERPRET, PDL=on,
        num_warps=1, **pdl.launch_options(on))
    return q_out, k_out


def _check(positions, q, k, v, cos_sin, rotary_dim, kv_cache, slot_mapping) -> None:
    tokens, _, dim = q.shape
    ok = (rotary_dim % 2 == 0 and rotary_dim <= dim and k.shape == v.shape and k.shape[0] == tokens
          and k.shape[2] == dim and cos_sin.shape[-1] == rotary_dim and cos_sin.dtype == torch.float32
          and positions.shape == (tokens,) and all(t.stride(-1) == 1 for t in (q, k, v, kv_cache))
          and kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and tuple(kv_cache.shape[3:]) == tuple(k.shape[1:])
          and slot_mapping.dtype == torch.int64 and slot_mapping.shape == (tokens,) and slot_mapping.is_contiguous())
    if not ok:
        raise ValueError("rope_and_store_kv: q [T, H, D], k / v [T, Hkv, D], cos_sin [P, rotary_dim] float32 "
                         "(rotary_dim even, <= D), kv_cache [2, blocks, block_size, Hkv, D], slot_mapping int64 [T]")


@triton.jit
def _rope_kv_store_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_plane, stride_blk, stride_tok, stride_head,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr, INTERLEAVED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, QUANTIZE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    # Program (token t, head h): h < HEADS a q head, then KV_HEADS k heads, then KV_HEADS v heads.
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    # the token's slot in a cache plane (the k plane; the v plane is stride_plane further)
    row = (slot // PAGE_SIZE) * stride_blk + (slot % PAGE_SIZE) * stride_tok
    if h < HEADS:
        _rotate_head(pos_ptr, cs_ptr, q_ptr, q_out_ptr, t, h, stride_qt, stride_qh, HEADS * DIM, DIM, cache_ptr,
                     k_scale_ptr, slot, stride_cs, HALF, BLOCK_HALF, REST, BLOCK_REST, INTERLEAVED, False, QUANTIZE,
                     INTERPRET)
    elif h < HEADS + KV_HEADS:
        j = h - HEADS
        _rotate_head(pos_ptr, cs_ptr, k_ptr, k_out_ptr, t, j, stride_kt, stride_kh, KV_HEADS * DIM, DIM,
                     cache_ptr + row + j * stride_head, k_scale_ptr, slot, stride_cs, HALF, BLOCK_HALF, REST,
                     BLOCK_REST, INTERLEAVED, True, QUANTIZE, INTERPRET)
    else:
        j = h - HEADS - KV_HEADS
        offs = tl.arange(0, BLOCK_DIM)
        ok = (offs < DIM) & (tl.full([BLOCK_DIM], 0, tl.int64) + slot >= 0)  # a block-shaped mask (interpreter)
        vals = tl.load(v_ptr + t * stride_vt + j * stride_vh + offs, mask=ok, other=0.0)
        store_cache_values(cache_ptr + stride_plane + row + j * stride_head + offs, vals, v_scale_ptr, ok, QUANTIZE,
                           INTERPRET)


@triton.jit
def _rotate_head(pos_ptr, cs_ptr, x_ptr, out_ptr, t, h, stride_xt, stride_xh, stride_ot, stride_oh, cache_row,
                 scale_ptr, slot, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, REST: tl.constexpr,
                 BLOCK_REST: tl.constexpr, INTERLEAVED: tl.constexpr, STORE: tl.constexpr, QUANTIZE: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Head h of token t rotated from x into out (elementwise.rotate_head: _rope_kernel's arithmetic and
    rounding); STORE: the same rounded values also to cache_row (a k head; skipped for a negative slot)."""
    src, dst, first, second, y1, y2, ok = rotate_head(pos_ptr, cs_ptr, x_ptr, out_ptr, t, h, stride_xt, stride_xh,
                                                      stride_ot, stride_oh, stride_cs, HALF, BLOCK_HALF, INTERLEAVED,
                                                      INTERPRET)
    if STORE:
        live = ok & (tl.full([BLOCK_HALF], 0, tl.int64) + slot >= 0)
        store_cache_values(cache_row + first, y1, scale_ptr, live, QUANTIZE, INTERPRET)
        store_cache_values(cache_row + second, y2, scale_ptr, live, QUANTIZE, INTERPRET)
    if REST > 0:  # the features past the rotary ones, unchanged
        r = tl.arange(0, BLOCK_REST)
        kept = tl.load(src + 2 * HALF + r, mask=r < REST, other=0.0)
        tl.store(dst + 2 * HALF + r, kept, mask=r < REST)
        if STORE:
            live_r = (r < REST) & (tl.full([BLOCK_REST], 0, tl.int64) + slot >= 0)
            store_cache_values(cache_row + 2 * HALF + r, kept, scale_ptr, live_r, QUANTIZE, INTERPRET)


def mla_rope_and_store(positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor,
                       cos_sin: torch.Tensor, interleaved: bool, latent_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA layer's rope and latent-cache store in one launch: elementwise.apply_rope(positions, q_pe, k_pe[:, None],
    cos_sin, P, interleaved) followed by triton_paged_attention.store_mla_cache(cat([kv_c, k_pe_rotated]), ...),
    which unfused took four launches (two ropes, the cat, the store; 108 of a V2-Lite decode step's, bench/RESULTS.md).
    q_pe [T, H, P], k_pe [T, P], kv_c [T, R] (the normalized latent; contiguous last axes), latent_cache
    [num_blocks, block_size, R + P]; returns the rotated (q_pe [T, H, P], k_pe [T, P]) as new tensors. Same
    numerics, bit for bit: the rotation rounded to the model's dtype, an FP8 cache's values / kv_scale saturated."""
    tokens, heads, rope = q_pe.shape
    rank = kv_c.shape[-1]
    _check_mla(positions, q_pe, k_pe, kv_c, cos_sin, latent_cache, slot_mapping)
    quantize = latent_cache.dtype == FP8
    if quantize and kv_scale is None:
        raise ValueError("an FP8 latent cache needs kv_scale")
    q_out = torch.empty(tokens, heads, rope, dtype=q_pe.dtype, device=q_pe.device)
    k_out = torch.empty(tokens, rope, dtype=k_pe.dtype, device=k_pe.device)
    if tokens == 0:
        return q_out, k_out
    on = pdl.wanted(q_pe, tokens)
    _mla_rope_store_kernel[(tokens, heads + 2)](
        positions, q_pe, k_pe, kv_c, cos_sin, q_out, k_out, latent_cache, slot_mapping, kv_scale if quantize else None,
        q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), kv_c.stride(0), cos_sin.stride(0), latent_cache.stride(0),
        latent_cache.stride(1), HEADS=heads, RANK=rank, BLOCK_RANK=triton.next_power_of_2(rank), HALF=rope // 2,
        BLOCK_HALF=triton.next_power_of_2(rope // 2), INTERLEAVED=interleaved, PAGE_SIZE=latent_cache.shape[1],
        QUANTIZE=quantize, INTERPRET=INTERPRET, PDL=on, num_warps=1, **pdl.launch_options(on))
    return q_out, k_out


def _check_mla(positions, q_pe, k_pe, kv_c, cos_sin, latent_cache, slot_mapping) -> None:
    tokens, _, rope = q_pe.shape
    ok = (rope % 2 == 0 and cos_sin.shape[-1] == rope and cos_sin.dtype == torch.float32
          and k_pe.shape == (tokens, rope) and kv_c.dim() == 2 and kv_c.shape[0] == tokens
          and positions.shape == (tokens,)
          and all(t.stride(-1) == 1 for t in (q_pe, k_pe, kv_c, latent_cache)) and latent_cache.dim() == 3
          and latent_cache.shape[2] == kv_c.shape[-1] + rope and slot_mapping.dtype == torch.int64
          and slot_mapping.shape == (tokens,) and slot_mapping.is_contiguous())
    if not ok:
        raise ValueError("mla_rope_and_store: q_pe [T, H, P], k_pe [T, P], kv_c [T, R] (contiguous last axes), "
                         "cos_sin [positions, P] float32 (P even), latent_cache [blocks, block_size, R + P], "
                         "slot_mapping int64 [T]")


@triton.jit
def _mla_rope_store_kernel(
    pos_ptr, q_ptr, k_ptr, c_ptr, cs_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr, scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_ct, stride_cs, stride_blk, stride_tok,
    HEADS: tl.constexpr, RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANTIZE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # Program (token t, h): h < HEADS a q_pe head rotated; HEADS: k_pe rotated, into k_out and the entry's last
    # P values; HEADS + 1: the latent kv_c into the entry's first R values. Negative slots (padding) store nothing.
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    row = cache_ptr + (slot // PAGE_SIZE) * stride_blk + (slot % PAGE_SIZE) * stride_tok  # the token's entry
    if h < HEADS:
        _rotate_head(pos_ptr, cs_ptr, q_ptr, q_out_ptr, t, h, stride_qt, stride_qh, HEADS * 2 * HALF, 2 * HALF,
                     cache_ptr, scale_ptr, slot, stride_cs, HALF, BLOCK_HALF, 0, 1, INTERLEAVED, False, QUANTIZE,
                     INTERPRET)
    elif h == HEADS:
        _rotate_head(pos_ptr, cs_ptr, k_ptr, k_out_ptr, t, 0, stride_kt, 0, 2 * HALF, 0, row + RANK, scale_ptr, slot,
                     stride_cs, HALF, BLOCK_HALF, 0, 1, INTERLEAVED, True, QUANTIZE, INTERPRET)
    else:
        offs = tl.arange(0, BLOCK_RANK)
        ok = (offs < RANK) & (tl.full([BLOCK_RANK], 0, tl.int64) + slot >= 0)  # a block-shaped mask (interpreter)
        vals = tl.load(c_ptr + t * stride_ct + offs, mask=ok, other=0.0)
        store_cache_values(row + offs, vals, scale_ptr, ok, QUANTIZE, INTERPRET)
