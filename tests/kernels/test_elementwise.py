"""kernels/elementwise.py (DEEPSERVE_TRITON_ELEMENTWISE) against the layers' plain functions, its references,
on odd shapes and strided views; then whole tiny models routed through the kernels against transformers."""

from __future__ import annotations

import pytest
import torch

from deepserve.layers.activation import silu_and_mul
from deepserve.layers.norm import add_rms_norm, rms_norm
from deepserve.layers.rotary import _apply_rope
from tests.kernels.triton_setup import DEVICE, MARKS, ON_GPU, import_kernels

ew = import_kernels("deepserve.kernels.elementwise")
pytestmark = MARKS

# fp32: the kernels and references agree to rounding; bf16: to about one rounding of the output.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _ref(fn):
    return fn.__wrapped__  # the plain function the layer runs on CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, inner", [(0, 8), (1, 3), (5, 1000), (3, 1030), (2, 2048)])
def test_silu_and_mul(dtype, tokens, inner):
    torch.manual_seed(0)
    x = (torch.randn(tokens, 2 * inner, device=DEVICE) * 3).to(dtype)
    got = ew.silu_and_mul(x)
    want = _ref(silu_and_mul)(x.float()).to(dtype)  # the compiled chain's numerics: fp32, rounded once
    assert got.shape == (tokens, inner) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    # 3-D input: rows are every leading index
    x3 = x[: tokens // 2 * 2].reshape(-1, 2, 2 * inner) if tokens >= 2 else x.reshape(tokens, 1, 2 * inner)
    torch.testing.assert_close(ew.silu_and_mul(x3), ew.silu_and_mul(x3.reshape(-1, 2 * inner)).view(
        *x3.shape[:-1], inner), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("tokens, hidden", [(0, 64), (1, 96), (7, 1000), (3, 2048)])
def test_rms_norm_and_the_residual_add(dtype, w_dtype, tokens, hidden):
    torch.manual_seed(1)
    wide = torch.randn(tokens, hidden + 24, device=DEVICE).to(dtype)
    x = wide[:, :hidden]  # a strided view, as MLA's latent slice is
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    weight = (1 + torch.randn(hidden, device=DEVICE) * 0.1).to(w_dtype)
    got = ew.rms_norm(x, weight, 1e-6)
    want = _ref(rms_norm)(x, weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    got_out, got_sum = ew.add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_sum = _ref(add_rms_norm)(x, residual, weight, 1e-5)
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # one add, rounded to x's dtype: exact
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])


def test_rms_norm_refuses_a_weight_of_another_width():
    with pytest.raises(ValueError, match="weight"):
        ew.rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(7, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 16), (80, 64), (100, 64), (24, 8)])
def test_rope(dtype, interleaved, head_dim, rotary_dim):
    torch.manual_seed(2)
    tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views of one projection
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(DEVICE)
    positions = torch.tensor([0, 5, 63, 17, 17, 2], device=DEVICE)
    got_q, got_k = ew.apply_rope(positions, q, k, cos_sin, rotary_dim, interleaved)
    want_q, want_k = _ref(_apply_rope)(positions, q, k, cos_sin, rotary_dim, interleaved)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])  # the rest is copied
    assert torch.equal(got_q[0], q[0])  # position 0 rotates by nothing (cos 1, sin 0)


def test_the_switch_is_decided_at_import_and_on_by_default():
    # Off: the layers' functions are compiled_on_cuda's wrappers themselves (no added call on the default
    # path). On: a wrapper that routes GPU tensors to the kernel and everything else to the compiled chain.
    import os
    import subprocess
    import sys

    probe = ("import torch; from deepserve.layers import norm, fusion\n"
             "print(fusion.TRITON_ELEMENTWISE, getattr(norm.rms_norm, 'triton_kernel', None))\n"
             "fusion._on_gpu = lambda t: True  # route this CPU tensor as a GPU one would go\n"
             "from deepserve.kernels import elementwise\n"
             "elementwise.rms_norm = lambda *a: 'kernel'\n"
             "print(norm.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6) == 'kernel')\n")
    env = {k: v for k, v in os.environ.items() if k != "DEEPSERVE_TRITON_ELEMENTWISE"}
    on = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    off = subprocess.run([sys.executable, "-c", probe], env={**env, "DEEPSERVE_TRITON_ELEMENTWISE": "0"},
                         capture_output=True, text=True, timeout=300)
    assert off.stdout.split() == ["False", "None", "False"], off.stderr[-2000:]
    assert on.stdout.split() == ["True", "rms_norm", "True"], on.stderr[-2000:]


@pytest.fixture
def through_the_kernels(monkeypatch):
    """Route the layers' chains through kernels/elementwise.py on this device (CPU: Triton's interpreter), as
    the switch does on a GPU, counting the launches so a test can tell the kernels really ran. The models run on
    the CPU: on a machine with a GPU, Triton compiles for it and cannot take CPU tensors (the engine checks run
    the kernels there, bench/gpu_check.py), so these tests are CPU-only."""
    if ON_GPU:
        pytest.skip("CPU-only: the models run on the CPU, which only Triton's interpreter (no GPU) launches on")
    from deepserve.layers import activation, norm, rotary

    calls = []
    for module, name, kernel in ((activation, "silu_and_mul", "silu_and_mul"), (norm, "rms_norm", "rms_norm"),
                                 (norm, "add_rms_norm", "add_rms_norm"), (rotary, "_apply_rope", "apply_rope")):
        real = getattr(ew, kernel)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=kernel: (calls.append(_name), _real(*a))[1])
    return calls


def test_a_dense_model_through_the_kernels_matches_transformers(through_the_kernels, tokenizer, tmp_path):
    from tests.conftest import save_checkpoint
    from tests.models.test_dense_models import PROMPTS, VARIANTS, make_dense_model, our_logits

    hf_model = make_dense_model(*VARIANTS["qwen2-gqa-untied"])
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path / "qwen2"))
    ours = our_logits(path, PROMPTS)
    assert {"silu_and_mul", "add_rms_norm", "rms_norm", "apply_rope"} <= set(through_the_kernels)
    for ids, got in zip(PROMPTS, ours, strict=True):
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["v2-group-limited-qlora-yarn", "v3-neox-no-qlora-tied"])
def test_deepseek_through_the_kernels_matches_transformers(through_the_kernels, tokenizer, tmp_path, variant):
    # MLA's norms over latent slices, interleaved (V2) and neox (V3 variant) rope, MoE experts' SiLU.
    from tests.conftest import save_checkpoint
    from tests.models.test_deepseek import (
        PROMPTS,
        VARIANTS,
        hf_logits,
        make_hf_model,
        make_runner,
        run_step,
        with_blocks,
    )

    hf_model = make_hf_model(*VARIANTS[variant])
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path / variant))
    runner = make_runner(path)
    runner.allocate_kv_cache(64)
    prompts = PROMPTS[:2]  # a short and a long one (the interpreter's time grows with the tokens)
    requests = with_blocks(runner, prompts)
    logits = run_step(runner, [(r, 0, len(r.prompt_token_ids)) for r in requests])
    assert {"silu_and_mul", "rms_norm", "apply_rope"} <= set(through_the_kernels)
    for ids, got in zip(prompts, logits.split([len(p) for p in prompts]), strict=True):
        torch.testing.assert_close(got, hf_logits(hf_model, ids), atol=2e-5, rtol=1e-4)
