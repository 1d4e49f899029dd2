"""The FP8 fused MoE launches compile for the H200 (sm_90) on a machine with no GPU: each wrapper runs once
in the interpreter with its launches recorded (test_compile_for_hopper.py's recorder), then every launch
is compiled with triton.compile: a decode-size and a prefill-size call with the default tiles (both
quantize activations once: a separate kernel for x, act in the gate-up epilogue), and one decode-size
call that quantizes inside the GEMMs (not a default since FP8 run 1, kept compiling).

The recorded launches carry the interpreter's own switches (FP8_ROUND_IN_FP32, DOT_UPCAST: True under
TRITON_INTERPRET); they are set as a GPU launch sets them, so what compiles is the code the GPU runs."""

from __future__ import annotations

import torch

from tests.kernels.test_compile_for_hopper import _compile_all, _record, pytestmark  # noqa: F401
from tests.kernels.triton_setup import import_kernels

GPU_SWITCHES = {"FP8_ROUND_IN_FP32": False, "DOT_UPCAST": False}


def as_on_gpu(launches: list) -> list:
    for job in launches:
        job["constexprs"].update({k: v for k, v in GPU_SWITCHES.items() if k in job["constexprs"]})
    return launches


def fp8_inputs(tokens: int, experts: int, k: int, hidden: int, inter: int) -> tuple:
    from deepserve.kernels import fp8_ref

    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w13, s13 = zip(*(fp8_ref.quantize_weight_block(torch.randn(inter, hidden), (128, 128))
                     for _ in range(2 * experts)), strict=True)
    w2, s2 = zip(*(fp8_ref.quantize_weight_block(torch.randn(hidden, inter), (128, 128)) for _ in range(experts)),
                 strict=True)
    w13 = torch.stack(w13).view(experts, 2 * inter, hidden)
    s13 = torch.stack(s13).view(experts, -1, s13[0].shape[1])
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    return x, w13, s13, torch.stack(w2), torch.stack(s2), torch.rand(tokens, k), ids


def test_fused_moe_fp8_kernels_compile(monkeypatch):
    fm = import_kernels("deepserve.kernels.fused_moe")
    decode = fp8_inputs(3, 8, 2, 256, 192)
    prefill = fp8_inputs(96, 4, 2, 256, 192)  # 48 assignments per expert; the prefill tile is forced below
    prefill_config = fm.default_fp8_config(8192, 8, 256)
    in_gemm = fm.MoEConfig(16, 64, 128, 1, 4, 4)  # activations quantized inside the GEMMs (not a default)
    assert prefill_config.block_m == 64 and fm.default_fp8_config(3, 2, 8).block_m == 16

    def run():
        for (x, w13, s13, w2, s2, weights, ids), config in ((decode, None), (prefill, prefill_config),
                                                             (decode, in_gemm)):
            fm.fused_moe(x, w13, w2, weights, ids, config=config, w13_scale=s13, w2_scale=s2, block=(128, 128))

    launches = as_on_gpu(_record(monkeypatch, fm, run))
    kernels = {job["kernel"] for job in launches}
    assert {"_fused_moe_gemm_kernel", "_quantize_groups_kernel", "_moe_align_kernel"} <= kernels
    _compile_all(launches)
