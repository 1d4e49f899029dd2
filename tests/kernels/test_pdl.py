"""kernels/pdl.py: programmatic dependent launch for the decode step's small kernels (DEEPSERVE_PDL).

On CPU: when a launch asks for it. On a Hopper GPU: a decode-like chain of the kernels that take part (each
layer's norm, rope + KV store, split decode attention and its merge, the FP8 tensor-core GEMV, SiLU-and-mul, with a
cuBLAS product, which does not take part, between two of them), captured in a CUDA graph with and without it,
gives the same bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, ON_GPU, import_kernels

HOPPER = ON_GPU and torch.cuda.get_device_capability() >= (9, 0)


def test_launches_ask_for_it_only_when_switched_on_on_a_gpu_and_for_one_row(monkeypatch):
    pdl = import_kernels("deepserve.kernels.pdl")
    monkeypatch.setattr(pdl, "ON", False)
    assert not pdl.wanted(torch.zeros(1, device=DEVICE), 1)
    monkeypatch.setattr(pdl, "ON", True)
    assert not pdl.wanted(torch.zeros(1), 1)  # a CPU tensor: never
    assert pdl.wanted(torch.zeros(1, device=DEVICE), 1) == HOPPER
    assert not pdl.wanted(torch.zeros(1, device=DEVICE), 2)  # two rows: GEMMs around it that do not take part
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


@pytest.mark.parametrize("setting, on", [(None, True), ("1", True), ("0", False)])
def test_the_mla_moe_switch_is_on_unless_turned_off(setting, on):
    # On by default (int4, bf16 and FP8 experts each timed no slower with it), read once when pdl is imported:
    # a fresh interpreter imports it under each setting.
    env = {k: v for k, v in os.environ.items() if k != "DEEPSERVE_PDL_MLA_MOE"}
    if setting is not None:
        env["DEEPSERVE_PDL_MLA_MOE"] = setting
    code = "from deepserve.kernels import pdl; print(pdl.MLA_MOE)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(on)


def test_mla_moe_launches_follow_the_switch(monkeypatch):
    pdl = import_kernels("deepserve.kernels.pdl")
    monkeypatch.setattr(pdl, "ON", True)
    monkeypatch.setattr(pdl, "_hopper", lambda device: True)
    x = torch.zeros(1)
    for on in (True, False):
        monkeypatch.setattr(pdl, "MLA_MOE", on)
        assert pdl.wanted(x, 1) and pdl.wanted(x, 1, mla_moe=True) is on and not pdl.wanted(x, 2, mla_moe=True)


@pytest.fixture
def tensors_on_the_kernels_device():
    """Factory calls make their tensors where the kernels run: the CPU under the interpreter, else the GPU
    (a CPU tensor handed to compiled Triton is refused)."""
    with torch.device(DEVICE):
        yield


@pytest.mark.usefixtures("tensors_on_the_kernels_device")
def test_each_launch_counts_the_rows_the_rule_is_about(monkeypatch):
    # kernels/pdl.py's MAX_ROWS is about one-token steps: each wrapper passes its tokens (sequences for decode
    # attention, whose rows are the batch), never its assignments or heads; the MLA / MoE kernels say so
    pdl = import_kernels("deepserve.kernels.pdl")
    ew = import_kernels("deepserve.kernels.elementwise")
    pa = import_kernels("deepserve.kernels.triton_paged_attention")
    from deepserve.kernels import head_matmul, moe_routing, moe_sum, rope_kv_store
    from deepserve.layers.moe import RoutingConfig

    seen: list = []
    monkeypatch.setattr(pdl, "wanted", lambda t, rows, mla_moe=False: seen.append((rows, mla_moe)) and False)

    def rows_of(fn) -> set:
        seen.clear()
        fn()
        return set(seen)

    bf16 = torch.bfloat16
    assert rows_of(lambda: ew.rms_norm(torch.randn(3, 64, dtype=bf16), torch.ones(64, dtype=bf16), 1e-6)) == \
        {(3, False)}
    assert rows_of(lambda: ew.silu_and_mul(torch.randn(2, 64, dtype=bf16))) == {(2, False)}
    assert rows_of(lambda: ew.silu_and_mul(torch.randn(6, 64, dtype=bf16), tokens=1)) == {(1, True)}  # MoE slots
    qkv = torch.randn(2, 4 * 64, dtype=bf16)
    cache = torch.zeros(2, 8, 16, 1, 64, dtype=bf16)
    assert rows_of(lambda: rope_kv_store.rope_and_store_kv(
        torch.tensor([3, 4]), qkv[:, :128].reshape(2, 2, 64), qkv[:, 128:192].reshape(2, 1, 64),
        qkv[:, 192:].reshape(2, 1, 64), torch.randn(16, 64), 64, False, cache, torch.tensor([3, 20]))) == {(2, False)}
    tables, lens = torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([50, 60], dtype=torch.int32)
    assert rows_of(lambda: pa.paged_decode_attention(torch.randn(2, 2, 64, dtype=bf16), cache, tables, lens, 0.1,
                                                     num_splits=2)) == {(2, False)}  # with its merge
    latent = torch.zeros(8, 16, 96, dtype=bf16)
    assert rows_of(lambda: pa.paged_mla_decode_attention(torch.randn(2, 16, 64, dtype=bf16),
                                                         torch.randn(2, 16, 32, dtype=bf16), latent, tables, lens,
                                                         0.1, num_splits=2)) == {(2, True), (2, False)}
    assert rows_of(lambda: head_matmul.head_matmul(torch.randn(1, 4, 64, dtype=bf16),
                                                   torch.randn(4, 32, 64, dtype=bf16))) == {(1, True)}
    assert rows_of(lambda: moe_routing.router_logits(torch.randn(3, 64, dtype=bf16), torch.randn(8, 64))) == \
        {(3, True)}
    cfg = RoutingConfig(num_experts=8, top_k=2, topk_method="greedy", scoring_func="softmax", n_group=1,
                        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert rows_of(lambda: moe_routing.fused_route(torch.randn(3, 8), cfg)) == {(3, True)}
    assert rows_of(lambda: moe_sum.sum_slots(torch.randn(6, 64), 3)) == {(2, True)}  # 6 slots of 2 tokens
    # the fused MoE's FP8 path (alignment, activation quantization, both grouped GEMMs, slot sum): its tokens
    from deepserve.kernels import fp8_ref
    from deepserve.kernels.fused_moe import fused_moe

    w13, s13 = fp8_ref.quantize_weight_block(torch.randn(4 * 256, 128), (128, 128))
    w2, s2 = fp8_ref.quantize_weight_block(torch.randn(4 * 128, 128), (128, 128))
    ids = torch.tensor([[0, 2], [1, 3], [2, 0]])
    assert rows_of(lambda: fused_moe(torch.randn(3, 128, dtype=bf16), w13.view(4, 256, 128), w2.view(4, 128, 128),
                                     torch.rand(3, 2), ids, w13_scale=s13.view(4, 2, 1),
                                     w2_scale=s2.view(4, 1, 1))) == {(3, True)}


def _chain(layers: int = 4, hidden: int = 512, heads: int = 4, dim: int = 128, keys: int = 300):
    ew = import_kernels("deepserve.kernels.elementwise")
    pa = import_kernels("deepserve.kernels.triton_paged_attention")
    from deepserve.kernels.fp8_mma_gemv import fp8_mma_gemv
    from deepserve.kernels.rope_kv_store import rope_and_store_kv

    g = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=DEVICE, generator=g).mul(scale).to(torch.bfloat16)

    page, blocks = 16, (keys + 16) // 16 + 1
    caches = [randn(2, blocks, page, heads, dim, scale=0.5) for _ in range(layers)]
    norms = [1 + randn(hidden, scale=0.1) for _ in range(2 * layers)]
    w_qkv = [randn(hidden, 3 * heads * dim, scale=0.05) for _ in range(layers)]
    # gate_up as FP8 weights (the tensor-core GEMV, which takes part) with per-channel scales
    w_up = [(randn(2 * hidden, hidden).to(torch.float8_e4m3fn),
             torch.rand(2 * hidden, device=DEVICE, generator=g) * 0.01 + 0.001) for _ in range(layers)]
    positions = torch.tensor([keys], device=DEVICE)
    slots = torch.tensor([keys], device=DEVICE, dtype=torch.int64)
    tables = torch.arange(blocks, device=DEVICE, dtype=torch.int32)[None]
    lens = torch.tensor([keys + 1], device=DEVICE, dtype=torch.int32)
    cos_sin = torch.randn(1024, dim, device=DEVICE, generator=g)
    x0, res0 = randn(1, hidden), randn(1, hidden)

    def run():
        x, res = x0, res0
        for i in range(layers):
            h, res = ew.add_rms_norm(x, res, norms[2 * i], 1e-6)
            q, k, v = (h @ w_qkv[i]).view(1, 3 * heads, dim).split(heads, dim=1)  # cuBLAS: no PDL
            q, _ = rope_and_store_kv(positions, q, k, v, cos_sin, dim, False, caches[i], slots)
            attn = pa.paged_decode_attention(q, caches[i], tables, lens, dim ** -0.5, max_seq_len=1024, num_splits=4)
            h = ew.rms_norm(attn.view(1, heads * dim)[:, :hidden], norms[2 * i + 1], 1e-6)
            x = ew.silu_and_mul(fp8_mma_gemv(h, *w_up[i], None))
        return [x, res] + caches

    return run, x0


def _mla_moe_chain(layers: int = 3, heads: int = 16, rank: int = 512, rope: int = 64, nope: int = 128,
                   hidden: int = 1024, experts: int = 16, keys: int = 300):
    """A V2-Lite-like layer's MLA and routing kernels and FP8 routed experts (DEEPSERVE_PDL_MLA_MOE's), between norms
    and cuBLAS products."""
    ew = import_kernels("deepserve.kernels.elementwise")
    pa = import_kernels("deepserve.kernels.triton_paged_attention")
    from deepserve.kernels.fp8_ref import quantize_weight_block
    from deepserve.kernels.fused_moe import fused_moe
    from deepserve.kernels.head_matmul import head_matmul
    from deepserve.kernels.moe_routing import fused_route, router_logits
    from deepserve.kernels.moe_sum import sum_slots
    from deepserve.kernels.rope_kv_store import mla_rope_and_store
    from deepserve.layers.moe import RoutingConfig

    g = torch.Generator(device=DEVICE).manual_seed(1)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return torch.randn(*shape, device=DEVICE, generator=g).mul(scale).to(dtype)

    page, blocks = 16, (keys + 16) // 16 + 1
    caches = [randn(blocks, page, rank + rope, scale=0.5) for _ in range(layers)]
    norms = [1 + randn(hidden, scale=0.1) for _ in range(layers)]
    w_q = [randn(hidden, heads * (nope + rope), scale=0.03) for _ in range(layers)]
    w_kv = [randn(hidden, rank + rope, scale=0.03) for _ in range(layers)]
    w_uk = [randn(heads, rank, nope, scale=0.05) for _ in range(layers)]
    w_uv = [randn(heads, nope, rank, scale=0.05) for _ in range(layers)]
    w_router = [randn(experts, hidden, scale=0.05, dtype=torch.float32) for _ in range(layers)]

    def fp8_experts(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_weight_block(randn(experts * rows, cols, dtype=torch.float32), (128, 128))
        return q.view(experts, rows, cols), scale.view(experts, rows // 128, cols // 128) * 0.02

    w_experts = []
    for _ in range(layers):
        (w13, s13), (w2, s2) = fp8_experts(2 * 256, hidden), fp8_experts(hidden, 256)
        w_experts.append((w13, w2, dict(w13_scale=s13, w2_scale=s2)))
    cfg = RoutingConfig(num_experts=experts, top_k=4, topk_method="greedy", scoring_func="softmax", n_group=1,
                        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    positions = torch.tensor([keys], device=DEVICE)
    slots = torch.tensor([keys], device=DEVICE, dtype=torch.int64)
    tables = torch.arange(blocks, device=DEVICE, dtype=torch.int32)[None]
    lens = torch.tensor([keys + 1], device=DEVICE, dtype=torch.int32)
    cos_sin = torch.randn(1024, rope, device=DEVICE, generator=g)
    x0 = randn(1, hidden)

    def run():
        x, outs = x0, []
        for i in range(layers):
            h = ew.rms_norm(x, norms[i], 1e-6)
            q = (h @ w_q[i]).view(1, heads, nope + rope)  # cuBLAS: no PDL
            kv = h @ w_kv[i]
            q_pe, _ = mla_rope_and_store(positions, q[..., nope:], kv[:, rank:], kv[:, :rank].contiguous(), cos_sin,
                                         True, caches[i], slots)
            q_latent = head_matmul(q[..., :nope], w_uk[i])  # [1, H, R]
            latents = pa.paged_mla_decode_attention(q_latent, q_pe, caches[i], tables, lens, 0.1, max_seq_len=1024,
                                                    num_splits=4)
            o = head_matmul(latents, w_uv[i])  # [1, H, nope]
            weights, ids = fused_route(router_logits(h, w_router[i]), cfg)
            mixed = sum_slots(o.view(1, heads * nope)[:, :hidden].repeat(4, 1), 4, weights, ids, experts)
            w13, w2, scales = w_experts[i]
            routed = fused_moe(h, w13, w2, weights, ids, block=(128, 128), **scales)  # FP8 experts, V3's format
            x = ew.silu_and_mul(torch.cat([mixed + routed, h], dim=-1))
            outs += [weights, ids, o, routed]
        return [x] + outs + caches

    return run, x0


def _fill_freed_memory_with_nans() -> None:
    # Freed blocks of torch's caching allocator keep their bytes: a run that read a buffer before the kernel
    # writing it had finished would read these NaNs, not the plain run's values left in the same blocks.
    junk = [torch.full((n,), float("nan"), device=DEVICE) for n in [1 << 10] * 256 + [1 << 18] * 64 + [1 << 23] * 8]
    del junk


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs an sm_90+ GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("chain", ["gqa-fp8-gemv", "gqa-kv-prefetch", "mla-moe", "mla-moe-kv-prefetch"])
def test_a_decode_chain_with_it_gives_the_plain_chains_bits(monkeypatch, chain):
    # Eagerly, then in a CUDA graph replayed with a new input each time (a read that raced ahead of its
    # producer would see the previous replay's values), with and without PDL: the same bits every time.
    # *-kv-prefetch: DEEPSERVE_PDL_KV_PREFETCH too, the decode attention's first tile asked into L2 before the
    # wait, while the rope + KV store before it may still be writing the newest key.
    pdl = import_kernels("deepserve.kernels.pdl")
    monkeypatch.setattr(pdl, "MLA_MOE", True)  # DEEPSERVE_PDL_MLA_MOE: with ON, those kernels take part too
    monkeypatch.setattr(pdl, "KV_PREFETCH", chain.endswith("kv-prefetch"))
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ON", on)
        run, x0 = _mla_moe_chain() if chain.startswith("mla") else _chain()
        g = torch.Generator(device=DEVICE).manual_seed(7)  # the same inputs for both
        inputs = [torch.randn(x0.shape, device=DEVICE, generator=g).to(x0.dtype) for _ in range(4)]
        _fill_freed_memory_with_nans()
        x0.copy_(inputs[0])
        got = [t.clone() for t in run()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for new in inputs[1:]:
            x0.copy_(new)
            graph.replay()
            got += [t.clone() for t in out]
        torch.cuda.synchronize()
        results[on] = got
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(a, b)
    assert torch.isfinite(results[False][0].float()).all()
