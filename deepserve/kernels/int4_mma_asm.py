"""The mma pair at the heart of the int4 tensor-core GEMVs (int4_mma_gemv.py, int4_tma_gemv.py,
int4_moe_mma.py through gemv_tile): one lane's word column of a 128-input block unpacked under bf16 / fp16's
magic exponent, the zero point subtracted and two mma.m16n8k16 into the accumulators. int4_mma_gemv.py's
docstring explains the layout and the numerics; int4_mma_ref.py replays this asm in torch for the CPU tests.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

BLOCK_INPUTS = 128  # inputs a block: 16 words of 8 codes, one scale group of 128 or a part of a wider one
# Two fp16/bf16 codes under the magic exponent per lop3: (q_i, q_{i+4}) of word >> 4i, for i = 0..3.
_UNPACK_BF16 = """
        lop3.b32 {d}0, {w}, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 tmp, {w}, 4;
        lop3.b32 {d}1, tmp, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 tmp, {w}, 8;
        lop3.b32 {d}2, tmp, 0x000F000F, 0x43004300, 0xEA;
        shr.u32 tmp, {w}, 12;
        lop3.b32 {d}3, tmp, 0x000F000F, 0x43004300, 0xEA;
        sub.bf16x2 {d}0, {d}0, {z};
        sub.bf16x2 {d}1, {d}1, {z};
        sub.bf16x2 {d}2, {d}2, {z};
        sub.bf16x2 {d}3, {d}3, {z};"""


def _block_asm(dtype: str) -> str:
    """One word column j of a 128-input block for one lane: rows a (g) and b (g + 8), each one packed word;
    x0..x3 the token's activations of that word as pairs (x0, x1) .. (x6, x7); za / zb 128 + z as f32
    (1024 + z for fp16); the 4 accumulators in ($12..$15) and out ($0..$3)."""
    if dtype == "bf16":
        unpack, cvt, mma = _UNPACK_BF16, "cvt.rn.bf16x2.f32", "bf16.bf16"
    else:
        unpack = _UNPACK_BF16.replace("0x43004300", "0x64006400").replace("bf16x2", "f16x2")
        cvt, mma = "cvt.rn.f16x2.f32", "f16.f16"
    return ("{\n        .reg .b32 tmp, za, zb, a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3;\n"
            f"        {cvt} za, $10, $10;\n        {cvt} zb, $11, $11;"
            + unpack.format(d="a", w="$4", z="za") + unpack.format(d="b", w="$5", z="zb") + """
        prmt.b32 x0, $6, $8, 0x5410;
        prmt.b32 x1, $6, $8, 0x7632;
        prmt.b32 x2, $7, $9, 0x5410;
        prmt.b32 x3, $7, $9, 0x7632;
        mma.sync.aligned.m16n8k16.row.col.f32.MMA.f32 {$0, $1, $2, $3}, {a0, b0, a1, b1}, {x0, x1},
            {$12, $13, $14, $15};
        mma.sync.aligned.m16n8k16.row.col.f32.MMA.f32 {$0, $1, $2, $3}, {a2, b2, a3, b3}, {x2, x3},
            {$0, $1, $2, $3};
        }""".replace("MMA", mma))


def _block_asm_interleaved(dtype: str) -> str:
    """_block_asm for tile_words' words, whose nibbles hold codes 0, 2, 4, 6, 1, 3, 5, 7: the lop3 pairs are
    then (q_2i, q_2i+1), the activations' own pairs, so no prmt ($6..$9 are the mmas' B registers)."""
    asm = "\n".join(line for line in _block_asm(dtype).splitlines() if not line.strip().startswith("prmt."))
    return asm.replace("{x0, x1}", "{$6, $7}").replace("{x2, x3}", "{$8, $9}")


BLOCK_ASM_BF16 = gl.constexpr(_block_asm("bf16"))
BLOCK_ASM_F16 = gl.constexpr(_block_asm("f16"))
TILED_ASM_BF16 = gl.constexpr(_block_asm_interleaved("bf16"))
TILED_ASM_F16 = gl.constexpr(_block_asm_interleaved("f16"))


@gluon.jit
def _block(acc, wa, wb, x, za, zb, j: gl.constexpr, F16: gl.constexpr, TILED: gl.constexpr):
    """acc (4 [W, 32] fp32) + word column j of the block (mma pair), see _block_asm (TILED: the interleaved)."""
    if TILED:
        asm: gl.constexpr = TILED_ASM_F16 if F16 else TILED_ASM_BF16
    else:
        asm: gl.constexpr = BLOCK_ASM_F16 if F16 else BLOCK_ASM_BF16
    return gl.inline_asm_elementwise(
        asm, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f,f,f",
        [wa, wb, x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3], za, zb, acc[0], acc[1], acc[2], acc[3]],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)
