"""The tensor-core int4 GEMV (int4_mma_gemv.py) replayed in torch, lane by lane, so CPU tests check its data
movement and its inline PTX: which packed words and activations each lane of a warp holds, what the kernel's
own asm text (BLOCK_ASM_BF16 / BLOCK_ASM_F16) computes from them, instruction by instruction, and how the
registers fill the fragments of mma.m16n8k16. No GPU; slow, for tiny shapes.

The PTX itself runs in ptx_replay.run_block_asm (the instructions' PTX ISA semantics, the mma's fragments).
The lanes' inputs follow the kernel's mapping (mma_gemv_replay); that mapping in the Gluon code itself
(its offsets) runs only on a GPU, where bench/gemv_probe.py checks the kernel against the same product.
"""

from __future__ import annotations

import torch

from deepserve.kernels.int4_mma_asm import BLOCK_ASM_BF16, BLOCK_ASM_F16, TILED_ASM_BF16, TILED_ASM_F16
from deepserve.kernels.int4_mma_gemv import BLOCK_INPUTS as KB
from deepserve.kernels.int4_mma_gemv import TILE_ROWS as ROWS
from deepserve.kernels.ptx_replay import MASK as _MASK
from deepserve.kernels.ptx_replay import run_block_asm


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
