"""`--quantization fp8` on unquantized Llama / Qwen2 / DeepSeek checkpoints: every linear layer quantized
at load (fp8 weights, one scale per output channel; routed experts in 128 x 128 blocks), activations per
token on the fly. Judged by transformers run on the dequantized weights, and the refusals."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2

from deepserve import LLM, SamplingParams
from deepserve.config import EngineArgs
from deepserve.kernels import fp8_ref
from deepserve.layers.quantization import Fp8Unsupported, resolve_quantization
from tests.conftest import save_checkpoint
from tests.loader.test_fp8 import TINY_V3, fp8_agreement, lossless_group_quantization
from tests.models.test_deepseek import make_hf_model
from tests.models.test_dense_models import COMMON, PROMPTS, make_dense_model, our_logits

DENSE = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, HFQwen2, dict(num_key_value_heads=2, tie_word_embeddings=False)),
}
# checkpoint projection -> (our merged parameter, member index): the rows to split back
_MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@pytest.fixture(scope="module", params=sorted(DENSE))
def dense(request, tmp_path_factory, tokenizer):
    hf_model = make_dense_model(*DENSE[request.param])
    return save_checkpoint(hf_model, tokenizer, str(tmp_path_factory.mktemp(request.param))), hf_model


def runner_model(path: str, **kwargs):
    from deepserve.runner.model_runner import ModelRunner

    args = EngineArgs(model=path, dtype="float32", device="cpu", **kwargs)
    return ModelRunner(args.create_engine_config()).model


def dequantized_copy(hf_model, ours) -> torch.nn.Module:
    """transformers' model with every linear weight replaced by our dequantized per-channel FP8 weight."""
    import copy

    ref = copy.deepcopy(hf_model)
    params = dict(ours.named_parameters())
    sizes = {}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            proj = name.split(".")[-2]
            if not name.endswith("proj.weight"):
                continue
            merged, member = _MERGED.get(proj, (proj, 0))
            ours_name = name.replace(f".{proj}.", f".{merged}.")
            w = params[ours_name].float() * params[ours_name.replace("weight", "weight_scale")][:, None]
            start = sum(sizes.get((ours_name, m), 0) for m in range(member))
            sizes[(ours_name, member)] = p.shape[0]
            p.copy_(w[start : start + p.shape[0]])
    return ref


def test_linear_weights_become_fp8_per_channel(dense):
    path, _ = dense
    model = runner_model(path, quantization="fp8")
    params = dict(model.named_parameters())
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"):
        assert params[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert params[f"{name}.weight_scale"].shape == (params[f"{name}.weight"].shape[0],)
    assert params["lm_head.weight"].dtype == params["model.embed_tokens.weight"].dtype == torch.float32


def test_quantized_logits_against_transformers_on_dequantized_weights(dense, monkeypatch):
    path, hf_model = dense
    ref = dequantized_copy(hf_model, runner_model(path, quantization="fp8"))
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([ids])).logits[0] for ids in PROMPTS])
    report = fp8_agreement(torch.cat(our_logits(path, PROMPTS, quantization="fp8")), want)
    # Measured (2 layers, hidden 64, 73 positions): llama 0.973 / 0.011 (two near-ties flip), qwen2 1.00 / 0.007.
    assert report["argmax_agreement"] >= 0.95 and report["max_top_logprob_gap"] <= 0.1, report
    # Without the activation rounding our FP8 model is exactly transformers' on the same weights.
    monkeypatch.setattr(fp8_ref, "quantize_per_token_group_ref", lossless_group_quantization)
    got = torch.cat(our_logits(path, PROMPTS, quantization="fp8"))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_llm_generates_with_fp8_and_follows_transformers(dense):
    path, hf_model = dense
    llm = LLM(model=path, dtype="float32", device="cpu", quantization="fp8")
    ref = dequantized_copy(hf_model, llm.llm_engine.core.runner.model)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=8, temperature=0.0))
    agree = total = 0
    for ids, out in zip(PROMPTS, outs, strict=True):
        seq = list(ids)
        with torch.no_grad():
            for token in out.outputs[0].token_ids:  # teacher-forced: transformers' choice after our prefix
                agree += int(ref(torch.tensor([seq])).logits[0, -1].argmax()) == token
                total += 1
                seq.append(token)
    assert total == 8 * len(PROMPTS) and agree / total >= 0.9, (agree, total)


def fp8_at_load_reference(hf_model) -> torch.nn.Module:
    """transformers' DeepSeek model with the weights `--quantization fp8` should end with, computed here
    from the checkpoint's own tensors: every projection but kv_b per output channel, each routed
    expert's gate, up and down in 128 x 128 blocks."""
    import copy

    ref = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
                for e in range(p.shape[0]):
                    for member in p[e].chunk(2):
                        member.copy_(fp8_ref.dequantize_weight_block(*fp8_ref.quantize_weight_block(member, (128, 128)),
                                                                     (128, 128)))
            elif name.endswith("experts.down_proj"):  # [E, H, I]
                for e in range(p.shape[0]):
                    q, scale = fp8_ref.quantize_weight_block(p[e], (128, 128))
                    p[e].copy_(fp8_ref.dequantize_weight_block(q, scale, (128, 128)))
            elif name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
                if ".kv_b_proj." not in name:
                    q, scale = fp8_ref.quantize_weight_per_channel(p)
                    p.copy_(q.float() * scale[:, None])
    return ref


def test_deepseek_at_load_equals_transformers_on_the_same_fp8_weights(tmp_path, tokenizer, monkeypatch):
    # With the activation rounding taken out, our per-channel dense layers and block-quantized experts
    # are exactly transformers on weights quantized and dequantized independently here.
    from tests.loader.test_fp8 import prompt_logits

    hf_model = make_hf_model(DeepseekV3Config, DeepseekV3ForCausalLM, dict(TINY_V3, moe_intermediate_size=160))
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path))
    ref = fp8_at_load_reference(hf_model)
    from tests.loader.test_fp8 import PROMPTS as V3_PROMPTS

    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([ids])).logits[0] for ids in V3_PROMPTS])
        plain = torch.cat([hf_model(torch.tensor([ids])).logits[0] for ids in V3_PROMPTS])
    assert not torch.allclose(want, plain, atol=1e-3)  # the quantization is real
    monkeypatch.setattr(fp8_ref, "quantize_per_token_group_ref", lossless_group_quantization)
    from tests.models.test_deepseek import make_runner

    got = torch.cat(prompt_logits(make_runner(path, quantization="fp8")))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_dummy_fp8_weights_are_small_and_varied():
    # --load-format dummy on an FP8 config (the V3 preset): fp8 codes over the whole e4m3 range times
    # scale_inv = 0.01 / 448, i.e. weights in [-0.01, 0.01] like the unquantized dummies.
    from deepserve.kernels.fp8_ref import dequantize_weight_block
    from deepserve.layers.linear import ReplicatedLinear
    from deepserve.layers.quantization import Fp8Config
    from deepserve.loader.checkpoint import init_dummy_weights

    layer = ReplicatedLinear(300, 200, quant=Fp8Config(weight_block=(128, 128)))
    init_dummy_weights(layer, seed=0)
    w = dequantize_weight_block(layer.weight, layer.weight_scale_inv, (128, 128))
    assert layer.weight.dtype == torch.float8_e4m3fn and w.abs().max() <= 0.01 + 1e-9
    assert w.std() > 0.004 and (w > 0).float().mean().item() == pytest.approx(0.5, abs=0.05)


def test_deepseek_quantized_at_load(tmp_path, tokenizer):
    # Dense layers per channel, routed experts in 128 x 128 blocks, wkv_b and the router untouched.
    hf_model = make_hf_model(DeepseekV3Config, DeepseekV3ForCausalLM, TINY_V3)
    path = save_checkpoint(hf_model, tokenizer, str(tmp_path))
    params = dict(runner_model(path, quantization="fp8").named_parameters())
    assert params["layers.1.ffn.experts.w13"].dtype == torch.float8_e4m3fn
    assert params["layers.1.ffn.experts.w13_scale_inv"].shape[1:] == (2 * 1, 2)  # I = 64 -> 1 block, H 144 -> 2
    # q_a_proj and kv_a_proj_with_mqa stacked (DEEPSERVE_FUSED_QKV_A, on by default), per-channel scales too
    assert params["layers.0.attn.wqkv_a.weight_scale"].dtype == torch.float32
    assert params["layers.0.attn.mla.wkv_b.weight"].dtype == torch.float32
    assert params["layers.1.ffn.gate.weight"].dtype == torch.float32
    llm = LLM(model=path, dtype="float32", device="cpu", quantization="fp8")
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=6, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 6


def test_unknown_quantization_is_refused(dense):
    path, _ = dense
    with pytest.raises(ValueError, match="--quantization") as refused:
        EngineArgs(model=path, device="cpu", quantization="int3").create_engine_config()
    said = str(refused.value)
    assert "'int3'" in said and all(m in said for m in ("fp8", "awq", "gptq", "none")), said


def test_gpu_without_fp8_is_refused_unless_told_to_dequantize(caplog):
    plain = LlamaConfig(**COMMON)
    with pytest.raises(ValueError, match="NVIDIA A100.*compute capability 8.0"):
        resolve_quantization(plain, "fp8", "cuda", (8, 0), "NVIDIA A100")
    shipped = DeepseekV3Config(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    # An FP8 checkpoint there is refused, naming the GPU and both ways out; dequantizing takes the flag.
    with pytest.raises(Fp8Unsupported, match=r"NVIDIA A100 \(compute capability 8.0\)") as refused:
        resolve_quantization(shipped, None, "cuda", (8, 0), "NVIDIA A100")
    assert "--quantization none" in str(refused.value) and "AWQ" in str(refused.value)
    with caplog.at_level(logging.INFO):
        assert resolve_quantization(shipped, "none", "cuda", (8, 0), "NVIDIA A100") is None
    assert "dequantized" in caplog.text
    assert resolve_quantization(shipped, None, "cuda", (9, 0), "NVIDIA H200") == "fp8"
    assert resolve_quantization(shipped, "none", "cuda", (9, 0)) is None
    assert resolve_quantization(shipped, "", "cuda", (9, 0)) == "fp8"  # Helm's empty value: the checkpoint's
    assert resolve_quantization(plain, None, "cpu") is None
