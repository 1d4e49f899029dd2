"""The decode GEMV (kernels/int4_gemv.py) and the prefill dequantize + cuBLAS path (kernels/int4_dequant.py)
against the torch reference (kernels/int4_ref.py) and against AWQ / GPTQ checkpoint tensors packed by
tests/loader/int4_pack.py (written from the formats' description, not from our unpacking).

Interpreter on CPU (tiny shapes), the GPU where there is one. Scales differ in magnitude per row and
group (tests/kernels/test_int4_gemm.py's random_weights), so a code, scale or zero point read from the
wrong row, group or bit field lands far past the tolerance (the wrong-zero test shows it per variant).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.kernels.test_int4_gemm import TOLERANCE, random_weights, rel_err
from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

int4 = import_kernels("deepserve.kernels.int4")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepserve.kernels import int4_ref, int4_tile  # noqa: E402
from deepserve.kernels.int4_dequant import Int4DequantConfig, dequantize_weight  # noqa: E402
from deepserve.kernels.int4_gemv import Int4GemvConfig, default_gemv_config, gemv_split_count  # noqa: E402
from deepserve.layers.quantization import Int4Config  # noqa: E402
from deepserve.loader.int4 import checkpoint_slice  # noqa: E402
from tests.loader.int4_pack import (  # noqa: E402
    awq_tensors,
    dequantize,
    gptq_tensors,
    group_index,
    quantize_groups,
)

pytestmark = MARKS
GEMV = Int4GemvConfig(block_n=16, block_k=32, num_stages=2)  # interpreter-sized tiles
FACTORED = Int4GemvConfig(block_n=16, block_k=32, num_stages=2, factored=True)
DEQUANT = Int4DequantConfig(block_n=16, block_k=32)
GATHER = Int4DequantConfig(block_n=16, block_k=32, reshape_unpack=False)
MAGIC = replace(FACTORED, magic=True)  # one token, 4-bit, bf16 / fp16 inputs; else the factored sum
BLOCK4 = Int4GemvConfig(block_n=16, block_k=32, num_stages=2, block_m=4)  # 4 tokens a program
VARIANTS = {"gemv": GEMV, "gemv-factored": FACTORED, "gemv-magic": MAGIC, "gemv-prefetch": replace(GEMV, prefetch=True),
            "gemv-block4": BLOCK4,
            "gemv-block4-factored": replace(BLOCK4, factored=True), "dequant": DEQUANT, "dequant-gather": GATHER}


def on(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)


def check(config, m: int, n: int, k: int, bits: int, group: int, dtype: torch.dtype = torch.float32,
          act_order: bool = False, bias: bool = False, seed: int = 0) -> None:
    qweight, scales, zeros, g_idx = map(on, random_weights(n, k, bits, group, act_order, seed))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    b = torch.randn(n).to(DEVICE, dtype) if bias else None
    # the reference in fp32 on the weight rounded to x's dtype (int4_ref's numerics)
    w = int4_ref.dequantize(qweight, scales, zeros, bits, group, g_idx).to(dtype).float()
    want = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    got = int4.w4a16_matmul(x, qweight, scales, zeros, bits, group, g_idx, b, config=config)
    assert got.dtype == dtype and got.shape == (m, n)
    assert rel_err(got, want) < TOLERANCE[dtype], rel_err(got, want)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m,bits,group", [(1, 4, 32), (3, 4, 16), (2, 8, 32), (2, 4, 4), (6, 4, 32)])
def test_variants_match_the_reference(variant, m, bits, group):
    # group 32 = block_k: one scale per row and K step; 16: one per word (two groups a step); 4 (narrower
    # than a word of 8 codes): one per input
    check(VARIANTS[variant], m, 40, 96, bits, group, bias=m == 3)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_with_act_order(variant):
    check(VARIANTS[variant], 3, 24, 64, 4, 16, act_order=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("group", [8, 32])
def test_variants_with_a_partial_last_k_step(variant, group):
    # K 80: the last K step of 32 is half empty (masked); group 32 keeps one group per step, 8 gathers
    check(VARIANTS[variant], 2, 20, 80, 4, group)


@pytest.mark.parametrize("variant", ["gemv", "gemv-factored", "gemv-block4", "dequant"])
def test_variants_with_half_precision_activations_and_bias(variant):
    check(VARIANTS[variant], 5, 24, 64, 4, 32, dtype=torch.float16, bias=True)


@pytest.mark.parametrize("group,k", [(32, 96), (16, 96), (32, 80), (8, 64), (128, 256)])
def test_magic_numerics_at_one_token_match_the_reference(group, k):
    # fp16 inputs take int4_tile._magic_tile (fp32 ones the factored sum): one group a K step (32, 128),
    # a group per word (8) or two a step (16), a masked last step (80)
    check(MAGIC, 1, 40, k, 4, group, dtype=torch.float16, bias=True)
    check(replace(MAGIC, prefetch=True, split_k=2), 1, 40, k, 4, group, dtype=torch.float16, seed=3)


@pytest.mark.parametrize("bits,group,act_order", [(8, 32, False), (4, 32, True), (4, 4, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_magic_config_falls_back_where_its_loop_does_not_apply(bits, group, act_order, dtype):
    # 8-bit codes, act order and groups narrower than a word take the factored / exact loops with half
    # precision inputs too (tests/kernels/test_compile_for_hopper.py shows which loop compiles)
    check(MAGIC, 1, 40, 96 if not act_order else 64, bits, group, dtype=dtype, act_order=act_order)


@triton.jit
def _fields_kernel(w_ptr, out_ptr, N: tl.constexpr):
    # _two_plus of every field of N words -> out [N, 8]
    u = tl.load(w_ptr + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    for f in tl.static_range(8):
        tl.store(out_ptr + tl.arange(0, N) * 8 + f, int4_tile._two_plus(u, f))


def test_magic_codes_read_two_plus_a_64th_of_the_code():
    # _magic_tile's values as the interpreter makes them (the GPU's byte permute: the sm_90 compile test and
    # the H200 checks): every code in every field of a word
    codes = (torch.arange(16)[:, None] + torch.arange(8)[None, :]) % 16  # word r, field f: code (r + f) % 16
    words = int4_ref.pack_rows(codes, 4)[:, 0].contiguous().to(DEVICE)
    out = torch.empty(16, 8, dtype=torch.float32, device=DEVICE)
    _fields_kernel[(1,)](words, out, N=16)
    assert torch.equal(out.cpu(), 2.0 + codes.float() / 64.0)


def test_magic_numerics_catch_a_wrong_zero_point_in_half_precision():
    qweight, scales, zeros, _ = map(on, random_weights(16, 64, 4, 32, False, 0))
    # seeded: with the global generator the outcome depended on the tests run before (it failed after
    # tests/kernels/test_int4_gemm.py)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(11)).to(DEVICE, torch.float16)
    want = int4_ref.w4a16_linear_ref(x, qweight, scales, zeros, 4, 32).float()
    assert rel_err(int4.w4a16_matmul(x, qweight, scales, zeros, 4, 32, config=MAGIC), want) < TOLERANCE[torch.float16]
    shifted = zeros.clone()
    shifted[:, 1] += 1
    got = int4.w4a16_matmul(x, qweight, scales, shifted, 4, 32, config=MAGIC)
    assert rel_err(got, want) > 10 * TOLERANCE[torch.float16]


@pytest.mark.parametrize("split", [2, 3])
def test_gemv_split_k_sums_the_partials_with_bias(split):
    # K 128 = 4 steps of 32: split 3 leaves the last split one step (its partial still written)
    check(Int4GemvConfig(16, 32, split_k=split, num_stages=2), 3, 24, 128, 4, 32, bias=True)
    check(Int4GemvConfig(16, 32, split_k=split, num_stages=2, factored=True), 3, 24, 128, 4, 32, bias=True)
    check(replace(BLOCK4, split_k=split), 5, 24, 128, 4, 32, bias=True)  # two token blocks, one partial
    # prefetching: the last split's lookahead re-reads its own last tile; an empty split reads a valid one
    check(Int4GemvConfig(16, 32, split_k=split, num_stages=2, prefetch=True), 3, 24, 128, 4, 32, bias=True)


def test_gemv_prefetch_with_more_splits_than_k_steps_writes_zero_partials():
    # K 64 = 2 steps of 32 over 3 splits: one split has no step; its prefetch still reads in bounds
    check(Int4GemvConfig(16, 32, split_k=3, num_stages=2, prefetch=True), 1, 24, 64, 4, 32)
    # the factored numerics through the prefetching loop (the loop body is shared): a partial last step too
    check(replace(FACTORED, prefetch=True), 1, 40, 80, 4, 16, bias=True)


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 22016, 4096), (8, 4096, 11008), (16, 576, 2048)])
@pytest.mark.parametrize("programs_per_sm", [4, 8, 16, None])
def test_gemv_split_count_fills_the_sms_with_no_empty_split(m, n, k, programs_per_sm):
    # None: the one-token default (64 x 128 tiles, 8 programs an SM)
    cfg = default_gemv_config(1) if programs_per_sm is None else Int4GemvConfig(programs_per_sm=programs_per_sm)
    programs_per_sm = cfg.programs_per_sm
    split = gemv_split_count(m, n, k, cfg, num_sms=132)
    k_tiles = -(-k // cfg.block_k)
    per_split = -(-k_tiles // split)
    assert 1 <= split <= k_tiles and (split - 1) * per_split < k_tiles  # every split has K steps
    programs = m * -(-n // cfg.block_n) * split
    # the SMs are busy unless K cannot be split further
    assert programs >= 132 or split == k_tiles
    assert programs >= programs_per_sm * 132 // 2 or split == k_tiles  # about the programs asked for


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_wrong_zero_point_is_caught(variant):
    qweight, scales, zeros, _ = map(on, random_weights(16, 64, 4, 32, False, 0))
    x = torch.randn(3, 64).to(DEVICE)
    want = int4_ref.w4a16_linear_ref(x, qweight, scales, zeros, 4, 32)
    shifted = zeros.clone()
    shifted[:, 1] += 1  # one group's zero point off by one code
    got = int4.w4a16_matmul(x, qweight, scales, shifted, 4, 32, config=VARIANTS[variant])
    assert rel_err(got, want) > 100 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("bits,group,act_order,dtype", [(4, 32, False, torch.float16), (4, 8, True, torch.float32),
                                                        (8, 16, False, torch.float16)])
def test_dequantized_weight_is_the_reference_bit_for_bit(bits, group, act_order, dtype):
    # q * s - z * s in fp32 is exact, so the scratch weight equals int4_ref's rounded to dtype exactly
    qweight, scales, zeros, g_idx = map(on, random_weights(40, 72, bits, group, act_order, 5))
    want = int4_ref.dequantize(qweight, scales, zeros, bits, group, g_idx).to(dtype)
    for cfg in (DEQUANT, GATHER):
        got = dequantize_weight(qweight, scales, zeros, bits, group, g_idx, dtype, cfg)
        assert got.dtype == dtype and torch.equal(got, want)


CHECKPOINTS = [("awq", 4, 32, False), ("gptq", 4, 32, False), ("gptq", 4, 16, True), ("gptq", 8, 32, False)]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("method,bits,group,desc_act", CHECKPOINTS)
def test_variants_on_awq_and_gptq_checkpoint_tensors(variant, method, bits, group, desc_act):
    # The checkpoint's tensors through the loader into our layout, then each variant, against the packer's
    # own dequantization (tests/loader/int4_pack.py) of the codes it packed.
    n, k = 32, 64
    gen = torch.Generator().manual_seed(n + bits + group)
    w = torch.randn(n, k, generator=gen)
    g_idx = group_index(k, group, desc_act, seed=4)
    codes, scales, zeros = quantize_groups(w, bits, group, False, g_idx, min_zero=int(method == "gptq"))
    packed = awq_tensors(codes, scales, zeros) if method == "awq" else gptq_tensors(codes, scales, zeros, bits, g_idx)
    cfg = Int4Config(method, bits, group, desc_act, zero_offset=method == "gptq")
    ours = {kind: on(checkpoint_slice(kind, t, cfg)) for kind, t in packed.items()}
    x = torch.randn(3, k, generator=gen).to(DEVICE)
    want = x @ dequantize(codes, scales, zeros, g_idx).to(DEVICE).T
    got = int4.w4a16_matmul(x, ours["qweight"], ours["scales"], ours["qzeros"], bits, group,
                            ours["g_idx"] if desc_act else None, config=VARIANTS[variant])
    assert rel_err(got, want) < TOLERANCE[torch.float32], rel_err(got, want)


def test_choose_config_switches_by_token_count():
    # the defaults (measured on the H200): the GEMV at one token, the tile kernel below 64 tokens,
    # dequantize + cuBLAS from 64
    assert isinstance(int4.choose_config(1, 4096, 4096), Int4GemvConfig)
    assert isinstance(int4.choose_config(2, 4096, 4096), int4.Int4GemmConfig)
    assert isinstance(int4.choose_config(63, 4096, 4096), int4.Int4GemmConfig)
    assert isinstance(int4.choose_config(64, 4096, 4096), Int4DequantConfig)
    # both thresholds 0: the tile kernel for every M
    for m in (1, 16, 8192):
        assert isinstance(int4.choose_config(m, 4096, 4096, gemv_max_m=0, cublas_min_m=0), int4.Int4GemmConfig)
    one = int4.choose_config(1, 4096, 4096, gemv_max_m=8, cublas_min_m=1024)
    assert isinstance(one, Int4GemvConfig) and one.block_m == 1 and one.prefetch
    assert int4.choose_config(8, 4096, 4096, gemv_max_m=8, cublas_min_m=1024).block_m == 8
    assert isinstance(int4.choose_config(9, 4096, 4096, gemv_max_m=8, cublas_min_m=1024), int4.Int4GemmConfig)
    assert isinstance(int4.choose_config(1024, 4096, 4096, gemv_max_m=8, cublas_min_m=1024), Int4DequantConfig)



@pytest.mark.skipif(ON_GPU, reason="the GPU run is the lead's (bench/check_int4.py --variants)")
def test_bench_variants_script_runs_on_tiny_shapes(tmp_path):
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "variants.json"
    # --one-of-each: the interpreter runs every config it is given (~0.6 s each at M = 1, ~2.5 s for an
    # expert GEMV at T = 3), and checking each tile size of a kind ran 54 checks (60 s); one variant of each
    # kind (asserted below) takes each code path of the script and of the kernels it drives (35 s). The
    # kernels' tile sizes are checked one by one above and in tests/kernels/test_fused_moe_int4.py.
    done = subprocess.run([sys.executable, "bench/check_int4.py", "--variants", "--smoke", "--one-of-each",
                           "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ALL CORRECT" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    variants = {r["variant"] for r in report["variant_speed"]}
    assert {"tile", "gemv n32 k256", "gemv-factored n32 k256", "dequant+cublas", "bf16", "moe tiles",
            "moe gemv n32 k256"} <= variants
    assert all(r["ok"] for r in report["variant_checks"])
    checked = {(r["variant"], r["m"]) for r in report["variant_checks"]}
    assert {(v + " g128", 1) for v in ("tile", "tile other-unpack", "gemv n32 k256", "gemv-factored n32 k256",
                                       "gemv n64 k128 pf pps8 w4", "gemv n64 k128 pps8",
                                       "gemv-factored n64 k128 pf pps8 w4")} <= checked
    assert {(v, 64) for v in ("tile g128", "tile other-unpack g128", "dequant+cublas g128", "tile act-order",
                              "dequant+cublas act-order", "tile 8-bit", "dequant+cublas 8-bit")} <= checked
    assert {(f"moe {v} g128", t) for t in (1, 3) for v in ("tiles", "gemv n32 k256", "gemv-factored n32 k256",
                                                          "gemv n32 k128 pf", "gemv-factored n32 k128 pf")} <= checked
