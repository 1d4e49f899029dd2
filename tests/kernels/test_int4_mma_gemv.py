"""The tensor-core int4 GEMV (kernels/int4_mma_gemv.py): its lane-by-lane data movement replayed in torch
(kernels/int4_mma_ref.py) against the dequantized product, when it is taken, and its sm_90 compile. The kernel
itself runs only on a GPU (Gluon has no CPU interpreter): bench/gemv_probe.py checks it there against the
same product (1-8 tokens, fp16 / bf16, bias, groups of 128 / 256, N not a multiple of 16)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from deepserve.kernels import int4_mma_asm, int4_mma_gemv, int4_ref
from deepserve.kernels.int4_mma_ref import mma_gemv_replay
from deepserve.kernels.ptx_replay import _lop3, _prmt, mma_m16n8k16
from tests.kernels.test_int4_gemm import random_weights
from tests.kernels.triton_setup import DEVICE


def dequantized_product(x, qweight, scales, zeros, group, bias=None):
    w = int4_ref.dequantize(qweight, scales, zeros, 4, group).double()
    out = x.double() @ w.T
    return (out if bias is None else out + bias.double()).float()


def _case(m, n, k, group, dtype):
    """Random row-layout weights (qweight, scales, zeros) and activations x [m, k] for a replay."""
    qweight, scales, zeros, _ = random_weights(n, k, 4, group, False, seed=m + n)
    return qweight, scales, zeros, torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)


@pytest.mark.parametrize("m, n, k, group, dtype", [(1, 16, 128, 128, torch.bfloat16),
                                                   (3, 40, 256, 128, torch.float16),
                                                   (8, 16, 256, 256, torch.bfloat16)])
def test_the_kernels_asm_replayed_lane_by_lane_equals_the_dequantized_product(m, n, k, group, dtype):
    # N 40: a partial last tile (rows wrap in the loads, are dropped at the store); fp16 runs BLOCK_ASM_F16
    qweight, scales, zeros, x = _case(m, n, k, group, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    got = mma_gemv_replay(x, qweight, scales, zeros, group, bias)
    want = dequantized_product(x, qweight, scales, zeros, group, bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m, n, k, group, dtype", [(1, 16, 128, 128, torch.bfloat16),
                                                   (3, 32, 256, 128, torch.float16),
                                                   (8, 16, 512, 256, torch.bfloat16)])
def test_the_tiled_asm_replayed_at_the_kernels_offsets_equals_the_dequantized_product(m, n, k, group, dtype):
    # tile_words / tile_scales read at the kernel's TILED offsets, with its prmt-free asm
    qweight, scales, zeros, x = _case(m, n, k, group, dtype)
    tiled = int4_mma_gemv.tile_words(qweight), int4_mma_gemv.tile_scales(scales, zeros)
    got = mma_gemv_replay(x, *tiled, None, group, tiled=True)
    torch.testing.assert_close(got, dequantized_product(x, qweight, scales, zeros, group), rtol=1e-4, atol=1e-4)
    # the row-major words under the tiled asm and offsets: wrong
    bad = mma_gemv_replay(x, qweight, tiled[1], None, group, tiled=True)
    assert (bad - got).norm() > 1e-2 * got.norm()


@pytest.mark.parametrize("wrong, right", [("0x5410", "0x4510"),  # the activations' re-pairing
                                          ("0x000F000F, 0x43004300", "0x000F000F, 0x43014300"),  # the magic
                                          ("shr.u32 tmp, $4, 8", "shr.u32 tmp, $4, 4"),  # which codes pair
                                          ("{a0, b0, a1, b1}", "{a0, a1, b0, b1}")])  # the A fragment's order
def test_the_replay_fails_for_a_wrong_asm(wrong, right):
    # the replay runs the kernel's own asm text: a changed constant or operand gives a wrong product
    asm = int4_mma_asm.BLOCK_ASM_BF16.value
    assert wrong in asm
    qweight, scales, zeros, _ = random_weights(16, 128, 4, 128, False, seed=3)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = dequantized_product(x, qweight, scales, zeros, 128)
    bad = mma_gemv_replay(x, qweight, scales, zeros, 128, asm=asm.replace(wrong, right, 1))
    assert (bad - want).norm() > 1e-3 * want.norm()


def test_lop3_and_prmt_follow_the_ptx_isa():
    a, b, c = 0x12345678, 0x0F0F0F0F, 0x43004300
    assert _lop3(a, b, c, 0xEA) == (a & b) | c  # the lut of (a & b) | c: 0xF0 & 0xCC | 0xAA
    assert _lop3(a, b, c, 0x96) == a ^ b ^ c
    assert _prmt(0x33221100, 0x77665544, 0x5410) == 0x55441100  # low halves of a and b
    assert _prmt(0x33221100, 0x77665544, 0x7632) == 0x77663322  # high halves


def test_mma_fragments_follow_the_ptx_layout():
    # lane 4g + t: A register i holds rows g + 8 (i % 2), inputs 2t + 8 (i // 2) + (0, 1); B the inputs of column g
    a = torch.zeros(32, 4, 2)
    b = torch.zeros(32, 2, 2)
    a[4 * 3 + 1, 2] = torch.tensor([1.0, 0.0])  # lane g 3, t 1, register 2: row 3, input 2 + 8 = 10
    b[4 * 5 + 1, 1] = torch.tensor([7.0, 0.0])  # lane g 5, t 1, register 1: input 10 of column 5
    d = mma_m16n8k16(a.double(), b.double(), torch.zeros(32, 4, dtype=torch.float64))
    # D[3][5] = 7 sits in lane g 3, t 2 (columns 4, 5), element 1 (row g, column 2t + 1)
    assert d[4 * 3 + 2, 1] == 7.0 and d.abs().sum() == 7.0


class _OnHopper:
    """Stands for a CUDA tensor on a Hopper GPU (no GPU here): what mma_gemv_supported reads of x."""
    is_cuda, device = True, torch.device("cuda", 0)

    def __init__(self, m: int, k: int, dtype: torch.dtype = torch.bfloat16, stride: int = 1, offset: int = 0):
        self.shape, self.dtype, self._stride, self._offset = (m, k), dtype, stride, offset

    def stride(self, dim: int) -> int:
        return self._stride if dim == 1 else self.shape[1]

    def data_ptr(self) -> int:
        return (1 << 20) + self._offset * 2


def test_it_is_taken_only_where_it_applies(monkeypatch):
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    assert not int4_mma_gemv.mma_gemv_supported(x, 4, 128, None, 256)  # CPU
    monkeypatch.setattr(int4_mma_gemv, "_is_hopper", lambda device: True)
    monkeypatch.setattr(int4_mma_gemv, "INTERPRET", False)  # the CPU tests run under Triton's interpreter
    supported = int4_mma_gemv.mma_gemv_supported
    assert supported(_OnHopper(1, 4096), 4, 128, None, 4096)
    assert supported(_OnHopper(8, 11008, torch.float16), 4, 128, None, 11008)
    assert supported(_OnHopper(2, 4096), 4, 4096, None, 4096)  # one group the whole row
    assert not supported(_OnHopper(9, 4096), 4, 128, None, 4096)  # more tokens than the mma's 8 columns
    assert not supported(_OnHopper(1, 4096, torch.float32), 4, 128, None, 4096)
    assert not supported(_OnHopper(1, 4096), 8, 128, None, 4096)  # 8-bit codes
    assert not supported(_OnHopper(1, 4096), 4, 64, None, 4096)  # groups smaller than a block
    assert not supported(_OnHopper(1, 4160), 4, 128, None, 4160)  # K not a multiple of 128
    assert not supported(_OnHopper(1, 4096), 4, 128, torch.zeros(4096, dtype=torch.int32), 4096)  # act order
    assert not supported(_OnHopper(1, 4096, stride=2), 4, 128, None, 4096)
    assert not supported(_OnHopper(1, 4096, offset=1), 4, 128, None, 4096)  # x read as int32 pairs: aligned only
    monkeypatch.setattr(int4_mma_gemv, "INTERPRET", True)
    assert not supported(_OnHopper(1, 4096), 4, 128, None, 4096)
    cfg = int4_mma_gemv.Int4MmaGemvConfig(one_split=False)
    # split-K: no split empty, about programs_per_sm programs an SM, at least a block a warp
    for n, k in ((4096, 4096), (22016, 4096), (4096, 11008), (12288, 4096), (80, 640), (16, 65536)):
        warps, s = int4_mma_gemv.mma_launch_shape(n, k, cfg, 132)
        per = -(-(k // 128) // s)
        assert warps == cfg.num_warps
        assert 1 <= s <= min(k // 128, 16) and (s - 1) * per < k // 128 and per >= min(cfg.num_warps, k // 128)
    # one split: LLM-7B's and V2-Lite's projections (V2-Lite's kv_a: 36 tiles, but 16 blocks, two a warp)
    shape = functools.partial(int4_mma_gemv.mma_launch_shape, cfg=int4_mma_gemv.Int4MmaGemvConfig(one_split=True),
                              num_sms=132)
    assert [shape(n, k) for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))] == \
        [(4, 1), (8, 1), (2, 1), (8, 1)]
    assert [shape(n, k) for n, k in ((3072, 2048), (576, 2048), (2048, 2048), (5632, 2048), (2048, 2816))] == \
        [(8, 1)] * 5
    assert shape(576, 7168)[1] > 1  # 36 tiles over 56 blocks: split-K


_COMPILE = """
import os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from deepserve.kernels.int4_mma_gemv import _int4_mma_gemv_kernel as K
sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "ws_ptr": "*fp32", "out_ptr": "*bf16",
       "bias_ptr": "*bf16", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "blocks_per_split": "i32",
       "stride_xm": "i32", "stride_qn": "i32", "stride_sn": "i32"}
aligned = ["x_ptr", "q_ptr", "s_ptr", "z_ptr", "ws_ptr", "out_ptr", "bias_ptr", "lock_ptr", "N", "K", "stride_xm",
           "stride_qn", "stride_sn"]
for f16 in (False, True):
    for fused, prefetch, tiled, warps, direct in ((True, True, False, 2, False), (False, False, False, 2, False),
                                                  (True, True, True, 1, False), (False, True, True, 16, True)):
        ce = dict(GROUP=128, F16=f16, HAS_BIAS=True, FUSED_SUM=fused, NUM_WARPS=warps, MAX_SPLITS=1 if direct else 8,
                  PREFETCH=prefetch, TILED=tiled, DIRECT=direct)
        s = dict(sig, x_ptr="*fp16", out_ptr="*fp16", bias_ptr="*fp16") if f16 else sig
        src = GluonASTSource(fn=K, signature=s | dict.fromkeys(ce, "constexpr"), constexprs=ce,
                             attrs={(K.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps)).asm["ptx"]
        print(f16, fused, prefetch, tiled, ptx.count("mma.sync.aligned.m16n8k16"), ptx.count("ld.global.v4"),
              ptx.count("prmt.b32"), ptx.count("atom.") + ptx.count("fence."))
"""


def test_the_kernel_compiles_for_hopper():
    # in a fresh interpreter without TRITON_INTERPRET (the interpreter patches triton.language in its process)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 8
    for f16, fused, prefetch, tiled, mmas, vector_loads, permutes, syncs in lines:
        # the fused split sum counts with an atomic behind fences; one split (DIRECT) stores with neither
        assert (int(syncs) > 0) == (fused == "True"), (fused, syncs)
        # 8 mmas a round (4 word columns x 2) a block; the tiled asm re-pairs no activations (no prmt in its loop)
        assert int(mmas) >= 8 and int(vector_loads) >= 2, (f16, fused, prefetch, tiled, mmas, vector_loads)
        assert (int(permutes) < 16) == (tiled == "True"), (f16, fused, prefetch, tiled, permutes)


def test_an_explicit_config_where_it_does_not_apply_is_refused():
    from deepserve.kernels import int4

    qweight, scales, zeros, _ = random_weights(16, 128, 4, 128, False, seed=0)
    with pytest.raises(ValueError, match="int4 mma gemv: needs"):
        int4.w4a16_matmul(torch.randn(1, 128), qweight, scales, zeros, 4, 128,
                          config=int4_mma_gemv.Int4MmaGemvConfig())


def test_int4_matmul_takes_it_up_to_its_token_limit(monkeypatch):
    from deepserve.kernels import int4

    taken = []
    monkeypatch.setattr(int4, "mma_gemv_supported", lambda x, bits, group, g_idx, k: True)
    monkeypatch.setattr(int4, "w4a16_mma_gemv",
                        lambda x, *args, **kwargs: taken.append(x.shape[0]) or x.new_zeros(x.shape[0], 16))
    qweight, scales, zeros = (t.to(DEVICE) for t in random_weights(16, 128, 4, 128, False, seed=0)[:3])
    for m in (1, 8, 9):
        int4.w4a16_matmul(torch.randn(m, 128, device=DEVICE), qweight, scales, zeros, 4, 128)
    assert taken == [1, 8]  # 9 tokens: the other kernels
    monkeypatch.setattr(int4, "MMA_GEMV_MAX_M", 0)
    int4.w4a16_matmul(torch.randn(1, 128, device=DEVICE), qweight, scales, zeros, 4, 128)
    assert taken == [1, 8]
