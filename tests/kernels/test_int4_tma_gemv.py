"""The int4 tensor-core GEMV with its weights staged by the copy engine (kernels/int4_tma_gemv.py): when it is
launched and with what, its sm_90 compile (the copies, the barriers, programmatic dependence), and on a Hopper
GPU its output against the dequantized product and against the register-loaded kernel (the same asm and
order of sums). Its arithmetic is int4_mma_gemv's (_block), replayed in torch in test_int4_mma_gemv.py."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from deepserve.kernels import int4_mma_gemv, int4_tma_gemv
from tests.kernels.test_int4_gemm import random_weights
from tests.kernels.test_int4_mma_gemv import dequantized_product

_ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_only_large_weights_at_one_token_take_it():
    supported = int4_tma_gemv.tma_supported
    assert supported(128, 22016, 4096, 1) and supported(128, 4096, 11008, 1)
    assert not supported(128, 4096, 4096, 1)  # LLM-7B's o: the register kernel was faster
    assert not supported(128, 4096, 11008, 4)  # 4 tokens: the register kernel was faster
    assert not supported(256, 22016, 4096, 1)
    # chained (DEEPSERVE_PDL: the kernels around it take programmatic dependence): any size at one token
    assert supported(128, 4096, 4096, 1, chained=True) and supported(128, 16, 128, 1, chained=True)
    assert not supported(128, 4096, 4096, 4, chained=True) and not supported(64, 4096, 4096, 1, chained=True)


def test_the_descriptors_are_built_once_and_do_not_hold_the_weight():
    int4_tma_gemv._descriptors.cache_clear()
    weight = 1 << 20  # an address, 16-byte aligned: nothing is read on the CPU
    first = int4_tma_gemv._descriptors(weight, weight + 4096, 4096, 11008, 1)
    assert int4_tma_gemv._descriptors(weight, weight + 4096, 4096, 11008, 1) is first  # cached
    words, scales = first
    assert not isinstance(words.base, torch.Tensor) and words.base.data_ptr() == weight
    assert words.shape == [4096 // 16 * 11008 // 128, 256] and words.block_shape == [1, 256]
    # the copy engine writes shared memory at 128-byte aligned addresses: a 1-warp stage of scales (64 bytes a
    # row) takes 2 rows, so the next stage starts aligned
    assert scales.block_shape == [2, 32] and scales.base.dtype == torch.float16


def test_a_stage_count_below_one_is_refused():
    qweight, scales = torch.zeros(16, 16, dtype=torch.int32), torch.zeros(1, 1, 8, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="DEEPSERVE_INT4_TMA_GEMV_STAGES"):
        int4_tma_gemv.tma_launch(torch.zeros(1, 128), qweight, scales, None, None, 1, 1, 0, None, None, {})


def test_the_defaults_are_two_stages_without_pdl():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPSERVE_INT4_TMA")}
    done = subprocess.run([sys.executable, "-c", "from deepserve.kernels.int4_mma_gemv import TILED_CONFIG as c; "
                           "print(c.tma_stages, c.tma_pdl)"], capture_output=True, text=True, env=env, timeout=300)
    assert done.stdout.split() == ["2", "0"], done.stderr[-2000:]


class _Launches:
    """Stands in for a kernel launch or tma_launch: records what it was given."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("registers", grid, kwargs))

    def __call__(self, x, qweight, scales, out, bias, warps, splits, stages, ws, locks, consts, pdl=0):
        self.calls.append(("tma", warps, splits, stages, pdl, consts["DIRECT"]))


@pytest.mark.parametrize("m, n, k, group, tiled, stages, taken", [
    (1, 22016, 4096, 128, True, 2, True),  # 45 MB of codes
    (1, 4096, 8192, 128, True, 2, True),  # exactly 16 MB
    (1, 1024, 32768, 128, True, 2, True),  # 16 MB in a split-K launch shape: the copies take it too
    (1, 4096, 8064, 128, True, 2, False),  # just under 16 MB: the register kernel
    (2, 22016, 4096, 128, True, 2, False),  # 2 tokens: the register kernel
    (1, 22016, 4096, 256, True, 2, False),  # a scale row serves two blocks: the register kernel
    (1, 22016, 4096, 128, False, 2, False),  # row layout: the register kernel
    (1, 22016, 4096, 128, True, 0, False),  # switched off
])
def test_it_is_launched_for_tiled_weights_with_groups_of_128(monkeypatch, m, n, k, group, tiled, stages, taken):
    launches = _Launches()
    monkeypatch.setattr(int4_mma_gemv, "tma_launch", launches)
    monkeypatch.setattr(int4_mma_gemv, "_int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(int4_mma_gemv, "sm_count", lambda device: 132)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    qweight = torch.zeros(n, k // 8, dtype=torch.int32)
    scales = torch.zeros(n // 16, k // group, 8, 4, dtype=torch.float16) if tiled else \
        torch.zeros(n, k // group, dtype=torch.float16)
    base = int4_mma_gemv.TILED_CONFIG if tiled else int4_mma_gemv.Int4MmaGemvConfig()
    cfg = replace(base, tma_stages=stages, tma_pdl=1)
    int4_mma_gemv.w4a16_mma_gemv(x, qweight, scales, None if tiled else scales, group, None, cfg, tiled)
    warps, splits = int4_mma_gemv.mma_launch_shape(n, k, cfg, 132)
    if taken:
        assert launches.calls == [("tma", warps, splits, 2, 1, splits == 1)]
    else:
        assert [c[0] for c in launches.calls] == ["registers"]


@pytest.mark.parametrize("m, n, k, group, capturing, taken", [
    (1, 4096, 4096, 128, True, True),  # LLM-7B's o (8 MB): without PDL the register kernel
    (1, 32, 256, 128, True, True),  # any size
    (1, 4096, 4096, 128, False, False),  # eager: small weights stay (no copy descriptors encoded a launch)
    (1, 22016, 4096, 128, False, True),  # eager: 45 MB takes it anyway, in mode 3
    (2, 4096, 4096, 128, True, False),  # 2 tokens: the register kernel
    (1, 4096, 4096, 256, True, False),  # a scale row serves two blocks: the register kernel
])
def test_with_pdl_every_one_token_gemv_of_groups_of_128_takes_it_in_mode_3(monkeypatch, m, n, k, group, capturing,
                                                                           taken):
    # DEEPSERVE_PDL (kernels/pdl.py): weights asked for before the wait, the next launch allowed after the loop
    launches = _Launches()
    monkeypatch.setattr(int4_mma_gemv, "tma_launch", launches)
    monkeypatch.setattr(int4_mma_gemv, "_int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(int4_mma_gemv, "sm_count", lambda device: 132)
    monkeypatch.setattr(int4_mma_gemv.pdl, "wanted", lambda t, rows, mla_moe=False: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    qweight, scales = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n // 16, k // group, 8, 4).half()
    int4_mma_gemv.w4a16_mma_gemv(x, qweight, scales, None, group, None, int4_mma_gemv.TILED_CONFIG, tiled=True)
    assert [c[0] for c in launches.calls] == ["tma" if taken else "registers"]
    if taken:
        assert launches.calls[0][4] == 3


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from deepserve.kernels.int4_tma_gemv import _int4_tma_gemv_kernel as K, scale_rows
layout = "NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth={}, rank=2, transposed=False, fp4_padded=False, " \\
         "cga_layout=[])"
aligned = ["x_ptr", "ws_ptr", "out_ptr", "bias_ptr", "lock_ptr", "N", "K", "stride_xm"]
for warps, stages, pdl, direct, f16 in ((1, 2, 0, False, False), (4, 2, 1, True, False), (8, 3, 2, True, True),
                                        (1, 2, 3, False, False)):
    dt = "fp16" if f16 else "bf16"
    sig = {"x_ptr": "*" + dt, "w_desc": f"tensordesc<i32[{warps}, 256],{layout.format(32)}>",
           "s_desc": f"tensordesc<fp16[{scale_rows(warps)}, 32],{layout.format(16)}>", "ws_ptr": "*fp32",
           "out_ptr": "*" + dt, "bias_ptr": "*" + dt, "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "blocks_per_split": "i32", "stride_xm": "i32"}
    ce = dict(F16=f16, HAS_BIAS=True, FUSED_SUM=not direct, NUM_WARPS=warps, MAX_SPLITS=1 if direct else 8,
              STAGES=stages, DIRECT=direct, PDL=pdl)
    src = GluonASTSource(fn=K, signature=sig | dict.fromkeys(ce, "constexpr"), constexprs=ce,
                         attrs={(K.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps)).asm["ptx"]
    copy = ptx.find("cp.async.bulk.tensor")
    wait = ptx.find("griddepcontrol.wait")
    print(warps, stages, pdl, ptx.count("cp.async.bulk.tensor"), ptx.count("mbarrier.try_wait"),
          ptx.count("mma.sync.aligned.m16n8k16"), int(wait >= 0), int(copy < wait),
          ptx.count("griddepcontrol.launch_dependents"), ptx.count("ld.local") + ptx.count("st.local"))
"""


def test_the_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [[int(v) for v in line.split()] for line in done.stdout.splitlines()]
    assert len(lines) == 4
    for _warps, stages, pdl, copies, waits, mmas, gdc_wait, copy_first, trigger, local in lines:
        # words and scales: two copies a stage before the loop and two in it; 8 mmas a round
        assert copies >= 2 * stages + 2 and waits >= 1 and mmas >= 8, lines
        # programmatic dependence: the weights are asked for before waiting on the previous kernel
        assert gdc_wait == (pdl > 0) and (copy_first == 1 or pdl == 0), lines
        assert (trigger > 0) == (pdl in (2, 3)) and local == 0, lines


@pytest.mark.skipif(not _ON_HOPPER, reason="Gluon's TMA kernel runs on a Hopper GPU only")
@pytest.mark.parametrize("m, n, k, dtype, bias, split_k, warps, stages, pdl", [
    (1, 4096, 4096, torch.bfloat16, False, 0, 0, 2, 1),
    (1, 12288, 4096, torch.bfloat16, False, 0, 0, 2, 0),  # LLM-7B's qkv: 4-warp programs
    (3, 2048, 2816, torch.float16, True, 0, 0, 3, 0),
    (8, 576, 7168, torch.bfloat16, True, 0, 0, 2, 2),  # split-K by the launch rule
    (4, 1024, 4096, torch.bfloat16, False, 3, 2, 2, 1),  # an explicit 3 splits: the last one short
    (1, 1024, 4096, torch.bfloat16, False, 2, 1, 2, 0),  # 1-warp programs: the scales' 2-row box
    (1, 4096, 4096, torch.bfloat16, False, 0, 0, 2, 3),  # DEEPSERVE_PDL's mode (trigger after the loop)
])
def test_on_the_gpu_it_equals_the_register_kernel(monkeypatch, m, n, k, dtype, bias, split_k, warps, stages, pdl):
    monkeypatch.setattr(int4_mma_gemv.pdl, "ON", False)  # each case's mode as given (DEEPSERVE_PDL would make 0 a 3)
    monkeypatch.setattr(int4_tma_gemv, "TMA_MIN_BYTES", 0)  # small weights too, for a quick test
    monkeypatch.setattr(int4_tma_gemv, "TMA_MAX_TOKENS", 8)  # and every token count the kernel takes
    qweight, scales, zeros, _ = random_weights(n, k, 4, 128, False, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype) if bias else None
    want = dequantized_product(x, qweight, scales, zeros, 128, b)
    dev = [t.cuda() if t is not None else None for t in (x, b)]
    tiled = int4_mma_gemv.tile_words(qweight).cuda(), int4_mma_gemv.tile_scales(scales, zeros).cuda()
    cfg = replace(int4_mma_gemv.TILED_CONFIG, split_k=split_k, num_warps=warps or 1)
    got = int4_mma_gemv.w4a16_mma_gemv(dev[0], *tiled, None, 128, dev[1], replace(cfg, tma_stages=stages, tma_pdl=pdl),
                                       tiled=True)
    registers = int4_mma_gemv.w4a16_mma_gemv(dev[0], *tiled, None, 128, dev[1], replace(cfg, tma_stages=0), tiled=True)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert torch.equal(got, registers)  # the same blocks summed in the same order


