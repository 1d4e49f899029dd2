"""Every Triton kernel, as our wrappers launch it, compiles for the H200 (sm_90) — on a machine with no GPU.

CI runs the kernels in Triton's interpreter, which accepts code the real compiler rejects (a plain Python
global read inside a kernel did exactly that once, and only the GPU run found it). Here each wrapper runs
once on CPU with its kernels recorded, then every recorded launch is compiled for sm_90 with
`triton.compile`: the signature, the constexprs and num_warps / num_stages come from the launch itself.

With DEEPSERVE_PTX_FINGERPRINT=FILE set, every compiled launch also appends a line to FILE: the kernel,
its constexprs, a hash of its PTX without line and file directives (the PTX itself goes to FILE.ptx/) and
`code=`, a hash of the same without the parameter list, which an unused new argument alone changes. Run
these tests in two trees and diff the files to show, on a machine with no GPU, that a change leaves a
kernel's GPU code identical (e.g. the bf16 path after an FP8 or int4 change)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.kernels.triton_setup import ON_GPU, import_kernels

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(ON_GPU or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="compiles interpreter-recorded launches; a GPU run compiles them anyway")

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


class _Recorder:
    """Stands in for an interpreted kernel: records each launch's arguments, then runs it (execute False:
    does not, for wrappers whose host code never reads what their kernels write)."""

    def __init__(self, module: str, name: str, kernel, launches: list, execute: bool = True) -> None:
        self.module, self.name, self.kernel, self.launches = module, name, kernel, launches
        self.execute = execute

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(_job(self, args, dict(kwargs)))
            return self.kernel[grid](*args, **kwargs) if self.execute else None
        return launch

    # @triton.jit helpers are replaced too (one loop over the module): called from inside a kernel, they
    # must behave as themselves.
    def __call__(self, *args, **kwargs):
        return self.kernel(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


def _record(monkeypatch, modules, run, execute: bool = True) -> list:
    """The launches `run` makes of the kernels of `modules` (a module or a tuple of them); execute False
    records them without running them in the interpreter (most of such a test's time)."""
    launches: list = []
    for module in modules if isinstance(modules, tuple) else (modules,):
        for name, value in list(vars(module).items()):
            if type(value).__name__ == "InterpretedFunction":
                monkeypatch.setattr(module, name, _Recorder(module.__name__, name, value, launches, execute))
    run()
    assert launches, "the wrapper launched no kernel"
    return launches


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _job(rec: _Recorder, args: tuple, kwargs: dict) -> dict:
    """What compiling this launch needs, as plain JSON: the signature, the constexprs, the options."""
    from triton.runtime.jit import JITFunction

    fn = JITFunction(rec.kernel.fn)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr or value is None:  # Triton's launcher makes a None argument a constexpr too
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = _arg_type(value)
    job = {"module": rec.module, "kernel": rec.name, "signature": signature, "constexprs": constexprs,
           "options": options}
    if "launch_pdl" in kwargs:  # a launch option, not an argument: recorded for the tests to check
        job["launch_pdl"] = kwargs["launch_pdl"]
    return job


# Runs in a fresh interpreter without TRITON_INTERPRET: the interpreter patches triton.language in the
# process that uses it, and the compiler cannot run beside it.
_COMPILER = """
import hashlib, importlib, json, os, re, sys
import triton
from triton.backends.compiler import GPUTarget
fingerprints = os.environ.get("DEEPSERVE_PTX_FINGERPRINT")
for job in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    source = triton.compiler.ASTSource(fn=kernel, signature=job["signature"], constexprs=job["constexprs"])
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 64), options=job["options"])
    assert "ptx" in compiled.asm
    for needle in job.get("expect_ptx", ()):  # what a test asks the code to contain
        assert needle in compiled.asm["ptx"], (job["kernel"], needle)
    for first, then in job.get("expect_order", ()):  # `then` nowhere before `first`'s first place
        at, later = compiled.asm["ptx"].find(first), compiled.asm["ptx"].find(then)
        assert later < 0 or 0 <= at < later, (job["kernel"], first, then)
    print("compiled", job["kernel"], job["constexprs"])
    if fingerprints:  # the code without its source positions (.loc / .file) and debug sections
        code = compiled.asm["ptx"].split(".section\\t.debug")[0]
        code = "\\n".join(line for line in code.splitlines() if not line.strip().startswith((".loc", ".file", "//")))
        digest = hashlib.sha256(code.encode()).hexdigest()[:16]
        # and without the parameter list (an unused argument added to a kernel changes only that)
        body = re.sub(r"_param_[0-9]+", "_param", "\\n".join(
            line for line in code.splitlines() if not line.strip().startswith(".param")))
        with open(fingerprints, "a") as f:
            f.write(f"{job['kernel']} {json.dumps(job['constexprs'], sort_keys=True)} "
                    f"{json.dumps(job['options'], sort_keys=True)} {digest} "
                    f"code={hashlib.sha256(body.encode()).hexdigest()[:16]}\\n")
        os.makedirs(fingerprints + ".ptx", exist_ok=True)  # the code itself, to diff two trees' versions
        with open(os.path.join(fingerprints + ".ptx", job["kernel"] + "-" + digest + ".ptx"), "w") as f:
            f.write(code)
"""


def _compile_all(launches: list) -> None:
    """Compile every distinct launch for sm_90, the jobs shared among up to one compiler process per core
    (compiling is CPU-bound and the processes are independent: the int4 launches alone took ~70 s in one)."""
    unique = list({json.dumps(j, sort_keys=True): j for j in launches}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    workers = max(1, min(os.cpu_count() or 1, 4, len(unique) // 3))
    parts = [unique[i::workers] for i in range(workers)]
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, text=True, cwd=pathlib.Path(__file__).parents[2])
             for _ in parts]
    try:
        results = [proc.communicate(json.dumps(part), timeout=600) for proc, part in zip(procs, parts, strict=True)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-3000:]
    assert sum(out.count("compiled") for out, _ in results) == len(unique)


def test_sampling_kernel_compiles(monkeypatch):
    ks = import_kernels("deepserve.kernels.sampling")
    logits = torch.randn(3, 300, dtype=torch.bfloat16)
    t, g = torch.tensor([1.0, 0.7, 1.0]), torch.tensor([True, False, False])
    mask = torch.full((3, 10), -1, dtype=torch.int32)  # structured output's allowed-token bitmask
    big = torch.randn(2, 5000, dtype=torch.bfloat16)  # split rows: the second pass too
    ids, sampled = torch.tensor([-1, 7, -2]), torch.tensor([3, 4])
    _compile_all(_record(monkeypatch, ks, lambda: (ks.gumbel_sample(logits, t, g, seed=3),
                                                   ks.gumbel_sample(logits, t, g, seed=3, allowed_bitmask=mask),
                                                   ks.gumbel_sample(big, t[:2], g[:2], seed=3, all_greedy=True),
                                                   ks.fill_placeholders(ids, sampled))))


def test_head_matmul_compiles(monkeypatch):
    hm = import_kernels("deepserve.kernels.head_matmul")
    x = torch.randn(1, 16, 192, dtype=torch.bfloat16)[:, :, :128]  # q_nope: a slice of q
    w_uk = torch.randn(16, 128, 512, dtype=torch.bfloat16)
    o = torch.randn(1, 16, 512, dtype=torch.bfloat16)  # one token: the variant serving meets (head_matmul_fits)
    w_uv = torch.randn(16, 128, 512, dtype=torch.bfloat16)
    _compile_all(_record(monkeypatch, hm, lambda: (hm.head_matmul(x, w_uk.transpose(1, 2)), hm.head_matmul(o, w_uv))))


def test_routing_kernel_compiles(monkeypatch):
    routing = import_kernels("deepserve.kernels.moe_routing")
    from deepserve.layers.moe import RoutingConfig

    cfg = RoutingConfig(num_experts=16, top_k=4, topk_method="noaux_tc", scoring_func="sigmoid", n_group=4,
                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    logits, bias = torch.randn(3, 16), torch.randn(16)
    _compile_all(_record(monkeypatch, routing, lambda: (routing.fused_route(logits, cfg, bias),
                                                        routing.fused_route(logits, cfg, bias, shared=2))))


def test_router_logits_and_slot_sum_kernels_compile(monkeypatch):
    routing = import_kernels("deepserve.kernels.moe_routing")
    moe_sum = import_kernels("deepserve.kernels.moe_sum")

    def run() -> None:
        routing.router_logits(torch.randn(2, 300, dtype=torch.bfloat16), torch.randn(8, 300))
        y = torch.randn(6, 40)
        moe_sum.sum_slots(y.bfloat16(), 3)
        moe_sum.sum_slots(y, 3, torch.rand(2, 3), torch.tensor([[0, 1, 8], [2, 3, 4]]), 8, out_dtype=torch.bfloat16)

    _compile_all(_record(monkeypatch, (routing, moe_sum), run))


def test_paged_attention_kernels_compile(monkeypatch):
    pa = import_kernels("deepserve.kernels.triton_paged_attention")
    block_size, blocks = 16, 8
    kv = torch.randn(2, blocks, block_size, 2, 64, dtype=torch.bfloat16)
    latent = torch.randn(blocks, block_size, 96, dtype=torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([40, 9], dtype=torch.int32)
    slots = torch.tensor([3, -1, 17], dtype=torch.int64)

    def run():
        q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
        pa.paged_decode_attention(q, kv, tables, lens, 0.1, max_seq_len=64, num_splits=2)
        pa.paged_decode_attention(q, kv, tables, lens, 0.1, max_seq_len=64, num_splits=1)
        pa.paged_mla_decode_attention(torch.randn(2, 4, 64, dtype=torch.bfloat16),
                                      torch.randn(2, 4, 32, dtype=torch.bfloat16), latent, tables, lens, 0.1,
                                      max_seq_len=64, num_splits=2)
        pa.store_kv_cache(torch.randn(3, 2, 64, dtype=torch.bfloat16), torch.randn(3, 2, 64, dtype=torch.bfloat16),
                          kv, slots)
        pa.store_mla_cache(torch.randn(3, 96, dtype=torch.bfloat16), latent, slots)
        # FP8 caches (--kv-cache-dtype fp8): the constexpr-switched stores and decode kernels
        k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
        pa.paged_decode_attention(q, kv8, tables, lens, 0.1, max_seq_len=64, num_splits=2, k_scale=k_scale,
                                  v_scale=v_scale)
        pa.paged_mla_decode_attention(torch.randn(2, 4, 64, dtype=torch.bfloat16),
                                      torch.randn(2, 4, 32, dtype=torch.bfloat16), latent8, tables, lens, 0.1,
                                      max_seq_len=64, num_splits=1, kv_scale=k_scale)
        # the FP8 defaults from 5 sequences on (the value tile reloaded) and the 32-key one-load tiles
        for reload in (True, False):
            tiles = pa.LaunchConfig(block_n=32, block_h=16, num_warps=4, num_stages=2, fp8_widen="fp16",
                                    reload_values=reload)
            pa.paged_mla_decode_attention(torch.randn(2, 4, 64, dtype=torch.bfloat16),
                                          torch.randn(2, 4, 32, dtype=torch.bfloat16), latent8, tables, lens, 0.1,
                                          max_seq_len=64, num_splits=2, kv_scale=k_scale, config=tiles)
        pa.store_kv_cache(torch.randn(3, 2, 64, dtype=torch.bfloat16), torch.randn(3, 2, 64, dtype=torch.bfloat16),
                          kv8, slots, k_scale, v_scale)
        pa.store_mla_cache(torch.randn(3, 96, dtype=torch.bfloat16), latent8, slots, k_scale)

    kv8, latent8 = kv.to(torch.float8_e4m3fn), latent.to(torch.float8_e4m3fn)
    _compile_all(_record(monkeypatch, pa, run))


def test_fused_moe_kernels_compile(monkeypatch):
    fm = import_kernels("deepserve.kernels.fused_moe")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w13 = torch.randn(8, 2 * 32, 64, dtype=torch.bfloat16)
    w2 = torch.randn(8, 64, 32, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (5, 2))
    weights = torch.rand(5, 2)
    _compile_all(_record(monkeypatch, fm, lambda: fm.fused_moe(x, w13, w2, weights, ids)))


def test_fp8_gemm_kernels_compile(monkeypatch):
    fp8 = import_kernels("deepserve.kernels.fp8")
    split_k = import_kernels("deepserve.kernels.split_k")
    from deepserve.kernels.fp8_ref import quantize_weight_block, quantize_weight_per_channel

    block = (128, 128)
    w_q, w_scale = quantize_weight_block(torch.randn(200, 256), block)
    odd_q, odd_scale = quantize_weight_block(torch.randn(200, 328), block)
    bias = torch.randn(200, dtype=torch.bfloat16)

    def run():
        fp8.quantize_per_token_group(torch.randn(2, 5000, dtype=torch.bfloat16), 5000)  # per token, chunked
        x_q, x_scale = fp8.quantize_per_token_group(torch.randn(3, 256, dtype=torch.bfloat16), 128)
        # Every regime's launch as the wrappers choose it for real shapes: decode with split-K (and the
        # split sum, kernels/split_k.py), mid, prefill, each with a bias and without (DeepSeek's linears
        # have none); then an odd K (masked K loads) with a bias, and the per-channel path.
        for m, n, k in ((1, 576, 7168), (1, 24576, 1536), (200, 7168, 2048), (8192, 7168, 2048)):
            cfg = fp8.default_config(m, n, k, block)
            for b in (bias, None):
                fp8.block_fp8_matmul(x_q, x_scale, w_q, w_scale, block, torch.bfloat16, b, config=cfg)
        fp8.block_fp8_linear(torch.randn(3, 328, dtype=torch.bfloat16), odd_q, odd_scale, block, bias)
        fp8.channel_fp8_triton(torch.randn(3, 328, dtype=torch.bfloat16), *quantize_weight_per_channel(
            torch.randn(200, 328)))

    launches = _record(monkeypatch, (fp8, split_k), run)
    sums = [j["constexprs"]["HAS_BIAS"] for j in launches if j["kernel"] == "_sum_splits_kernel"]
    assert set(sums) == {True, False}, sums  # the decode path's split sum, with and without a bias
    _compile_all(launches)


def test_fp8_gemv_kernels_compile(monkeypatch):
    gemv = import_kernels("deepserve.kernels.fp8_gemv")
    from deepserve.kernels.fp8_ref import quantize_weight_block, quantize_weight_per_channel

    # The GPU's launch: a bf16 dot (the interpreter takes an fp32 one; its products are not checked here).
    monkeypatch.setattr(gemv, "INTERPRET", False)
    w_q, w_scale = quantize_weight_block(torch.randn(200, 328), (128, 128))
    c_q, c_scale = quantize_weight_per_channel(torch.randn(200, 256))
    bias = torch.randn(200, dtype=torch.bfloat16)

    def run():
        for numerics, m, prefetch in (("dot", 3, False), ("fma", 1, False), ("fma", 2, False), ("fma", 1, True),
                                      ("fma2d", 1, False), ("fma2d", 1, True)):
            cfg = gemv.Fp8GemvConfig(numerics=numerics, block_n=32, prefetch=prefetch)
            gemv.fp8_gemv(torch.randn(m, 328, dtype=torch.bfloat16), w_q, w_scale, (128, 128), bias, cfg)
            gemv.fp8_gemv(torch.randn(m, 256, dtype=torch.bfloat16), c_q, c_scale, None, None, cfg)

    launches = _record(monkeypatch, gemv, run)
    split_k = import_kernels("deepserve.kernels.split_k")
    launches += _record(monkeypatch, split_k, lambda: split_k.sum_splits(torch.zeros(2, 3, 200), torch.empty(
        3, 200, dtype=torch.bfloat16), bias))
    _compile_all(launches)


def test_int4_gemm_kernels_compile(monkeypatch):
    from dataclasses import replace

    int4 = import_kernels("deepserve.kernels.int4")
    split_k = import_kernels("deepserve.kernels.split_k")
    from deepserve.kernels.int4_ref import pack_rows

    n, k = 192, 256
    qweight = pack_rows(torch.randint(0, 16, (n, k)), 4)
    scales, zeros = torch.rand(n, 2, dtype=torch.float16), torch.full((n, 2), 8.0, dtype=torch.float16)
    bias = torch.randn(n, dtype=torch.bfloat16)

    def run():
        x = torch.randn(3, k, dtype=torch.bfloat16)
        # Every regime's launch as the wrappers choose it for real shapes: decode with split-K (and the
        # split sum, kernels/split_k.py, with and without a bias), mid, prefill; then act order, 8-bit
        # codes, and an odd K (masked K steps) with a bias.
        for m, nn, kk in ((1, 4096, 4096), (200, 4096, 4096), (8192, 4096, 4096)):
            cfg = int4.default_config(m, nn, kk)
            int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=cfg)
            int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=replace(cfg, reshape_unpack=False))
            int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, bias=bias, config=cfg)
        g_idx = (torch.randperm(k) // 128).to(torch.int32)
        int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, g_idx, bias)
        int4.w4a16_matmul(x, pack_rows(torch.randint(0, 256, (n, k)), 8), scales, zeros, 8, 128)
        odd = pack_rows(torch.randint(0, 16, (n, 200)), 4)
        int4.w4a16_matmul(torch.randn(3, 200, dtype=torch.bfloat16), odd, scales, zeros, 4, 128, bias=bias)

    launches = _record(monkeypatch, (int4, split_k), run)
    sums = [j["constexprs"]["HAS_BIAS"] for j in launches if j["kernel"] == "_sum_splits_kernel"]
    assert set(sums) == {True, False}, sums  # the decode path's split sum, with and without a bias
    _compile_all(launches)


def test_int4_gemv_and_dequant_kernels_compile(monkeypatch):
    # The decode GEMV (kernels/int4_gemv.py) and the prefill dequantization (kernels/int4_dequant.py) as
    # w4a16_matmul launches them: default tiles, both GEMV numerics, split-K, act order, 8-bit, odd K.
    from dataclasses import replace

    int4 = import_kernels("deepserve.kernels.int4")
    from deepserve.kernels import int4_dequant, int4_gemv, split_k
    from deepserve.kernels.int4_ref import pack_rows

    n, k = 192, 512
    qweight = pack_rows(torch.randint(0, 16, (n, k)), 4)
    scales, zeros = torch.rand(n, 4, dtype=torch.float16), torch.full((n, 4), 8.0, dtype=torch.float16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    g_idx = (torch.randperm(k) // 128).to(torch.int32)
    odd = pack_rows(torch.randint(0, 16, (n, 200)), 4)
    gemv, dequant = int4_gemv.Int4GemvConfig(), int4_dequant.Int4DequantConfig()

    def run():
        x = torch.randn(2, k, dtype=torch.bfloat16)
        for cfg in (gemv, int4_gemv.default_gemv_config(1), replace(gemv, factored=True), replace(gemv, split_k=2),
                    replace(gemv, prefetch=True),
                    replace(gemv, prefetch=True, factored=True, split_k=2), replace(gemv, block_m=4),
                    replace(gemv, block_m=4, block_n=16, block_k=128, factored=True), dequant,
                    replace(dequant, reshape_unpack=False), replace(gemv, factored=True, magic=True),
                    replace(int4_gemv.default_gemv_config(1), factored=True, magic=True)):
            int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=cfg)
            int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, g_idx, bias, config=cfg)
        for cfg in (gemv, replace(gemv, factored=True), dequant, replace(gemv, factored=True, magic=True)):
            int4.w4a16_matmul(x, pack_rows(torch.randint(0, 256, (n, k)), 8), scales, zeros, 8, 128, config=cfg)
            int4.w4a16_matmul(torch.randn(3, 200, dtype=torch.bfloat16), odd, scales, zeros, 4, 128, bias=bias,
                              config=cfg)

    # The int4 wrappers never read their kernels' outputs on the host: record without interpreting them
    # (split-K's sum too, which would add up the unwritten partials: it is compiled with them).
    _compile_all(_record(monkeypatch, (int4_gemv, int4_dequant, split_k), run, execute=False))


def test_fused_split_sum_gemvs_compile(monkeypatch):
    # DEEPSERVE_SPLIT_K_FUSED_SUM: both decode GEMVs with the in-kernel sum (the fences' inline PTX, which
    # the interpreter never sees, the counting atomic, the L2 reads), with and without a bias.
    split_k = import_kernels("deepserve.kernels.split_k")
    fp8_gemv = import_kernels("deepserve.kernels.fp8_gemv")
    from deepserve.kernels import int4_gemv
    from deepserve.kernels.fp8_ref import quantize_weight_block
    from deepserve.kernels.int4_ref import pack_rows

    int4 = import_kernels("deepserve.kernels.int4")
    monkeypatch.setattr(split_k, "FUSED_SUM", True)
    monkeypatch.setattr(split_k, "INTERPRET", False)
    monkeypatch.setattr(split_k, "_tile_locks", {})
    monkeypatch.setattr(fp8_gemv, "INTERPRET", False)
    w_q, w_scale = quantize_weight_block(torch.randn(200, 328), (128, 128))
    long_q, long_scale = quantize_weight_block(torch.randn(64, 4096), (128, 128))  # 8 splits: the unrolled sum
    n, k = 192, 512
    qweight = pack_rows(torch.randint(0, 16, (n, k)), 4)
    scales, zeros = torch.rand(n, 4, dtype=torch.float16), torch.full((n, 4), 8.0, dtype=torch.float16)
    bias = torch.randn(200, dtype=torch.bfloat16)

    def run():
        for m in (1, 2):
            fp8_gemv.fp8_gemv(torch.randn(m, 328, dtype=torch.bfloat16), w_q, w_scale, (128, 128), bias)
            fp8_gemv.fp8_gemv(torch.randn(m, 328, dtype=torch.bfloat16), w_q, w_scale, (128, 128), None)
            fp8_gemv.fp8_gemv(torch.randn(m, 4096, dtype=torch.bfloat16), long_q, long_scale, (128, 128), None)
            x = torch.randn(m, k, dtype=torch.bfloat16)
            int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=int4_gemv.default_gemv_config(m))
            int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, bias=bias[:n], config=int4_gemv.default_gemv_config(m))

    launches = _record(monkeypatch, (fp8_gemv, int4_gemv), run, execute=False)
    fused = [j for j in launches if j["constexprs"].get("FUSED_SUM")]
    assert len(fused) == len(launches) == 10 and all(j["constexprs"]["INTERPRETED"] is False for j in fused)
    assert max(j["constexprs"]["MAX_SPLITS"] for j in fused if j["kernel"] == "_fp8_gemv_kernel") >= 8
    _compile_all(launches)


def test_fused_moe_int4_kernels_compile(monkeypatch):
    fm = import_kernels("deepserve.kernels.fused_moe")
    from deepserve.kernels.int4_ref import pack_rows

    e, h, inter = 8, 256, 128
    w13, w2 = pack_rows(torch.randint(0, 16, (e, 2 * inter, h)), 4), pack_rows(torch.randint(0, 16, (e, h, inter)), 4)

    def operands(rows: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        # small scales: silu's exp stays in range in the interpreter run
        scales = (torch.rand(e, rows, groups) * 1e-3).half()
        return scales, torch.full((e, rows, groups), 8.0, dtype=torch.float16)

    int4 = fm.Int4Experts(4, *operands(2 * inter, 2), *operands(h, 1), 128, 128)
    act_order = fm.Int4Experts(4, *operands(2 * inter, 2), *operands(h, 1), 128, 128,
                               (torch.arange(h) // 128).repeat(e, 1).to(torch.int32),
                               torch.zeros(e, inter, dtype=torch.int32))
    x, ids, weights = torch.randn(5, h, dtype=torch.bfloat16), torch.randint(0, e, (5, 2)), torch.rand(5, 2)

    def run():
        for tokens in (1, 4096):  # decode and prefill tiles
            cfg = fm.default_config(tokens, 2, e, torch.bfloat16)
            fm.fused_moe(x, w13, w2, weights, ids, cfg, int4=int4)
        fm.fused_moe(x, w13, w2, weights, ids, int4=act_order)

    _compile_all(_record(monkeypatch, fm, run))


def test_int4_moe_gemv_kernels_compile(monkeypatch):
    # The decode expert GEMVs (kernels/int4_moe_gemv.py) as fused_moe launches them: both numerics,
    # act order, and an intermediate size that ends on a partial K step.
    from dataclasses import replace

    fm = import_kernels("deepserve.kernels.fused_moe")
    from deepserve.kernels import int4_moe_gemv
    from deepserve.kernels.int4_gemv import Int4GemvConfig, default_moe_gemv_config
    from deepserve.kernels.int4_ref import pack_rows

    e, h = 8, 256

    def experts(inter: int, act_order: bool):
        w13 = pack_rows(torch.randint(0, 16, (e, 2 * inter, h)), 4)
        w2 = pack_rows(torch.randint(0, 16, (e, h, inter)), 4)
        groups2 = -(-inter // 128)
        scales = [(torch.rand(e, 2 * inter, 2) * 1e-3).half(), (torch.rand(e, h, groups2) * 1e-3).half()]
        zeros = [torch.full((e, 2 * inter, 2), 8.0, dtype=torch.float16),
                 torch.full((e, h, groups2), 8.0, dtype=torch.float16)]
        g_idx = [(torch.arange(h) // 128).repeat(e, 1).to(torch.int32),
                 (torch.arange(inter) // 128).repeat(e, 1).to(torch.int32)] if act_order else [None, None]
        return w13, w2, fm.Int4Experts(4, scales[0], zeros[0], scales[1], zeros[1], 128, 128, *g_idx)

    x, ids, weights = torch.randn(2, h, dtype=torch.bfloat16), torch.randint(0, e, (2, 2)), torch.rand(2, 2)
    cfg = Int4GemvConfig()

    def run():
        for inter, act_order, factored in ((256, False, False), (256, False, True), (256, True, False),
                                           (176, False, False)):
            w13, w2, int4 = experts(inter, act_order)
            fm.fused_moe(x, w13, w2, weights, ids, replace(cfg, factored=factored), int4=int4)
            fm.fused_moe(x, w13, w2, weights, ids, replace(cfg, factored=factored, prefetch=True), int4=int4)
            if not factored:  # the expert GEMVs' default tiles (taken under DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS)
                fm.fused_moe(x, w13, w2, weights, ids, default_moe_gemv_config(), int4=int4)

    # not executed: the GEMVs' outputs (and so the slot sum's inputs) stay uninitialized; the routing kernels run
    moe_sum = import_kernels("deepserve.kernels.moe_sum")
    _compile_all(_record(monkeypatch, (int4_moe_gemv, moe_sum), run, execute=False))


def test_fused_rope_and_kv_store_kernel_compiles(monkeypatch):
    # DEEPSERVE_FUSED_ROPE_KV_STORE (kernels/rope_kv_store.py): a bf16 and an FP8 cache, a partial rotary dim,
    # interleaved pairs; the GPU's launches (no interpreter rounding).
    fused = import_kernels("deepserve.kernels.rope_kv_store")
    monkeypatch.setattr(fused, "INTERPRET", False)
    tokens, heads, kv_heads = 3, 4, 2
    positions = torch.tensor([0, 5, 9])
    slots = torch.tensor([1, -1, 7], dtype=torch.int64)

    def run():
        for dim, rotary, interleaved, cache_dtype in ((128, 128, False, torch.bfloat16), (80, 64, True, torch.bfloat16),
                                                      (128, 128, False, torch.float8_e4m3fn)):
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            cache = torch.zeros(2, 2, 16, kv_heads, dim).to(cache_dtype)
            cos_sin = torch.randn(16, rotary)
            fused.rope_and_store_kv(positions, q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim),
                                    v.view(tokens, kv_heads, dim), cos_sin, rotary, interleaved, cache, slots,
                                    torch.tensor(0.5), torch.tensor(2.0))
        # MLA (mla_rope_and_store): V2-Lite's 16 heads, rank 512, rope 64, interleaved; a bf16 and an FP8 cache
        q = torch.randn(tokens, 16, 192, dtype=torch.bfloat16)
        kv = torch.randn(tokens, 576, dtype=torch.bfloat16)
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            fused.mla_rope_and_store(positions, q[..., 128:], kv[:, 512:], kv[:, :512].contiguous(),
                                     torch.randn(16, 64), True, torch.zeros(2, 16, 576).to(cache_dtype), slots,
                                     torch.tensor(0.5))

    _compile_all(_record(monkeypatch, fused, run, execute=False))


def test_elementwise_kernels_compile(monkeypatch):
    ew = import_kernels("deepserve.kernels.elementwise")
    monkeypatch.setattr(ew, "INTERPRET", False)  # the GPU's launches: no interpreter rounding

    def run():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(5, 2 * 1030).to(dtype)
            ew.silu_and_mul(x)
            w = torch.ones(1000, dtype=dtype)
            ew.rms_norm(x[:, :1000], w, 1e-6)
            ew.add_rms_norm(torch.randn(3, 1000).to(dtype), torch.randn(3, 1000).to(dtype), w, 1e-6)
            cos_sin = torch.randn(16, 64)
            q, k = torch.randn(3, 4, 80).to(dtype), torch.randn(3, 2, 80).to(dtype)
            for interleaved in (False, True):
                ew.apply_rope(torch.tensor([0, 3, 15]), q, k, cos_sin, 64, interleaved)
            ew.apply_rope(torch.tensor([1, 2, 3]), q[..., :64], k[..., :64], cos_sin, 64, True)  # no rest

    _compile_all(_record(monkeypatch, ew, run))


def test_pdl_launches_compile_with_the_grid_dependency_instructions(monkeypatch):
    # DEEPSERVE_PDL (kernels/pdl.py): every kernel that takes part, launched as the switch launches it, compiles
    # for sm_90 with both griddepcontrol instructions in its code; the launches ask for programmatic dependence.
    ew = import_kernels("deepserve.kernels.elementwise")
    pa = import_kernels("deepserve.kernels.triton_paged_attention")
    fused = import_kernels("deepserve.kernels.rope_kv_store")
    from deepserve.kernels import pdl

    monkeypatch.setattr(pdl, "wanted", lambda t, rows, mla_moe=False: True)
    for module in (ew, fused):
        monkeypatch.setattr(module, "INTERPRET", False)

    def run():
        x = torch.randn(2, 2 * 1030, dtype=torch.bfloat16)
        ew.silu_and_mul(x)
        w = torch.ones(1000, dtype=torch.bfloat16)
        ew.rms_norm(x[:, :1000], w, 1e-6)
        ew.add_rms_norm(torch.randn(2, 1000, dtype=torch.bfloat16), torch.randn(2, 1000, dtype=torch.bfloat16), w,
                        1e-6)
        qkv = torch.randn(1, 8 * 128, dtype=torch.bfloat16)
        q, k, v = qkv.split([4 * 128, 2 * 128, 2 * 128], dim=-1)
        kv = torch.zeros(2, 4, 16, 2, 128, dtype=torch.bfloat16)
        fused.rope_and_store_kv(torch.tensor([3]), q.view(1, 4, 128), k.view(1, 2, 128), v.view(1, 2, 128),
                                torch.randn(16, 128), 128, False, kv, torch.tensor([3]))
        fused.mla_rope_and_store(torch.tensor([3]), torch.randn(1, 16, 64, dtype=torch.bfloat16),
                                 torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(1, 512, dtype=torch.bfloat16),
                                 torch.randn(16, 64), True, torch.zeros(2, 16, 576, dtype=torch.bfloat16),
                                 torch.tensor([3]))
        cache = torch.zeros(2, 8, 16, 2, 128, dtype=torch.bfloat16)  # 128 keys: room for 2 splits
        tables, lens = torch.arange(8, dtype=torch.int32)[None], torch.tensor([100], dtype=torch.int32)
        pa.paged_decode_attention(torch.randn(1, 4, 128, dtype=torch.bfloat16), cache, tables, lens, 0.1,
                                  num_splits=2)
        # DEEPSERVE_PDL_MLA_MOE's kernels: MLA decode, the absorbed head product, router logits, routing, slot sum
        latent = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
        pa.paged_mla_decode_attention(torch.randn(1, 16, 512, dtype=torch.bfloat16),
                                      torch.randn(1, 16, 64, dtype=torch.bfloat16), latent, tables, lens, 0.1)
        with monkeypatch.context() as m:  # DEEPSERVE_PDL_KV_PREFETCH: the first tile asked into L2 before the wait
            m.setattr(pdl, "KV_PREFETCH", True)
            pa.paged_decode_attention(torch.randn(1, 4, 128, dtype=torch.bfloat16), cache, tables, lens, 0.1,
                                      num_splits=2)
            pa.paged_mla_decode_attention(torch.randn(1, 16, 512, dtype=torch.bfloat16),
                                          torch.randn(1, 16, 64, dtype=torch.bfloat16), latent.to(torch.float8_e4m3fn),
                                          tables, lens, 0.1, kv_scale=torch.ones(1))
        hm.head_matmul(torch.randn(1, 16, 128, dtype=torch.bfloat16), torch.randn(16, 512, 128, dtype=torch.bfloat16))
        logits = routing.router_logits(torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(16, 256))
        routing.fused_route(logits, RoutingConfig(num_experts=16, top_k=4, topk_method="greedy",
                                                  scoring_func="softmax", n_group=1, topk_group=1,
                                                  norm_topk_prob=True, routed_scaling_factor=1.0))
        moe_sum.sum_slots(torch.randn(4, 256, dtype=torch.bfloat16), 4)
        # the fused MoE's FP8 path at one token: alignment, activation quantization, both grouped GEMMs
        w13 = torch.randn(4, 512, 256).to(torch.float8_e4m3fn)
        w2 = torch.randn(4, 256, 256).to(torch.float8_e4m3fn)
        fm.fused_moe(torch.randn(1, 256, dtype=torch.bfloat16), w13, w2, torch.rand(1, 2), torch.tensor([[0, 3]]),
                     w13_scale=torch.rand(4, 4, 2), w2_scale=torch.rand(4, 2, 2))

    hm = import_kernels("deepserve.kernels.head_matmul")
    fm = import_kernels("deepserve.kernels.fused_moe")
    routing = import_kernels("deepserve.kernels.moe_routing")
    moe_sum = import_kernels("deepserve.kernels.moe_sum")
    from deepserve.layers.moe import RoutingConfig

    launches = _record(monkeypatch, (ew, pa, fused, hm, routing, moe_sum, fm), run, execute=False)
    assert {j["kernel"] for j in launches} == {"_silu_and_mul_kernel", "_rms_norm_kernel", "_rope_kv_store_kernel",
                                              "_mla_rope_store_kernel", "_gqa_decode_kernel", "_merge_splits_kernel",
                                              "_mla_decode_kernel", "_head_matmul_kernel", "_router_logits_kernel",
                                              "_route_kernel", "_sum_slots_kernel", "_moe_align_kernel",
                                              "_quantize_groups_kernel", "_fused_moe_gemm_kernel"}
    # Only these read anything before the wait: their weights (constants), by design, and with KV prefetch the
    # decode attention its block table and seq_lens (written before the step's first kernel), to prefetch
    weights_first = {"_rms_norm_kernel", "_head_matmul_kernel"}
    prefetching = [j for j in launches if j["constexprs"].get("PREFETCH")]
    # GQA bf16: 256 bytes a key, 2 lines; MLA FP8: 576, 5 lines rounded up to 8
    assert [(j["kernel"], j["constexprs"]["PREFETCH"]) for j in prefetching] == [("_gqa_decode_kernel", 2),
                                                                                 ("_mla_decode_kernel", 8)]
    for job in prefetching:
        job["expect_order"] = [["prefetch.global.L2", "griddepcontrol.wait"]]  # the prefetch comes first
    for job in launches:
        assert job["constexprs"]["PDL"] is True and job["launch_pdl"] is True, job["kernel"]
        job["expect_ptx"] = ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
        # nothing stored, counted or copied asynchronously before the wait; nothing loaded either but weights
        reads_first = job["kernel"] in weights_first or job["constexprs"].get("PREFETCH", False)
        after_wait = ["st.global", "atom.", "red.", "cp.async"] + ([] if reads_first else ["ld.global"])
        job["expect_order"] = job.get("expect_order", []) + [["griddepcontrol.wait", then] for then in after_wait]
        del job["launch_pdl"]
    _compile_all(launches)


_PTX_COUNT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
for job in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    source = triton.compiler.ASTSource(fn=kernel, signature=job["signature"], constexprs=job["constexprs"])
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 64), options=job["options"]).asm["ptx"]
    print(json.dumps([job["constexprs"]["MAGIC"], job["signature"]["a_ptr"], job["constexprs"]["BITS"],
                      job["constexprs"]["HAS_G_IDX"], ptx.count("prmt.b32")]))
"""


def test_int4_magic_gemv_takes_the_byte_permutes_on_the_gpu(monkeypatch):
    # The one-token default (DEEPSERVE_INT4_GEMV_MAGIC) must compile to _magic_tile's inline PTX on sm_90 for
    # bf16 and fp16 inputs (8 prmt a word: 64 per 64 x 128 tile's loop, more with the prefetch's copies), and
    # every case it must not take (the factored config, fp32 inputs, 8-bit codes, act order) to none: the
    # interpreter's tests pass on the factored loop too, so only the compiled code shows which loop runs.
    from dataclasses import replace

    from deepserve.kernels import int4_gemv, split_k
    from deepserve.kernels.int4_ref import pack_rows

    int4 = import_kernels("deepserve.kernels.int4")
    monkeypatch.setattr(split_k, "INTERPRET", False)  # the GPU's launch: ASM on (recorded, not run)
    monkeypatch.setattr(split_k, "_tile_locks", {})
    n, k = 192, 512
    scales, zeros = torch.rand(n, 4, dtype=torch.float16), torch.full((n, 4), 8.0, dtype=torch.float16)
    g_idx = (torch.randperm(k) // 128).to(torch.int32)
    magic = int4_gemv.default_gemv_config(1)
    assert magic.magic and magic.factored

    def run():
        for bits in (4, 8):
            qweight = pack_rows(torch.randint(0, 2**bits, (n, k)), bits)
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = torch.randn(1, k, dtype=dtype)
                int4.w4a16_matmul(x, qweight, scales, zeros, bits, 128, config=magic)
                if bits == 4 and dtype != torch.float32:
                    int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, g_idx, config=magic)
                    int4.w4a16_matmul(x, qweight, scales, zeros, 4, 128, config=replace(magic, magic=False))

    launches = _record(monkeypatch, int4_gemv, run, execute=False)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PTX_COUNT], input=json.dumps(launches), capture_output=True,
                          text=True, env=env, cwd=pathlib.Path(__file__).parents[2], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 10
    for magic_on, dtype, bits, act_order, permutes in rows:
        takes = magic_on and bits == 4 and not act_order and dtype in ("*bf16", "*fp16")
        assert (permutes >= 64) if takes else (permutes == 0), (magic_on, dtype, bits, act_order, permutes)


def test_sass_loop_counts_a_shorter_magic_loop_of_byte_permutes():
    # bench/sass_loop.py (the figures in int4_gemv.py's docstring): the one-token GEMV's K loop in sm_90
    # machine code, one byte permute per code with the magic numerics and fewer instructions than factored
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).parents[2]
    done = subprocess.run([sys.executable, str(root / "bench" / "sass_loop.py")], capture_output=True, text=True,
                          env=env, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {line.split(":")[0]: line for line in done.stdout.splitlines()}
    total = {name: int(line.split(": ")[1].split()[0]) for name, line in counts.items()}
    assert total["magic"] < total["factored"], done.stdout
    assert "PRMT 64" in counts["magic"] and "PRMT" not in counts["factored"], done.stdout
