"""DeepSeek's FP8 block-scaled checkpoints: block dequantization, weight/scale pairing across
shards, MTP layers skipped, and a tiny V3 checkpoint quantized here that loads and matches its
dequantized reference in transformers."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from deepserve.kernels import fp8_ref
from deepserve.kernels.fp8_ref import dequantize_weight_block
from deepserve.loader.fp8 import dequantize_fp8_weights, fp8_block_size, skip_mtp_layers
from tests.conftest import save_checkpoint
from tests.models.test_deepseek import PROMPTS, make_hf_model, make_runner, run_step, with_blocks

BLOCK = 128
QUANTIZED = re.compile(r"(proj|proj_with_mqa)\.weight$")  # the linear layers DeepSeek ships in FP8


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale_inv [ceil(N/128), ceil(K/128)]) as DeepSeek writes them."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    tiles = torch.zeros(nb * block, kb * block)
    tiles[:n, :k] = w
    tiles = tiles.view(nb, block, kb, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's largest finite value
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * block, kb * block)
    return q[:n, :k].contiguous(), scale


def dequantize_by_tiles(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block : (i + 1) * block, j * block : (j + 1) * block] *= scale[i, j]
    return out


@pytest.mark.parametrize("shape", [(300, 260), (128, 128), (5, 7), (256, 129)])
def test_block_dequantization(shape):
    torch.manual_seed(0)
    q, scale = quantize(torch.randn(shape))
    got = dequantize_weight_block(q, scale, (BLOCK, BLOCK))
    assert torch.equal(got, dequantize_by_tiles(q, scale))
    with pytest.raises(ValueError, match="scale"):
        dequantize_weight_block(q, scale[:, :1].repeat(1, scale.shape[1] + 1), (BLOCK, BLOCK))


def test_pairs_weights_and_scales_in_any_order():
    q, scale = quantize(torch.randn(10, 10))
    norm = torch.ones(10)
    stream = [("b.weight_scale_inv", scale), ("n.weight", norm), ("b.weight", q), ("a.weight", q),
              ("a.weight_scale_inv", scale)]
    out = dict(dequantize_fp8_weights(stream, (BLOCK, BLOCK)))
    assert set(out) == {"a.weight", "b.weight", "n.weight"} and out["n.weight"] is norm
    assert torch.equal(out["a.weight"], out["b.weight"])
    with pytest.raises(ValueError, match="c.weight"):
        list(dequantize_fp8_weights([("c.weight", q)], (BLOCK, BLOCK)))


def test_quantization_config_is_checked():
    config = DeepseekV3Config()
    assert fp8_block_size(config) is None
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    assert fp8_block_size(config) == (128, 128)
    config.quantization_config = {"quant_method": "awq"}
    assert fp8_block_size(config) is None  # int4: loader/int4.py
    config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        fp8_block_size(config)
    config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_block_size(config)
    # DeepSeek's own fields: dynamic activation scales, e4m3 codes; anything else is named and refused
    shipped = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    config.quantization_config = shipped
    assert fp8_block_size(config) == (128, 128)
    for field, value in (("activation_scheme", "static"), ("fmt", "e5m2")):
        config.quantization_config = {**shipped, field: value}
        with pytest.raises(ValueError, match=f"quantization_config.{field} is '{value}'"):
            fp8_block_size(config)


def test_mtp_layers_are_skipped_and_said_once(caplog):
    stream = [(f"model.layers.{i}.mlp.down_proj.weight", torch.zeros(1)) for i in range(5)]
    stream += [("model.layers.4.eh_proj.weight", torch.zeros(1)), ("model.norm.weight", torch.zeros(1))]
    with caplog.at_level(logging.INFO, logger="deepserve.loader.fp8"):
        kept = [name for name, _ in skip_mtp_layers(stream, num_hidden_layers=4)]
    assert kept == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)] + ["model.norm.weight"]
    assert sum("multi-token-prediction" in r.getMessage() for r in caplog.records) == 1


def write_fp8_checkpoint(src: str, fp8_dir: str, ref_dir: str, num_layers: int, block: int = BLOCK) -> None:
    """From a float32 checkpoint: an FP8 one in two shards (weights, then every scale) with one MTP
    layer, and the reference checkpoint holding exactly the dequantized values."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    weights, scales, reference = {}, {}, {}
    for name, t in tensors.items():
        if QUANTIZED.search(name) and ".gate." not in name:
            q, scale = quantize(t, block)
            weights[name], scales[name + "_scale_inv"] = q, scale
            reference[name] = dequantize_by_tiles(q, scale, block)
        else:
            weights[name] = reference[name] = t
    q, scale = quantize(torch.randn(64, 128))
    weights[f"model.layers.{num_layers}.eh_proj.weight"] = q  # an MTP layer, as V3 ships one
    scales[f"model.layers.{num_layers}.eh_proj.weight_scale_inv"] = scale
    weights[f"model.layers.{num_layers}.enorm.weight"] = torch.ones(64)
    for folder in (fp8_dir, ref_dir):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(reference, os.path.join(ref_dir, "model.safetensors"))
    shards = {"model-00001-of-00002.safetensors": weights, "model-00002-of-00002.safetensors": scales}
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, os.path.join(fp8_dir, shard))
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(fp8_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config_path = os.path.join(fp8_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [block, block]}
    config["num_nextn_predict_layers"] = 1
    with open(config_path, "w") as f:
        json.dump(config, f)


# hidden 144 and FFN 200: weights of several blocks, the last ones partial
TINY_V3 = dict(hidden_size=144, intermediate_size=200, q_lora_rank=24, topk_method="noaux_tc", n_group=4,
               topk_group=2, n_shared_experts=1, first_k_dense_replace=1)


@pytest.fixture
def fp8_checkpoint(tmp_path, tokenizer):
    """(hf_model it came from, FP8 checkpoint folder, folder of the exactly dequantized reference)."""
    hf_model = make_hf_model(DeepseekV3Config, DeepseekV3ForCausalLM, TINY_V3)
    src = save_checkpoint(hf_model, tokenizer, str(tmp_path / "f32"))
    fp8_dir, ref_dir = str(tmp_path / "fp8"), str(tmp_path / "ref")
    write_fp8_checkpoint(src, fp8_dir, ref_dir, hf_model.config.num_hidden_layers)
    return hf_model, fp8_dir, ref_dir


def prompt_logits(runner) -> list[torch.Tensor]:
    runner.allocate_kv_cache(64)
    requests = with_blocks(runner, PROMPTS)
    logits = run_step(runner, [(r, 0, len(r.prompt_token_ids)) for r in requests])
    return list(logits.split([len(p) for p in PROMPTS]))


def reference_logits(ref_dir: str) -> list[torch.Tensor]:
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [reference(torch.tensor([ids])).logits[0] for ids in PROMPTS]


def test_fp8_checkpoint_dequantized_matches_reference(fp8_checkpoint, caplog):
    # --quantization none: every FP8 weight dequantized at load, so the model is exactly the reference.
    hf_model, fp8_dir, ref_dir = fp8_checkpoint
    with caplog.at_level(logging.INFO, logger="deepserve.loader.fp8"):
        runner = make_runner(fp8_dir, quantization="none")
    assert sum("multi-token-prediction" in r.getMessage() for r in caplog.records) == 1
    assert all(p.dtype == torch.float32 for p in runner.model.parameters())
    logits = prompt_logits(runner)
    for got, want in zip(logits, reference_logits(ref_dir), strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    logits = torch.cat(logits)
    # The quantization is real: the FP8 model is not the float32 one it came from.
    with torch.no_grad():
        original = hf_model(torch.tensor([PROMPTS[1]])).logits[0]
    assert not torch.allclose(logits.split([len(p) for p in PROMPTS])[1], original, atol=1e-3)


@pytest.mark.parametrize("fused", [False, True], ids=["", "shared-fused"])
def test_fp8_checkpoint_served_in_fp8(fp8_checkpoint, monkeypatch, fused):
    # The default: the checkpoint's FP8 weights stay FP8 (wkv_b excepted) and activations are quantized
    # per token and 128-column group on the fly (as DeepSeek's own inference code does). fused:
    # DEEPSERVE_SHARED_EXPERTS_FUSION, the shared expert's FP8 weights and block scales one more routed expert,
    # and DEEPSERVE_FUSED_QKV_A, which keeps q_a_proj and kv_a_proj_with_mqa apart here: q_lora_rank 24 is not
    # whole 128-row blocks (tests/layers/test_stacked_rows.py stacks FP8 blocks).
    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1" if fused else "0")
    monkeypatch.setenv("DEEPSERVE_FUSED_QKV_A", "1" if fused else "0")  # on by default: the unfused path too
    hf_model, fp8_dir, ref_dir = fp8_checkpoint
    runner = make_runner(fp8_dir)
    params = dict(runner.model.named_parameters())
    fp8 = {n for n, p in params.items() if p.dtype == torch.float8_e4m3fn}
    assert "layers.1.ffn.experts.w13" in fp8 and "layers.0.ffn.w13.weight" in fp8
    assert ("layers.1.ffn.shared_experts.w2.weight" in fp8) != fused
    assert "layers.0.attn.wq_a.weight" in fp8 and "layers.0.attn.wqkv_a.weight" not in fp8
    experts = hf_model.config.n_routed_experts + (hf_model.config.n_shared_experts if fused else 0)
    assert params["layers.1.ffn.experts.w2"].shape[0] == params["layers.1.ffn.experts.w2_scale_inv"].shape[0] == experts
    assert params["layers.0.attn.mla.wkv_b.weight"].dtype == torch.float32
    assert {n + "_scale_inv" for n in fp8 if n.endswith("weight")} <= set(params)
    want = torch.cat(reference_logits(ref_dir))
    report = fp8_agreement(torch.cat(prompt_logits(runner)), want)
    # Measured on this 3-layer random model (73 prompt positions): argmax agreement 0.77, largest gap of
    # the reference's top-token logprob 1.09. The model is that sensitive: rounding only the activations
    # to bf16 already gives 0.96 / 0.35, and e4m3 keeps 3 mantissa bits to bf16's 7.
    assert report["argmax_agreement"] >= 0.7 and report["max_top_logprob_gap"] <= 1.5, report
    # Without the activation rounding the FP8 weights, their scales and every shard are exactly the
    # reference's: what is left of the gap is the activation quantization alone.
    monkeypatch.setattr(fp8_ref, "quantize_per_token_group_ref", lossless_group_quantization)
    exact = fp8_agreement(torch.cat(prompt_logits(make_runner(fp8_dir))), want)
    assert exact["argmax_agreement"] == 1.0 and exact["max_top_logprob_gap"] < 1e-4, exact


def test_fp8_q_a_and_kv_a_projections_stacked_are_exact(tmp_path, tokenizer, monkeypatch):
    # DEEPSERVE_FUSED_QKV_A on FP8 as shipped: q_lora_rank 128 is one whole block, so q_a_proj's blocks and then
    # kv_a_proj_with_mqa's (40 rows: a partial block) stack, scale rows too; with the activation rounding
    # replaced, exactly the reference (as the unstacked model in the test above).
    hf_model = make_hf_model(DeepseekV3Config, DeepseekV3ForCausalLM, dict(TINY_V3, q_lora_rank=128))
    src = save_checkpoint(hf_model, tokenizer, str(tmp_path / "f32"))
    fp8_dir, ref_dir = str(tmp_path / "fp8"), str(tmp_path / "ref")
    write_fp8_checkpoint(src, fp8_dir, ref_dir, hf_model.config.num_hidden_layers)
    monkeypatch.setenv("DEEPSERVE_FUSED_QKV_A", "1")
    monkeypatch.setattr(fp8_ref, "quantize_per_token_group_ref", lossless_group_quantization)
    runner = make_runner(fp8_dir)
    params = dict(runner.model.named_parameters())
    rows = 128 + hf_model.config.kv_lora_rank + hf_model.config.qk_rope_head_dim
    assert params["layers.0.attn.wqkv_a.weight"].dtype == torch.float8_e4m3fn
    assert "layers.0.attn.wq_a.weight" not in params
    assert params["layers.0.attn.wqkv_a.weight_scale_inv"].shape[0] == -(-rows // 128) == 2
    exact = fp8_agreement(torch.cat(prompt_logits(runner)), torch.cat(reference_logits(ref_dir)))
    assert exact["argmax_agreement"] == 1.0 and exact["max_top_logprob_gap"] < 1e-4, exact


def lossless_group_quantization(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Stands in for the FP8 activation quantizer: float32 "codes" with unit scales, so a dequantized
    # activation is the activation itself.
    return x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))


def fp8_agreement(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Per position: whether the argmax token agrees, and how far our logprob of the reference's top
    token is from the reference's."""
    top = want.argmax(-1)
    gap = (got.log_softmax(-1).gather(1, top[:, None]) - want.log_softmax(-1).gather(1, top[:, None])).abs()
    return {"argmax_agreement": (got.argmax(-1) == top).float().mean().item(), "max_top_logprob_gap": gap.max().item()}


def test_dummy_fp8_weights_fill_in_bounded_pieces(monkeypatch):
    # A large FP8 parameter is drawn through float32 a piece at a time (one of V3's expert stacks in one
    # piece took a 28 GiB temporary): every piece is filled, within ±448, from the one seeded generator.
    from deepserve.loader import checkpoint

    monkeypatch.setattr(checkpoint, "DUMMY_CHUNK_ELEMENTS", 1000)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(37, 100, dtype=torch.float8_e4m3fn), requires_grad=False)
    drawn = []
    real_empty = torch.empty
    monkeypatch.setattr(checkpoint.torch, "empty", lambda *a, **k: drawn.append(a[0]) or real_empty(*a, **k))
    checkpoint.init_dummy_weights(layer, seed=0)
    assert max(torch.Size(s).numel() for s in drawn) == 1000 and len(drawn) == 4
    values = layer.weight.float()
    assert values.abs().max() <= 448 and (values != 0).float().mean() > 0.9
    assert all((values[i:i + 10] != 0).any() for i in range(0, 37, 10))  # pieces of 10 rows: 10, 10, 10, 7
    # a transposed (non-contiguous) parameter is drawn in pieces too
    drawn.clear()
    layer.weight = torch.nn.Parameter(torch.zeros(100, 37, dtype=torch.float8_e4m3fn).t(), requires_grad=False)
    checkpoint.init_dummy_weights(layer, seed=0)
    assert max(torch.Size(s).numel() for s in drawn) <= 1000 and (layer.weight.float() != 0).float().mean() > 0.9
    again = torch.nn.Module()
    again.weight = torch.nn.Parameter(torch.zeros(37, 100, dtype=torch.float8_e4m3fn), requires_grad=False)
    monkeypatch.setattr(checkpoint.torch, "empty", real_empty)
    checkpoint.init_dummy_weights(again, seed=0)
    assert torch.equal(again.weight.float(), values)  # seeded: the same model every run
