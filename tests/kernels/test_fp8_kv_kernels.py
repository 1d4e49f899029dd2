"""FP8 KV caches (float8_e4m3fn, per-layer scales) in the Triton stores and decode kernels against the torch
references, and the references' own contract: stored value / scale saturated to ±448, read fp8 * scale.

The scales are deliberately not 1 (keys 0.05, values 3.0, latents 0.2): a kernel that ignored one, or
applied it on the wrong side, would be off by that factor. The interpreter's fp32 -> e4m3 cast rounds
wrongly, so there the store rounds first (kernels/fp8.py's helper); the bytes must equal torch's cast."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.kernels.test_triton_paged_attention import TOLERANCE, make_decode, make_mla, rel_err
from tests.kernels.triton_setup import DEVICE, MARKS, import_kernels

tpa = import_kernels("deepserve.kernels.triton_paged_attention")

from deepserve.kernels.mla_attention import mla_attention_ref, store_latent_ref  # noqa: E402
from deepserve.kernels.paged_attention import (  # noqa: E402
    PagedLayout,
    dequantize_kv,
    paged_attention_ref,
    quantize_kv,
    store_kv_ref,
)

pytestmark = MARKS
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE, LATENT_SCALE = 0.05, 3.0, 0.2


def scale(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=DEVICE)


def to_fp8(cache: torch.Tensor, value: float) -> torch.Tensor:
    return quantize_kv(cache, value, FP8)  # NaN poison stays NaN (e4m3fn has NaN)


def test_quantize_saturates_and_reads_back_within_e4m3_precision():
    x = torch.tensor([0.0, 1.0, -1.0, 0.3, 1000.0, -1000.0, 448.0 * 2, 17.3])
    q = quantize_kv(x, 2.0, FP8)  # stored: x / 2, saturated to ±448
    back = dequantize_kv(q, 2.0, torch.float32)
    assert back[4] == 896.0 and back[5] == -896.0 and back[6] == 896.0  # saturated, not inf / NaN
    finite = torch.tensor([0, 1, 2, 3, 7])
    assert ((back[finite] - x[finite]).abs() <= x[finite].abs() / 16).all()  # 3 mantissa bits: <= half an ulp
    assert quantize_kv(x, 2.0, torch.bfloat16).dtype == torch.bfloat16  # other caches: a cast, scale unused
    assert torch.equal(dequantize_kv(x, 5.0, torch.float32), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache_fp8_bytes_equal_the_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, kv_heads, dim, num_blocks, block_size = 9, 3, 64, 6, 16
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=FP8, device=DEVICE)
    key = (torch.randn(tokens, kv_heads, dim, generator=gen) * 4).to(DEVICE, dtype)
    value = (torch.randn(tokens, kv_heads, dim, generator=gen) * 4).to(DEVICE, dtype)
    key[0, 0, :4] = torch.tensor([100.0, -100.0, 0.0123, 22.4])  # saturates (100 / 0.05), a subnormal, a tie
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1
    slots = slots.to(DEVICE)
    expected = cache.clone()
    tpa.store_kv_cache_ref(key, value, expected, slots, K_SCALE, V_SCALE)
    tpa.store_kv_cache(key, value, cache, slots, scale(K_SCALE), scale(V_SCALE))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    # the engine's reference store writes the same bytes (it has no padding slots)
    keep = slots >= 0
    engine = torch.zeros_like(cache)
    store_kv_ref(key[keep], value[keep], engine, slots[keep], scale(K_SCALE), scale(V_SCALE))
    assert torch.equal(engine.view(torch.uint8), expected.view(torch.uint8))


def test_store_mla_cache_fp8_bytes_equal_the_reference():
    gen = torch.Generator().manual_seed(1)
    tokens, rank, rope, num_blocks, block_size = 11, 64, 32, 4, 16
    cache = torch.zeros(num_blocks, block_size, rank + rope, dtype=FP8, device=DEVICE)
    latent = (torch.randn(tokens, rank + rope, generator=gen) * 10).to(DEVICE, torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[0] = -1
    slots = slots.to(DEVICE)
    expected = cache.clone()
    tpa.store_mla_cache_ref(latent, expected, slots, LATENT_SCALE)
    tpa.store_mla_cache(latent, cache, slots, scale(LATENT_SCALE))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    engine = torch.zeros_like(cache)
    store_latent_ref(latent[1:, :rank], latent[1:, rank:], engine, slots[1:], scale(LATENT_SCALE))
    assert torch.equal(engine.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("heads,kv_heads,dtype,num_splits", [
    (2, 2, torch.float32, 1),  # MHA
    (8, 2, torch.bfloat16, None),  # GQA
    (7, 1, torch.bfloat16, 3),  # MQA, split-K with a merge
])
def test_decode_fp8_matches_reference(heads, kv_heads, dtype, num_splits):
    query, kv_cache, table, seq_lens, lens = make_decode(6, heads, kv_heads, 64, 16, 70, dtype, seed=heads)
    kv8 = torch.stack([to_fp8(kv_cache[0].float(), K_SCALE), to_fp8(kv_cache[1].float(), V_SCALE)])
    sm_scale = 64 ** -0.5
    out = torch.full_like(query, float("nan"))
    tpa.paged_decode_attention(query, kv8, table, seq_lens, sm_scale, out=out, max_seq_len=max(lens),
                               num_splits=num_splits, k_scale=scale(K_SCALE), v_scale=scale(V_SCALE))
    ref = tpa.paged_decode_attention_ref(query, kv8, table, seq_lens, sm_scale, K_SCALE, V_SCALE)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert (out[[b for b, n in enumerate(lens) if n == 0]] == 0).all()
    # the reference read fp8 * scale: the same as a float32 cache holding those values
    deq = torch.stack([dequantize_kv(kv8[0], K_SCALE, torch.float32), dequantize_kv(kv8[1], V_SCALE, torch.float32)])
    assert rel_err(ref, tpa.paged_decode_attention_ref(query.float(), deq, table, seq_lens, sm_scale)) < 1e-2


MLA_FP8_TILES = {"values reloaded": {"reload_values": True}, "one load": {"reload_values": False},
                 "64-key tiles, one load": {"block_n": 64, "num_warps": 8, "reload_values": False}}


def test_fp8_mla_tiles_by_batch():
    # the reload from 5 sequences on, and for more than 16 heads; 64-key one-load tiles at 1-4 of <= 16 heads
    assert tpa.default_mla_config(16, True).reload_values and tpa.default_mla_config(128, True, 1).reload_values
    small = tpa.default_mla_config(16, True, tpa.FP8_MLA_SMALL_BATCH)
    assert (small.block_n, small.num_warps, small.reload_values) == (64, 8, False)
    assert tpa.default_mla_config(16, True, tpa.FP8_MLA_SMALL_BATCH + 1).reload_values
    assert not tpa.default_mla_config(16, False, 1).reload_values  # a bf16 cache's tiles are unchanged


@pytest.mark.parametrize("batch", [tpa.FP8_MLA_SMALL_BATCH, tpa.FP8_MLA_SMALL_BATCH + 1])
def test_the_decode_wrapper_picks_fp8_mla_tiles_by_its_batch(batch, monkeypatch):
    # paged_mla_decode_attention asks default_mla_config with the batch it launches (a CUDA graph's padded
    # batch), so eager steps and graph replays of one batch size take the same tiles
    asked = []
    original = tpa.default_mla_config
    monkeypatch.setattr(tpa, "default_mla_config", lambda *args: asked.append(args) or original(*args))
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(batch, 16, 64, 32, 16, 40, torch.bfloat16, seed=9)
    cache8 = to_fp8(cache.float(), LATENT_SCALE)
    out = tpa.paged_mla_decode_attention(q_latent, q_rope, cache8, table, seq_lens, 0.1, max(lens),
                                         kv_scale=scale(LATENT_SCALE))
    assert asked == [(16, True, batch)]
    ref = tpa.paged_mla_decode_attention_ref(q_latent, q_rope, cache8, table, seq_lens, 0.1, LATENT_SCALE)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("heads,dtype,num_splits", [(16, torch.float32, None), (16, torch.bfloat16, 2),
                                                     (20, torch.bfloat16, 3)])
@pytest.mark.parametrize("tiles", MLA_FP8_TILES)
def test_mla_decode_fp8_matches_reference(heads, dtype, num_splits, tiles):
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(5, heads, 64, 32, 16, 60, dtype, seed=heads)
    cache8 = to_fp8(cache.float(), LATENT_SCALE)
    sm_scale = (128 + 32) ** -0.5
    out = torch.full_like(q_latent, float("nan"))
    tpa.paged_mla_decode_attention(q_latent, q_rope, cache8, table, seq_lens, sm_scale, max(lens), out=out,
                                   num_splits=num_splits, kv_scale=scale(LATENT_SCALE),
                                   config=replace(tpa.default_mla_config(heads, kv_fp8=True), **MLA_FP8_TILES[tiles]))
    ref = tpa.paged_mla_decode_attention_ref(q_latent, q_rope, cache8, table, seq_lens, sm_scale, LATENT_SCALE)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert (out[[b for b, n in enumerate(lens) if n == 0]] == 0).all()


def test_engine_references_read_fp8_as_the_dequantized_cache():
    # Sequences with a cached prefix (2 and 3 new tokens over 40 and 21): what they read from an FP8 cache
    # is exactly the float32 cache of its dequantized values; a fresh one (5 of 5) reads this step's keys.
    query, kv_cache, table, _, _ = make_decode(0, 4, 2, 64, 16, 0, torch.float32, seed=8, lens=[40, 21, 5])
    kv_cache = kv_cache.nan_to_num(0.0)
    kv8 = torch.stack([to_fp8(kv_cache[0], K_SCALE), to_fp8(kv_cache[1], V_SCALE)])
    deq = torch.stack([dequantize_kv(kv8[0], K_SCALE, torch.float32), dequantize_kv(kv8[1], V_SCALE, torch.float32)])
    num_new = [2, 3, 5]
    layout = PagedLayout(table, 16, [0, 2, 5, 10], [40, 21, 5])
    q = torch.randn(sum(num_new), 4, 64, device=DEVICE)  # make_decode's tensors are on DEVICE
    k, v = torch.randn(sum(num_new), 2, 64, device=DEVICE), torch.randn(sum(num_new), 2, 64, device=DEVICE)
    got = paged_attention_ref(q, k, v, kv8, layout, 0.125, k_scale=scale(K_SCALE), v_scale=scale(V_SCALE))
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, deq, layout, 0.125), rtol=0, atol=0)
    latent = torch.randn(8, 16, 48, device=DEVICE)
    latent8 = to_fp8(latent, LATENT_SCALE)
    q_lat, q_pe = torch.randn(10, 4, 32, device=DEVICE), torch.randn(10, 4, 16, device=DEVICE)
    got = mla_attention_ref(q_lat, q_pe, latent8, layout, 0.2, scale(LATENT_SCALE))
    want = mla_attention_ref(q_lat, q_pe, dequantize_kv(latent8, LATENT_SCALE, torch.float32), layout, 0.2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp8_cache_without_its_scales_is_refused():
    query, kv_cache, table, seq_lens, _ = make_decode(2, 4, 2, 64, 16, 20, torch.float32, seed=0)
    kv8 = kv_cache.nan_to_num(0.0).to(FP8)
    with pytest.raises(ValueError, match="scales"):
        tpa.paged_decode_attention(query, kv8, table, seq_lens, 1.0)
    with pytest.raises(ValueError, match="scales"):
        tpa.store_kv_cache(query[:, :2], query[:, :2], kv8, torch.zeros(2, dtype=torch.int64), scale(1.0), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        tpa.paged_decode_attention(query, kv8.to(torch.float16), table, seq_lens, 1.0)


def test_fp16_widening_saturates_queries_past_fp16_range():
    # The FP8 defaults run the dots in fp16: a query element beyond fp16's range is saturated, not inf,
    # so the output stays finite (the reference, in fp32, is only a sanity bound here).
    query, kv_cache, table, seq_lens, lens = make_decode(3, 4, 2, 64, 16, 40, torch.bfloat16, seed=7)
    query[:, :, 0] = 1e5
    kv8 = torch.stack([to_fp8(kv_cache[0].float(), K_SCALE), to_fp8(kv_cache[1].float(), V_SCALE)])
    out = tpa.paged_decode_attention(query, kv8, table, seq_lens, 64 ** -0.5, max_seq_len=max(lens),
                                     k_scale=scale(K_SCALE), v_scale=scale(V_SCALE))
    assert torch.isfinite(out).all()
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(3, 16, 64, 32, 16, 40, torch.bfloat16, seed=8)
    q_latent[:, :, 0] = -1e5
    out = tpa.paged_mla_decode_attention(q_latent, q_rope, to_fp8(cache.float(), LATENT_SCALE), table, seq_lens,
                                         0.1, max(lens), kv_scale=scale(LATENT_SCALE))
    assert torch.isfinite(out).all()
