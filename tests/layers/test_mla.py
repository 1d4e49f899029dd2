"""The latent MLA front against a dense, fully expanded reference written out here: fresh prompts
(expanded form), continuations over a paged cache (absorbed form below EXPAND_MIN_NEW_TOKENS new
tokens, expanded over the gathered history from it), both in one step, decode."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import deepserve.layers.mla as mla_module
from deepserve.forward_context import AttentionMetadata, forward_context
from deepserve.kernels.mla_attention import gather_latent, store_latent_ref
from deepserve.layers.mla import MLAAttention

H, C, DN, DR, DV = 4, 16, 8, 4, 12
SCALE = 0.3


def dense_mla(q_nope, q_pe, c, k_pe, wkv_b, num_cached: int) -> torch.Tensor:
    """One sequence: queries at positions num_cached.., keys c/k_pe at 0..L-1, everything expanded."""
    w = wkv_b.view(H, DN + DV, C)
    k_nope = torch.einsum("lc,hdc->lhd", c, w[:, :DN])  # [L, H, Dn]
    v = torch.einsum("lc,hdc->lhd", c, w[:, DN:])  # [L, H, Dv]
    scores = torch.einsum("nhd,lhd->hnl", q_nope, k_nope) + torch.einsum("nhr,lr->hnl", q_pe, k_pe)
    n, length = q_nope.shape[0], c.shape[0]
    mask = torch.ones(n, length, dtype=torch.bool).tril(num_cached)
    probs = (scores * SCALE).masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).flatten(1)  # [n, H * Dv]


def make_meta(seqs: list[tuple[int, int]], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """seqs: (tokens cached before, new tokens) per sequence."""
    starts, slots = [0], []
    for (cached, new), table in zip(seqs, tables, strict=True):
        starts.append(starts[-1] + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    width = max(len(t) for t in tables)
    seq_lens = [cached + new for cached, new in seqs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size, max_seq_len=max(seq_lens), query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
    )


CASES = {
    "fresh-prompts": [(0, 5), (0, 1), (0, 17)],
    "continuations": [(9, 4), (3, 1), (16, 16)],
    "mixed": [(0, 6), (11, 1), (5, 7), (0, 1)],
    "decode": [(20, 1), (1, 1), (33, 1)],
}


@pytest.mark.parametrize("expand_from", [mla_module.EXPAND_MIN_NEW_TOKENS, 2], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_front_matches_dense_expanded_attention(case, block_size, expand_from, monkeypatch):
    # Several new tokens over a cache take the absorbed form below EXPAND_MIN_NEW_TOKENS, the expanded
    # form over the gathered history from it: both must equal dense attention.
    monkeypatch.setattr(mla_module, "EXPAND_MIN_NEW_TOKENS", expand_from)
    check_front(CASES[case], block_size)


@pytest.mark.parametrize("seqs", [[(9, 4), (16, 16), (0, 5)], [(7, 9)]], ids=["fresh-and-over-cache", "over-cache"])
def test_prompt_chunks_attend_on_flash(seqs, monkeypatch):
    # Prompts, and prompt chunks over a cache long enough for the expanded form, must reach SDPA's
    # flash kernel: only flash is allowed here (CPU flash), so a call that would fall back to the math
    # path raises instead. The absorbed form (576-wide keys, 512-wide values) cannot; every chunk over
    # a cache once took it.
    monkeypatch.setattr(mla_module, "EXPAND_MIN_NEW_TOKENS", 4)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        check_front(seqs, 4)


def test_default_threshold_sends_long_chunks_to_flash():
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        check_front([(40, mla_module.EXPAND_MIN_NEW_TOKENS), (0, 3)], 16)


def check_front(seqs: list[tuple[int, int]], block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    mla = MLAAttention(H, C, DN, DR, DV, SCALE)
    mla.wkv_b.weight.data = torch.randn(H * (DN + DV), C, generator=gen) * 0.3
    lengths = [cached + new for cached, new in seqs]
    # Scatter every sequence over shuffled blocks, so paging is really exercised.
    free = torch.randperm(64, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    mla.kv_cache = torch.zeros(mla.kv_cache_spec(torch.float32).shape(64, block_size))
    data = [(torch.randn(n, H, DN, generator=gen), torch.randn(n, H, DR, generator=gen),
             torch.randn(n, C, generator=gen), torch.randn(n, DR, generator=gen)) for n in lengths]
    # What earlier steps would have stored.
    for (cached, _), table, (_, _, c, k_pe) in zip(seqs, tables, data, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(cached)])
        store_latent_ref(c[:cached], k_pe[:cached], mla.kv_cache, slots.long())
    new = [tuple(t[cached:] for t in d) for (cached, _), d in zip(seqs, data, strict=True)]
    inputs = [torch.cat([n[i] for n in new]) for i in range(4)]
    with forward_context(make_meta(seqs, tables, block_size)):
        out = mla(*inputs)
    want = [dense_mla(q_nope[cached:], q_pe[cached:], c, k_pe, mla.wkv_b.weight, cached)
            for (cached, _), (q_nope, q_pe, c, k_pe) in zip(seqs, data, strict=True)]
    torch.testing.assert_close(out, torch.cat(want), atol=1e-5, rtol=1e-5)
    # The cache now holds every token's latent and rope key, in position order.
    for table, n, (_, _, c, k_pe) in zip(tables, lengths, data, strict=True):
        entries = gather_latent(mla.kv_cache, torch.tensor(table), n, block_size)
        torch.testing.assert_close(entries, torch.cat([c, k_pe], dim=-1))


def test_cache_has_no_head_axis():
    mla = MLAAttention(128, 512, 128, 64, 128, 0.1)
    assert mla.kv_cache_spec(torch.bfloat16).shape(10, 16) == (10, 16, 576)
    assert mla.kv_cache_spec(torch.bfloat16).bytes_per_token == 576 * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_front_on_gpu_matches_cpu():
    seqs, block_size = CASES["mixed"], 4
    torch.manual_seed(0)
    mla = MLAAttention(H, C, DN, DR, DV, SCALE)
    mla.wkv_b.weight.data.normal_(0, 0.3)
    tables = [[i * 8 + j for j in range(-(-(a + b) // block_size))] for i, (a, b) in enumerate(seqs)]
    num_new = sum(b for _, b in seqs)
    inputs = [torch.randn(num_new, H, DN), torch.randn(num_new, H, DR), torch.randn(num_new, C),
              torch.randn(num_new, DR)]
    cache = torch.randn(mla.kv_cache_spec(torch.float32).shape(64, block_size))
    outs = []
    for device in ("cpu", "cuda"):
        mla.to(device)
        mla.kv_cache = cache.clone().to(device)
        meta = make_meta(seqs, tables, block_size)
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(meta, name, getattr(meta, name).to(device))
        with forward_context(meta):
            outs.append(mla(*[t.to(device) for t in inputs]).cpu())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
