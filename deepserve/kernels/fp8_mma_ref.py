"""The tensor-core FP8 GEMV (fp8_mma_gemv.py) replayed in torch, lane by lane, so CPU tests check its data
movement and its inline PTX: which weight words and activation pairs each lane of a warp holds (the kernel's
offsets, written out again here), what the kernel's own asm text (WORD_ASM_BF16 / WORD_ASM_F16) computes from
them, instruction by instruction (ptx_replay.run_block_asm), and how the sums are scaled. No GPU; slow, for
tiny shapes. The Gluon code's offsets run only on a GPU, where bench/fp8_gemv_probe.py checks the kernel against
the dequantized product.
"""

from __future__ import annotations

import torch

from deepserve.kernels.fp8_mma_gemv import TILE_ROWS as ROWS
from deepserve.kernels.fp8_mma_gemv import WORD_ASM_BF16, WORD_ASM_F16
from deepserve.kernels.ptx_replay import MASK, run_block_asm


def lane_word(t: int, item: int) -> int:
    """The kernel's in_round: item `item` of lane t's words of a round's row is this word of the round."""
    return (item // 4) * 16 + t * 4 + item % 4


def lane_pair(t: int, item: int) -> int:
    """The kernel's x_off within a round: item `item` of lane t's activation pairs is this pair of the round."""
    return (item // 8) * 32 + t * 8 + item % 8


def fp8_mma_gemv_replay(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                        bias: torch.Tensor | None = None, words: int = 8, asm: str | None = None) -> torch.Tensor:
    """x [M <= 8, K] (bf16 / fp16) times the FP8 weight w_q [N, K] -> [M, N] fp32, the way a warp of the kernel
    computes it: per 16-row tile and round of 16 * words inputs, lane (g, t) holds items lane_word(t, i) of rows
    g and g + 8 and token g's pairs lane_pair(t, 2i), lane_pair(t, 2i + 1), and runs the asm once per word
    column i. Per channel (block None) the sums run across rounds and the row's scale multiplies them at the
    end; block scales multiply each round's sums. asm: another asm text than the kernel's (tests)."""
    asm = asm or (WORD_ASM_F16 if x.dtype == torch.float16 else WORD_ASM_BF16).value
    (m, k), n = x.shape, w_q.shape[0]
    w = w_q.contiguous().view(torch.int32).to(torch.int64) & MASK  # [N, K / 4]
    xs = torch.zeros(8, k, dtype=x.dtype)
    xs[:m] = x
    x_bits = xs.view(torch.int16).to(torch.int64) & 0xFFFF
    x_pairs = x_bits[:, 0::2] | x_bits[:, 1::2] << 16  # [8, K / 2]: inputs 2i (lower half), 2i + 1
    inputs = 16 * words
    out = torch.zeros(8, n, dtype=torch.float64)
    for tile in range(-(-n // ROWS)):
        rows = [(tile * ROWS + r) % n for r in range(ROWS)]
        acc = [[0.0] * 4 for _ in range(32)]
        for rnd in range(k // inputs):
            if block is not None:
                acc = [[0.0] * 4 for _ in range(32)]
            for i in range(words):
                lanes = []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    word = rnd * inputs // 4 + lane_word(t, i)
                    pair = rnd * inputs // 2
                    lane_in = {"$4": int(w[rows[g], word]), "$5": int(w[rows[g + 8], word]),
                               "$6": int(x_pairs[g, pair + lane_pair(t, 2 * i)]),
                               "$7": int(x_pairs[g, pair + lane_pair(t, 2 * i + 1)])}
                    lane_in.update({f"${8 + j}": acc[lane][j] for j in range(4)})
                    lanes.append(lane_in)
                acc = run_block_asm(asm, lanes)
            if block is not None:
                s = float(scale[tile * ROWS // block[0], rnd * inputs // block[1]])
                _add(out, acc, tile, n, [s] * n)
        if block is None:
            _add(out, acc, tile, n, scale.double().tolist())
    out = out[:m]
    return (out if bias is None else out + bias.double()).float()


def _add(out: torch.Tensor, acc: list[list[float]], tile: int, n: int, row_scales: list[float]) -> None:
    # lane (g, t)'s D element j: row g + 8 (j // 2), token 2t + j % 2; times its row's scale
    for lane in range(32):
        g, t = divmod(lane, 4)
        for j in range(4):
            row = tile * ROWS + g + 8 * (j // 2)
            if row < n:
                out[2 * t + j % 2, row] += row_scales[row] * acc[lane][j]
