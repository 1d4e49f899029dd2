"""The tensor-core int4 GEMV (int4_mma_gemv.py) replayed in torch, lane by lane, so CPU tests check its data
movement and its inline PTX: which packed words and activations each lane of a warp holds, what the kernel's
own asm text (BLOCK_ASM_BF16 / BLOCK_ASM_F16) computes from them, instruction by instruction, and how the
registers fill the fragments of mma.m16n8k16. No GPU; slow, for tiny shapes.

run_block_asm interprets the few PTX instructions the asm uses (lop3, shr, prmt, sub / cvt on bf16x2 and
f16x2, mma.sync) on 32 lanes in lockstep, with their PTX ISA semantics:
  lop3.b32 d, a, b, c, lut   each bit of d = bit (4 a + 2 b + c) of lut
  prmt.b32 d, a, b, sel      byte i of d = byte (sel >> 4i) & 7 of the 8 bytes {b, a} (a's bytes 0-3)
  cvt.rn.bf16x2.f32 d, a, b  a rounded in d's upper half, b in its lower half
  mma.m16n8k16 (16-bit A / B, fp32 C), lane = 4 g + t:
    A register i holds rows g + 8 (i % 2), inputs 2t + 8 (i // 2) + (0, 1) (lower half first)
    B register i holds inputs 2t + 8 i + (0, 1) of column g
    C / D element i is row g + 8 (i // 2), column 2t + (i % 2)
The lanes' inputs follow the kernel's mapping (mma_gemv_replay); that mapping in the Gluon code itself
(its offsets) runs only on a GPU, where bench/gemv_probe.py checks the kernel against the same product.
"""

from __future__ import annotations

import re

import torch

from deepserve.kernels.int4_mma_gemv import BLOCK_ASM_BF16, BLOCK_ASM_F16, TILED_ASM_BF16, TILED_ASM_F16
from deepserve.kernels.int4_mma_gemv import BLOCK_INPUTS as KB
from deepserve.kernels.int4_mma_gemv import TILE_ROWS as ROWS

_MASK = 0xFFFFFFFF


def mma_m16n8k16(a_regs: torch.Tensor, b_regs: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One warp's mma from its lanes' registers: a_regs [32, 4, 2], b_regs [32, 2, 2] (each register's two
    halves, lower first), c [32, 4] -> d [32, 4], in float64 (the products of small integers and 16-bit
    floats are exact; the kernel's fp32 sums round)."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    b = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            a[g + 8 * (i % 2), 2 * t + 8 * (i // 2): 2 * t + 8 * (i // 2) + 2] = a_regs[lane, i]
        for i in range(2):
            b[2 * t + 8 * i: 2 * t + 8 * i + 2, g] = b_regs[lane, i]
    d = a @ b
    out = torch.empty(32, 4, dtype=torch.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        out[lane] = torch.stack([d[g + 8 * (i // 2), 2 * t + (i % 2)] for i in range(4)])
    return c + out


def _halves(value: int, dtype: torch.dtype) -> tuple[float, float]:
    bits = torch.tensor([value & 0xFFFF, value >> 16], dtype=torch.int32).to(torch.int16)
    lo, hi = bits.view(dtype).double().tolist()
    return lo, hi


def _pack(lo: float, hi: float, dtype: torch.dtype) -> int:
    bits = torch.tensor([lo, hi], dtype=torch.float64).to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for k in range(8):
        if lut >> k & 1:
            out |= (a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c)
    return out & _MASK


def _prmt(a: int, b: int, sel: int) -> int:
    source = (b << 32 | a).to_bytes(8, "little")
    return int.from_bytes(bytes(source[(sel >> 4 * i) & 7] for i in range(4)), "little")


def _instructions(asm: str) -> list[tuple[str, list[str]]]:
    body = re.sub(r"\.reg[^;]*;", "", asm).replace("\n", " ").strip()
    body = body.removeprefix("{").removesuffix("}")  # the asm's own scope
    out = []
    for text in body.split(";"):
        text = text.strip()
        if text:
            op, _, rest = text.partition(" ")
            out.append((op, [p.strip() for p in re.findall(r"\{[^}]*\}|[^,\s][^,]*", rest)]))
    return out


def run_block_asm(asm: str, lanes: list[dict[str, int | float]]) -> list[list[float]]:
    """The asm run on 32 lanes in lockstep: lanes[l] maps $4.. (the inputs) to lane l's values (b32 registers
    as ints, f32 operands as floats); returns each lane's $0..$3."""
    regs = [dict(lane) for lane in lanes]
    for op, args in _instructions(asm):
        if op.startswith("mma.sync"):
            dtype = torch.float16 if ".f16.f16." in op else torch.bfloat16
            d, a, b, c = ([name.strip() for name in arg.strip("{}").split(",")] for arg in args)
            a_regs = torch.tensor([[_halves(r[n], dtype) for n in a] for r in regs], dtype=torch.float64)
            b_regs = torch.tensor([[_halves(r[n], dtype) for n in b] for r in regs], dtype=torch.float64)
            acc = torch.tensor([[r[n] for n in c] for r in regs], dtype=torch.float64)
            out = mma_m16n8k16(a_regs, b_regs, acc).float().double()  # D is fp32
            for r, row in zip(regs, out.tolist(), strict=True):
                r.update(zip(d, row, strict=True))
            continue
        for r in regs:
            val = [int(x, 0) if x[0].isdigit() else r[x] for x in args[1:]]
            if op == "lop3.b32":
                r[args[0]] = _lop3(*val)
            elif op == "shr.u32":
                r[args[0]] = (val[0] & _MASK) >> val[1]
            elif op == "prmt.b32":
                r[args[0]] = _prmt(val[0] & _MASK, val[1] & _MASK, val[2])
            elif op in ("sub.bf16x2", "sub.f16x2"):
                dtype = torch.bfloat16 if "bf16" in op else torch.float16
                (a_lo, a_hi), (b_lo, b_hi) = _halves(val[0], dtype), _halves(val[1], dtype)
                r[args[0]] = _pack(a_lo - b_lo, a_hi - b_hi, dtype)
            elif op in ("cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32"):
                r[args[0]] = _pack(val[1], val[0], torch.bfloat16 if "bf16" in op else torch.float16)
            else:
                raise ValueError(f"int4_mma_ref: no emulation of {op}")
    return [[r[f"${i}"] for i in range(4)] for r in regs]


def mma_gemv_replay(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group: int, bias: torch.Tensor | None = None, asm: str | None = None,
                    tiled: bool = False) -> torch.Tensor:
    """x [M <= 8, K] (bf16 / fp16) @ the int4 weight -> [M, N] fp32, computed the way each warp of the kernel
    does: per 16-row tile and 128-input block, lane (g, t) holds words 4t .. 4t + 3 of rows g and g + 8 and
    token g's activations of those words (as bf16 / fp16 pairs), and runs the kernel's asm once per word
    column j; the block's sums are scaled and added. asm: another asm text than the kernel's (tests).
    tiled: qweight / scales are tile_words / tile_scales (zeros unused), read at the kernel's offsets, with
    its TILED asm."""
    f16 = x.dtype == torch.float16
    kernel_asm = (TILED_ASM_F16 if f16 else TILED_ASM_BF16) if tiled else (BLOCK_ASM_F16 if f16 else BLOCK_ASM_BF16)
    asm = asm or kernel_asm.value
    magic = 1024.0 if f16 else 128.0
    (m, k), n = x.shape, qweight.shape[0]
    words = qweight.to(torch.int64) & _MASK
    flat, flat_sz = words.flatten(), scales.flatten()  # tiled: read at the kernel's flat offsets
    xs = torch.zeros(8, k, dtype=x.dtype)
    xs[:m] = x
    x_bits = xs.view(torch.int16).to(torch.int64) & 0xFFFF
    x_pairs = x_bits[:, 0::2] | x_bits[:, 1::2] << 16  # [8, K / 2]: inputs 2i (lower half), 2i + 1
    out = torch.zeros(8, n, dtype=torch.float64)
    for tile in range(-(-n // ROWS)):
        rows = [(tile * ROWS + r) % n for r in range(ROWS)]
        for blk in range(k // KB):
            grp = blk * KB // group
            acc = [[0.0] * 4 for _ in range(32)]
            for j in range(4):
                lanes = []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    w = blk * 16 + 4 * t + j  # the lane's word of the block's row
                    if tiled:  # the kernel's offsets: the tile's block, rows g's 128 words then rows g + 8's
                        at = tile * (k // 8 * ROWS) + blk * 256 + lane * 4 + j
                        at_sz = (tile * (k // group) + grp) * 32 + g * 4  # scale a, scale b, zero a, zero b
                        sz = flat_sz[at_sz: at_sz + 4].tolist()
                        lane_in = {"$4": int(flat[at]), "$5": int(flat[at + 128]), "$10": sz[2] + magic,
                                   "$11": sz[3] + magic}
                    else:
                        lane_in = {"$4": int(words[rows[g], w]), "$5": int(words[rows[g + 8], w]),
                                   "$10": float(zeros[rows[g], grp]) + magic,
                                   "$11": float(zeros[rows[g + 8], grp]) + magic}
                    lane_in.update({f"${6 + i}": int(x_pairs[g, 4 * w + i]) for i in range(4)})
                    lane_in.update({f"${12 + i}": acc[lane][i] for i in range(4)})
                    lanes.append(lane_in)
                acc = run_block_asm(asm, lanes)
            for lane in range(32):
                g, t = divmod(lane, 4)
                for i in range(4):
                    row = tile * ROWS + g + 8 * (i // 2)
                    if row < n:
                        at_s = (tile * (k // group) + grp) * 32 + g * 4 + i // 2
                        scale = float(flat_sz[at_s]) if tiled else float(scales[row, grp])
                        out[2 * t + (i % 2), row] += scale * acc[lane][i]
    out = out[:m]
    return (out if bias is None else out + bias.double()).float()
