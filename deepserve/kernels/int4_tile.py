"""The one int4 / int8 weight-tile dequantization both W4A16 GEMMs share (kernels/int4.py for linear
layers, kernels/fused_moe.py for the routed experts); int4_ref.py has the layout and the numerics. Also
gemv_rows, the inner loop of the decode GEMVs (kernels/int4_gemv.py, kernels/int4_moe_gemv.py).

Two ways to get the codes out of the packed int32 words, switched by a constexpr so bench/check_int4.py
can time both (neither measured yet):
  reshape  load each word once ([BLOCK_K / pack, BLOCK_N]), shift it by all `pack` offsets at once and
           reshape [BLOCK_K / pack, pack, BLOCK_N] to [BLOCK_K, BLOCK_N]: `pack` times fewer loads, one
           register relayout (the default: decode is a weight stream and load instructions count there)
  gather   load the word of every (k, n) (each word `pack` times, from L1), then shift and mask
The weight is w = q * s - z * s in one fma per element, exactly (q - z) * s: both products are exact in
fp32 (an fp16 scale times an integer below 2^9), so the single rounding is of the exact value.
"""

from __future__ import annotations

import triton
import triton.language as tl

RESHAPE_UNPACK = True  # the default way (module docstring); Int4GemmConfig.reshape_unpack overrides it


@triton.jit
def row_starts(n64, K, stride_qn, stride_sn, GROUP: tl.constexpr, TILED: tl.constexpr):
    """Offsets of output rows n64's first word, scale and zero point: int4_ref's row-major layout, or (TILED)
    int4_mma_gemv.tile_words' and tile_scales' (scales and zeros then in one tensor, the zero 2 past the
    scale); dequantize_tile adds the inputs' part (separable in both layouts)."""
    if TILED:
        sub = n64 % 16
        s = (n64 // 16) * (K // GROUP) * 32 + (sub % 8) * 4 + sub // 8
        return (n64 // 16) * (K // 8 * 16) + (sub // 8) * 128 + (sub % 8) * 16, s, s + 2
    return n64 * stride_qn, n64 * stride_sn, n64 * stride_sn


@triton.jit
def _word_offsets(words, TILED: tl.constexpr):
    # word w of a row sits at (w // 16) * 256 + w % 16 past the row's start in tile_words' layout
    if TILED:
        return (words // 16) * 256 + words % 16
    return words


@triton.jit
def _field_shifts(fields, BITS: tl.constexpr, TILED: tl.constexpr):
    # tile_words' nibble p holds code (0, 2, 4, 6, 1, 3, 5, 7)[p]: code f is at nibble (f % 2) * 4 + f // 2
    if TILED:
        return ((fields % 2) * 4 + fields // 2) * 4
    return fields * BITS


@triton.jit
def dequantize_tile(q_cols, s_cols, z_cols, g_ptr, offs_k, k_start, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                    HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
                    RESHAPE: tl.constexpr, TILED: tl.constexpr = False):
    """w^T [BLOCK_K, BLOCK_N] in fp32 for inputs offs_k (= k_start + arange(BLOCK_K)) of the BLOCK_N output
    rows whose packed codes start at q_cols and whose scales / zero points (one per group) start at s_cols /
    z_cols (all [BLOCK_N] pointers: row_starts); g_ptr: g_idx [K] under act order. Inputs past K read
    code 0: their activations are 0. TILED: the weight is in tile_words' / tile_scales' layout (4-bit)."""
    G_STRIDE: tl.constexpr = 32 if TILED else 1  # from a row's group to its next
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if RESHAPE:
        words = k_start // PACK + tl.arange(0, BLOCK_K // PACK)  # [BLOCK_K / PACK]
        w_ptrs = q_cols[None, :] + _word_offsets(words, TILED)[:, None]
        if EVEN_K:
            packed = tl.load(w_ptrs)
        else:  # K is a multiple of PACK: a word is in or out whole
            packed = tl.load(w_ptrs, mask=(words * PACK < K)[:, None], other=0)
        shifts = _field_shifts(tl.arange(0, PACK), BITS, TILED)
        codes = (packed[:, None, :] >> shifts[None, :, None]) & MASK  # [BLOCK_K / PACK, PACK, BLOCK_N]
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))  # k = word * PACK + field: the packing order
    else:
        q_ptrs = q_cols[None, :] + _word_offsets(offs_k // PACK, TILED)[:, None]  # each int32 read PACK times (L1)
        if EVEN_K:
            packed = tl.load(q_ptrs)
        else:
            packed = tl.load(q_ptrs, mask=(offs_k < K)[:, None], other=0)
        codes = (packed >> _field_shifts(offs_k % PACK, BITS, TILED)[:, None]) & MASK  # [BLOCK_K, BLOCK_N]
    ONE_GROUP_PER_TILE: tl.constexpr = (not HAS_G_IDX) and GROUP % BLOCK_K == 0
    if ONE_GROUP_PER_TILE:  # the tile's inputs share a group: one scale and zero per output row
        g0 = k_start // GROUP
        s = tl.load(s_cols + g0 * G_STRIDE).to(tl.float32)[None, :]
        z = tl.load(z_cols + g0 * G_STRIDE).to(tl.float32)[None, :]
    else:
        k_in = offs_k % K  # in bounds for the masked tail
        g = tl.load(g_ptr + k_in) if HAS_G_IDX else k_in // GROUP
        s = tl.load(s_cols[None, :] + g[:, None] * G_STRIDE).to(tl.float32)
        z = tl.load(z_cols[None, :] + g[:, None] * G_STRIDE).to(tl.float32)
    return codes.to(tl.float32) * s - z * s


@triton.jit
def gemv_rows(a_row, q_cols, s_cols, z_cols, g_ptr, first, last, K, BITS: tl.constexpr, GROUP: tl.constexpr,
              HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              FACTORED: tl.constexpr, PREFETCH: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr):
    """sum over the K tiles first .. last - 1 of a_row[k] * w[n, k] -> [BLOCK_N] fp32, for the BLOCK_N
    output rows whose packed codes start at q_cols and scales / zero points at s_cols / z_cols ([BLOCK_N]
    pointers), one token's inputs at a_row. kernels/int4_gemv.py's docstring has the loop and the three
    numerics (FACTORED, MAGIC).

    PREFETCH: the next K tile's words are loaded before this tile is unpacked, so each program keeps a
    load in flight while it computes (Triton's pipeliner stages loads that feed tl.dot, not these). The
    lookahead stays inside the split: its last step reloads its own last tile (an L1/L2 hit) instead of
    the next split's first, and an empty split reads K's last tile once, in bounds. ASM: _magic_tile's
    inline PTX (not under Triton's interpreter)."""
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    span = tl.arange(0, WORDS)
    if PREFETCH:
        final = tl.cdiv(K, BLOCK_K) - 1
        packed = _load_words(q_cols, tl.minimum(first, final) * WORDS + span, K, PACK, EVEN_K)
        for t in range(first, last):
            following = _load_words(q_cols, tl.minimum(t + 1, last - 1) * WORDS + span, K, PACK, EVEN_K)
            acc = _gemv_tile(acc, packed, a_row, s_cols, z_cols, g_ptr, t, t * WORDS + span, K, BITS, GROUP,
                             HAS_G_IDX, BLOCK_N, BLOCK_K, EVEN_K, FACTORED, MAGIC, ASM)
            packed = following
    else:
        for t in range(first, last):
            words = t * WORDS + span
            acc = _gemv_tile(acc, _load_words(q_cols, words, K, PACK, EVEN_K), a_row, s_cols, z_cols, g_ptr, t,
                             words, K, BITS, GROUP, HAS_G_IDX, BLOCK_N, BLOCK_K, EVEN_K, FACTORED, MAGIC, ASM)
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_tile(acc, packed, a_row, s_cols, z_cols, g_ptr, t, words, K, BITS: tl.constexpr, GROUP: tl.constexpr,
               HAS_G_IDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               FACTORED: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr):
    """acc [BLOCK_N, WORDS] + K tile t's products: its packed words [BLOCK_N, WORDS] (at `words`) unpacked
    one bit field at a time, each field's inputs k = word * pack + field."""
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    MASK: tl.constexpr = (1 << BITS) - 1
    WORD_GROUP: tl.constexpr = (not HAS_G_IDX) and GROUP % PACK == 0  # _word_scales
    if WORD_GROUP:
        s, zs = _word_scales(s_cols, z_cols, t, words, K, PACK, GROUP, BLOCK_K)
    # the magic numerics need 4-bit codes and inputs of at most 11 significant bits (bf16 / fp16: _magic_tile)
    USE_MAGIC: tl.constexpr = MAGIC and FACTORED and WORD_GROUP and BITS == 4 and a_row.dtype.element_ty != tl.float32
    if USE_MAGIC:
        return _magic_tile(acc, packed, a_row, s, zs, words, K, EVEN_K, ASM)
    if FACTORED and WORD_GROUP:
        qx = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        sx = tl.zeros([WORDS], dtype=tl.float32)
    for f in tl.static_range(PACK):
        ks = words * PACK + f
        if EVEN_K:
            x = tl.load(a_row + ks).to(tl.float32)
        else:
            x = tl.load(a_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        code = _codes_to_float((packed >> (f * BITS)) & MASK)
        if FACTORED and WORD_GROUP:
            qx += code * x[None, :]
            sx += x
        else:
            if WORD_GROUP:
                w = code * s - zs
            else:
                s_k, zs_k = _input_scales(s_cols, z_cols, g_ptr, ks, K, GROUP, HAS_G_IDX)
                w = code * s_k - zs_k
            w = w.to(a_row.dtype.element_ty).to(tl.float32)  # the weight as int4_ref rounds it
            acc += w * x[None, :]
    if FACTORED and WORD_GROUP:
        acc += qx * s - zs * sx[None, :]
    return acc


@triton.jit
def _magic_tile(acc, packed, a_row, s, zs, words, K, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """acc + one K tile of 4-bit codes times one token ([BLOCK_N, WORDS] fp32): per packed word the factored
    sum s (sum_f x_f q_f - z sum_f x_f) (kernels/int4_gemv.py), each code made a float by one byte permute.

    The word's even and odd nibbles are split into two words of clean bytes (0x0q: two and-masks and a
    shift per word), then each byte is moved under 2.0f's exponent byte: 0x40 0q 00 00 reads 2 + q / 64
    (exact), one `prmt` per code (ASM: inline PTX; Triton's interpreter makes the same values by shifts and
    masks, _two_plus). With v_f = 2 + q_f / 64, sum_f x_f v_f = 2 sum x + (sum x q) / 64, and every product
    x v is exact in fp32 (x has at most 11 significant bits, v at most 8), so
        s (sum x q - z sum x) = 64 s sum_f x_f v_f - (128 + z) s sum_f x_f
    with 64 s and (128 + z) s exact (an fp16 scale): two fmas per word and row after the 8 products. The
    two terms are each ~128 s sum x, so their roundings cost more than the factored sum's; both stay far
    below bf16's rounding (tests/kernels/test_int4_variants.py's tolerances)."""
    u = packed.to(tl.uint32, bitcast=True)
    if ASM:
        v = tl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi, two;
            mov.b32 two, 0x40000000;
            and.b32 lo, $8, 0x0F0F0F0F;
            shr.u32 hi, $8, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            prmt.b32 $0, lo, two, 0x7054;
            prmt.b32 $1, hi, two, 0x7054;
            prmt.b32 $2, lo, two, 0x7154;
            prmt.b32 $3, hi, two, 0x7154;
            prmt.b32 $4, lo, two, 0x7254;
            prmt.b32 $5, hi, two, 0x7254;
            prmt.b32 $6, lo, two, 0x7354;
            prmt.b32 $7, hi, two, 0x7354;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [u], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        v = (_two_plus(u, 0), _two_plus(u, 1), _two_plus(u, 2), _two_plus(u, 3), _two_plus(u, 4), _two_plus(u, 5),
             _two_plus(u, 6), _two_plus(u, 7))
    xv = tl.zeros(packed.shape, dtype=tl.float32)  # sum_f x_f v_f per word and row
    sx = tl.zeros(words.shape, dtype=tl.float32)
    for f in tl.static_range(8):
        ks = words * 8 + f
        if EVEN_K:
            x = tl.load(a_row + ks).to(tl.float32)
        else:
            x = tl.load(a_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        xv += v[f] * x[None, :]
        sx += x
    s64 = s * 64.0
    c = s * 128.0 + zs  # (128 + z) s: exact
    return acc + xv * s64 - c * sx[None, :]


@triton.jit
def _two_plus(u, f: tl.constexpr):
    # 2 + q_f / 64 as _magic_tile's permute makes it: code f (bits 4f..4f+3) at bits 16..19 under 0x40
    return ((((u >> (4 * f)) & 0xF) << 16) | 0x40000000).to(tl.float32, bitcast=True)


@triton.jit
def gemv_rows_block(a_rows, q_cols, s_cols, z_cols, g_ptr, first, last, K, BITS: tl.constexpr,
                    GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FACTORED: tl.constexpr):
    """gemv_rows for BLOCK_M tokens at once (a_rows: [BLOCK_M] pointers, every one in bounds) ->
    [BLOCK_M, BLOCK_N] fp32: each weight tile is unpacked once for all of them (a 3-D product
    [BLOCK_M, BLOCK_N, BLOCK_K / pack] per bit field, summed along K after the loop)."""
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    MASK: tl.constexpr = (1 << BITS) - 1
    WORD_GROUP: tl.constexpr = (not HAS_G_IDX) and GROUP % PACK == 0
    acc = tl.zeros([BLOCK_M, BLOCK_N, WORDS], dtype=tl.float32)
    for t in range(first, last):
        words = t * WORDS + tl.arange(0, WORDS)
        packed = _load_words(q_cols, words, K, PACK, EVEN_K)
        if WORD_GROUP:
            s, zs = _word_scales(s_cols, z_cols, t, words, K, PACK, GROUP, BLOCK_K)
        if FACTORED and WORD_GROUP:
            qx = tl.zeros([BLOCK_M, BLOCK_N, WORDS], dtype=tl.float32)
            sx = tl.zeros([BLOCK_M, WORDS], dtype=tl.float32)
        for f in tl.static_range(PACK):
            ks = words * PACK + f
            if EVEN_K:
                x = tl.load(a_rows[:, None] + ks[None, :]).to(tl.float32)  # [BLOCK_M, WORDS]
            else:
                x = tl.load(a_rows[:, None] + ks[None, :], mask=(ks < K)[None, :], other=0.0).to(tl.float32)
            code = _codes_to_float((packed >> (f * BITS)) & MASK)
            if FACTORED and WORD_GROUP:
                qx += code[None, :, :] * x[:, None, :]
                sx += x
            else:
                if WORD_GROUP:
                    w = code * s - zs
                else:
                    s_k, zs_k = _input_scales(s_cols, z_cols, g_ptr, ks, K, GROUP, HAS_G_IDX)
                    w = code * s_k - zs_k
                w = w.to(a_rows.dtype.element_ty).to(tl.float32)  # the weight as int4_ref rounds it
                acc += w[None, :, :] * x[:, None, :]
        if FACTORED and WORD_GROUP:
            acc += qx * s[None, :, :] - zs[None, :, :] * sx[:, None, :]
    return tl.sum(acc, axis=2)


@triton.jit
def _load_words(q_cols, words, K, PACK: tl.constexpr, EVEN_K: tl.constexpr):
    # [BLOCK_N, WORDS] packed words of the rows at q_cols; K is a multiple of PACK, so a word is in or
    # out of K whole, and words past K read as 0
    ptrs = q_cols[:, None] + words[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(words * PACK < K)[None, :], other=0)


@triton.jit
def _word_scales(s_cols, z_cols, t, words, K, PACK: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """(s, z * s) in fp32 for K tile t when every word lies in one group (GROUP % PACK == 0, no act
    order): [BLOCK_N, 1] when the tile lies in one group, else [BLOCK_N, WORDS] (a gather that L1 serves:
    neighbouring words share a group). z * s is exact: an fp16 times an integer below 2^9."""
    if GROUP % BLOCK_K == 0:
        g0 = (t * BLOCK_K) // GROUP
        s = tl.load(s_cols + g0).to(tl.float32)[:, None]
        zs = tl.load(z_cols + g0).to(tl.float32)[:, None] * s
    else:
        g_w = ((words * PACK) % K) // GROUP  # words past K (the masked tail) read group 0's
        s = tl.load(s_cols[:, None] + g_w[None, :]).to(tl.float32)
        zs = tl.load(z_cols[:, None] + g_w[None, :]).to(tl.float32) * s
    return s, zs


@triton.jit
def _input_scales(s_cols, z_cols, g_ptr, ks, K, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr):
    # (s, z * s) [BLOCK_N, len(ks)] per input: act order (g_idx) or groups that split a word
    k_in = ks % K  # in bounds for the masked tail
    g = tl.load(g_ptr + k_in) if HAS_G_IDX else k_in // GROUP
    s = tl.load(s_cols[:, None] + g[None, :]).to(tl.float32)
    return s, tl.load(z_cols[:, None] + g[None, :]).to(tl.float32) * s


@triton.jit
def _codes_to_float(codes):
    """Non-negative int32 codes below 2^23 -> exactly the same values in fp32, without an int-to-float
    conversion instruction (the CUDA programming guide's throughput table lists conversions well below
    fp32 fma, and the GEMV converts every code): the code in the mantissa of 2^23 (bits 0x4B000000),
    minus 2^23, both steps exact. Whether it is faster is for bench/check_int4.py --variants to show."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
