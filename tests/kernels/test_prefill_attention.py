"""Prefill attention (several new tokens per sequence) against an explicit softmax written here.

The per-sequence prefill paths (`paged_attention_ref` for MHA/GQA, `mla_prefill_ref` for MLA's
expanded form) run on the GPU too. They must hand SDPA inputs its fused kernels accept: inputs of the
wrong rank silently take the math path, which materializes every score (the prefill steps of the W1
runs in bench/RESULTS.md ran that way). So each case also runs with only the flash backend allowed
(it exists on CPU too): a call that would fall back to math raises "No available kernel" instead.

Cases: fresh prompts, prompts with a cached prefix (chunked prefill, prefix-cache hits; the queries
sit at the end of the keys), grouped key heads, one-token prompts, and MLA's value head smaller
than its key head.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepserve.forward_context import AttentionMetadata
from deepserve.kernels.mla_attention import mla_prefill_ref
from deepserve.kernels.paged_attention import paged_attention_ref, store_kv_ref

BLOCK = 4


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D], k [L, Hkv, D], v [L, Hkv, Dv]; query i at position L - n + i sees keys 0 ..= it."""
    n, length, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    positions = torch.arange(length - n, length).unsqueeze(1)  # [n, 1]
    scores = scores.masked_fill(torch.arange(length).unsqueeze(0) > positions, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def layout(new: list[int], cached: list[int], gen: torch.Generator) -> tuple[AttentionMetadata, int]:
    """Metadata for sequences with `new[b]` new tokens after `cached[b]` cached ones, blocks shuffled."""
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    need = [-(-n // BLOCK) for n in lens]
    perm = torch.randperm(sum(need) + 2, generator=gen).tolist()
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    slots = []
    for b, k in enumerate(need):
        table[b, :k] = torch.tensor(perm[:k], dtype=torch.int32)
        perm = perm[k:]
        slots += [int(table[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(cached[b], lens[b])]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, block_size=BLOCK,
        max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )
    return meta, sum(need) + 2


def run(fn, only_flash: bool):
    if not only_flash:
        return fn()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return fn()


@pytest.mark.parametrize("only_flash", [False, True], ids=["any-backend", "flash-only"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("cached", [[0, 0, 0], [5, 0, 9], [3, 8, 1]], ids=["fresh", "mixed", "all-cached"])
def test_paged_prefill_matches_explicit_softmax(heads, kv_heads, cached, only_flash):
    gen = torch.Generator().manual_seed(heads + sum(cached))
    new = [7, 1, 12]
    meta, num_blocks = layout(new, cached, gen)
    dim, scale = 16, 0.3
    # Every sequence's keys, cached ones first; the cache holds them all (this step's are stored first,
    # as the layer does), the step passes only the new ones. Unowned cache rows are NaN.
    keys = [torch.randn(c + n, kv_heads, dim, generator=gen) for c, n in zip(cached, new, strict=True)]
    values = [torch.randn(c + n, kv_heads, dim, generator=gen) for c, n in zip(cached, new, strict=True)]
    kv_cache = torch.full((2, num_blocks, BLOCK, kv_heads, dim), float("nan"))
    for b, c in enumerate(cached):
        prefix = layout_slots(meta, b, c)
        kv_cache[0].view(-1, kv_heads, dim)[prefix] = keys[b][:c]
        kv_cache[1].view(-1, kv_heads, dim)[prefix] = values[b][:c]
    step_k = torch.cat([k[c:] for k, c in zip(keys, cached, strict=True)])
    step_v = torch.cat([v[c:] for v, c in zip(values, cached, strict=True)])
    store_kv_ref(step_k, step_v, kv_cache, meta.slot_mapping)
    query = torch.randn(sum(new), heads, dim, generator=gen)

    out = run(lambda: paged_attention_ref(query, step_k, step_v, kv_cache, meta.paged, scale), only_flash)

    starts = meta.query_start_loc_cpu
    for b in range(len(new)):
        expected = explicit_attention(query[starts[b]:starts[b + 1]], keys[b], values[b], scale)
        torch.testing.assert_close(out[starts[b]:starts[b + 1]].double(), expected, atol=2e-5, rtol=2e-5)


def layout_slots(meta: AttentionMetadata, b: int, count: int) -> torch.Tensor:
    """Cache slots of sequence b's first `count` positions."""
    table = meta.block_tables[b]
    return torch.tensor([int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(count)], dtype=torch.int64)


@pytest.mark.parametrize("only_flash", [False, True], ids=["any-backend", "flash-only"])
@pytest.mark.parametrize("dk,dv", [(24, 16), (16, 16)])
def test_mla_expanded_prefill_matches_explicit_softmax(dk, dv, only_flash):
    gen = torch.Generator().manual_seed(dk + dv)
    new = [9, 1, 5]
    meta, _ = layout(new, [0, 0, 0], gen)
    heads, scale = 4, 0.25
    q = torch.randn(sum(new), heads, dk, generator=gen)
    k = torch.randn(sum(new), heads, dk, generator=gen)
    v = torch.randn(sum(new), heads, dv, generator=gen)

    out = run(lambda: mla_prefill_ref(q, k, v, meta.query_start_loc, meta.query_start_loc_cpu, scale), only_flash)

    assert out.shape == (sum(new), heads, dv)
    starts = meta.query_start_loc_cpu
    for b in range(len(new)):
        rows = slice(starts[b], starts[b + 1])
        torch.testing.assert_close(out[rows].double(), explicit_attention(q[rows], k[rows], v[rows], scale),
                                   atol=2e-5, rtol=2e-5)


def test_bf16_prefill_runs_on_flash():
    # The dtype the GPU serves in; CPU flash takes bf16 too (looser tolerance: bf16 inputs).
    gen = torch.Generator().manual_seed(0)
    meta, num_blocks = layout([6, 3], [0, 4], gen)
    kv_cache = torch.randn(2, num_blocks, BLOCK, 2, 16, generator=gen).bfloat16()
    query = torch.randn(9, 8, 16, generator=gen).bfloat16()
    step_k = torch.randn(9, 2, 16, generator=gen).bfloat16()
    step_v = torch.randn(9, 2, 16, generator=gen).bfloat16()
    store_kv_ref(step_k, step_v, kv_cache, meta.slot_mapping)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        flash = paged_attention_ref(query, step_k, step_v, kv_cache, meta.paged, 0.25)
    with sdpa_kernel([SDPBackend.MATH]):
        math = paged_attention_ref(query, step_k, step_v, kv_cache, meta.paged, 0.25)
    torch.testing.assert_close(flash.float(), math.float(), atol=2e-2, rtol=2e-2)


def test_lower_right_bias_holds_no_storage():
    # torch's causal_lower_right(n, L) allocates an uninitialized [2, n, L] fp32 host tensor per call;
    # ours is the same bias without it (a context of 2**20 keys would want 64 GiB there).
    from torch.nn.attention.bias import CausalVariant

    from deepserve.kernels.paged_attention import lower_right_causal

    bias = lower_right_causal(8192, 2**20)
    assert bias.untyped_storage().nbytes() == 0
    assert (bias.variant, bias.seq_len_q, bias.seq_len_kv) == (CausalVariant.LOWER_RIGHT, 8192, 2**20)
