"""The fused split-K sum (kernels/split_k.store_split, DEEPSERVE_SPLIT_K_FUSED_SUM): the decode GEMVs' output
with the partials added in the kernel equals, bit for bit, the output with sum_splits' separate kernel (the
same additions in the same order), no separate sum is launched, and every tile counter is back at 0 after each
launch (a CUDA graph replays with the same counters). The interpreter runs programs one after another, so
on CPU this tests the counting and the sum's order; the H200 run (bench/check_split_k.py) tests it under
real concurrency."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_fp8_gemm import block_weight
from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

split_k = import_kernels("deepserve.kernels.split_k")
fp8_gemv = import_kernels("deepserve.kernels.fp8_gemv")
int4_gemv = import_kernels("deepserve.kernels.int4_gemv")
int4 = import_kernels("deepserve.kernels.int4")

from deepserve.kernels.int4_ref import pack_rows  # noqa: E402

pytestmark = MARKS


def _fused(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(split_k, "FUSED_SUM", on)
    monkeypatch.setattr(split_k, "_tile_locks", {})


@pytest.fixture(params=["in-order", "splits-reversed"])
def launch_order(request, monkeypatch):
    """On CPU the interpreter runs a grid's programs in order, so the last split always arrives last; with
    "splits-reversed" grid axis 1 (the split) runs backwards, so split 0 completes each tile: a kernel that
    picked the finishing program by its split index instead of the count would sum unwritten partials."""
    if request.param == "splits-reversed":
        if ON_GPU:
            pytest.skip("the GPU's programs run in no set order; bench/check_split_k.py checks it there")
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        real = builder.set_grid_idx
        monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: real(x, builder.grid_dim[1] - 1 - y, z))
    return request.param


def _both(monkeypatch, run):
    """run() without and with the fused sum; with it, sum_splits must not be called."""
    _fused(monkeypatch, False)
    unfused = run()
    _fused(monkeypatch, True)
    called = []
    for module in (fp8_gemv, int4_gemv):
        monkeypatch.setattr(module, "sum_splits", lambda *a: called.append(a))
    fused = run()
    assert not called, "a fused launch also ran the separate sum"
    locks = split_k._tile_locks[torch.device(DEVICE.type, 0) if DEVICE.type == "cuda" else DEVICE]
    assert int(locks.count_nonzero()) == 0, "a tile counter was left set"
    return unfused, fused


@pytest.mark.parametrize("numerics", ["fma", "dot"])
@pytest.mark.parametrize("m,split", [(1, 3), (3, 2), (2, 0)])
def test_fp8_gemv_fused_sum_equals_the_separate_sum(monkeypatch, launch_order, numerics, m, split):
    n, k = 200, 328  # a partial N tile and a partial K block
    w_q, scale = block_weight(n, k, (128, 128), seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    cfg = fp8_gemv.Fp8GemvConfig(block_n=32, block_k=64, split_k=split, numerics=numerics)

    def run():
        return fp8_gemv.fp8_gemv(x, w_q.to(DEVICE), scale.to(DEVICE), (128, 128), bias, cfg)

    unfused, fused = _both(monkeypatch, run)
    assert torch.equal(unfused, fused)
    again = run()  # the counters were reset: a second launch sums again
    assert torch.equal(again, fused)


@pytest.mark.parametrize("cfg", [
    int4_gemv.Int4GemvConfig(16, 32, split_k=3, num_stages=2),
    int4_gemv.Int4GemvConfig(16, 32, split_k=2, num_stages=2, factored=True, prefetch=True),
    int4_gemv.Int4GemvConfig(16, 32, block_m=4, split_k=2, num_stages=2),
], ids=["exact", "factored-prefetch", "block4"])
def test_int4_gemv_fused_sum_equals_the_separate_sum(monkeypatch, launch_order, cfg):
    n, k, group = 40, 128, 32
    g = torch.Generator().manual_seed(3)
    qweight = pack_rows(torch.randint(0, 16, (n, k), generator=g), 4).to(DEVICE)
    scales = (torch.rand(n, k // group, generator=g) / 8 + 0.01).to(DEVICE, torch.float16)
    zeros = torch.randint(0, 16, (n, k // group), generator=g).to(DEVICE, torch.float16)
    x = torch.randn(5, k, generator=g).to(DEVICE, torch.bfloat16)
    bias = torch.randn(n, generator=g).to(DEVICE, torch.bfloat16)

    def run():
        return int4.w4a16_matmul(x, qweight, scales, zeros, 4, group, bias=bias, config=cfg)

    unfused, fused = _both(monkeypatch, run)
    assert torch.equal(unfused, fused)


def test_the_decode_switches_that_are_on_by_default(monkeypatch):
    from deepserve import envs

    for name in ("DEEPSERVE_SPLIT_K_FUSED_SUM", "DEEPSERVE_INT4_GEMV_FACTORED", "DEEPSERVE_INT4_GEMV_MAGIC",
                 "DEEPSERVE_FUSED_ROPE_KV_STORE"):
        monkeypatch.delenv(name, raising=False)
        assert getattr(envs, name) is True, name
    one_token = int4_gemv.default_gemv_config(1)
    assert split_k.FUSED_SUM is True and one_token.factored is True and one_token.magic is True
    assert int4_gemv.default_gemv_config(2).magic is False  # several tokens a program: not that loop


def test_too_many_tiles_fall_back_to_the_separate_sum(monkeypatch):
    _fused(monkeypatch, True)
    assert split_k.tile_locks(DEVICE, split_k.LOCK_SLOTS + 1) is None
    assert split_k.tile_locks(DEVICE, 4) is not None
    # end to end: a GEMV with more output tiles than counters takes sum_splits, and gives the same output
    monkeypatch.setattr(split_k, "LOCK_SLOTS", 2)
    w_q, scale = block_weight(200, 328, (128, 128), seed=7)
    x = torch.randn(1, 328, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    cfg = fp8_gemv.Fp8GemvConfig(block_n=32, block_k=64, split_k=2, numerics="fma")  # 7 N tiles > 2 slots
    called = []
    real_sum = fp8_gemv.sum_splits
    monkeypatch.setattr(fp8_gemv, "sum_splits", lambda *a: called.append(1) or real_sum(*a))
    fell_back = fp8_gemv.fp8_gemv(x, w_q.to(DEVICE), scale.to(DEVICE), (128, 128), None, cfg)
    assert called
    _fused(monkeypatch, False)
    assert torch.equal(fell_back, fp8_gemv.fp8_gemv(x, w_q.to(DEVICE), scale.to(DEVICE), (128, 128), None, cfg))
    assert split_k.tile_locks(DEVICE, 4) is None  # the switch off: never fused
    lock_arg, flags = split_k.fused_sum(DEVICE, 4, torch.empty(1), split=False)
    assert flags["FUSED_SUM"] is False and lock_arg.numel() == 1  # one split: nothing to sum


def test_counters_first_needed_inside_a_capture_fall_back(monkeypatch):
    # a CUDA-graph capture that came before any warm-up must not allocate the counters from the graph's
    # pool: that launch takes sum_splits (the capture is simulated: tile_locks asks torch whether it is on)
    _fused(monkeypatch, True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert split_k.tile_locks(torch.device("cuda", 0), 4) is None and not split_k._tile_locks
