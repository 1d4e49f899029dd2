"""Triton decode attention and cache stores against their torch references.

Two modes. With CUDA every test runs on the GPU (marked `gpu`) over the full shape grid. Without CUDA
the kernels run on CPU under the Triton interpreter over a small grid (the interpreter runs each program
in Python, so the whole CPU file stays under a minute). To run the interpreter mode on a GPU machine:
`CUDA_VISIBLE_DEVICES= pytest tests/kernels/test_triton_paged_attention.py`.

Inputs are adversarial where the contract allows: cache rows past seq_len and blocks no sequence owns
hold NaN (a masked-load mistake shows up as NaN), outputs start as NaN (a missing store shows up),
rows with seq_len 0 stand for CUDA-graph padding and must come back as zeros. The split-K tests also
start the split partials as NaN (the merge must not read what an empty split never wrote) and check
which splits got keys: the device-side split layout, which only speed would otherwise reveal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

tpa = import_kernels("deepserve.kernels.triton_paged_attention")

from deepserve.forward_context import AttentionMetadata  # noqa: E402
from deepserve.kernels.mla_attention import mla_attention_ref  # noqa: E402
from deepserve.kernels.paged_attention import paged_attention_ref  # noqa: E402

pytestmark = MARKS
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel output (an unwritten row or a masked load that was not)"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def seq_lens_for(batch: int, block_size: int, max_len: int, gen: torch.Generator) -> list[int]:
    # Cycle through the edge cases: 1, exact block multiples, one past a block, padding (0), the longest.
    pattern = [max_len, 1, block_size, 2 * block_size + 1, 0, 3 * block_size, None]
    lens = []
    for i in range(batch):
        n = pattern[i % len(pattern)]
        lens.append(int(torch.randint(1, max_len + 1, (1,), generator=gen)) if n is None else min(n, max_len))
    return lens


def paged_layout(lens: list[int], block_size: int, gen: torch.Generator, spare: int = 3
                 ) -> tuple[torch.Tensor, int, list[list[int]]]:
    # -> block_tables [B, max_blocks] int32 (distinct shuffled blocks, rows padded with 0), num_blocks, owned
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    owned, table = [], torch.zeros(len(lens), max(max(need), 1), dtype=torch.int32)
    for b, k in enumerate(need):
        owned.append(perm[:k])
        perm = perm[k:]
        table[b, :k] = torch.tensor(owned[b], dtype=torch.int32)
    return table.to(DEVICE), num_blocks, owned


def poison_unused(cache: torch.Tensor, lens: list[int], owned: list[list[int]], block_size: int) -> None:
    # cache [num_blocks, block_size, ...]: NaN everywhere a correct kernel never reads.
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for n, blocks in zip(lens, owned, strict=True):
        for i, blk in enumerate(blocks):
            keep[blk, : min(block_size, n - i * block_size)] = True
    cache[~keep.to(cache.device)] = float("nan")


def make_decode(batch: int, heads: int, kv_heads: int, dim: int, block_size: int, max_len: int,
                dtype: torch.dtype, seed: int, lens: list[int] | None = None) -> tuple:
    # lens: explicit sequence lengths (then batch and max_len are ignored), else the edge-case cycle.
    gen = torch.Generator().manual_seed(seed)
    lens = lens if lens is not None else seq_lens_for(batch, block_size, max_len, gen)
    table, num_blocks, owned = paged_layout(lens, block_size, gen)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    for half in kv_cache:
        poison_unused(half, lens, owned, block_size)
    query = torch.randn(len(lens), heads, dim, generator=gen).to(DEVICE, dtype)
    return query, kv_cache, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE), lens


def check_decode(query, kv_cache, table, seq_lens, lens, **kwargs) -> None:
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))
    tpa.paged_decode_attention(query, kv_cache, table, seq_lens, scale, out=out, **kwargs)
    ref = tpa.paged_decode_attention_ref(query, kv_cache, table, seq_lens, scale)
    assert rel_err(out, ref) < TOLERANCE[query.dtype]
    padding = [b for b, n in enumerate(lens) if n == 0]
    assert (out[padding] == 0).all(), "rows with seq_len 0 must be zeros"


if ON_GPU:
    DECODE_CASES = [
        (batch, kv * group, kv, dim, bs, 300, dtype)
        for batch in (1, 7, 33) for group, kv in ((1, 4), (4, 2), (7, 4)) for dim in (64, 128) for bs in (16, 32)
        for dtype in (torch.float32, torch.bfloat16)
    ] + [(2, 32, 32, 128, 16, 2100, torch.bfloat16), (3, 28, 4, 128, 16, 2100, torch.float16)]
else:
    DECODE_CASES = [
        (1, 2, 2, 64, 16, 40, torch.float32),
        (3, 4, 1, 64, 32, 70, torch.float32),
        (5, 7, 1, 128, 16, 100, torch.bfloat16),
        (7, 8, 2, 64, 16, 50, torch.bfloat16),
        (4, 3, 3, 128, 32, 80, torch.bfloat16),
        (33, 4, 1, 64, 16, 33, torch.float32),
        (2, 7, 1, 64, 32, 60, torch.float16),
        (9, 14, 2, 128, 32, 130, torch.bfloat16),
    ]


@pytest.mark.parametrize("batch,heads,kv_heads,dim,block_size,max_len,dtype", DECODE_CASES)
def test_decode_matches_reference(batch, heads, kv_heads, dim, block_size, max_len, dtype):
    query, kv_cache, table, seq_lens, lens = make_decode(batch, heads, kv_heads, dim, block_size, max_len,
                                                         dtype, seed=batch * 1000 + heads * 10 + dim)
    check_decode(query, kv_cache, table, seq_lens, lens, max_seq_len=max(lens))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_split_counts(num_splits, group, nan_partials):
    # 1: no merge. 3: a masked lse vector in the merge (BLOCK_S 64); rows of <= 2 tiles leave split 2 empty.
    query, kv_cache, table, seq_lens, lens = make_decode(5, 2 * group, 2, 64, 16, 70, torch.float32, seed=7)
    check_decode(query, kv_cache, table, seq_lens, lens, max_seq_len=70, num_splits=num_splits)


def test_merge_variant_does_not_follow_the_split_count(monkeypatch):
    # An eager step's S follows its longest sequence; the decode graphs compiled the merge at start-up with
    # the graph bound's S. The launch's constexprs must not depend on S (BLOCK_S is MAX_SPLITS's), or each
    # new S compiles a variant inside a timed run. The outputs stay right at every S (check_decode). S itself
    # is also kept out of Triton's integer specialization (do_not_specialize): the interpreter cannot show
    # that, the sm_90 compile of the GPU run does.
    launches = []
    real = tpa._merge_splits_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({k: v for k, v in kwargs.items() if k.isupper()})
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(tpa, "_merge_splits_kernel", Recorder())
    query, kv_cache, table, seq_lens, lens = make_decode(3, 4, 2, 64, 16, 200, torch.float32, seed=11)
    for splits in (2, 3, 5, 13):
        check_decode(query, kv_cache, table, seq_lens, lens, max_seq_len=200, num_splits=splits)
    assert len(launches) == 4 and all(constexprs == launches[0] for constexprs in launches)
    assert launches[0]["BLOCK_S"] == tpa.MERGE_BLOCK_S


def test_decode_wrong_length_bound_is_still_correct():
    # max_seq_len only sizes S; the kernel cuts each sequence by its own length, so a stale bound costs
    # speed only.
    query, kv_cache, table, seq_lens, lens = make_decode(3, 4, 2, 64, 16, 90, torch.float32, seed=3)
    check_decode(query, kv_cache, table, seq_lens, lens, max_seq_len=20)
    check_decode(query, kv_cache, table, seq_lens, lens)  # default bound: block_tables width * block_size


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("config", [
    tpa.LaunchConfig(block_n=32, block_h=1, num_warps=4, num_stages=2),  # MHA without tl.dot
    tpa.LaunchConfig(block_n=64, block_h=1, num_warps=4, num_stages=2),
    tpa.LaunchConfig(block_n=128, block_h=16, num_warps=8, num_stages=3),
], ids=["fma-n32", "fma-n64", "dot-n128"])
def test_decode_alternative_configs(config, num_splits):
    # The launch variants bench/check_kernels.py times next to the defaults must be correct too.
    query, kv_cache, table, seq_lens, lens = make_decode(5, 4, 4, 64, 16, 150, torch.bfloat16, seed=5)
    check_decode(query, kv_cache, table, seq_lens, lens, config=config, num_splits=num_splits)


def test_split_count_heuristic():
    # Host side of the split plan: what must hold however the constants get tuned.
    graph, gqa, mla = 4096, tpa.GQA_TARGET_PROGRAMS, tpa.MLA_TARGET_PROGRAMS  # graph: the decode graphs' bound
    # B=256: no split, no merge, for DeepSeek-LLM-7B (32 kv heads), Qwen-7B (4) and V2-Lite (1 head tile).
    assert tpa.choose_num_splits(256 * 32, graph, gqa) == tpa.choose_num_splits(256 * 4, graph, gqa) == 1
    assert tpa.choose_num_splits(256, graph, mla) == 1
    assert tpa.choose_num_splits(32, graph, gqa) > 1  # DeepSeek-LLM-7B at B=1 splits
    assert tpa.choose_num_splits(1, graph, mla) == tpa.MAX_SPLITS  # V2-Lite at B=1
    assert tpa.choose_num_splits(4, 100) == 100 // tpa.MIN_TOKENS_PER_SPLIT  # short eager steps: capped
    assert tpa._num_splits(10, 70, 32, 9, gqa) == 3  # splits past cdiv(max_seq_len, tile) could only be empty
    assert tpa._num_splits(10, graph, 64, None, mla) == tpa.choose_num_splits(10, graph, mla)


# The CUDA-graph situation: grids planned for max_seq_len = max_model_len, sequences far shorter, padding
# rows (0) mixed in. Each row's own keys must be spread over the splits, the splits past them left empty.
GRAPH_BOUND = 4096
GRAPH_LENS = [1, 0, 17, 300, 1024]
INTERPRETER_SPLITS = 3  # the interpreter runs ~20 ms a program: a GPU-sized grid (264-528) takes 5-10 s


@pytest.fixture
def nan_partials(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    # Split partials start as NaN instead of torch.empty's leftovers: a partial output the merge reads
    # without a split having written it (empty splits write only their lse), or a missing lse, shows up.
    # -> the part_lse [B, H, S] of every split launch, for assert_split_layout.
    original, lses = tpa._partials, []

    def poisoned(batch: int, heads: int, splits: int, dim: int, out: torch.Tensor):
        part_out, part_lse = original(batch, heads, splits, dim, out)
        if splits > 1:
            part_out.fill_(float("nan"))
            part_lse.fill_(float("nan"))
            lses.append(part_lse)
        return part_out, part_lse

    monkeypatch.setattr(tpa, "_partials", poisoned)
    return lses


def assert_split_layout(part_lse: torch.Tensor, lens: list[int], block_n: int) -> None:
    # The device-side plan: row b's keys over its first cdiv(L_b, T_b) splits, T_b = cdiv(cdiv(L_b, S), N) * N,
    # whatever max_seq_len was; the rest have lse -inf. (A plan sized by max_seq_len = 4096 would leave a
    # 1024-key row in the first quarter of the splits: correct, but slow, so only this check sees it.)
    splits = part_lse.shape[-1]
    cdiv = lambda a, b: -(-a // b)
    for b, n in enumerate(lens):
        per_split = cdiv(cdiv(n, splits), block_n) * block_n
        live = cdiv(n, per_split) if n else 0
        expected = [True] * live + [False] * (splits - live)
        assert torch.isfinite(part_lse[b, 0]).tolist() == expected, f"row {b} (seq_len {n})"


def graph_splits(monkeypatch: pytest.MonkeyPatch, target: str, programs_per_split: int) -> int:
    # On CPU, shrink the occupancy target (GQA_ or MLA_TARGET_PROGRAMS) so the automatic split count is
    # INTERPRETER_SPLITS (still through choose_num_splits, as in the runner); on a GPU keep the real one.
    if not ON_GPU:
        monkeypatch.setattr(tpa, target, INTERPRETER_SPLITS * programs_per_split)
    splits = tpa.choose_num_splits(programs_per_split, GRAPH_BOUND, getattr(tpa, target))
    assert splits > 1
    return splits


@pytest.mark.parametrize("group", [1, 4, 7])
def test_decode_graph_bound_mixed_lengths(group, monkeypatch, nan_partials):
    query, kv_cache, table, seq_lens, lens = make_decode(0, group, 1, 64, 16, 0, torch.bfloat16, seed=group,
                                                         lens=GRAPH_LENS)
    graph_splits(monkeypatch, "GQA_TARGET_PROGRAMS", len(lens))
    check_decode(query, kv_cache, table, seq_lens, lens, max_seq_len=GRAPH_BOUND)
    assert_split_layout(nan_partials[0], lens, tpa.default_gqa_config(group, torch.bfloat16).block_n)


@pytest.mark.parametrize("num_splits", [8, 32, 64] if ON_GPU else [8, 64])  # CPU: ~20 ms a program
def test_decode_forced_splits_one_long_sequence(num_splits, nan_partials):
    # Batch 1, 1024 keys: fp32 tiles of 32 keys give up to 32 live splits (64: half of them empty); with
    # D 128 the merge takes 16 splits per chunk, so 32 and 64 splits run its chunk loop twice.
    query, kv_cache, table, seq_lens, lens = make_decode(0, 4, 1, 128, 16, 0, torch.float32, seed=num_splits,
                                                         lens=[1024])
    check_decode(query, kv_cache, table, seq_lens, lens, max_seq_len=GRAPH_BOUND, num_splits=num_splits)
    assert_split_layout(nan_partials[0], lens, tpa.default_gqa_config(4, torch.float32).block_n)


def test_decode_strided_query():
    # The query may be a view into a fused qkv projection: [B, H, D] with a larger batch stride.
    query, kv_cache, table, seq_lens, lens = make_decode(3, 4, 2, 64, 16, 40, torch.float32, seed=11)
    fused = torch.randn(3, 8, 64, device=DEVICE)
    fused[:, :4] = query
    check_decode(fused[:, :4], kv_cache, table, seq_lens, lens)


def make_mla(batch: int, heads: int, rank: int, rope: int, block_size: int, max_len: int, dtype: torch.dtype,
             seed: int, lens: list[int] | None = None) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    lens = lens if lens is not None else seq_lens_for(batch, block_size, max_len, gen)
    table, num_blocks, owned = paged_layout(lens, block_size, gen)
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(DEVICE, dtype)
    poison_unused(cache, lens, owned, block_size)
    q_latent = torch.randn(len(lens), heads, rank, generator=gen).to(DEVICE, dtype)
    q_rope = torch.randn(len(lens), heads, rope, generator=gen).to(DEVICE, dtype)
    return q_latent, q_rope, cache, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE), lens


if ON_GPU:
    MLA_CASES = [
        (batch, heads, 512, 64, bs, 300, dtype, splits)
        for batch in (1, 7, 33) for heads in (16, 40, 128) for bs in (16, 32)
        for dtype in (torch.float32, torch.bfloat16) for splits in (None, 1, 5)
    ]
else:
    MLA_CASES = [
        (1, 16, 64, 32, 16, 40, torch.float32, None),
        (5, 20, 64, 32, 32, 70, torch.float32, 3),
        (3, 16, 128, 64, 16, 50, torch.bfloat16, None),
        (7, 40, 64, 16, 16, 40, torch.bfloat16, 1),
        (2, 16, 512, 64, 16, 40, torch.bfloat16, None),  # the V2-Lite head shape
    ]


@pytest.mark.parametrize("batch,heads,rank,rope,block_size,max_len,dtype,num_splits", MLA_CASES)
def test_mla_decode_matches_reference(batch, heads, rank, rope, block_size, max_len, dtype, num_splits):
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(batch, heads, rank, rope, block_size, max_len,
                                                              dtype, seed=batch * 100 + heads)
    scale = (128 + rope) ** -0.5
    out = torch.full_like(q_latent, float("nan"))
    tpa.paged_mla_decode_attention(q_latent, q_rope, cache, table, seq_lens, scale, max(lens), out=out,
                                   num_splits=num_splits)
    ref = tpa.paged_mla_decode_attention_ref(q_latent, q_rope, cache, table, seq_lens, scale)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert (out[[b for b, n in enumerate(lens) if n == 0]] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_with_the_value_tile_reloaded_over_a_16_bit_or_fp32_cache(dtype):
    # reload_values is tuned for FP8 caches; on a cache of the queries' dtype it must still be exact
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(3, 16, 64, 32, 16, 50, dtype, seed=31)
    tiles = dataclasses.replace(tpa.default_mla_config(16), reload_values=True)
    check_mla(q_latent, q_rope, cache, table, seq_lens, lens, max_seq_len=max(lens), num_splits=2, config=tiles)


def check_mla(q_latent, q_rope, cache, table, seq_lens, lens, **kwargs) -> None:
    scale = (128 + q_rope.shape[-1]) ** -0.5
    out = torch.full_like(q_latent, float("nan"))
    tpa.paged_mla_decode_attention(q_latent, q_rope, cache, table, seq_lens, scale, out=out, **kwargs)
    ref = tpa.paged_mla_decode_attention_ref(q_latent, q_rope, cache, table, seq_lens, scale)
    assert rel_err(out, ref) < TOLERANCE[q_latent.dtype]
    assert (out[[b for b, n in enumerate(lens) if n == 0]] == 0).all(), "rows with seq_len 0 must be zeros"


def test_mla_graph_bound_mixed_lengths(monkeypatch, nan_partials):
    # Without the 1024-key row (the next test has a long row) and with 4 heads: the interpreter spends
    # ~25 ms per MLA tile and ~15 ms per merge program (one per sequence and head).
    lens = GRAPH_LENS[:-1]
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(0, 4, 64, 16, 16, 0, torch.bfloat16, seed=12,
                                                              lens=lens)
    graph_splits(monkeypatch, "MLA_TARGET_PROGRAMS", len(lens))
    check_mla(q_latent, q_rope, cache, table, seq_lens, lens, max_seq_len=GRAPH_BOUND)
    assert_split_layout(nan_partials[0], lens, tpa.default_mla_config(4).block_n)


def test_mla_forced_splits_one_long_sequence(nan_partials):
    # As the V2-Lite graph at batch 1 (64 splits of one 16-key tile for 1024 keys), at half the size for the
    # interpreter: 32 splits, 512 keys, all live, 4 heads. R 256 makes the merge take two feature tiles of
    # 128, each in 2 chunks of 16 splits.
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(0, 4, 256, 32, 16, 0, torch.float32, seed=64,
                                                              lens=[512])
    check_mla(q_latent, q_rope, cache, table, seq_lens, lens, max_seq_len=GRAPH_BOUND, num_splits=32)
    assert_split_layout(nan_partials[0], lens, tpa.default_mla_config(4).block_n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, kv_heads, dim, num_blocks, block_size = 9, 3, 64, 6, 16
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    fused = torch.randn(tokens, 2 * kv_heads + 4, dim, generator=gen).to(DEVICE, dtype)  # a qkv-like view
    key, value = fused[:, 4:4 + kv_heads], fused[:, 4 + kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 5]] = -1  # padding tokens write nothing
    slots = slots.to(DEVICE)
    expected = cache.clone()
    tpa.store_kv_cache_ref(key, value, expected, slots)
    tpa.store_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_store_mla_cache():
    gen = torch.Generator().manual_seed(1)
    tokens, width, num_blocks, block_size = 11, 96, 4, 16
    cache = torch.randn(num_blocks, block_size, width, generator=gen).to(DEVICE, torch.bfloat16)
    latent = torch.randn(tokens, width, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[0] = -1
    slots = slots.to(DEVICE)
    expected = cache.clone()
    tpa.store_mla_cache_ref(latent, expected, slots)
    tpa.store_mla_cache(latent, cache, slots)
    assert torch.equal(cache, expected)


def test_wrappers_reject_bad_layouts():
    query, kv_cache, table, seq_lens, _ = make_decode(2, 4, 2, 64, 16, 20, torch.float32, seed=0)
    with pytest.raises(ValueError, match="block_tables"):
        tpa.paged_decode_attention(query, kv_cache, table.long(), seq_lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        tpa.paged_decode_attention(query.half(), kv_cache, table, seq_lens, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        tpa.store_kv_cache(query[:, :2], query[:, :2], kv_cache, seq_lens)


def decode_meta(lens: list[int], table: torch.Tensor, block_size: int) -> AttentionMetadata:
    # One new token per sequence. The metadata grows fields while the runner evolves: pass the ones it has.
    fields = {f.name for f in dataclasses.fields(AttentionMetadata)}
    optional = {"max_seq_len": max(lens), "decode_only": True}
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64), query_start_loc=torch.arange(len(lens) + 1),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, block_size=block_size,
        query_start_loc_cpu=list(range(len(lens) + 1)), seq_lens_cpu=lens,
        **{name: value for name, value in optional.items() if name in fields},
    )


@pytest.mark.parametrize("group", [1, 4])
def test_decode_reference_matches_engine_reference(group):
    # The engine reference takes this step's key/value separately: they are the cache rows at seq_len - 1.
    query, kv_cache, table, seq_lens, lens = make_decode(6, 2 * group, 2, 64, 16, 50, torch.float32, seed=2)
    keep = [b for b, n in enumerate(lens) if n > 0]  # the engine never schedules an empty sequence
    query, table, seq_lens, lens = query[keep], table[keep], seq_lens[keep], [lens[b] for b in keep]
    key, value = (torch.stack([tpa._gather_rows(half, table[b], n)[-1] for b, n in enumerate(lens)])
                  for half in kv_cache)  # [B, Hkv, D] each
    ours = tpa.paged_decode_attention_ref(query, kv_cache, table, seq_lens, 0.125)
    theirs = paged_attention_ref(query, key, value, kv_cache, decode_meta(lens, table, 16).paged, 0.125)
    assert rel_err(ours, theirs) < 1e-5


def test_mla_reference_matches_engine_reference():
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(6, 4, 32, 16, 16, 50, torch.float32, seed=4)
    keep = [b for b, n in enumerate(lens) if n > 0]
    q_latent, q_rope, table = q_latent[keep], q_rope[keep], table[keep]
    seq_lens, lens = seq_lens[keep], [lens[b] for b in keep]
    ours = tpa.paged_mla_decode_attention_ref(q_latent, q_rope, cache, table, seq_lens, 0.2)
    theirs = mla_attention_ref(q_latent, q_rope, cache, decode_meta(lens, table, 16).paged, 0.2)
    assert rel_err(ours, theirs) < 1e-5


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
def test_decode_replays_in_a_cuda_graph():
    # Captured once with a fixed max_seq_len, replayed after the lengths and the cache change in place.
    query, kv_cache, table, seq_lens, lens = make_decode(4, 8, 2, 128, 16, 400, torch.bfloat16, seed=9)
    kv_cache.nan_to_num_(0.0)
    out = torch.empty_like(query)
    run = lambda: tpa.paged_decode_attention(query, kv_cache, table, seq_lens, 0.1, out=out, max_seq_len=400)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    seq_lens.copy_(torch.tensor([n // 2 for n in lens], dtype=torch.int32))
    kv_cache.normal_()
    graph.replay()
    ref = tpa.paged_decode_attention_ref(query, kv_cache, table, seq_lens, 0.1)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
def test_mla_decode_replays_in_a_cuda_graph():
    # Captured once for max_seq_len 4096 as the runner does, replayed as the lengths change in place: the
    # split layout is computed on the device from seq_lens at every replay.
    q_latent, q_rope, cache, table, seq_lens, lens = make_mla(0, 16, 512, 64, 16, 0, torch.bfloat16, seed=5,
                                                              lens=[1024, 0, 300, 17])
    cache.nan_to_num_(0.0)
    out = torch.empty_like(q_latent)
    run = lambda: tpa.paged_mla_decode_attention(q_latent, q_rope, cache, table, seq_lens, 0.1, 4096, out=out)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for new_lens in ([1, 0, 0, 17], [1000, 0, 299, 16]):  # within each row's blocks
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        ref = tpa.paged_mla_decode_attention_ref(q_latent, q_rope, cache, table, seq_lens, 0.1)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
