"""kernels/rope_kv_store.py (DEEPSERVE_FUSED_ROPE_KV_STORE): rope and the KV-cache store in one launch must
equal, bit for bit, the two unfused kernels it replaces: elementwise.apply_rope, then
triton_paged_attention.store_kv_cache of the rotated keys and the values (which tests/kernels/
test_elementwise.py and test_triton_paged_attention.py hold to their torch references). Covered: MHA and
GQA, a partial rotary dim, interleaved pairs, bf16 and fp32, an FP8 cache with scales, padding tokens
(negative slots: rotated, not stored) and an empty batch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, import_kernels

fused = import_kernels("deepserve.kernels.rope_kv_store")
ew = import_kernels("deepserve.kernels.elementwise")
tpa = import_kernels("deepserve.kernels.triton_paged_attention")

pytestmark = MARKS
FP8 = torch.float8_e4m3fn


def _inputs(tokens, heads, kv_heads, head_dim, rotary_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype) * 3
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, heads, head_dim)  # strided views of one projection, as the model has
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, head_dim)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=g).to(DEVICE)
    return positions, q, k, v, cos_sin


def _both(positions, q, k, v, cos_sin, rotary_dim, interleaved, cache_dtype, slots, scales):
    """(q, k, cache) from the unfused pair of kernels and from the fused one, from the same empty cache."""
    blocks, block_size = 4, 8
    shape = (2, blocks, block_size, k.shape[1], k.shape[2])
    want_cache = torch.zeros(shape, device=DEVICE).to(cache_dtype)
    got_cache = want_cache.clone()
    want_q, want_k = ew.apply_rope(positions, q, k, cos_sin, rotary_dim, interleaved)
    tpa.store_kv_cache(want_k, v, want_cache, slots, *scales)
    got_q, got_k = fused.rope_and_store_kv(positions, q, k, v, cos_sin, rotary_dim, interleaved, got_cache, slots,
                                           *scales)
    return (want_q, want_k, want_cache), (got_q, got_k, got_cache)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8 else torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 4, 16, 16), (4, 2, 80, 64), (6, 2, 24, 8)])
@pytest.mark.parametrize("cache", ["model", "fp8"])
def test_fused_rope_and_store_equal_the_two_kernels(dtype, interleaved, heads, kv_heads, head_dim, rotary_dim, cache):
    tokens = 5
    positions, q, k, v, cos_sin = _inputs(tokens, heads, kv_heads, head_dim, rotary_dim, dtype)
    slots = torch.tensor([3, -1, 17, 8, 31], dtype=torch.int64, device=DEVICE)  # token 1 is padding
    if cache == "fp8":
        cache_dtype = FP8
        scales = (torch.tensor(0.5, device=DEVICE), torch.tensor(2.0, device=DEVICE))
    else:
        cache_dtype, scales = dtype, (None, None)
    want, got = _both(positions, q, k, v, cos_sin, rotary_dim, interleaved, cache_dtype, slots, scales)
    for w, g in zip(want, got, strict=True):
        assert w.dtype == g.dtype and _equal(w, g)
    stored = got[2].flatten(1, 2)  # [2, slots, Hkv, D]
    assert stored[:, slots[slots >= 0]].float().abs().sum() > 0  # the live tokens were written
    assert not torch.equal(got[1], k)  # and the keys did rotate


def test_an_empty_batch_and_a_bad_shape():
    positions, q, k, v, cos_sin = _inputs(0, 4, 2, 16, 16, torch.bfloat16)
    cache = torch.zeros(2, 2, 8, 2, 16, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q_out, k_out = fused.rope_and_store_kv(positions, q, k, v, cos_sin, 16, False, cache, slots)
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)
    with pytest.raises(ValueError, match="kv_cache"):
        fused.rope_and_store_kv(positions, q, k, v, cos_sin, 16, False, cache[0], slots)


@pytest.mark.parametrize("cache", ["model", "fp8"])
def test_fused_rope_and_store_against_the_torch_references(cache):
    # The layers' own CPU path (layers/rotary.py's torch rope, store_kv_cache_ref): rope within bf16
    # rounding (the kernels' fp32 arithmetic may differ in the last bit), the cache then holds those keys.
    from deepserve.layers.rotary import _apply_rope

    dtype, rotary_dim = torch.bfloat16, 64
    positions, q, k, v, cos_sin = _inputs(4, 4, 2, 80, rotary_dim, dtype, seed=5)
    slots = torch.tensor([0, 9, -1, 30], dtype=torch.int64, device=DEVICE)
    cache_dtype = FP8 if cache == "fp8" else dtype
    scales = (torch.tensor(0.25, device=DEVICE), torch.tensor(3.0, device=DEVICE)) if cache == "fp8" else (None, None)
    got_cache = torch.zeros(2, 4, 8, 2, 80, device=DEVICE).to(cache_dtype)
    got_q, got_k = fused.rope_and_store_kv(positions, q, k, v, cos_sin, rotary_dim, False, got_cache, slots, *scales)
    want_q, want_k = _apply_rope.__wrapped__(positions, q, k, cos_sin, rotary_dim, False)
    torch.testing.assert_close(got_q, want_q, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got_k, want_k, atol=2e-2, rtol=1e-2)
    want_cache = torch.zeros_like(got_cache)
    tpa.store_kv_cache_ref(got_k, v, want_cache, slots, *(s if s is not None else 1.0 for s in scales))
    assert _equal(got_cache, want_cache)  # the stored rows: exactly the reference's store of those keys


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cache", ["model", "fp8"])
def test_mla_rope_and_store_equal_the_four_kernels(dtype, interleaved, cache):
    # An MLA layer's q_pe / k_pe rotation and latent store in one launch against apply_rope, the cat and
    # store_mla_cache (the unfused path of layers/mla.py), bit for bit; q_pe and k_pe strided views of their
    # projections as the model has them, a padding token, an FP8 cache with its one scale.
    tokens, heads, nope, rope, rank = 5, 3, 16, 8, 24
    positions, _, _, _, cos_sin = _inputs(tokens, 1, 1, rope, rope, dtype, seed=3)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(tokens, heads, nope + rope, generator=g) * 3).to(DEVICE, dtype)
    kv = (torch.randn(tokens, rank + rope, generator=g) * 3).to(DEVICE, dtype)
    q_pe, kv_c, k_pe = q[..., nope:], kv[:, :rank].contiguous(), kv[:, rank:]  # kv_c: the norm's new tensor
    slots = torch.tensor([3, -1, 17, 8, 31], dtype=torch.int64, device=DEVICE)
    cache_dtype = FP8 if cache == "fp8" else dtype
    scale = torch.tensor(0.5, device=DEVICE) if cache == "fp8" else None
    want_cache = torch.zeros(4, 8, rank + rope, device=DEVICE).to(cache_dtype)
    got_cache = want_cache.clone()
    want_q, want_k = ew.apply_rope(positions, q_pe, k_pe[:, None], cos_sin, rope, interleaved)
    tpa.store_mla_cache(torch.cat([kv_c, want_k[:, 0]], dim=-1), want_cache, slots, scale)
    got_q, got_k = fused.mla_rope_and_store(positions, q_pe, k_pe, kv_c, cos_sin, interleaved, got_cache, slots, scale)
    assert _equal(got_q, want_q) and _equal(got_k, want_k[:, 0]) and _equal(got_cache, want_cache)
    live = got_cache.flatten(0, 1)[slots[slots >= 0]]
    assert live[:, :rank].float().abs().sum() > 0 and live[:, rank:].float().abs().sum() > 0  # both parts written
    assert got_cache.flatten(0, 1).float().abs().sum(-1).count_nonzero() == 4  # the padding token stored nothing
    assert not torch.equal(got_k, k_pe)  # the key did rotate
    # and against the torch references (layers/rotary.py's rotation, store_mla_cache_ref's store): the rotation
    # to rounding (torch rounds in its own order), the latent part of each entry exactly
    from deepserve.layers.rotary import _apply_rope

    ref_q, ref_k = _apply_rope(positions, q_pe, k_pe[:, None], cos_sin, rope, interleaved)
    ref_cache = torch.zeros_like(want_cache)
    tpa.store_mla_cache_ref(torch.cat([kv_c, got_k], dim=-1), ref_cache, slots, 1.0 if scale is None else scale)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_q.float(), ref_q.float(), **tol)
    torch.testing.assert_close(got_k.float(), ref_k[:, 0].float(), **tol)
    assert _equal(got_cache, ref_cache)  # the same rotated key and latent, stored (and quantized) alike


def test_mla_rope_and_store_refuses_a_bad_shape():
    positions, _, _, _, cos_sin = _inputs(2, 1, 1, 8, 8, torch.bfloat16)
    q_pe = torch.zeros(2, 3, 8, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, 8, 24 + 8, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="mla_rope_and_store"):  # the cache's entry is not R + P wide
        fused.mla_rope_and_store(positions, q_pe, q_pe[:, 0], torch.zeros(2, 16, dtype=torch.bfloat16, device=DEVICE),
                                 cos_sin, False, cache, slots)
    with pytest.raises(ValueError, match="kv_scale"):
        fused.mla_rope_and_store(positions, q_pe, q_pe[:, 0], torch.zeros(2, 24, dtype=torch.bfloat16, device=DEVICE),
                                 cos_sin, False, cache.to(FP8), slots)
