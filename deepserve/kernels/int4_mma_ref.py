"""The tensor-core int4 GEMV (int4_mma_gemv.py) replayed in torch, lane by lane, so CPU tests check its data
movement: which packed words and activations each lane of a warp holds, how its registers fill the fragments
of mma.m16n8k16 (as the PTX ISA defines them for 16-bit A / B and fp32 C), and which outputs each lane ends
with. No GPU; slow, for tiny shapes.

The fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16" with .bf16 / .f16), lane = 4 g + t:
  A (16 x 16): register i (0..3) holds rows g + 8 (i % 2), inputs 2t + 8 (i // 2) + (0, 1)
  B (16 x 8):  register i (0..1) holds inputs 2t + 8 i + (0, 1) of column g
  C (16 x 8):  element i (0..3) is row g + 8 (i // 2), column 2t + (i % 2)
"""

from __future__ import annotations

import torch

from deepserve.kernels.int4_ref import unpack_rows

ROWS, KB = 16, 128


def mma_m16n8k16(a_regs: torch.Tensor, b_regs: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One warp's mma from its lanes' registers: a_regs [32, 4, 2], b_regs [32, 2, 2] (each register's two
    halves, low first), c [32, 4] -> d [32, 4], in fp32 (products of small integers and 16-bit floats are
    exact there)."""
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


def lane_pairs(codes: torch.Tensor) -> torch.Tensor:
    """A word's 8 codes -> the kernel's 4 registers (lop3 on word >> 4i): (q_i, q_{i+4}) for i = 0..3."""
    return torch.stack([codes[..., [i, i + 4]] for i in range(4)], dim=-2)


def mma_gemv_replay(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, repair_x: bool = True) -> torch.Tensor:
    """x [M <= 8, K] @ the int4 weight -> [M, N] fp32, computed the way each warp of the kernel does: per
    16-row tile and 128-input block, lane (g, t) holds words 4t .. 4t + 3 of rows g and g + 8 and token g's
    activations of those words; word j's pairs (0, 4), (1, 5) feed one mma and (2, 6), (3, 7) the next.
    repair_x False skips the activations' re-pairing (the kernel's prmt): a wrong kernel, for tests."""
    (m, k), n = x.shape, qweight.shape[0]
    codes = unpack_rows(qweight, 4).double()  # [N, K]
    xs = torch.zeros(8, k, dtype=torch.float64)
    xs[:m] = x.double()
    out = torch.zeros(8, n, dtype=torch.float64)
    for tile in range(-(-n // ROWS)):
        rows = [(tile * ROWS + r) % n for r in range(ROWS)]
        for blk in range(k // KB):
            grp = blk * KB // group
            acc = torch.zeros(32, 4, dtype=torch.float64)
            for j in range(4):
                a_pairs, x_pairs = [], []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    ks = blk * KB + (4 * t + j) * 8 + torch.arange(8)  # word 4t + j of the block
                    qa = lane_pairs(codes[rows[g], ks] - zeros[rows[g], grp].double())
                    qb = lane_pairs(codes[rows[g + 8], ks] - zeros[rows[g + 8], grp].double())
                    a_pairs.append(torch.stack([qa, qb], dim=1))  # [4 pairs, 2 rows, 2 halves]
                    xw = xs[g, ks]
                    x_pairs.append(lane_pairs(xw) if repair_x else xw.view(4, 2))
                a_pairs, x_pairs = torch.stack(a_pairs), torch.stack(x_pairs)  # [32, 4, 2, 2], [32, 4, 2]
                for half in range(2):  # pairs 2 half, 2 half + 1: A {row a P, row b P, row a P', row b P'}
                    p, q = 2 * half, 2 * half + 1
                    a_regs = torch.stack([a_pairs[:, p, 0], a_pairs[:, p, 1], a_pairs[:, q, 0], a_pairs[:, q, 1]], 1)
                    acc = mma_m16n8k16(a_regs, torch.stack([x_pairs[:, p], x_pairs[:, q]], 1), acc)
            for lane in range(32):
                g, t = divmod(lane, 4)
                for i in range(4):
                    row = tile * ROWS + g + 8 * (i // 2)
                    if row < n:
                        out[2 * t + (i % 2), row] += scales[row, grp].double() * acc[lane, i]
    out = out[:m]
    return (out if bias is None else out + bias.double()).float()
