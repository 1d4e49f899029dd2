"""Fused MoE with block-scaled FP8 experts (W8A8) against fused_moe_fp8_ref, and the reference itself
against an independent computation of the same math.

Modes as in test_fused_moe.py: with CUDA every test runs on the GPU over the full grid; without CUDA the
kernels run in Triton's interpreter on CPU over small shapes (the file stays under ~40 s).

Inputs are adversarial where the contract allows: skewed routing, NaN-filled workspaces, H and I that
are not multiples of the 128 x 128 blocks, and scales that differ by up to 2^6 from block to block and
group to group (random weights quantized block by block all get about the same scale, so a kernel that
read a neighbour's scale would pass with them). With fp32 activations nothing is rounded outside the
quantization itself, so kernel and reference differ by fp32 accumulation order, except where that
order moves an act value across an fp8 rounding boundary (rare, but one such value costs up to ~5e-4 on
these small shapes: 1e-3; a wrong scale costs > 1e-1); with bf16 the slot sum rounds each slot's output
(2e-2, as the bf16 kernel tests), except with one expert per token, where only act's rounding to bf16
could differ (~1e-2 if it were left out): that checks it is rounded as the reference rounds it.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

fm = import_kernels("deepserve.kernels.fused_moe")

from deepserve.kernels import fp8_ref  # noqa: E402

pytestmark = MARKS
# fp32: on the GPU, prefill tiles run on fp8 wgmma, which sums each 128-long product in reduced precision
# (about 14 bits, per the DeepSeek-V3 report's FP8 section) before it reaches the fp32 accumulator: more
# act values cross an fp8 rounding boundary than with the interpreter's exact products. fp16 there: up to 5.7e-3
# over eight seeds of the 257-token case (an H200, 2026-12-05; the reference itself moved 2.9e-3 between CPU
# and GPU), so 1e-2, still a tenth of what a wrong scale costs.
TOLERANCE = {torch.float32: 5e-3 if ON_GPU else 1e-3, torch.float16: 1e-2 if ON_GPU else 5e-3,
             torch.bfloat16: 2e-2}
MC = fm.MoEConfig
BLOCK = (128, 128)


@pytest.fixture(autouse=True)
def poisoned_workspaces(monkeypatch):
    # Every workspace the kernels should fully write (act, its fp8 copy and scales, x's) starts as NaN.
    monkeypatch.setattr(fm, "_workspace", lambda rows, cols, like: torch.full(
        (rows, cols), float("nan"), device=like.device).to(like.dtype))
    if not ON_GPU:  # the interpreter sorts slowly: larger cases take the torch path (tested in the bf16 file)
        monkeypatch.setattr(fm, "ALIGN_KERNEL_MAX", 512)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel output (an unwritten row or a masked load that was not)"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def routing(tokens: int, experts: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # -> topk_weights [T, K] float32, topk_ids [T, K]: K distinct experts per token, skewed as in the bf16
    # tests (the upper half of the experts gets nothing when K allows; experts 0 and 1 get most).
    scores = torch.randn(tokens, experts, generator=gen)
    if experts - experts // 2 >= k:
        scores[:, experts // 2:] = float("-inf")
    scores[:, :2] += 2.0
    weights = torch.rand(tokens, k, generator=gen) + 0.1
    return weights.to(DEVICE), scores.topk(k, dim=-1).indices.to(DEVICE)


def uneven(rows: int, cols: int, block: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """[rows, cols] factors 2^u, u uniform in [-3, 3], constant on each block: every block's scale differs."""
    (bn, bk), nb, kb = block, -(-rows // block[0]), -(-cols // block[1])
    factors = torch.exp2(torch.rand(nb, kb, generator=gen) * 6 - 3)
    return factors.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def fp8_weights(experts: int, rows: int, cols: int, members: int, block: tuple[int, int], gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """[experts, members * rows, cols] fp8 and its block scales as DeepSeek ships them: each member (gate,
    up) quantized on its own, its scale rows stacked after the previous member's."""
    qs, scales = [], []
    for _ in range(experts * members):
        w = torch.randn(rows, cols, generator=gen) * cols**-0.5 * uneven(rows, cols, block, gen)
        q, s = fp8_ref.quantize_weight_block(w, block)
        qs.append(q)
        scales.append(s)
    q = torch.stack(qs).view(experts, members * rows, cols)
    s = torch.stack(scales).view(experts, members * scales[0].shape[0], scales[0].shape[1])
    return q.to(DEVICE), s.to(DEVICE)


def make_case(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int,
              block: tuple[int, int] = BLOCK) -> dict:
    gen = torch.Generator().manual_seed(seed)
    # x's groups differ in magnitude too, so a wrong activation scale index fails as well.
    x = torch.randn(tokens, hidden, generator=gen) * uneven(1, hidden, (1, block[1]), gen)
    w13, w13_scale = fp8_weights(experts, inter, hidden, 2, block, gen)
    w2, w2_scale = fp8_weights(experts, hidden, inter, 1, block, gen)
    weights, ids = routing(tokens, experts, k, gen)
    return dict(x=x.to(DEVICE, dtype), w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale,
                topk_weights=weights, topk_ids=ids, block=block)


def run_kernel(case: dict, config: MC | None = None, skips: bool = False) -> torch.Tensor:
    c = case
    out = fm.fused_moe(c["x"], c["w13"], c["w2"], c["topk_weights"], c["topk_ids"], config=config, skips=skips,
                       w13_scale=c["w13_scale"], w2_scale=c["w2_scale"], block=c["block"])
    assert out.shape == c["x"].shape and out.dtype == c["x"].dtype
    return out


def run_ref(case: dict) -> torch.Tensor:
    c = case
    return fm.fused_moe_fp8_ref(c["x"], c["w13"], c["w13_scale"], c["w2"], c["w2_scale"], c["topk_weights"],
                                c["topk_ids"], c["block"])


def check(case: dict, config: MC | None = None, tolerance: float | None = None) -> None:
    err = rel_err(run_kernel(case, config), run_ref(case))
    assert err < (tolerance or TOLERANCE[case["x"].dtype]), err


IN_GEMM = MC(block_m=16, block_n=64, block_k=128, group_m=2, num_warps=4, num_stages=2)
ONCE = MC(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=2, prequantize=True)

if ON_GPU:
    CASES = [
        (tokens, experts, k, hidden, inter, dtype, BLOCK)
        for tokens in (1, 7, 33, 300, 2000) for experts, k in ((8, 2), (64, 6), (256, 8))
        for hidden, inter in ((200, 96), (256, 128), (384, 320)) for dtype in (torch.float32, torch.bfloat16)
    ] + [(257, 16, 4, 192, 96, torch.float16, (32, 64)), (5000, 16, 4, 256, 256, torch.bfloat16, BLOCK)]
else:
    CASES = [
        (1, 4, 2, 200, 96, torch.bfloat16, BLOCK),  # decode, fewer tokens than one block; H, I not multiples
        (5, 8, 3, 256, 128, torch.float32, BLOCK),  # multiples of the block
        (40, 8, 6, 200, 96, torch.float32, BLOCK),  # 30 per expert: the second decode regime
        (150, 8, 2, 256, 200, torch.bfloat16, BLOCK),  # 37 per expert; I past one group, not a multiple
        (300, 8, 2, 128, 96, torch.float32, (64, 64)),  # prefill regime (prequantize), torch-side alignment
        (24, 4, 2, 96, 80, torch.float32, (32, 64)),  # several scale rows inside one N tile
    ]


@pytest.mark.parametrize("tokens,experts,k,hidden,inter,dtype,block", CASES)
def test_fp8_matches_reference(tokens, experts, k, hidden, inter, dtype, block):
    # The default config for each size, so every regime's default tile is checked.
    check(make_case(tokens, experts, k, hidden, inter, dtype, seed=tokens * 100 + experts + k, block=block))


@pytest.mark.parametrize("config", [
    IN_GEMM,
    ONCE,
    MC(block_m=32, block_n=64, block_k=128, group_m=4, num_warps=8, num_stages=4),  # mid and prefill defaults
    MC(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4, prequantize=True),
    MC(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, prequantize=True),  # bk / 2
    MC(block_m=128, block_n=32, block_k=128, group_m=8, num_warps=8, num_stages=3),
], ids=lambda c: f"m{c.block_m}-n{c.block_n}-k{c.block_k}-g{c.group_m}{'-once' if c.prequantize else ''}")
def test_fp8_launch_configs(config):
    # Both quantization placements and the tiles of each regime on one shape: several blocks per expert
    # (grouped order), empty experts, H and I past one group without being multiples of it.
    check(make_case(90, 8, 3, 200, 136, torch.float32, seed=5), config)


@pytest.mark.parametrize("config", [IN_GEMM, ONCE], ids=["in-gemm", "once"])
def test_fp8_rounds_act_to_x_dtype_before_quantizing(config):
    # One expert per token: y is the output, rounded once as the reference rounds it, so only act's
    # rounding to bf16 (or its absence) could make the kernel differ by more than accumulation order.
    case = make_case(33, 8, 1, 256, 192, torch.bfloat16, seed=11)
    check(case, config, tolerance=1e-3)


@pytest.mark.parametrize("config", [IN_GEMM, ONCE], ids=["in-gemm", "once"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_fp8_skips_other_ranks_assignments(tokens, config):
    case = make_case(tokens, 8, 4, 200, 96, torch.float32, seed=tokens + 7)
    ids, weights = case["topk_ids"], case["topk_weights"]
    others = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)).to(ids.device) < 0.5
    others[0, 0] = True
    case["topk_ids"] = torch.where(others, 8, ids)
    out = run_kernel(case, config, skips=True)
    # The same sum with the skipped assignments' weights zeroed and sent to a real expert.
    zeroed = dict(case, topk_ids=torch.where(others, 0, ids), topk_weights=torch.where(others, 0.0, weights))
    assert rel_err(out, run_ref(zeroed)) < TOLERANCE[torch.float32]
    assert rel_err(out, run_ref(case)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("rows,cols,group", [(5, 200, 128), (33, 256, 64), (1, 96, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_bit_exact(rows, cols, group, dtype):
    # The separate quantization kernel (and so _quantize_rows, shared with the GEMMs) equals fp8_ref byte
    # for byte, across magnitudes from e4m3's subnormals to its largest values.
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-12, 12, (rows, cols), generator=gen)))
    x[0, :group] = 0.0  # an all-zero group: the floored scale
    x = x.to(DEVICE, dtype)
    q, scale = fm._quantize_groups(x, group, torch.empty(0, dtype=fp8_ref.FP8, device=DEVICE),
                                   torch.empty(0, device=DEVICE))
    q_ref, scale_ref = fp8_ref.quantize_per_token_group_ref(x, group)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())  # as values: the interpreter writes 0 for -0


def independent_fp8_moe(case: dict) -> torch.Tensor:
    """The same math written out differently from fused_moe_fp8_ref: every weight dequantized up front
    through explicit scale indices (gate row n: scale row n // bn, up row n: ceil(I/bn) + n // bn), then
    token by token, slot by slot, with activation groups quantized in a loop."""
    c = case
    x, (bn, bk) = c["x"].cpu(), c["block"]
    experts, two_i, hidden = c["w13"].shape
    inter = two_i // 2
    gate_rows = -(-inter // bn)
    n13 = torch.arange(two_i)
    scale_row13 = torch.where(n13 < inter, n13 // bn, gate_rows + (n13 - inter) // bn)  # [2I]
    w13 = c["w13"].cpu().float() * c["w13_scale"].cpu()[:, scale_row13][:, :, torch.arange(hidden) // bk]
    w2 = c["w2"].cpu().float() * c["w2_scale"].cpu()[:, torch.arange(hidden) // bn][:, :, torch.arange(inter) // bk]
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        xt = quantize_vector(x[t].float(), bk)
        for slot, e in enumerate(c["topk_ids"][t].tolist()):
            if e >= experts:
                continue
            h = w13[e] @ xt  # [2I]
            act = quantize_vector((torch.nn.functional.silu(h[:inter]) * h[inter:]).to(x.dtype).float(), bk)
            out[t] += c["topk_weights"][t, slot].item() * (w2[e] @ act)
    return out.to(x.dtype)


def quantize_vector(v: torch.Tensor, group: int) -> torch.Tensor:
    """v [K] -> v quantized to e4m3 group by group and dequantized again."""
    out = torch.empty_like(v)
    for start in range(0, v.numel(), group):
        part = v[start:start + group]
        scale = max(part.abs().max().item(), fp8_ref.AMAX_FLOOR) / fp8_ref.FP8_MAX
        scale = torch.tensor(scale, dtype=torch.float32)  # fp8_ref computes it in fp32
        out[start:start + group] = (part / scale).clamp(-448, 448).to(fp8_ref.FP8).float() * scale
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,inter,block", [(200, 96, BLOCK), (96, 80, (32, 64))])
def test_reference_matches_independent_math(hidden, inter, block, dtype):
    case = make_case(6, 4, 2, hidden, inter, dtype, seed=3, block=block)
    case = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in case.items()}
    case["topk_ids"][0, 1] = 4  # a skipped assignment (id E) contributes nothing
    err = rel_err(run_ref(case), independent_fp8_moe(case))
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


def test_default_fp8_config_regimes():
    # As measured on the H200: activations quantized once, tiles growing with assignments per expert,
    # block_n = block_k = bk (the gate-up epilogue quantizes act in bk groups).
    rows = {tokens: fm.default_fp8_config(tokens, 8, 256) for tokens in (1, 64, 256, 1024, 8192)}
    assert all(cfg.prequantize and cfg.block_n == cfg.block_k == 128 for cfg in rows.values())
    assert [rows[t].block_m for t in (1, 64, 256, 1024, 8192)] == [16, 16, 16, 64, 64]
    assert fm.default_fp8_config(256, 6, 64).block_m == 32  # V2-Lite's W1 decode: 24 per expert
    assert fm.default_fp8_config(1, 6, 64, group_k=64).block_k == 64


@pytest.mark.parametrize("change, message", [
    (dict(w2_scale=None), "need w13_scale and w2_scale"),
    (dict(w13_scale=lambda s: s[:, 1:]), "want"),
    (dict(w2_scale=lambda s: s.double()), "float32"),
    (dict(block=(128, 96)), "power of two"),
    (dict(config=MC(16, 64, 64, 1, 4, 2)), "block_k == bk"),
    (dict(config=MC(16, 64, 128, 1, 4, 2, prequantize=True)), "block_n == bk"),
    (dict(w13=lambda w: w.float(), w2=lambda w: w.float()), "float8_e4m3fn weights only"),
])
def test_fp8_rejects_bad_inputs(change, message):
    case = make_case(3, 4, 2, 128, 64, torch.float32, seed=1)
    config = change.pop("config", None)
    case = {**case, **{name: fn(case[name]) if callable(fn) else fn for name, fn in change.items()}}
    if case["w13"].dtype != fp8_ref.FP8:
        case["x"] = case["x"].float()
    with pytest.raises(ValueError, match=message):
        run_kernel(case, config)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("tokens,experts", [(4, 64), (600, 16)], ids=["decode", "prefill"])
def test_fp8_captures_in_a_cuda_graph(tokens, experts):
    # Capture fails on any host sync; replay on new routing must match the reference. Decode quantizes in
    # the GEMMs, prefill (225 per expert) in the separate kernel and the epilogue.
    case = make_case(tokens, experts, 6, 256, 128, torch.bfloat16, seed=9)
    run_kernel(case)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_kernel(case)
    new_weights, new_ids = routing(tokens, experts, 6, torch.Generator().manual_seed(10))
    case["topk_weights"].copy_(new_weights)
    case["topk_ids"].copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, run_ref(case)) < TOLERANCE[torch.bfloat16]
