"""The int4 routed experts on the tensor-core GEMV (kernels/int4_moe_mma.py). Its Gluon kernel runs only on a GPU
(bench/int4_moe_mma_probe.py checks it there against fused_moe_int4_ref; its per-lane data movement is
int4_mma_gemv's, replayed on the CPU in test_int4_mma_gemv.py; its final sum is test_moe_sum.py's); here: the
host wiring around the GEMVs (which rows, which experts, SiLU, skipped assignments) with the
GEMV emulated in torch, when the path is taken, and the sm_90 compile."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepserve.kernels import fused_moe as fm
from deepserve.kernels import int4_mma_gemv, int4_moe_mma, int4_ref
from tests.kernels.test_int4_gemm import random_weights
from tests.kernels.test_int4_mma_gemv import _OnHopper
from tests.kernels.triton_setup import DEVICE, ON_GPU


def experts(num: int, hidden: int, inter: int, group: int = 128) -> tuple:
    """(w13, w2, Int4Experts) with random codes, scales and zero points in fused_moe's int4 layout."""
    def stacked(n: int, k: int, seed: int) -> list[torch.Tensor]:
        parts = [random_weights(n, k, 4, group, False, seed=seed + e)[:3] for e in range(num)]
        return [torch.stack(t) for t in zip(*parts, strict=True)]

    w13, s13, z13 = (t.to(DEVICE) for t in stacked(2 * inter, hidden, 0))
    w2, s2, z2 = (t.to(DEVICE) for t in stacked(hidden, inter, 100))
    return w13, w2, fm.Int4Experts(4, s13, z13, s2, z2, group, group)


def emulated_launch(a, w, operands, ids, out, rows_per_a, num_experts, tokens):
    """_launch's contract in torch: out[i] = a[i // rows_per_a] @ dequant(w[ids[i]])^T in fp32; a skipped id's
    row is not written (NaN here: whatever the empty row holds must be selected away, never summed). tokens: the
    call's, for kernels/pdl.py's rule only."""
    assert ids.numel() % tokens == 0 and a.shape[0] in (tokens, ids.numel())  # the tokens, not the assignments
    scales, zeros, _, group = operands
    for i, e in enumerate(ids.tolist()):
        if e >= num_experts:
            out[i] = float("nan")
            continue
        weight = int4_ref.dequantize(w[e], scales[e], zeros[e], 4, group).float()
        out[i] = a[i // rows_per_a].float() @ weight.T


def test_the_host_wiring_matches_the_reference(monkeypatch):
    w13, w2, ex = experts(num=5, hidden=256, inter=128)
    monkeypatch.setattr(int4_moe_mma, "_launch", emulated_launch)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 256, generator=gen) * 0.01).to(DEVICE, torch.bfloat16)  # gate sums well inside exp's range
    ids = torch.tensor([[4, 1], [0, 4], [2, 3]], device=DEVICE)
    weights = torch.rand(3, 2, generator=gen).to(DEVICE)
    got = int4_moe_mma.int4_moe_mma(x, w13, w2, weights, ids, ex.operands("w13"), ex.operands("w2"))
    want = fm.fused_moe_int4_ref(x, w13, w2, weights, ids, ex)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 256)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    # an assignment left out (id E = 5, expert parallelism) contributes nothing, whatever its weight
    skipped = ids.clone()
    skipped[1, 0] = 5
    kept = weights.clone()
    kept[1, 0] = 0.0
    got = int4_moe_mma.int4_moe_mma(x, w13, w2, weights, skipped, ex.operands("w13"), ex.operands("w2"))
    want = fm.fused_moe_int4_ref(x, w13, w2, kept, ids, ex)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    # the rows: the gate-up GEMV reads token a // K_top, the down GEMV its own assignment's row
    swapped = int4_moe_mma.int4_moe_mma(x.flip(0), w13, w2, weights.flip(0), ids.flip(0), ex.operands("w13"),
                                        ex.operands("w2"))
    assert torch.equal(swapped.flip(0), int4_moe_mma.int4_moe_mma(x, w13, w2, weights, ids, ex.operands("w13"),
                                                                  ex.operands("w2")))


def test_it_is_taken_only_where_it_applies(monkeypatch):
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    supported = int4_moe_mma.mma_moe_supported
    assert not supported(x, 4, 128, 128, None, None, 2048, 1408, 6, 64)  # CPU
    monkeypatch.setattr(int4_mma_gemv, "_is_hopper", lambda device: True)
    monkeypatch.setattr(int4_mma_gemv, "INTERPRET", False)
    monkeypatch.setattr(int4_moe_mma, "MAX_ASSIGNMENTS", 256)
    hopper = _OnHopper(4, 2048)
    assert supported(hopper, 4, 128, 128, None, None, 2048, 1408, 96, 64)  # V2-Lite, 16 tokens x 6 experts
    assert supported(hopper, 4, 128, 128, None, None, 7168, 2048, 24, 64)
    assert not supported(hopper, 4, 128, 128, None, None, 2048, 1408, 192, 64)  # 32 tokens: the tiles pay
    assert not supported(hopper, 4, 128, 128, None, None, 7168, 2048, 264, 256)  # past MAX_ASSIGNMENTS
    assert not supported(hopper, 4, 128, 128, None, None, 2048, 1400, 6, 64)  # I not a multiple of 128
    assert not supported(hopper, 4, 128, 128, None, None, 2000, 1408, 6, 64)  # H not a multiple of 128
    assert not supported(hopper, 4, 64, 128, None, None, 2048, 1408, 6, 64)  # groups below a 128-input block
    assert not supported(hopper, 4, 128, 64, None, None, 2048, 1408, 6, 64)  # the down product's groups
    assert not supported(hopper, 4, 128, 128, None, torch.zeros(1408, dtype=torch.int32), 2048, 1408, 6, 64)
    assert not supported(_OnHopper(4, 2048, torch.float32), 4, 128, 128, None, None, 2048, 1408, 6, 64)
    assert not supported(_OnHopper(4, 2048, stride=2), 4, 128, 128, None, None, 2048, 1408, 6, 64)
    assert not supported(_OnHopper(4, 2048, offset=1), 4, 128, 128, None, None, 2048, 1408, 6, 64)  # 16-byte rows
    assert not supported(hopper, 8, 128, 128, None, None, 2048, 1408, 6, 64)  # 8-bit codes
    act_order = torch.zeros(2048, dtype=torch.int32)
    assert not supported(hopper, 4, 128, 128, act_order, None, 2048, 1408, 6, 64)
    monkeypatch.setattr(int4_moe_mma, "MAX_ASSIGNMENTS", 0)
    assert not supported(hopper, 4, 128, 128, None, None, 2048, 1408, 6, 64)  # switched off


def test_expected_experts_hit_matches_a_simulation():
    gen = torch.Generator().manual_seed(0)
    for assignments, experts in ((6, 64), (96, 64), (192, 64), (256, 256), (64, 16)):
        draws = torch.randint(0, experts, (2000, assignments), generator=gen)
        simulated = torch.stack([row.unique().numel() * torch.ones(()) for row in draws]).mean().item()
        assert abs(int4_moe_mma.expected_experts_hit(assignments, experts) - simulated) < 0.02 * simulated


def test_the_path_follows_the_probe(monkeypatch):
    # bench/int4_moe_mma_probe.py on the H200 (bench/RESULTS.md, fifth session of 2026-12-04): faster than the
    # tiles at V2-Lite 16 tokens (96 assignments over 64 experts), V3 32 tokens (256 over 256), 16 V3-sized
    # experts at 4 tokens (32); slower with those 16 at 8 tokens (64); even (1.04x) with V2-Lite at 32 tokens
    # (192, ratio 3.2), past the line the rule draws at 3
    monkeypatch.setattr(int4_moe_mma, "MAX_ASSIGNMENTS", 256)
    pays = int4_moe_mma.mma_moe_pays
    assert pays(6, 64) and pays(96, 64) and pays(256, 256) and pays(32, 16)
    assert not pays(64, 16) and not pays(192, 64)
    assert not pays(264, 256)  # past the most timed
    assert not pays(0, 64)
    # expert parallelism (no expert count: fused_moe sees only its rank's): the cap alone
    assert pays(256, None) and not pays(264, None)
    monkeypatch.setattr(int4_moe_mma, "MAX_ASSIGNMENTS", 24)  # the earlier limit still binds when set
    assert pays(24, 64) and not pays(30, 64) and pays(24, None)


def test_expert_parallel_calls_apply_the_cap_alone(monkeypatch):
    # V2-Lite on 8 ranks: 8 local experts, 4 tokens x 6 = 24 assignments, most of them skipped. Over the local
    # count the ratio would send this to the tiles (24 > 3 x 7.8), which the probe found slower there
    w13, w2, ex = experts(num=8, hidden=256, inter=128)
    x = (torch.randn(4, 256) * 0.01).to(DEVICE, torch.bfloat16)
    ids, weights = torch.randint(0, 9, (4, 6), device=DEVICE), torch.rand(4, 6, device=DEVICE)
    asked = []
    monkeypatch.setattr(fm, "mma_moe_supported", lambda *args: asked.append(args) or False)
    fm.fused_moe(x, w13, w2, weights, ids, int4=ex, skips=True)
    fm.fused_moe(x, w13, w2, weights, ids.clamp(max=7), int4=ex)
    assert [a[-2:] for a in asked] == [(24, None), (24, 8)]
    monkeypatch.setattr(int4_moe_mma, "MAX_ASSIGNMENTS", 24)
    assert int4_moe_mma.mma_moe_pays(24, None) and not int4_moe_mma.mma_moe_pays(24, 8)


def test_fused_moe_hands_int4_experts_to_it(monkeypatch):
    w13, w2, ex = experts(num=3, hidden=256, inter=128)
    x = (torch.randn(2, 256) * 0.01).to(DEVICE, torch.bfloat16)
    ids, weights = torch.tensor([[0, 2], [1, 0]], device=DEVICE), torch.rand(2, 2, device=DEVICE)
    asked, seen = [], []
    monkeypatch.setattr(fm, "mma_moe_supported", lambda *args: asked.append(args) or True)
    monkeypatch.setattr(fm, "int4_moe_mma", lambda *args: seen.append(args) or "mma")
    assert fm.fused_moe(x, w13, w2, weights, ids, int4=ex) == "mma" and len(seen) == 1
    # what it is asked: x, bits, both products' groups and act orders, H, I, the assignments (T x K), E
    assert asked[0][0] is x and asked[0][1:] == (4, 128, 128, None, None, 256, 128, 4, 3)
    assert seen[0][:5] == (x, w13, w2, weights, ids)
    assert seen[0][5][0] is ex.w13_scales and seen[0][6][0] is ex.w2_scales
    monkeypatch.setattr(fm, "mma_moe_supported", lambda *args: False)
    assert fm.fused_moe(x, w13, w2, weights, ids, int4=ex).shape == (2, 256)  # the tiles


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from deepserve.kernels.int4_moe_mma import _int4_moe_mma_kernel as K
sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "out_ptr": "*fp32", "ids_ptr": "*i64",
       "E": "i32", "N": "i32", "K": "i32", "rows_per_a": "i32", "stride_xm": "i32", "stride_qe": "i32",
       "stride_qn": "i32", "stride_se": "i32", "stride_sn": "i32"}
aligned = ["x_ptr", "q_ptr", "s_ptr", "z_ptr", "out_ptr", "ids_ptr", "N", "K", "stride_xm", "stride_qe", "stride_qn",
           "stride_se", "stride_sn"]
# the down product's launch passes rows_per_a = 1, which Triton specializes into a constant
# (2 warps a program: DEEPSERVE_INT4_MOE_MMA_WARPS's default)
for f16, rows_per_a, pdl, warps in ((False, None, False, 2), (True, None, False, 2), (False, 1, False, 2),
                                    (False, None, True, 2), (False, None, False, 1), (False, None, False, 4),
                                    (False, 1, True, 8)):
    ce = dict(GROUP=128, F16=f16, NUM_WARPS=warps, PDL=pdl)
    ce |= {} if rows_per_a is None else dict(rows_per_a=rows_per_a)
    s = dict(sig, x_ptr="*fp16") if f16 else sig
    src = GluonASTSource(fn=K, signature=s | dict.fromkeys(ce, "constexpr"), constexprs=ce,
                         attrs={(K.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps)).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    print(ptx.count("mma.sync.aligned.m16n8k16"), ptx.count("ld.global.v4"), ptx.count("atom."), int(pdl),
          int(0 <= ptx.find("griddepcontrol.launch_dependents") < wait < ptx.find("ld.global")))
"""


def test_the_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 7  # the last three: programs of 1, 4 and 8 warps (DEEPSERVE_INT4_MOE_MMA_WARPS)
    for mmas, vector_loads, atomics, pdl, pdl_first in lines:
        # 8 mmas a 128-input round; one split, so no split-K counter (no atomics)
        assert int(mmas) >= 8 and int(vector_loads) >= 2 and int(atomics) == 0, (mmas, vector_loads, atomics)
        # programmatic dependence (DEEPSERVE_PDL_MLA_MOE): trigger, then wait, before any load (the ids too)
        assert pdl_first == pdl, (pdl, pdl_first)


@pytest.mark.skipif(not ON_GPU, reason="the Gluon kernel runs on a GPU only")
@pytest.mark.parametrize("warps", [1, 2, 4])
def test_on_the_gpu_against_the_reference(monkeypatch, warps):
    monkeypatch.setattr(int4_moe_mma, "MAX_ASSIGNMENTS", 64)
    monkeypatch.setattr(int4_moe_mma, "NUM_WARPS", warps)  # DEEPSERVE_INT4_MOE_MMA_WARPS
    w13, w2, ex = experts(num=8, hidden=256, inter=256)
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16) * 0.01
    ids = torch.tensor([[7, 1], [0, 7], [2, 3]], device="cuda")
    weights = torch.rand(3, 2, device="cuda")
    if not int4_moe_mma.mma_moe_supported(x, 4, 128, 128, None, None, 256, 256, 6, 8):
        pytest.skip("not a Hopper GPU")
    got = fm.fused_moe(x, w13, w2, weights, ids, int4=ex)
    want = fm.fused_moe_int4_ref(x, w13, w2, weights, ids, ex)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    # assignments left out (id E = 8, expert parallelism): their programs return at once, rows unwritten,
    # and the sum selects them away (over NaN-filled buffers: an unwritten row that were read would show)
    skipped = torch.tensor([[8, 1], [8, 8], [2, 8]], device="cuda")
    kept = torch.where(skipped < 8, weights, 0.0)
    want = fm.fused_moe_int4_ref(x, w13, w2, kept, torch.where(skipped < 8, skipped, 0), ex)
    empty = torch.empty

    def nan_filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", nan_filled)
        got = int4_moe_mma.int4_moe_mma(x, w13, w2, weights, skipped, ex.operands("w13"), ex.operands("w2"))
    assert torch.isfinite(got).all()
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
