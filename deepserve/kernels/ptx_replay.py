"""A few PTX instructions run in torch on the 32 lanes of a warp in lockstep, so CPU tests can replay the inline
asm of the tensor-core GEMVs (int4_mma_ref.py, fp8_mma_ref.py) instruction by instruction. Registers are
Python ints (b16 / b32 bit patterns) or floats (f32). The semantics, from the PTX ISA:
  lop3.b32 d, a, b, c, lut     each bit of d = bit (4 a + 2 b + c) of lut
  shr.u32 d, a, n              logical shift right
  prmt.b32 d, a, b, sel        byte i of d = byte (sel >> 4i) & 7 of the 8 bytes {b, a} (a's bytes 0-3)
  mov.b32 {lo, hi}, a          a's lower 16 bits into lo, its upper into hi
  sub.{bf16x2, f16x2} d, a, b  halfwise, rounded to the type
  cvt.rn.{bf16x2, f16x2}.f32 d, a, b   a rounded in d's upper half, b in its lower half
  cvt.rn.f16x2.e4m3x2 d, a     a's lower byte (an e4m3 value) into d's lower half as f16, its upper byte into
                               the upper half (exact)
  cvt.f32.f16 d, a             exact
  mma.m16n8k16 (16-bit A / B, fp32 C), lane = 4 g + t:
    A register i holds rows g + 8 (i % 2), inputs 2t + 8 (i // 2) + (0, 1) (lower half first)
    B register i holds inputs 2t + 8 i + (0, 1) of column g
    C / D element i is row g + 8 (i // 2), column 2t + (i % 2)
"""

from __future__ import annotations

import re

import torch

MASK = 0xFFFFFFFF


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
    return out & MASK


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
        if op == "mov.b32" and args[0].startswith("{"):  # split a b32 register into two b16
            lo, hi = (name.strip() for name in args[0].strip("{}").split(","))
            for r in regs:
                r[lo], r[hi] = r[args[1]] & 0xFFFF, (r[args[1]] & MASK) >> 16
            continue
        for r in regs:
            val = [int(x, 0) if x[0].isdigit() else r[x] for x in args[1:]]
            if op == "lop3.b32":
                r[args[0]] = _lop3(*val)
            elif op == "shr.u32":
                r[args[0]] = (val[0] & MASK) >> val[1]
            elif op == "prmt.b32":
                r[args[0]] = _prmt(val[0] & MASK, val[1] & MASK, val[2])
            elif op in ("sub.bf16x2", "sub.f16x2"):
                dtype = torch.bfloat16 if "bf16" in op else torch.float16
                (a_lo, a_hi), (b_lo, b_hi) = _halves(val[0], dtype), _halves(val[1], dtype)
                r[args[0]] = _pack(a_lo - b_lo, a_hi - b_hi, dtype)
            elif op in ("cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32"):
                r[args[0]] = _pack(val[1], val[0], torch.bfloat16 if "bf16" in op else torch.float16)
            elif op == "cvt.rn.f16x2.e4m3x2":
                codes = torch.tensor([val[0] & 0xFF, val[0] >> 8 & 0xFF], dtype=torch.uint8)
                r[args[0]] = _pack(*codes.view(torch.float8_e4m3fn).double().tolist(), torch.float16)
            elif op == "cvt.f32.f16":
                r[args[0]] = _halves(val[0] & 0xFFFF, torch.float16)[0]
            else:
                raise ValueError(f"ptx_replay: no emulation of {op}")
    return [[r[f"${i}"] for i in range(4)] for r in regs]
