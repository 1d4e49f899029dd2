"""FP8 W8A8 kernels (deepserve/kernels/fp8.py) against deepserve/kernels/fp8_ref.py.

Two modes, as in test_fused_moe.py: with CUDA every test runs on the GPU (marked `gpu`) over the full grid;
without CUDA the kernels run on CPU under the Triton interpreter over a small grid.

The quantization must equal the reference bit for bit. The GEMM is compared with an fp32 product of the
dequantized operands (fp8_ref's dequantize helpers, not the kernel's formula). Inputs make wrong indexing
visible: every activation group and weight block has its own magnitude (10^-2 .. 10^2), so a scale read
from the wrong group or block moves the output far past the tolerance (test_wrong_scale_is_caught shows
by how much); shapes leave partial tiles, partial groups and partial scale blocks.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

fp8 = import_kernels("deepserve.kernels.fp8")

from deepserve.kernels import fp8_ref as ref  # noqa: E402

pytestmark = MARKS
# Relative (Frobenius) error against fp32. On the GPU each 128-long fp8 dot is summed by the tensor cores
# in reduced precision before its fp32 promotion.
TOLERANCE = {torch.float32: 2e-3 if ON_GPU else 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
GC = fp8.Fp8GemmConfig


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel output"
    return ((out.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()


def grouped_activations(m: int, k: int, group: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [M, K] whose every (token, group) has its own magnitude, 10^-2 .. 10^2."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    magnitude = 10 ** (torch.rand(m, groups, generator=gen) * 4 - 2)
    x = torch.randn(m, k, generator=gen) * magnitude.repeat_interleave(group, dim=1)[:, :k]
    return x.to(DEVICE, dtype)


def block_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)]) of a weight whose blocks differ in magnitude."""
    gen = torch.Generator().manual_seed(seed)
    (bn, bk), nb, kb = block, -(-n // block[0]), -(-k // block[1])
    magnitude = 10 ** (torch.rand(nb, kb, generator=gen) * 4 - 2)
    w = torch.randn(n, k, generator=gen) * magnitude.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return ref.quantize_weight_block(w.to(DEVICE), block)


def gemm_reference(x_q, x_scale, w_q, w_scale, block, bias=None) -> torch.Tensor:
    out = ref.dequantize_per_token_group(x_q, x_scale, block[1]) @ ref.dequantize_weight_block(w_q, w_scale, block).T
    return out if bias is None else out + bias.float()


def assert_bit_exact(x: torch.Tensor, group: int) -> None:
    q, scale = fp8.quantize_per_token_group(x, group)
    q_ref, scale_ref = ref.quantize_per_token_group_ref(x, group)
    assert q.shape == q_ref.shape and q.dtype == ref.FP8 and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref), f"scales differ at {(scale != scale_ref).nonzero()[:5].tolist()}"
    mismatch = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert mismatch.numel() == 0, f"{len(mismatch)} fp8 values differ, first at {mismatch[:5].tolist()}"


# --- quantization ---------------------------------------------------------------------------------------

QUANT_CASES = [
    (1, 328, 128, torch.bfloat16),  # a partial last group
    (7, 300, 128, torch.float32),
    (3, 256, 128, torch.float16),
    (5, 200, 200, torch.bfloat16),  # one scale per token, a group that is not a power of two
    (2, 5000, 5000, torch.bfloat16),  # one scale per token, read in chunks
    (4, 96, 32, torch.float32),  # many groups per program
    (3, 500, 96, torch.float32),  # groups of 96 in 128-wide chunks: a chunk overhangs into the next group
] + ([(257, 7168, 128, torch.bfloat16), (64, 18432, 18432, torch.bfloat16), (1000, 1000, 128, torch.float16)]
     if ON_GPU else [])


@pytest.mark.parametrize("m,k,group,dtype", QUANT_CASES)
def test_quantize_matches_reference_bit_for_bit(m, k, group, dtype):
    x = grouped_activations(m, k, group, dtype, seed=m + k)
    x[0] = 0  # an all-zero row: the floor keeps its scale positive
    if m > 1:
        x[1, : min(group, k)] = 0  # and an all-zero group beside non-zero ones
    assert_bit_exact(x, group)


def test_quantize_rounds_ties_to_even_and_keeps_signs():
    # Every finite e4m3 value and every midpoint between neighbours (ties), both signs, -0, subnormals:
    # each group's amax is 448 * 2^-5, so its scale is exactly 2^-5 and x / scale lands on them exactly.
    values = torch.arange(127, dtype=torch.uint8).view(ref.FP8).float()  # [127] all non-negative finite
    mids = (values[:-1] + values[1:]) / 2
    row = torch.cat([values, mids, -values, -mids, torch.tensor([-0.0])])
    group = 128
    x = torch.zeros(1, -(-row.numel() // group) * group)
    x[0, : row.numel()] = row
    x[0, ::group] = 448.0
    for dtype in (torch.float32, torch.bfloat16):
        assert_bit_exact((x * 2.0**-5).to(DEVICE, dtype), group)


def test_quantize_wide_dynamic_range_and_strided_rows():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 1000, generator=gen) * 10 ** (torch.rand(16, 1000, generator=gen) * 18 - 14)
    wide = torch.zeros(16, 1100)
    wide[:, :1000] = x
    assert_bit_exact(wide.to(DEVICE)[:, :1000], 128)  # rows of a larger buffer: stride(0) != K


def test_quantize_no_rows():
    q, scale = fp8.quantize_per_token_group(torch.zeros(0, 300, device=DEVICE, dtype=torch.bfloat16), 128)
    assert q.shape == (0, 300) and scale.shape == (0, 3)


@pytest.mark.parametrize("m", [1, 3, 4, 6] + ([257, 1023] if ON_GPU else []))
def test_quantize_cublas_layout(m):
    # cuBLAS's block-wise layout: M padded to a multiple of 4 with zero rows, scales token-fastest. The real
    # rows equal the row-major quantization bit for bit; the padding rows equal what a zero row quantizes to.
    x = grouped_activations(m, 300, 128, torch.bfloat16, seed=m)
    q, scale = fp8.quantize_per_token_group(x, 128, cublas_layout=True)
    rows = -(-m // 4) * 4
    assert q.shape == (rows, 300) and scale.shape == (rows, 3) and scale.stride() == (1, rows)
    q_ref, scale_ref = ref.quantize_per_token_group_ref(torch.cat([x, x.new_zeros(rows - m, 300)]), 128)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert not q[m:].view(torch.uint8).any()


def test_cublas_blockwise_shapes(monkeypatch):
    # The shapes block_fp8_linear hands to cuBLAS: those the H200 probe found correct (bench/RESULTS.md).
    monkeypatch.setattr(fp8, "CUBLAS_MIN_M", 257)
    bf16, block = torch.bfloat16, (128, 128)
    takes = functools.partial(fp8.cublas_blockwise_shape, block=block, dtype=bf16, scales_contiguous=True)
    assert takes(257, 576, 7168) and takes(8192, 36864, 7168) and takes(4097, 7168, 512)
    assert not takes(256, 576, 7168)  # decode sizes stay on Triton (CUDA graphs)
    for k in (384, 1408, 1664, 11008):  # K / 128 not a multiple of 4: cuBLAS returned wrong products
        assert not takes(1024, 4096, k)
    assert not takes(1024, 1000, 1024)  # torch refuses N % 16
    assert not fp8.cublas_blockwise_shape(1024, 4096, 4096, (128, 64), bf16, True)
    assert not fp8.cublas_blockwise_shape(1024, 4096, 4096, block, torch.float16, True)
    assert not fp8.cublas_blockwise_shape(1024, 4096, 4096, block, bf16, False)


def _fake_blockwise_mm(misread_weight_scales: bool):
    """torch._scaled_mm's block-wise contract in torch (the layout block_fp8_linear passes); optionally reading
    the weight scales transposed within each row block's groups, as a wrong layout would."""
    def mm(x_q, w_t, scale_a, scale_b, out_dtype):
        assert scale_a.stride() == (1, x_q.shape[0]) and x_q.shape[0] % 4 == 0
        w_scale = scale_b.t().contiguous()  # [N/128, G]
        if misread_weight_scales:
            w_scale = w_scale.flip(1)
        w = ref.dequantize_weight_block(w_t.t(), w_scale, (128, 128))
        return (ref.dequantize_per_token_group(x_q, scale_a.contiguous(), 128) @ w.t()).to(out_dtype)
    return mm


@pytest.mark.parametrize("misread", [False, True])
def test_the_cublas_self_check_catches_wrong_products(monkeypatch, misread):
    # block_fp8_linear takes cuBLAS only after one product of an allowed shape matched the reference
    monkeypatch.setattr(torch, "_scaled_mm", _fake_blockwise_mm(misread))
    fp8._blockwise_supported.cache_clear()
    try:
        assert fp8._blockwise_supported(torch.device(DEVICE)) is (not misread)
    finally:
        fp8._blockwise_supported.cache_clear()


@pytest.mark.skipif(not ON_GPU, reason="cuBLAS's block-wise FP8 scaling runs on the GPU only")
@pytest.mark.parametrize("m,n,k", [(257, 272, 1024), (260, 576, 2048), (300, 256, 1408)])
def test_block_fp8_linear_on_cublas(monkeypatch, m, n, k):
    # M not a multiple of 4 (padded), N not a multiple of 128, and K = 1,408 (11 groups: must stay on Triton)
    monkeypatch.setattr(fp8, "CUBLAS_BLOCKWISE", True)
    monkeypatch.setattr(fp8, "CUBLAS_MIN_M", 257)
    block = (128, 128)
    x = grouped_activations(m, k, 128, torch.bfloat16, seed=m)
    w_q, w_scale = block_weight(n, k, block, seed=n)
    bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    assert fp8._blockwise_supported(x.device)  # its self-check runs before the spy below
    calls, real = [], torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    out = fp8.block_fp8_linear(x, w_q, w_scale, block, bias)
    assert out.shape == (m, n)
    assert rel_err(out, ref.block_fp8_linear_ref(x, w_q, w_scale, block, bias)) < TOLERANCE[torch.bfloat16]
    assert calls == ([] if k % 512 else [(-(-m // 4) * 4, k)])  # cuBLAS took it (M padded), or Triton did


# --- block-scaled GEMM ----------------------------------------------------------------------------------

if ON_GPU:
    GEMM_CASES = [(m, n, k, block, dtype) for m in (1, 3, 16, 64, 257, 1024) for n, k in ((1000, 328), (576, 7168),
                  (256, 384), (130, 200)) for block in ((128, 128),) for dtype in (torch.bfloat16, torch.float32)]
    GEMM_CASES += [(8192, 512, 1024, (128, 128), torch.bfloat16), (40, 300, 512, (64, 128), torch.bfloat16)]
else:
    GEMM_CASES = [
        (1, 200, 328, (128, 128), torch.float32),  # decode; N and K not tile multiples, a partial scale block
        (5, 130, 256, (128, 128), torch.bfloat16),
        (33, 96, 200, (128, 128), torch.float32),
        (70, 64, 384, (64, 128), torch.float32),  # prefill regime; 64-row weight blocks
        (300, 40, 96, (32, 32), torch.float16),  # small blocks: BLOCK_K follows bk
    ]


@pytest.mark.parametrize("m,n,k,block,dtype", GEMM_CASES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_block_fp8_matmul_matches_dequantized_product(m, n, k, block, dtype, with_bias):
    x = grouped_activations(m, k, block[1], torch.float32, m) * (1e-2 if dtype == torch.float16 else 1.0)
    x_q, x_scale = ref.quantize_per_token_group_ref(x, block[1])  # fp16: keep the products in range
    w_q, w_scale = block_weight(n, k, block, seed=n + k)
    bias = torch.randn(n, device=DEVICE) if with_bias else None
    out = fp8.block_fp8_matmul(x_q, x_scale, w_q, w_scale, block, dtype, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, gemm_reference(x_q, x_scale, w_q, w_scale, block, bias)) < TOLERANCE[dtype]


@pytest.mark.parametrize("config,block", [
    (GC(16, 64, 128, 1, 4, 4), (128, 128)),  # the decode default: two tiles per weight block along N
    (GC(16, 64, 128, 1, 4, 3, split_k=2), (128, 128)),  # decode split-K
    (GC(16, 32, 64, 1, 4, 2, split_k=4), (128, 128)),  # two K tiles per scale group; one split is empty
    (GC(32, 128, 128, 2, 4, 3), (64, 128)),  # a tile spans two weight blocks: per-column scales
    (GC(64, 128, 128, 8, 4, 4), (128, 128)),  # the mid default
    (GC(128, 128, 128, 8, 8, 4), (128, 128)),  # the prefill default
], ids=lambda c: f"m{c.block_m}-n{c.block_n}-k{c.block_k}-s{c.split_k}" if isinstance(c, GC) else str(c))
def test_block_fp8_matmul_launch_configs(config, block):
    m, n, k = 40, 200, 328  # K: 3 groups, the last partial (5 K tiles of 64 for the split case)
    x_q, x_scale = ref.quantize_per_token_group_ref(grouped_activations(m, k, 128, torch.float32, 7), block[1])
    w_q, w_scale = block_weight(n, k, block, seed=8)
    bias = torch.randn(n, device=DEVICE)
    out = fp8.block_fp8_matmul(x_q, x_scale, w_q, w_scale, block, torch.float32, bias, config=config)
    assert rel_err(out, gemm_reference(x_q, x_scale, w_q, w_scale, block, bias)) < TOLERANCE[torch.float32]


def test_wrong_scale_is_caught():
    # The tolerance is meaningful: the same product with the weight's K groups of scales swapped, or the
    # activation scales of two tokens swapped, is far off.
    m, n, k, block = 4, 128, 256, (128, 128)
    x_q, x_scale = ref.quantize_per_token_group_ref(grouped_activations(m, k, 128, torch.float32, 1), 128)
    w_q, w_scale = block_weight(n, k, block, seed=2)
    expected = gemm_reference(x_q, x_scale, w_q, w_scale, block)
    out = fp8.block_fp8_matmul(x_q, x_scale, w_q, w_scale, block, torch.float32)
    assert rel_err(out, expected) < TOLERANCE[torch.float32]
    for xs, ws in ((x_scale, w_scale.flip(1).contiguous()), (x_scale.flip(0).contiguous(), w_scale)):
        assert rel_err(fp8.block_fp8_matmul(x_q, xs, w_q, ws, block, torch.float32), expected) > 100 * 1e-2


def test_block_fp8_linear_matches_reference():
    block = (128, 128)
    x = grouped_activations(6, 328, 128, torch.bfloat16, 5).view(2, 3, 328)  # [..., K]
    w_q, w_scale = block_weight(200, 328, block, seed=6)
    bias = torch.randn(200, device=DEVICE, dtype=torch.bfloat16)
    out = fp8.block_fp8_linear(x, w_q, w_scale, block, bias)
    assert out.shape == (2, 3, 200) and out.dtype == torch.bfloat16
    assert rel_err(out, ref.block_fp8_linear_ref(x, w_q, w_scale, block, bias)) < TOLERANCE[torch.bfloat16]
    assert fp8.block_fp8_linear(x[:0], w_q, w_scale, block).shape == (0, 3, 200)


def test_default_config_regimes():
    block = (128, 128)
    assert fp8.default_config(1, 7168, 2048, block).block_m == 16
    assert fp8.default_config(40, 7168, 2048, block).block_m == 64
    assert fp8.default_config(8192, 7168, 2048, block).block_m == 128
    kv_a = fp8.default_config(1, 576, 7168, block)  # 9 output tiles: split K to fill 132 SMs
    assert kv_a.split_k > 1 and 9 * kv_a.split_k <= 2 * 132 and 7168 // 128 // kv_a.split_k >= 4
    assert fp8.default_config(1, 24576, 1536, block).split_k == 1  # 384 tiles: enough already
    assert fp8.default_config(8192, 576, 7168, block).split_k == 1
    assert fp8.default_config(1, 7168, 2048, (128, 96)).block_k == 32


@pytest.mark.parametrize("bad, message", [
    (dict(x_scale=lambda t: t[:, :1]), "x_scale must be"),
    (dict(w_scale=lambda t: t[:, :1]), "w_scale_inv must be"),
    (dict(w_q=lambda t: t.float()), "must be torch.float8_e4m3fn"),
    (dict(x_q=lambda t: t[:, :-1]), "do not match"),
    (dict(x_scale=lambda t: t.double()), "float32"),
])
def test_block_fp8_matmul_rejects_bad_inputs(bad, message):
    x_q, x_scale = ref.quantize_per_token_group_ref(torch.randn(2, 256, device=DEVICE), 128)
    w_q, w_scale = block_weight(64, 256, (128, 128), seed=1)
    args = dict(x_q=x_q, x_scale=x_scale, w_q=w_q, w_scale=w_scale)
    args = {name: bad.get(name, lambda t: t)(t) for name, t in args.items()}
    with pytest.raises(ValueError, match=message):
        fp8.block_fp8_matmul(args["x_q"], args["x_scale"], args["w_q"], args["w_scale"], (128, 128), torch.float32)


# --- per-channel ----------------------------------------------------------------------------------------

CHANNEL_CASES = [(3, 64, 256, torch.bfloat16), (5, 100, 200, torch.bfloat16), (4, 48, 96, torch.float16)]
if ON_GPU:
    CHANNEL_CASES += [(m, n, k, torch.bfloat16) for m in (1, 64, 1000) for n, k in ((4096, 4096), (1000, 328))]


def channel_case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * (10 ** (torch.rand(m, 1, generator=gen) * 4 - 2))).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen) * 10 ** (torch.rand(n, 1, generator=gen) * 4 - 2)  # rows differ
    w_q, w_scale = ref.quantize_weight_per_channel(w.to(DEVICE))
    return x, w_q, w_scale, torch.randn(n, generator=gen).to(DEVICE, dtype)


@pytest.mark.skipif(not ON_GPU, reason="on CPU channel_fp8_linear is the reference itself: nothing to compare")
@pytest.mark.parametrize("m,n,k,dtype", CHANNEL_CASES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_channel_fp8_linear_matches_reference(m, n, k, dtype, with_bias):
    # CUDA: _scaled_mm or the Triton fallback (test_channel_triton_fallback_matches_reference runs the
    # latter on CPU too).
    x, w_q, w_scale, bias = channel_case(m, n, k, dtype, seed=m + n)
    bias = bias if with_bias else None
    out = fp8.channel_fp8_linear(x.view(1, m, k), w_q, w_scale, bias)
    assert out.shape == (1, m, n) and out.dtype == dtype
    if fp8.activations_unquantized(x, w_q, None):  # a GEMV: activations not quantized (fp8_gemv / fp8_mma_gemv)
        want = x.float() @ (w_q.float() * w_scale.float()[:, None]).t() + (0 if bias is None else bias.float())
    else:
        want = ref.channel_fp8_linear_ref(x, w_q, w_scale, bias)
    assert rel_err(out, want.view(1, m, n)) < TOLERANCE[dtype]


@pytest.mark.parametrize("m,n,k", [(3, 100, 200), (17, 64, 256)])
def test_channel_triton_fallback_matches_reference(m, n, k):
    # The path CUDA takes when _scaled_mm cannot (K or N not a multiple of 16, not bf16), run directly.
    x, w_q, w_scale, bias = channel_case(m, n, k, torch.float32, seed=k)
    out = fp8.channel_fp8_triton(x, w_q, w_scale, bias)
    assert rel_err(out, ref.channel_fp8_linear_ref(x, w_q, w_scale, bias)) < TOLERANCE[torch.float32]
