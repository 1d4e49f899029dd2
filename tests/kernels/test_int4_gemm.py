"""The W4A16 GEMM (deepserve/kernels/int4.py) against the torch reference (kernels/int4_ref.py).

With CUDA the tests run on the GPU (marked `gpu`); without, under the Triton interpreter on tiny shapes.
Every group of every output row gets its own scale magnitude (10^-2 .. 10^2) and zero point, so a scale,
zero or code read from the wrong group, row or bit field moves the output far past the tolerance (the
last test shows it). Shapes leave partial tiles, partial K steps and, under act order, scattered groups.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

int4 = import_kernels("deepserve.kernels.int4")

from deepserve.kernels import int4_ref  # noqa: E402

pytestmark = MARKS
TOLERANCE = {torch.float32: 1e-3 if ON_GPU else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
GC = int4.Int4GemmConfig
SMALL = GC(16, 32, 32, 2, 4, 2)  # interpreter-sized tiles


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel output"
    return ((out.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def random_weights(n: int, k: int, bits: int, group: int, act_order: bool, seed: int):
    """(qweight [N, K/pack], scales, zeros [N, G], g_idx or None) in our layout, random codes."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen)
    scales = (10 ** (torch.rand(n, groups, generator=gen) * 4 - 2) / 2**bits).half()
    zeros = torch.randint(0, 2**bits, (n, groups), generator=gen).half()
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32)
    return int4_ref.pack_rows(codes, bits), scales, zeros, g_idx


def check(m: int, n: int, k: int, bits: int, group: int, dtype: torch.dtype, act_order: bool = False,
          bias: bool = False, config: GC | None = SMALL, seed: int = 0) -> None:
    qweight, scales, zeros, g_idx = (t.to(DEVICE) if t is not None else None
                                     for t in random_weights(n, k, bits, group, act_order, seed))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    b = torch.randn(n).to(DEVICE, dtype) if bias else None
    want = int4_ref.w4a16_linear_ref(x.float(), qweight, scales, zeros, bits, group, g_idx,
                                     None if b is None else b.float())
    if dtype != torch.float32:  # the weight rounded to x's dtype, as the reference does in x's dtype
        w = int4_ref.dequantize(qweight, scales, zeros, bits, group, g_idx).to(dtype).float()
        want = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    got = int4.w4a16_matmul(x, qweight, scales, zeros, bits, group, g_idx, b, config=config)
    assert got.dtype == dtype and got.shape == (m, n)
    assert rel_err(got, want) < TOLERANCE[dtype], rel_err(got, want)


@pytest.mark.parametrize("reshape", [True, False])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 32)])
def test_matches_the_reference(m, bits, group, reshape):
    # both ways of unpacking the words (kernels/int4_tile.py)
    check(m, 40, 96, bits, group, torch.float32, config=GC(16, 32, 32, 2, 4, 2, reshape_unpack=reshape))


def test_half_precision_activations_with_bias():
    check(7, 24, 64, 4, 32, torch.float16, bias=True)


@pytest.mark.parametrize("reshape", [True, False])
def test_act_order_gathers_each_inputs_group(reshape):
    check(3, 24, 64, 4, 16, torch.float32, act_order=True, config=GC(16, 32, 32, 2, 4, 2, reshape_unpack=reshape))


@pytest.mark.parametrize("reshape", [True, False])
def test_odd_k_and_groups_across_k_steps(reshape):
    # K 72: the last K step is partial (masked); groups of 8 are narrower than a K step (per-input gather)
    check(4, 16, 72, 4, 8, torch.float32, config=GC(16, 32, 32, 2, 4, 2, reshape_unpack=reshape))


def test_split_k_sums_the_partials_with_bias():
    check(2, 24, 128, 4, 32, torch.float32, bias=True, config=GC(16, 32, 32, 1, 4, 2, split_k=3))


def test_default_configs_choose_split_k_for_decode():
    cfg = int4.default_config(1, 4096, 4096)
    assert cfg.block_m == 16 and cfg.split_k > 1
    assert int4.default_config(4096, 4096, 4096).split_k == 1


def test_wrong_zero_point_is_caught():
    qweight, scales, zeros, _ = random_weights(16, 64, 4, 32, False, 0)
    qweight, scales, zeros = qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)
    x = torch.randn(3, 64).to(DEVICE)
    want = int4_ref.w4a16_linear_ref(x, qweight, scales, zeros, 4, 32)
    shifted = zeros.clone()
    shifted[:, 1] += 1  # one group's zero point off by one code
    got = int4.w4a16_matmul(x, qweight, scales, shifted, 4, 32, config=SMALL)
    assert rel_err(got, want) > 100 * TOLERANCE[torch.float32]


@pytest.mark.skipif(not ON_GPU, reason="GPU-sized shapes")
@pytest.mark.parametrize("m", [1, 16, 100, 1024])
def test_gpu_shapes_with_default_configs(m):
    check(m, 4096, 4096, 4, 128, torch.bfloat16, config=None)


@pytest.mark.skipif(ON_GPU, reason="the GPU run is the gate's (bench/gate.py int4)")
def test_bench_check_script_runs_on_tiny_shapes():
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "bench/check_int4.py", "--smoke"], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "ALL CORRECT" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
