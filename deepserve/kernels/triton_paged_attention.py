"""Triton decode attention over the paged caches, with the torch references the tests compare against.

MHA/GQA cache (layout of kernels/paged_attention.py): kv_cache [2, num_blocks, block_size, Hkv, D].
Latent MLA cache (layout of kernels/mla_attention.py): latent_cache [num_blocks, block_size, R + P],
the first R values the compressed kv c_kv, the last P the roped key k_pe.
Token p of a sequence lives in block block_table[p // block_size], row p % block_size.

Decode = one query token per sequence, at position seq_len - 1, seeing keys 0 .. seq_len - 1.
Every wrapper is CUDA-graph safe: no host sync, launch shapes depend only on tensor shapes and on the
Python int `max_seq_len`. Rows with seq_len == 0 (graph padding) read no cache and produce zeros.

Split-K: the host picks the split count S from occupancy (GQA_/MLA_TARGET_PROGRAMS), capped by
max_seq_len / MIN_TOKENS_PER_SPLIT; the kernel cuts each sequence by its own length, on the device:
split s of sequence b covers [s * T_b, (s + 1) * T_b) clipped to seq_len_b, with
T_b = cdiv(cdiv(seq_len_b, S), N) * N (a whole number of tiles). A CUDA graph captured with
max_seq_len = max_model_len therefore still spreads a short sequence over all its splits instead of
leaving most of them idle, and correctness never depends on max_seq_len (it only sizes S).
Every program writes its log2-sum-exp; a split that got no key (past seq_len_b, or seq_len_b == 0)
writes lse -inf and no partial output. `_merge_splits_kernel` weighs the partial outputs by
2^(lse - max lse), stops after the last split with keys and drops (selects away, never multiplies) the
unwritten output of any split with lse -inf, so torch.empty partials are safe and a row whose splits
are all empty merges to zeros, never NaN.

FP8 caches (float8_e4m3fn, --kv-cache-dtype fp8): the stores write value / scale saturated to ±448; the
decode kernels widen each loaded tile to the query's dtype (exact: every e4m3 value is a bf16 value),
fold the key scale into the score scale and apply the value scale to the output, once per program. The
switch is a constexpr (KV_FP8 / QUANTIZE) and the scale pointers are None otherwise, which Triton turns
into constexprs too: a bf16 cache compiles to the same code as before FP8 caches existed (its PTX was
compared launch for launch on sm_90).

Shapes: B sequences, H query heads, Hkv kv heads, G = H / Hkv, D head_dim, R kv_lora_rank,
P qk_rope_head_dim, S splits, N tokens per tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepserve import envs
from deepserve.kernels import pdl
from deepserve.kernels.fp8 import _round_to_e4m3  # the interpreter's fp32 -> e4m3 rounding, corrected
from deepserve.kernels.fp8_ref import FP8
from deepserve.kernels.paged_attention import KVScale, dequantize_kv, quantize_kv

# Triton decides at decoration, when the module is imported; a launch must not reread the environment.
INTERPRET = envs.TRITON_INTERPRET

LOG2E = 1.4426950408889634
# Split-K heuristic for the H200 (132 SMs), tuned with CUDA-graph replays (bench/check_kernels.py).
NUM_SMS = 132
# Programs (CTAs) a decode launch aims for; split-K makes up what batch x heads lacks. One CTA (4 warps,
# <= 2 tiles of loads in flight) cannot keep an SM's share of HBM busy. Measured on the H200 (graph
# replays, B = 1 .. 128 at 1,024 and 4,096 keys, max_seq_len 4,096): GQA/MHA programs (80-96 registers)
# do best at about 4 per SM, e.g. DeepSeek-LLM-7B B=4 L=4096 71 us against 87 us at 2 per SM, and
# nothing got slower; MLA programs are wider (145 registers, a 16 x 512 fp32 accumulator, partials 4x
# the bytes) and do best at about 2 per SM (V2-Lite B=16 L=1024 21 us, 24 us at 4 per SM).
GQA_TARGET_PROGRAMS = 4 * NUM_SMS
MLA_TARGET_PROGRAMS = 2 * NUM_SMS
# default_mla_config over an FP8 cache: up to this many sequences (of <= 16 heads) the 64-key one-load tiles,
# whose splits hold few tiles each; from the next batch on the reload (H200 figures in default_mla_config).
FP8_MLA_SMALL_BATCH = 4
# Host cap on S: S <= max_seq_len / MIN_TOKENS_PER_SPLIT, so an eager step whose longest sequence is
# short does not launch splits that could only be empty. It binds only when max_seq_len is small: in a
# CUDA graph (max_seq_len = max_model_len) the occupancy target and MAX_SPLITS decide S.
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64  # keeps the merge's lse vector small
MERGE_BLOCK_S = triton.next_power_of_2(MAX_SPLITS)
# Merge tile: CHUNK_S splits x BLOCK_D features, MERGE_TILE fp32 values, 16 per thread at 4 warps: 16
# independent loads in flight per thread where a split-at-a-time loop has one.
MERGE_TILE = 2048
# The merge cuts the feature axis into more programs (down to MERGE_MIN_BLOCK_D wide) only while the
# (sequence, head) pairs alone stay under MERGE_TARGET_PROGRAMS: V2-Lite at B=1 gets 16 heads x 4
# programs; at B=16 (256 pairs) one 512-wide program per pair, as more programs there only add waves
# (H200, V3 B=16: 4 x 2048 programs of 128 features took 24 us, 2048 of 512 features 4 us).
MERGE_TARGET_PROGRAMS = 2 * NUM_SMS
MERGE_MIN_BLOCK_D = 128


@dataclass(frozen=True)
class LaunchConfig:
    """Per-program tile sizes and launch options of a decode kernel."""

    block_n: int  # keys per loop iteration (a tile may span several cache blocks)
    # Query rows per program. GQA: the group padded to >= 16 for tl.dot, or 1 for MHA through
    # broadcast-multiply-sum instead of tl.dot. MLA: the head tile.
    block_h: int
    num_warps: int
    num_stages: int
    # FP8 caches only: the dtype the codes widen to for the dots. "query": the query's (bf16); "fp16"
    # (the FP8 defaults): e4m3 -> fp16 is one conversion instruction per two values on sm_90 (bf16 is
    # not), with the queries (saturated to fp16's range) and the probabilities cast to fp16 too.
    fp8_widen: str = "query"
    # MLA only: load the value tile (the latent rows the key tile holds already) a second time, from L2.
    # Over an FP8 cache Triton 3.6 pipelines a tile through cp.async only when its one use is a dot; the
    # shared tile feeds two dots, so it is loaded synchronously each iteration (sm_90 SASS: 2 LDGSTS in
    # the kernel against 50 with the reload). A bf16 cache's tile pipelines either way.
    reload_values: bool = False


def default_gqa_config(group: int, dtype: torch.dtype, kv_fp8: bool = False) -> LaunchConfig:
    # tl.dot even for MHA (group 1 padded to 16 rows): on sm_90 Triton then pipelines the K/V tile loads
    # through shared memory (cp.async, one tile ahead); the block_h=1 FMA path loads into registers only.
    # ptxas sm_90, bf16, D 128: 80-96 registers, 38 KiB shared memory, no spills.
    block_h = max(16, triton.next_power_of_2(group))
    if dtype == torch.float32:  # tests only: fp32 tiles are twice the bytes
        return LaunchConfig(block_n=32, block_h=block_h, num_warps=4, num_stages=1)
    if kv_fp8:
        # Half the bytes a key: 128-key tiles, 3 stages, codes widened to fp16. H200 (check_kernels
        # --kv-dtype fp8, graph replays): LLM-7B B=256 L=2,048 1,782 us against 2,126 with the bf16 cache's
        # tiles widened to bf16 (and 1,907 for a bf16 cache); Qwen-7B 226 / 288 (bf16 cache 256).
        return LaunchConfig(block_n=128, block_h=block_h, num_warps=4, num_stages=3, fp8_widen="fp16")
    return LaunchConfig(block_n=64, block_h=block_h, num_warps=4, num_stages=2)


def default_mla_config(num_heads: int, kv_fp8: bool = False, batch: int | None = None) -> LaunchConfig:
    # The [block_h, R] fp32 accumulator is what limits the head tile: 32 x 512 needs 8 warps.
    # FP8 caches widen their codes to fp16 (H200, every case of check_kernels --kv-dtype fp8 faster than
    # widening to bf16: V2-Lite B=256 L=1,024 146 against 162 us) and load the value tile on its own
    # (reload_values; H200, 2026-12-03: V2-Lite B=256 L=1,024 123 against 147 us, V3 B=256 L=2,048 1,780
    # against 1,880 with 16-head tiles, the best of the tiles timed at every V3 shape of 64 and 256 sequences).
    # At 1-4 sequences of <= 16 heads (split-K programs of few tiles each) 64-key tiles of 8 warps with one
    # load were faster: V2-Lite 1 x 1,024 8.9 against 10.1 us, 1 x 4,096 11.3 against 14.9 (bf16 cache 8.1 /
    # 12.0), 4 x 1,024 10.5 against 11.8; not at 4 x 4,096 (19.2 against 18.8). Not timed for more heads.
    if kv_fp8 and num_heads <= 16 and batch is not None and batch <= FP8_MLA_SMALL_BATCH:
        return LaunchConfig(block_n=64, block_h=16, num_warps=8, num_stages=2, fp8_widen="fp16")
    if kv_fp8:
        return LaunchConfig(block_n=32, block_h=16, num_warps=4, num_stages=2, fp8_widen="fp16", reload_values=True)
    if num_heads <= 16:
        # 32-token tiles: measured faster than 16 in every V2-Lite case of bench/check_kernels.py on the
        # H200 (batch 1 to 256, 1k and 2k tokens; e.g. 114 vs 147 us at batch 256 x 1,024).
        return LaunchConfig(block_n=32, block_h=16, num_warps=4, num_stages=2)
    return LaunchConfig(block_n=16, block_h=32, num_warps=8, num_stages=2)  # 128 registers, 55 KiB


def _patch_interpreter_index() -> None:
    # Triton 3.6's interpreter holds scalars as 1-element arrays and its `tensor.__index__` calls int() on
    # them, which numpy >= 2.4 rejects, so `range(start, seq_len, N)` fails on CPU (triton-lang/triton#9171,
    # fixed upstream by #9172). Re-set __index__ the fixed way; compiled GPU kernels never reach this.
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_deepserve_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._deepserve_fixed = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _patch_interpreter_index()


@triton.jit
def _gqa_decode_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, num_heads,
    stride_qb, stride_qh, stride_kv, stride_blk, stride_tok, stride_head, stride_bt,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr, WIDEN_F16: tl.constexpr, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):
    # One program = (sequence b, kv head, split s); it serves the G query heads of the kv head, so each
    # K/V row is read once per group. BLOCK_G == 1 (MHA only) uses broadcast-multiply-sum; otherwise
    # tl.dot with the group padded to BLOCK_G >= 16 rows (the tensor-core minimum; pad rows are never stored).
    if PREFETCH:  # with PDL: the first tile's keys and values asked into L2 before the wait (_tile_lines)
        seq = tl.program_id(0).to(tl.int64)
        first, last = _split_range(tl.load(seq_lens_ptr + seq), tl.program_id(2), tl.num_programs(2), BLOCK_N)
        lines = _tile_lines(block_tables_ptr + seq * stride_bt, first + tl.arange(0, BLOCK_N), last,
                            tl.program_id(1) * stride_head, stride_blk, stride_tok, PAGE_SIZE, HEAD_DIM,
                            128 // (kv_ptr.dtype.element_ty.primitive_bitwidth // 8), PREFETCH)
        _prefetch_l2(kv_ptr + lines)  # keys
        _prefetch_l2(kv_ptr + stride_kv + lines)  # values
    pdl.wait(PDL)  # everything read here is written by earlier kernels (kernels/pdl.py)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    start, end = _split_range(tl.load(seq_lens_ptr + b), s, tl.num_programs(2), BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head = kvh * GROUP + offs_g  # [BLOCK_G] query heads of this group
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    if KV_FP8:  # scores of k = fp8 * k_scale: the scale joins the score scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if WIDEN_F16:  # saturated: a query past fp16's range (never seen) must not turn into inf / NaN
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_off = kvh * stride_head
    for tile in range(start, end, BLOCK_N):  # every tile holds >= 1 valid key, so m_i turns finite
        offs_n = tile + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        # Masked: past seq_len the block table may end, and rows with seq_len 0 read nothing.
        page = tl.load(block_tables_ptr + b * stride_bt + offs_n // PAGE_SIZE, mask=valid, other=0)
        row = page.to(tl.int64) * stride_blk + (offs_n % PAGE_SIZE) * stride_tok + head_off  # int64: big caches
        kv_offs = row[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv + kv_offs, mask=kv_mask, other=0.0)
        if KV_FP8:  # exact widening; the dots then run in the query's dtype as for a bf16 cache
            k = k.to(q.dtype)  # (fp16 when WIDEN_F16: q was cast above)
            v = v.to(q.dtype)
        if BLOCK_G == 1:
            scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        else:
            scores = _mma(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST)  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BLOCK_G == 1:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        else:
            pv = _mma(p.to(v.dtype), v, None, DOT_PRECISION, DOT_UPCAST)  # [BLOCK_G, BLOCK_D]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    pdl.trigger(PDL)  # after the loop: the merge's programs take no slot from a program with keys left
    if KV_FP8:  # v = fp8 * v_scale: the output (and each split's partial) is linear in v
        acc = acc * tl.load(v_scale_ptr)
    _store_result(acc, m_i, l_i, out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                  part_out_ptr + b * stride_pb + head[:, None] * stride_ph + s * stride_ps + offs_d[None, :],
                  part_lse_ptr + (b * num_heads + head) * tl.num_programs(2) + s,
                  g_mask[:, None] & d_mask[None, :], g_mask, SPLIT)


@triton.jit
def _tile_lines(table_row, offs_n, end, head_off, stride_blk, stride_tok, PAGE_SIZE: tl.constexpr,
                WIDTH: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr):
    """DEEPSERVE_PDL_KV_PREFETCH (kernels/pdl.py KV_PREFETCH), before the PDL wait: [BLOCK_N, LINES] offsets, one
    in each 128-byte line (LINE values) of the WIDTH values cached for the keys offs_n (< end; LINES: the lines
    rounded up to a power of two, _prefetch_lines), for _prefetch_l2,
    so the loop after the wait finds them in L2. A prefetch returns nothing to the kernel, so it cannot read a
    value early: the newest key, which the kernel before may still be writing, is read after the wait like every
    other. What this does read before the wait, seq_lens and the block table, the step wrote before its first
    kernel started (kernels/pdl.py)."""
    valid = offs_n < end
    # Keys past the end take block 0 (every cache has one): a harmless prefetch, no branch.
    page = tl.load(table_row + offs_n // PAGE_SIZE, mask=valid, other=0)
    row = page.to(tl.int64) * stride_blk + (offs_n % PAGE_SIZE) * stride_tok + head_off
    line_starts = tl.minimum(tl.arange(0, LINES) * LINE, WIDTH - 1)  # the power-of-two padding repeats the last
    return row[:, None] + line_starts[None, :]


@triton.jit
def _prefetch_l2(ptrs):
    # PTX prefetch.global.L2: the line at each address into L2; the dummy output only gives the asm a result.
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _mma(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:  # the interpreter multiplies bf16 as raw 16-bit integers: do it in fp32 there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _split_range(seq_len, s, num_splits, BLOCK_N: tl.constexpr):
    # Keys [start, end) of split s: the sequence's own length cut into num_splits ranges of whole tiles
    # (no tile straddles two splits). num_splits * per_split >= seq_len, so the splits cover every key
    # whatever the host's max_seq_len was; splits starting at or past seq_len get start >= end (empty).
    per_split = (seq_len + num_splits - 1) // num_splits
    per_split = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = s * per_split
    return start, tl.minimum(start + per_split, seq_len)


@triton.jit
def _store_result(acc, m_i, l_i, out_ptrs, part_out_ptrs, part_lse_ptrs, mask, row_mask, SPLIT: tl.constexpr):
    # A row that saw no key (empty split, seq_len 0) has l_i == 0: output 0, lse -inf, never NaN.
    # Split partials: the lse is always written; the output only where the split saw a key (the merge
    # drops the output of a split whose lse is -inf), so empty splits cost one small store.
    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT:
        tl.store(part_out_ptrs, o, mask=mask & has_keys[:, None])
        tl.store(part_lse_ptrs, tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf")),
                 mask=row_mask)
    else:
        tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits, num_heads, stride_ob, stride_oh,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, PDL: tl.constexpr = False,
):
    # One program = (sequence, head, BLOCK_D features): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
    # part_out [B, H, S, DIM] fp32 contiguous, part_lse [B, H, S] fp32 contiguous. The partials are summed
    # as [CHUNK_S, BLOCK_D] tiles (CHUNK_S independent loads per feature in flight), reduced over the split
    # axis once at the end.
    pdl.trigger(PDL)  # a small kernel: the next one may start now (kernels/pdl.py)
    pdl.wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    lse_row = part_lse_ptr + (b * num_heads + h) * num_splits
    out_rows = part_out_ptr + (b * num_heads + h) * num_splits * DIM
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < DIM
    offs_c = tl.arange(0, CHUNK_S)
    # The first chunk is loaded before anything waits on the lse vector, so its loads overlap that one.
    lse_c, o = _load_partials(lse_row, out_rows, offs_c, num_splits, offs_d, d_mask, DIM)
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): weights 0, output 0
    total = tl.sum(tl.exp2(lse - m), axis=0)  # 2^-inf = 0 for the empty splits
    acc = _weigh(lse_c, o, m)
    if BLOCK_S > CHUNK_S:
        # Chunks past the last split with keys are not visited. (Split s has keys iff s * T_b < seq_len_b,
        # so those with keys are a prefix, but nothing here relies on it.)
        num_live = tl.max(tl.where(lse > float("-inf"), offs_s + 1, 0), axis=0)
        for chunk in range(CHUNK_S, num_live, CHUNK_S):
            lse_c, o = _load_partials(lse_row, out_rows, chunk + offs_c, num_live, offs_d, d_mask, DIM)
            acc += _weigh(lse_c, o, m)
    out = tl.sum(acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _load_partials(lse_row, out_rows, offs_c, count, offs_d, d_mask, DIM: tl.constexpr):
    # -> lse [CHUNK_S] and outputs [CHUNK_S, BLOCK_D] of the splits offs_c below count (others: -inf, 0).
    # An empty split's output was never written: what is loaded for it is garbage, dropped by _weigh.
    valid = offs_c < count
    lse = tl.load(lse_row + offs_c, mask=valid, other=float("-inf"))
    o = tl.load(out_rows + offs_c[:, None] * DIM + offs_d[None, :], mask=valid[:, None] & d_mask[None, :],
                other=0.0)
    return lse, o


@triton.jit
def _weigh(lse, o, m):
    # 2^(lse - m) * o per split; a split with weight 0 (lse -inf: empty) is selected away, not multiplied,
    # as its output may be NaN garbage and 0 * NaN = NaN.
    w = tl.exp2(lse - m)[:, None]
    return tl.where(w > 0, w * o, 0.0)


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    kv_scale_ptr, qk_scale, num_heads,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_blk, stride_tok, stride_bt,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr, WIDEN_F16: tl.constexpr,
    RELOAD_VALUES: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    # One program = (head tile, sequence b, split s). The head tile is grid axis 0, so the programs
    # sharing a sequence run side by side and the latent rows they all read come from L2.
    if PREFETCH:  # with PDL: the first tile's latent rows asked into L2 before the wait (_tile_lines)
        seq = tl.program_id(1).to(tl.int64)
        first, last = _split_range(tl.load(seq_lens_ptr + seq), tl.program_id(2), tl.num_programs(2), BLOCK_N)
        _prefetch_l2(cache_ptr + _tile_lines(block_tables_ptr + seq * stride_bt, first + tl.arange(0, BLOCK_N), last,
                                             0, stride_blk, stride_tok, PAGE_SIZE, RANK + ROPE,
                                             128 // (cache_ptr.dtype.element_ty.primitive_bitwidth // 8), PREFETCH))
    pdl.wait(PDL)  # everything read here is written by earlier kernels (kernels/pdl.py)
    ht = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    start, end = _split_range(tl.load(seq_lens_ptr + b), s, tl.num_programs(2), BLOCK_N)

    head = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = head < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask, p_mask = offs_r < RANK, offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + b * stride_qlb + head[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(q_rope_ptr + b * stride_qrb + head[:, None] * stride_qrh + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_P]

    if KV_FP8:  # one scale for the whole entry: the keys' (c_kv and k_pe) joins the score scale
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    if WIDEN_F16:  # saturated: a query past fp16's range (never seen) must not turn into inf / NaN
        q_lat = tl.clamp(q_lat.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        q_pe = tl.clamp(q_pe.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        page = tl.load(block_tables_ptr + b * stride_bt + offs_n // PAGE_SIZE, mask=valid, other=0)
        row = page.to(tl.int64) * stride_blk + (offs_n % PAGE_SIZE) * stride_tok  # [BLOCK_N]
        c_kv = tl.load(cache_ptr + row[:, None] + offs_r[None, :],
                       mask=valid[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]: key and value
        k_pe = tl.load(cache_ptr + row[:, None] + RANK + offs_p[None, :],
                       mask=valid[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_P]
        if KV_FP8:  # exact widening to the queries' dtype (fp16 when WIDEN_F16)
            c_kv = c_kv.to(q_lat.dtype)
            k_pe = k_pe.to(q_lat.dtype)
        v_kv = c_kv  # the values are the keys' first RANK columns
        if RELOAD_VALUES:  # a second load of the same rows (from L2), feeding only the value dot; the
            # cache modifier keeps it a load of its own (identical loads are merged into one)
            v_kv = tl.load(cache_ptr + row[:, None] + offs_r[None, :], mask=valid[:, None] & r_mask[None, :],
                           other=0.0, cache_modifier=".cg").to(c_kv.dtype)
        scores = _mma(q_lat, tl.trans(c_kv), None, DOT_PRECISION, DOT_UPCAST)
        scores = _mma(q_pe, tl.trans(k_pe), scores, DOT_PRECISION, DOT_UPCAST)  # [BLOCK_H, BLOCK_N]
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _mma(p.to(v_kv.dtype), v_kv, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    pdl.trigger(PDL)  # after the loop: the merge's programs take no slot from a program with keys left
    if KV_FP8:  # the values (v_kv, the latent's first RANK columns) carry the same scale
        acc = acc * tl.load(kv_scale_ptr)
    _store_result(acc, m_i, l_i, out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_r[None, :],
                  part_out_ptr + b * stride_pb + head[:, None] * stride_ph + s * stride_ps + offs_r[None, :],
                  part_lse_ptr + (b * num_heads + head) * tl.num_programs(2) + s,
                  h_mask[:, None] & r_mask[None, :], h_mask, SPLIT)


@triton.jit
def _store_rows_kernel(
    src_ptr, cache_ptr, slot_ptr, scale_ptr, stride_src_t, stride_src_h, stride_blk, stride_tok, stride_head,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANTIZE: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    # One program = (token t, head h): copy WIDTH contiguous values to the token's slot; slot < 0 skips.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, BLOCK)
    # The slot test is broadcast to a block-shaped tensor before the &: newer Triton interpreters reject
    # a mask made from a scalar comparison.
    mask = (offs < WIDTH) & (tl.full([BLOCK], 0, tl.int64) + slot >= 0)
    vals = tl.load(src_ptr + t * stride_src_t + h * stride_src_h + offs, mask=mask)
    dst = (slot // PAGE_SIZE) * stride_blk + (slot % PAGE_SIZE) * stride_tok + h * stride_head
    store_cache_values(cache_ptr + dst + offs, vals, scale_ptr, mask, QUANTIZE, ROUND_IN_FP32)


@triton.jit
def store_cache_values(ptrs, vals, scale_ptr, mask, QUANTIZE: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """vals into a KV cache at ptrs (also kernels/rope_kv_store.py's store). QUANTIZE (an FP8 cache): value /
    scale saturated to e4m3's ±448; the cast rounds to nearest even. ROUND_IN_FP32: interpreter only, its own
    cast rounds wrongly (kernels/fp8.py)."""
    if QUANTIZE:
        x = vals.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        if ROUND_IN_FP32:
            x = _round_to_e4m3(x)
        vals = x
    tl.store(ptrs, vals.to(ptrs.dtype.element_ty), mask=mask)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_paged(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int) -> None:
    _require(block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == batch,
             "block_tables must be int32 [B, max_blocks]")
    _require(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    _require(seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,) and seq_lens.is_contiguous(),
             "seq_lens must be contiguous int32 [B]")


def _check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _require(out.shape == query.shape and out.is_contiguous() and out.dtype == query.dtype,
             "out must be contiguous, of the query's shape and dtype")
    return out


def _kv_scales(cache: torch.Tensor, *scales: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """What the kernels get for the scales: an FP8 cache's, checked; for any other cache None each, which
    Triton makes a constexpr, so that launch compiles to the kernel it was before FP8 caches."""
    if cache.dtype != FP8:
        return (None,) * len(scales)
    for scale in scales:
        _require(isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.numel() == 1
                 and scale.device == cache.device,
                 "an FP8 kv cache needs its scales: one-element float32 tensors on the cache's device")
    return scales


def _widen_f16(cfg: LaunchConfig, cache: torch.Tensor, query_dtype: torch.dtype) -> bool:
    # fp32 queries (tests) keep their precision: the fp16 dots are for 16-bit queries only.
    _require(cfg.fp8_widen in ("query", "fp16"), "config.fp8_widen must be 'query' or 'fp16'")
    return cache.dtype == FP8 and cfg.fp8_widen == "fp16" and query_dtype != torch.float32


def _dot_options(dtype: torch.dtype) -> dict[str, object]:
    # fp32 inputs: "ieee", not the tf32 default, so fp32 matches the reference to 1e-5.
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                DOT_UPCAST=dtype == torch.bfloat16 and INTERPRET)


def choose_num_splits(programs_per_split: int, max_seq_len: int, target_programs: int | None = None) -> int:
    """Splits per sequence: enough programs for target_programs (GQA_TARGET_PROGRAMS when None, or
    MLA_TARGET_PROGRAMS), at most max_seq_len / MIN_TOKENS_PER_SPLIT.

    programs_per_split = B * Hkv (GQA) or B * head tiles (MLA). The kernel spreads each sequence's own
    keys over all S splits, so S need not shrink for sequences shorter than max_seq_len."""
    by_occupancy = max(1, (target_programs or GQA_TARGET_PROGRAMS) // max(programs_per_split, 1))
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return min(by_occupancy, by_length, MAX_SPLITS)


def _num_splits(programs_per_split: int, max_seq_len: int, block_n: int, num_splits: int | None,
                target_programs: int) -> int:
    # A split with a key holds >= 1 whole tile, so a sequence within the bound fills at most
    # cdiv(max_seq_len, block_n) splits: the others could only be empty, drop them (also for an override).
    # A bound that is too small still gives correct results, as the kernel covers seq_len with any S.
    splits = num_splits or choose_num_splits(programs_per_split, max_seq_len, target_programs)
    return max(1, min(splits, triton.cdiv(max_seq_len, block_n)))


def _partials(batch: int, heads: int, splits: int, dim: int, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # part_out [B, H, S, dim] fp32, part_lse [B, H, S] fp32. Every program writes its lse, and its output
    # where the lse is finite; the merge drops the others' outputs unread or unused: torch.empty is safe.
    # Without a split the kernel writes `out` directly and never touches these: `out` stands in for both.
    if splits == 1:
        return out, out
    return (torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=out.device),
            torch.empty(batch, heads, splits, dtype=torch.float32, device=out.device))


def _merge(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    batch, heads, splits, dim = part_out.shape
    on = pdl.wanted(out, batch)
    block_d = triton.next_power_of_2(dim)
    while block_d > MERGE_MIN_BLOCK_D and batch * heads * triton.cdiv(dim, block_d // 2) <= MERGE_TARGET_PROGRAMS:
        block_d //= 2
    # BLOCK_S is MAX_SPLITS's, not this launch's S, and S is not specialized on: the variant depends on the
    # model and the batch (block_d) alone, so an eager step whose S follows its longest sequence reuses the
    # variants the decode graphs compiled at start-up instead of compiling one inside a timed run. The
    # unused lanes cost a masked load of MAX_SPLITS lse values per program; chunks past the live splits
    # are never visited. (An explicit num_splits above MAX_SPLITS, bench/tests only, gets its own.)
    block_s = max(MERGE_BLOCK_S, triton.next_power_of_2(splits))
    _merge_splits_kernel[(batch, heads, triton.cdiv(dim, block_d))](
        part_out, part_lse, out, splits, heads, out.stride(0), out.stride(1),
        DIM=dim, BLOCK_D=block_d, BLOCK_S=block_s, CHUNK_S=max(1, min(block_s, MERGE_TILE // block_d)),
        PDL=on, num_warps=4, **pdl.launch_options(on),
    )


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D], contiguous
    max_seq_len: int | None = None,  # host-side bound on seq_lens, used only to pick the split count
    *,
    num_splits: int | None = None,  # override of choose_num_splits
    config: LaunchConfig | None = None,  # override of default_gqa_config
    k_scale: torch.Tensor | None = None,  # an FP8 cache's scales: float32, one value each
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, H, D]
    """Decode attention: each sequence's one query (at position seq_len - 1) over its seq_len cached
    keys. Writes every element of `out`; rows with seq_len 0 get zeros."""
    batch, heads, dim = query.shape
    _, _, page, kv_heads, kv_dim = kv_cache.shape
    _require(kv_dim == dim and heads % kv_heads == 0, "query [B, H, D] must match kv_cache heads / head_dim")
    _require(kv_cache.dtype in (query.dtype, FP8), "kv_cache must have the query's dtype or be float8_e4m3fn")
    k_scale, v_scale = _kv_scales(kv_cache, k_scale, v_scale)
    _require(query.stride(-1) == 1 and kv_cache.stride(-1) == 1, "head_dim must be the contiguous axis")
    _check_paged(block_tables, seq_lens, batch)
    out = _check_out(out, query)
    group = heads // kv_heads
    cfg = config or default_gqa_config(group, query.dtype, kv_cache.dtype == FP8)
    _require(cfg.block_h == 1 and group == 1 or cfg.block_h >= max(16, group),
             "config.block_h must be 1 (MHA only) or >= max(16, group)")
    splits = _num_splits(batch * kv_heads, max_seq_len or block_tables.shape[1] * page, cfg.block_n, num_splits,
                         GQA_TARGET_PROGRAMS)
    part_out, part_lse = _partials(batch, heads, splits, dim, out)
    on = pdl.wanted(query, batch)
    _gqa_decode_kernel[(batch, kv_heads, splits)](
        query, kv_cache, block_tables, seq_lens, out, part_out, part_lse, k_scale, v_scale,
        scale * LOG2E, heads,
        query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        GROUP=group, BLOCK_G=cfg.block_h, HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_N=cfg.block_n, PAGE_SIZE=page, SPLIT=splits > 1, **_dot_options(query.dtype),
        KV_FP8=kv_cache.dtype == FP8, WIDEN_F16=_widen_f16(cfg, kv_cache, query.dtype), PDL=on,
        PREFETCH=_prefetch_lines(on, dim, kv_cache), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options(on),
    )
    if splits > 1:
        _merge(part_out, part_lse, out)
    return out


def _prefetch_lines(chained: bool, width: int, cache: torch.Tensor) -> int:
    """The kernels' PREFETCH: 0 (no prefetch), or, for a launch with programmatic dependence under
    DEEPSERVE_PDL_KV_PREFETCH, the 128-byte lines a key's `width` cached values span, rounded up to a power of two."""
    if not (chained and pdl.KV_PREFETCH):
        return 0
    return triton.next_power_of_2(triton.cdiv(width * cache.element_size(), 128))


def paged_mla_decode_attention(
    q_latent: torch.Tensor,  # [B, H, R]: q_nope with W_UK absorbed
    q_rope: torch.Tensor,  # [B, H, P]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    max_seq_len: int | None = None,  # host-side bound on seq_lens, used only to pick the split count
    out: torch.Tensor | None = None,  # [B, H, R], contiguous
    *,
    num_splits: int | None = None,
    config: LaunchConfig | None = None,  # override of default_mla_config
    kv_scale: torch.Tensor | None = None,  # an FP8 cache's scale (of whole entries): float32, one value
) -> torch.Tensor:  # [B, H, R]: attention-weighted latents (W_UV still to apply)
    """Absorbed MLA decode: score(h, t) = (q_latent[h]·c_kv[t] + q_rope[h]·k_pe[t]) * scale, output the
    softmax-weighted sum of c_kv. Writes every element of `out`; rows with seq_len 0 get zeros."""
    batch, heads, rank = q_latent.shape
    rope = q_rope.shape[2]
    _, page, width = latent_cache.shape
    _require(q_rope.shape[:2] == (batch, heads) and width == rank + rope, "latent_cache rows must be R + P wide")
    _require(q_latent.dtype == q_rope.dtype and latent_cache.dtype in (q_latent.dtype, FP8),
             "latent_cache must have the queries' dtype or be float8_e4m3fn")
    (kv_scale,) = _kv_scales(latent_cache, kv_scale)
    _require(q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1 and latent_cache.stride(-1) == 1,
             "the feature axis must be contiguous")
    _check_paged(block_tables, seq_lens, batch)
    out = _check_out(out, q_latent)
    cfg = config or default_mla_config(heads, latent_cache.dtype == FP8, batch)
    _require(cfg.block_h >= 16, "config.block_h must be >= 16 (tl.dot)")
    head_tiles = triton.cdiv(heads, cfg.block_h)
    splits = _num_splits(batch * head_tiles, max_seq_len or block_tables.shape[1] * page, cfg.block_n, num_splits,
                         MLA_TARGET_PROGRAMS)
    part_out, part_lse = _partials(batch, heads, splits, rank, out)
    on = pdl.wanted(q_latent, batch, mla_moe=True)
    _mla_decode_kernel[(head_tiles, batch, splits)](
        q_latent, q_rope, latent_cache, block_tables, seq_lens, out, part_out, part_lse, kv_scale,
        scale * LOG2E, heads,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        RANK=rank, BLOCK_R=triton.next_power_of_2(rank), ROPE=rope, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PAGE_SIZE=page, SPLIT=splits > 1,
        **_dot_options(q_latent.dtype), KV_FP8=latent_cache.dtype == FP8,
        WIDEN_F16=_widen_f16(cfg, latent_cache, q_latent.dtype), RELOAD_VALUES=cfg.reload_values, PDL=on,
        PREFETCH=_prefetch_lines(on, rank + rope, latent_cache), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_options(on),
    )
    if splits > 1:
        _merge(part_out, part_lse, out)
    return out


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """key, value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T] int64
    (block * block_size + offset); tokens with a negative slot (padding) are skipped. An FP8 cache
    stores key / k_scale and value / v_scale (float32 one-element tensors), saturated to ±448."""
    _require(key.shape == value.shape and key.shape[1:] == kv_cache.shape[3:], "key/value must be [T, Hkv, D]")
    _require(key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1,
             "head_dim must be the contiguous axis")
    for which, (src, scale) in enumerate(zip((key, value), _kv_scales(kv_cache, k_scale, v_scale), strict=True)):
        _store_rows(src, kv_cache[which], slot_mapping, scale)


def store_mla_cache(latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scale: torch.Tensor | None = None) -> None:
    """latent [T, R + P] (c_kv then k_pe) into latent_cache [num_blocks, block_size, R + P] at slot_mapping
    [T] int64; tokens with a negative slot (padding) are skipped. An FP8 cache stores latent / kv_scale."""
    _require(latent.dim() == 2 and latent.shape[1] == latent_cache.shape[2], "latent must be [T, R + P]")
    _require(latent.stride(-1) == 1 and latent_cache.stride(-1) == 1, "the feature axis must be contiguous")
    (kv_scale,) = _kv_scales(latent_cache, kv_scale)
    _store_rows(latent[:, None], latent_cache[:, :, None], slot_mapping, kv_scale)


def _store_rows(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: torch.Tensor | None
                ) -> None:
    # src [T, heads, W]; cache [num_blocks, block_size, heads, W] (a view of one K/V half or the latent cache);
    # scale: an FP8 cache's (checked by _kv_scales), else None
    tokens, heads, width = src.shape
    _require(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (tokens,) and slot_mapping.is_contiguous(),
             "slot_mapping must be contiguous int64 [T]")
    if tokens == 0:  # shape-only branch: an empty grid is not launchable
        return
    quantize = cache.dtype == FP8
    _store_rows_kernel[(tokens, heads)](
        src, cache, slot_mapping, scale, src.stride(0), src.stride(1), cache.stride(0), cache.stride(1),
        cache.stride(2), WIDTH=width, BLOCK=triton.next_power_of_2(width), PAGE_SIZE=cache.shape[1],
        QUANTIZE=quantize, ROUND_IN_FP32=quantize and INTERPRET, num_warps=4,
    )


# --- torch references: plain gathers and an fp32 softmax; tests and bench/check_kernels.py compare to them ---

def _gather_rows(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    # cache [num_blocks, block_size, ...] -> the sequence's first seq_len rows [seq_len, ...]
    num_blocks = math.ceil(seq_len / cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [H, D], k [L, H, D], v [L, H, D] -> [H, D], all fp32
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, v)


def paged_decode_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, k_scale: KVScale = 1.0,
                               v_scale: KVScale = 1.0) -> torch.Tensor:
    # query [B, H, D] -> [B, H, D]; rows with seq_len 0 are zeros; the scales count for an FP8 cache only
    out = torch.zeros_like(query)
    group = query.shape[1] // kv_cache.shape[3]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = dequantize_kv(_gather_rows(kv_cache[0], block_tables[b], seq_len), k_scale, torch.float32)
        v = dequantize_kv(_gather_rows(kv_cache[1], block_tables[b], seq_len), v_scale, torch.float32)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out[b] = _softmax_attend(query[b].float(), k, v, scale).to(query.dtype)
    return out


def paged_mla_decode_attention_ref(q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
                                   block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                   kv_scale: KVScale = 1.0) -> torch.Tensor:
    # q_latent [B, H, R], q_rope [B, H, P] -> [B, H, R]; every head attends to the same latent rows
    out = torch.zeros_like(q_latent)
    rank = q_latent.shape[2]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        rows = dequantize_kv(_gather_rows(latent_cache, block_tables[b], seq_len), kv_scale, torch.float32)
        # rows [L, R + P]: the keys; rows[:, :R] the values
        q = torch.cat([q_latent[b], q_rope[b]], dim=-1).float()  # [H, R + P]
        probs = torch.softmax(q @ rows.T * scale, dim=-1)  # [H, L]
        out[b] = (probs @ rows[:, :rank]).to(q_latent.dtype)
    return out


def store_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: KVScale = 1.0, v_scale: KVScale = 1.0) -> None:
    keep = slot_mapping >= 0
    flat = kv_cache.flatten(1, 2)  # [2, slots, Hkv, D], a view
    flat[0, slot_mapping[keep]] = quantize_kv(key[keep], k_scale, kv_cache.dtype)
    flat[1, slot_mapping[keep]] = quantize_kv(value[keep], v_scale, kv_cache.dtype)


def store_mla_cache_ref(latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_scale: KVScale = 1.0) -> None:
    keep = slot_mapping >= 0
    latent_cache.flatten(0, 1)[slot_mapping[keep]] = quantize_kv(latent[keep], kv_scale, latent_cache.dtype)
