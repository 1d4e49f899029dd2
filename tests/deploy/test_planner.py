"""The capacity planner against hand-computed figures (BENCHMARKS.md shapes)."""

from __future__ import annotations

import json

import pytest

from deepserve.entrypoints.cli import main
from deepserve.planner import PlanRequest, plan
from deepserve.planner.cli import format_plan
from deepserve.planner.gpus import GIB, gpu_memory_bytes


@pytest.mark.parametrize("model, kv_bytes", [
    ("deepseek-llm-7b", 2 * 32 * 128 * 30 * 2),     # MHA: 2 (k, v) × 32 heads × 128 × 30 layers × bf16 = 491,520
    ("r1-distill-qwen-7b", 2 * 4 * 128 * 28 * 2),   # GQA: 4 kv heads = 57,344
    ("deepseek-v2-lite", (512 + 64) * 27 * 2),      # MLA latent 576 × 27 layers = 31,104
    ("deepseek-v3", (512 + 64) * 61 * 2),           # 61 layers (the MTP layer is skipped) = 70,272
])
def test_bf16_kv_bytes_per_token(model, kv_bytes):
    assert plan(PlanRequest(model, max_model_len=4096)).kv_bytes_per_token == kv_bytes
    assert kv_bytes in (491_520, 57_344, 31_104, 70_272)


@pytest.mark.parametrize("model, billions", [
    ("deepseek-llm-7b", 6.91), ("r1-distill-qwen-7b", 7.62), ("deepseek-v2-lite", 15.71), ("deepseek-v3", 671.03),
])
def test_parameter_counts_match_benchmarks_md(model, billions):
    assert round(plan(PlanRequest(model, max_model_len=4096)).num_params / 1e9, 2) == billions


def test_deepseek_v3_fits_one_h200_node_in_fp8_as_shipped():
    fp8 = plan(PlanRequest("deepseek-v3", tensor_parallel_size=8, max_model_len=4096))
    bf16 = plan(PlanRequest("deepseek-v3", tensor_parallel_size=8, max_model_len=4096, quantization="none"))
    assert fp8.quantization == "fp8" and bf16.quantization is None and fp8.num_params == bf16.num_params
    assert fp8.fits and not bf16.fits
    # Nearly every weight is one byte instead of two; the embedding, head, router, norms, wkv_b and the
    # float32 scales (1 per 128 x 128 block) stay as they were.
    assert 0.5 < fp8.weights_bytes / bf16.weights_bytes < 0.52
    assert "--quantization" not in fp8.serve_command  # the checkpoint's own FP8: nothing to pass
    per_channel = plan(PlanRequest("deepseek-llm-7b", max_model_len=4096, quantization="fp8"))
    assert per_channel.serve_command[-4:-2] == ["--quantization", "fp8"]
    assert per_channel.weights_bytes < 0.6 * plan(PlanRequest("deepseek-llm-7b", max_model_len=4096)).weights_bytes


def test_fp8_follows_the_gpu_and_the_load_peak():
    # An A100 has no FP8 tensor cores: serve refuses V3's FP8 there unless --quantization none dequantizes
    # it, so the planner plans the dequantized weights with that flag in the serve line, and says why ...
    a100 = plan(PlanRequest("deepseek-v3", gpu="a100-80g", tensor_parallel_size=8, max_model_len=4096))
    assert a100.quantization is None and not a100.fits and not a100.engine_refuses and not a100.warnings
    assert a100.fp8_dequantized.startswith("a100-80g has no FP8 tensor cores (compute capability 8.0)")
    assert "FP8: a100-80g has no FP8 tensor cores" in format_plan(a100)
    more = next(a for a in a100.advice if a["change"] == "more GPUs")  # its serve line needs the flag too
    assert more["flags"].endswith("--quantization none"), more
    nodes = plan(PlanRequest("deepseek-v3", gpu="a100-80g", tensor_parallel_size=8, pipeline_parallel_size=4,
                             max_model_len=4096))
    assert nodes.fits and nodes.serve_command[nodes.serve_command.index("--quantization") + 1] == "none"
    # asked for FP8 explicitly, the checkpoint's own included: refused as serve refuses it
    with pytest.raises(ValueError, match="compute capability 8.0.*--quantization none"):
        plan(PlanRequest("deepseek-v3", gpu="a100-80g", tensor_parallel_size=8, quantization="fp8"))
    # ... and refuses --quantization fp8 as the engine would.
    with pytest.raises(ValueError, match="a100-80g"):
        plan(PlanRequest("deepseek-llm-7b", gpu="a100-80g", max_model_len=4096, quantization="fp8"))
    # -q fp8 converts after loading the bf16 weights: 12 GiB holds the FP8 model but not the load.
    small = plan(PlanRequest("deepseek-llm-7b", gpu="12", max_model_len=4096, quantization="fp8"))
    assert small.weights_bytes < 8 * 2**30 and not small.fits
    assert any("loads the bfloat16 weights first" in w for w in small.warnings)


def test_weights_are_parameters_plus_the_rope_tables_the_engine_allocates():
    def extra(model):
        p = plan(PlanRequest(model, max_model_len=4096))
        return p.weights_bytes - 2 * p.num_params  # bf16 parameters; the rest is float32 buffers

    # Every model keeps one float32 cos/sin table [max_position_embeddings, rotary dim], shared by its layers,
    # and per attention layer two float32 FP8-KV-cache scales (k_scale, v_scale)
    assert extra("deepseek-llm-7b") == 4096 * 128 * 4 + 30 * 2 * 4
    assert extra("r1-distill-qwen-7b") == 131072 * 128 * 4 + 28 * 2 * 4  # 64 MiB at 128k positions
    # DeepSeek-V2 shares one [163840, rope 64] table between its layers (+ small MoE buffers)
    assert 163840 * 64 * 4 <= extra("deepseek-v2-lite") < 64 * 2**20


def test_tensor_parallel_splits_heads_but_not_the_mla_latent():
    dense = [plan(PlanRequest("deepseek-llm-7b", tensor_parallel_size=tp, max_model_len=4096)) for tp in (1, 2)]
    assert dense[1].kv_bytes_per_token == 491_520 // 2
    # halved but for what every rank keeps whole: norms and the rope tables
    assert dense[0].weights_bytes / 2 < dense[1].weights_bytes < dense[0].weights_bytes * 0.51
    mla = plan(PlanRequest("deepseek-v2-lite", tensor_parallel_size=2, max_model_len=4096))
    assert mla.kv_bytes_per_token == 31_104  # the latent is replicated on every rank
    gqa = plan(PlanRequest("r1-distill-qwen-7b", tensor_parallel_size=4, max_model_len=4096))
    assert gqa.kv_bytes_per_token == 2 * 1 * 128 * 28 * 2  # 4 kv heads over 4 ranks: one per rank
    with pytest.raises(ValueError, match="Sizes that fit: 1, 2, 4"):  # 28 query heads: the engine refuses 8
        plan(PlanRequest("r1-distill-qwen-7b", tensor_parallel_size=8, max_model_len=4096))


def test_fp8_kv_halves_the_cache_and_both_preset_spellings_work():
    a = plan(PlanRequest("deepseek-r1-distill-qwen-7b", max_model_len=4096, kv_cache_dtype="fp8"))
    b = plan(PlanRequest("r1-distill-qwen-7b", max_model_len=4096))
    assert a.model == b.model == "r1-distill-qwen-7b"
    assert a.kv_bytes_per_token * 2 == b.kv_bytes_per_token
    assert not a.warnings  # the engine serves --kv-cache-dtype fp8 now


def test_a_bf16_kv_cache_on_a_bf16_model_is_planned_as_the_engines_auto():
    # `plan --kv-cache-dtype bf16` (its help offers bf16) printed a serve line with --kv-cache-dtype bf16,
    # which serve refuses; on a bf16 model that cache is the engine's auto.
    p = plan(PlanRequest("deepseek-v2-lite", gpu="h100", kv_cache_dtype="bf16", max_model_len=4096))
    auto = plan(PlanRequest("deepseek-v2-lite", gpu="h100", max_model_len=4096))
    assert p.kv_bytes_per_token == auto.kv_bytes_per_token and p.serve_command == auto.serve_command
    assert not p.warnings
    fp16 = plan(PlanRequest("deepseek-v2-lite", gpu="h100", kv_cache_dtype="fp16", max_model_len=4096))
    assert "--kv-cache-dtype" in fp16.serve_command and "refuses it" in fp16.warnings[0]  # no engine spelling
    assert fp16.fits and fp16.engine_refuses and not p.engine_refuses


def test_cli_exits_1_when_the_engine_would_refuse_the_planned_command(capsys):
    # fp8_e5m2 sizes like fp8 in memory, but serve refuses it: a rollout gated on the exit code must stop.
    assert main(["plan", "deepseek-v3", "--gpu", "h200", "-tp", "8", "--kv-cache-dtype", "fp8_e5m2"]) == 1
    out = capsys.readouterr().out
    assert "fits in memory, but deepserve serve refuses the command" in out and "fits. run:" not in out
    assert main(["plan", "deepseek-v3", "--gpu", "h200", "-tp", "8", "--kv-cache-dtype", "fp8"]) == 0


def test_tokens_and_sequences_follow_the_budget_arithmetic():
    p = plan(PlanRequest("deepseek-llm-7b", gpu="h100", max_model_len=4096))
    _, total = gpu_memory_bytes("h100")
    assert p.budget_bytes == int(total * 0.9)
    free = p.budget_bytes - p.weights_bytes - p.activation_bytes  # graphs are outside the budget, as in the engine
    assert p.kv_tokens == free // (491_520 * 16) * 16
    assert p.max_sequences == p.kv_tokens // 4096 and p.fits
    # activations: T = min(8192, 4096) tokens × (4·4096 + 3·4096 + 2·11008) × 2 bytes + 256 × 102400 × 4
    assert p.activation_bytes == 4096 * (4 * 4096 + 3 * 4096 + 2 * 11008) * 2 + 256 * 102400 * 4
    assert p.serve_command == ["deepserve", "serve", "deepseek-llm-7b", "--max-model-len", "4096",
                               "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256", "--load-format", "dummy"]


def test_does_not_fit_says_what_would():
    p = plan(PlanRequest("deepseek-llm-7b", gpu="16", max_model_len=4096))
    assert not p.fits and p.max_sequences == 0
    advice = {a["change"]: a for a in p.advice}
    assert advice["more GPUs"]["flags"] == "--tensor-parallel-size 2"
    assert advice["more GPUs"]["max_sequences"] == plan(
        PlanRequest("deepseek-llm-7b", gpu="16", max_model_len=4096, tensor_parallel_size=2)).max_sequences > 0
    shorter = advice["shorter context"]
    assert shorter["flags"] == f"--max-model-len {p.kv_tokens}" and 0 < p.kv_tokens < 4096
    assert plan(PlanRequest("deepseek-llm-7b", gpu="16", max_model_len=p.kv_tokens)).fits
    # V3 in bf16 (--quantization none dequantizes its FP8): 8 × H200 is not enough; 2 nodes of 8 are
    v3 = plan(PlanRequest("deepseek-v3", tensor_parallel_size=8, max_model_len=32768, quantization="none"))
    assert not v3.fits and v3.weights_bytes > v3.budget_bytes
    assert v3.advice[0]["flags"] == "--tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2"
    assert "2 nodes of 8 GPUs" in v3.advice[0]["detail"]
    two_nodes = plan(PlanRequest("deepseek-v3", tensor_parallel_size=8, pipeline_parallel_size=2, max_model_len=4096,
                                 quantization="none"))
    cmd = two_nodes.serve_command
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == "0"
    assert v3.advice[-1]["flags"] is None and "no context length helps" in v3.advice[-1]["detail"]
    over = (v3.weights_bytes + v3.activation_bytes - v3.budget_bytes) / 2**30  # said as an excess, not "leave -x"
    assert f"are {over:.1f} GiB over the {v3.budget_bytes / 2**30:.1f} GiB budget" in v3.advice[-1]["detail"]
    # room for blocks, but --quantization fp8 holds the bf16 weights while loading: said as that, not "< a block"
    loading = plan(PlanRequest("deepseek-llm-7b", gpu="12", quantization="fp8", max_model_len=4096))
    assert not loading.fits and loading.kv_cache_bytes > 2**30
    assert loading.advice[-1]["detail"] == ("no context length helps: loading the weights is over the budget "
                                            "whatever the context (see the note below)")


def test_smaller_weights_are_advised_where_they_fit():
    # 7B in bf16 on a 16 GiB GPU: FP8 quantized at load (the bf16 weights still fit while loading) or int4.
    advice = {a["change"]: a for a in plan(PlanRequest("deepseek-llm-7b", gpu="16", max_model_len=4096)).advice}
    for change, method in (("fp8 weights", "fp8"), ("int4 weights", "awq")):
        assert advice[change]["flags"] == f"--quantization {method}"
        alt = plan(PlanRequest("deepseek-llm-7b", gpu="16", max_model_len=4096, quantization=method))
        assert alt.fits and advice[change]["max_sequences"] == alt.max_sequences > 0
    # V3 on 8 x A100-80GB: no FP8 tensor cores (FP8 only dequantized there), so int4 only.
    v3 = plan(PlanRequest("deepseek-v3", gpu="a100-80g", tensor_parallel_size=8))
    changes = [a["change"] for a in v3.advice]
    assert not v3.fits and "int4 weights" in changes and "fp8 weights" not in changes, changes
    # FP8 already: no fp8 advice; int4 neither where it does not fit (V3 on 2 GPUs)
    fp8 = plan(PlanRequest("deepseek-v3", tensor_parallel_size=2, max_model_len=4096))
    assert fp8.quantization == "fp8" and not fp8.fits
    assert not {"fp8 weights", "int4 weights"} & {a["change"] for a in fp8.advice}


def test_checkpoint_folder_and_config_json(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                architectures=["LlamaForCausalLM"], torch_dtype="bfloat16").save_pretrained(tmp_path)
    by_folder = plan(PlanRequest(str(tmp_path), gpu="24"))
    by_file = plan(PlanRequest(str(tmp_path / "config.json"), gpu="24"))
    assert by_folder.kv_bytes_per_token == by_file.kv_bytes_per_token == 2 * 2 * 64 * 2 * 2
    assert by_folder.max_model_len == 2048 and "--load-format" not in by_folder.serve_command


def test_a_presets_serve_line_says_its_weights_are_random(tmp_path, capsys):
    # The line users copy (docs/deploy.md) ends in --load-format dummy for a preset: said so under it.
    code, out = _plan_cli(capsys, "deepseek-llm-7b", "--gpu", "h100", "--max-model-len", "4096")
    assert code == 0 and out.split("fits. run:\n")[1].splitlines()[0].endswith("--load-format dummy")
    assert "--load-format dummy serves random weights" in out
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    code, out = _plan_cli(capsys, str(tmp_path), "--gpu", "24")
    assert code == 0 and "fits. run:" in out and "random weights" not in out


def test_cli_json_shape_and_exit_codes(capsys):
    assert main(["plan", "deepseek-v2-lite", "--gpu", "a100-80g", "--max-model-len", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("model", "gpu", "num_gpus", "weights_bytes", "kv_bytes_per_token", "activation_bytes",
                "cuda_graph_bytes", "kv_tokens", "max_sequences", "fits", "serve_command_line", "advice",
                "formulas", "warnings"):
        assert key in out
    assert out["fits"] is True and out["kv_bytes_per_token"] == 31_104
    assert out["serve_command_line"].startswith("deepserve serve deepseek-v2-lite --max-model-len 8192")
    assert main(["plan", "deepseek-llm-7b", "--gpu", "16", "--max-model-len", "4096"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "deepseek-llm-7b", "--gpu", "t4"]) == 2
    assert "unknown --gpu" in capsys.readouterr().err


def test_gpu_sizes():
    assert gpu_memory_bytes("80") == ("80 GiB", 80 * GIB)
    assert gpu_memory_bytes("H200")[1] > gpu_memory_bytes("h20")[1] > gpu_memory_bytes("a100-80g")[1]


def test_graph_memory_only_where_the_engine_captures_graphs():
    # One GPU captures decode graphs; tensor-parallel ranks run eager by default; --enforce-eager never.
    one = plan(PlanRequest("deepseek-llm-7b", max_model_len=4096))
    assert one.cuda_graph_bytes > 0
    assert plan(PlanRequest("deepseek-llm-7b", max_model_len=4096, enforce_eager=True)).cuda_graph_bytes == 0
    assert plan(PlanRequest("deepseek-llm-7b", max_model_len=4096, tensor_parallel_size=2)).cuda_graph_bytes == 0


def test_deepseek_v3_int4_fits_eight_a100s():
    # The seeds' node: AWQ int4 (0.5 byte a weight plus fp16 scales and zeros per group of 128) fits V3 on
    # 8 x A100-80GB, which neither its FP8 (dequantized there: no FP8 tensor cores) nor bf16 does.
    awq = plan(PlanRequest("deepseek-v3", gpu="a100-80g", tensor_parallel_size=8, max_model_len=4096,
                           quantization="awq"))
    bf16 = plan(PlanRequest("deepseek-v3", gpu="a100-80g", tensor_parallel_size=8, max_model_len=4096,
                            quantization="none"))
    assert awq.quantization == "awq" and awq.fits and not bf16.fits and awq.num_params == bf16.num_params
    # (0.5 + 4/128) / 2 = 0.266 for the int4 layers; embedding, head, router, norms and wkv_b stay bf16.
    assert 0.26 < awq.weights_bytes / bf16.weights_bytes < 0.29
    assert awq.serve_command[-4:] == ["--quantization", "awq", "--load-format", "dummy"]
    gptq = plan(PlanRequest("deepseek-llm-7b", gpu="a100-80g", max_model_len=4096, quantization="gptq"))
    assert gptq.weights_bytes < 0.45 * plan(PlanRequest("deepseek-llm-7b", max_model_len=4096)).weights_bytes


def test_a_tensor_parallel_size_that_does_not_divide_the_model_names_the_flag_and_the_sizes_that_fit(capsys):
    assert main(["plan", "deepseek-v3", "--gpu", "h200", "-tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 3 does not fit this model" in err and "Sizes that fit: 1, 2, 4, 8" in err


def test_more_gpus_advice_uses_the_largest_tensor_parallel_size_the_model_divides():
    # R1-Distill-Qwen-7B's 28 heads take TP 4 at most in a node (the engine refuses 8): with too little
    # memory per GPU the advice is TP 4 with pipeline stages, not a TP 8 that serve would refuse.
    p = plan(PlanRequest("r1-distill-qwen-7b", gpu="5", max_model_len=32768, enforce_eager=True))
    assert not p.fits
    more = [a for a in p.advice if a["change"] == "more GPUs"]
    assert more and "--tensor-parallel-size 4 --pipeline-parallel-size" in more[0]["flags"], p.advice


def test_advice_never_offers_a_re_plan_the_engine_would_refuse():
    # fp8_e5m2 sizes like fp8 but serve refuses it: TP 2 would fit in memory (as it does with the model's
    # own cache dtype) yet is not offered with it; the note says what the engine refuses.
    refused = plan(PlanRequest("deepseek-llm-7b", gpu="15", kv_cache_dtype="fp8_e5m2", max_model_len=4096))
    auto = plan(PlanRequest("deepseek-llm-7b", gpu="15", max_model_len=4096))
    assert not refused.fits and refused.engine_refuses and "refuses it" in refused.warnings[0]
    assert [a["change"] for a in auto.advice][0] == "more GPUs"
    assert "more GPUs" not in [a["change"] for a in refused.advice]


def _moe_checkpoint(path) -> str:
    # Experts 36 wide (not divisible by 8), 8 of them (divisible), shared experts 2 x 36 = 72 (divisible):
    # TP 8 fits only with the routed experts kept whole (expert parallelism).
    from transformers import DeepseekV2Config

    DeepseekV2Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=36,
                     num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8,
                     n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                     q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     max_position_embeddings=256, architectures=["DeepseekV2ForCausalLM"],
                     torch_dtype="bfloat16").save_pretrained(path)
    return str(path)


def test_expert_parallel_plans_what_only_expert_parallelism_fits(tmp_path, capsys):
    model = _moe_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(36\) is not divisible"):
        plan(PlanRequest(model, gpu="24", tensor_parallel_size=8))
    ep = plan(PlanRequest(model, gpu="24", tensor_parallel_size=8, enable_expert_parallel=True))
    assert ep.fits and "--enable-expert-parallel" in ep.serve_command
    # the same bytes a rank as splitting each expert would hold: 1/8 of the experts, each whole
    tp2 = plan(PlanRequest(model, gpu="24", tensor_parallel_size=2))
    tp2_ep = plan(PlanRequest(model, gpu="24", tensor_parallel_size=2, enable_expert_parallel=True))
    assert tp2.weights_bytes == tp2_ep.weights_bytes
    # the CLI takes the flag, prints the serve line with it, and exits 0
    assert main(["plan", model, "--gpu", "24", "-tp", "8", "--enable-expert-parallel"]) == 0
    out = capsys.readouterr().out
    assert "experts whole across the TP ranks (EP)" in out and "--enable-expert-parallel" in out


@pytest.mark.parametrize("quantization", [None, "awq"])
def test_the_load_time_fusions_plan_the_same_model(quantization, monkeypatch):
    # DEEPSERVE_SHARED_EXPERTS_FUSION and DEEPSERVE_FUSED_QKV_A rearrange loaded weights (the planner builds the
    # model on the meta device and runs the same after-load pass): the same parameters and bytes.
    request = PlanRequest("deepseek-v2-lite", max_model_len=4096, quantization=quantization)
    monkeypatch.setenv("DEEPSERVE_FUSED_QKV_A", "0")  # on by default
    plain = plan(request)
    monkeypatch.setenv("DEEPSERVE_SHARED_EXPERTS_FUSION", "1")
    monkeypatch.setenv("DEEPSERVE_FUSED_QKV_A", "1")
    fused = plan(request)
    assert (fused.num_params, fused.weights_bytes) == (plain.num_params, plain.weights_bytes)


# --- plan's verdict is serve's: what serve refuses, plan refuses (exit 1, a note) --------------------------


def _config(path, config) -> str:
    path.mkdir()
    config.save_pretrained(path)
    return str(path)


def _fp8_v3(path, moe_intermediate_size: int = 128) -> str:
    # DeepSeek's 128 x 128 FP8 blocks; only the routed experts' width (moe_intermediate_size) can be cut
    # at -tp 2: the shared experts (2 x 128), the dense MLP and the attention split in whole blocks.
    from transformers import DeepseekV3Config

    return _config(path, DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64,
        qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, max_position_embeddings=256,
        architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16",
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                             "activation_scheme": "dynamic"}))


def _llama(path, quantization_config: dict | None = None) -> str:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    if quantization_config:
        config.quantization_config = quantization_config
    return _config(path, config)


def _plan_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(["plan", *argv])
    return code, capsys.readouterr().out


def test_a_tensor_parallel_shard_that_cuts_an_fp8_block_is_refused_as_serve_refuses_it(tmp_path, capsys):
    model = _fp8_v3(tmp_path / "v3-fp8")
    # 128 / 2 = 64 rows a rank: rank 1's share starts inside the first 128-row block (layers/moe.py's loader)
    code, out = _plan_cli(capsys, model, "--gpu", "24", "-tp", "2")
    assert code == 1 and "fits in memory, but deepserve serve refuses the command" in out
    assert "note: " in out and "moe_intermediate_size shard of 64 per rank cuts FP8 blocks of 128" in out
    assert _plan_cli(capsys, model, "--gpu", "24")[0] == 0  # one GPU cuts nothing
    # experts whole (expert parallelism): nothing is cut
    assert _plan_cli(capsys, model, "--gpu", "24", "-tp", "2", "--enable-expert-parallel")[0] == 0
    # the preset plans the release: V3 at -tp 32 splits its dense MLP (18,432) into 576 rows, the experts (2,048)
    # into 64: its FP8 checkpoint cannot load so (the preset's dummy weights would hide it)
    code, out = _plan_cli(capsys, "deepseek-v3", "--gpu", "h100", "-tp", "32")
    assert code == 1 and "note: this model's FP8 checkpoint is refused" in out and "cuts an FP8 block of 128" in out


@pytest.mark.parametrize("checkpoint, flag, has", [
    (None, "awq", "no quantization_config"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "gptq",
     "quant_method 'awq'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}, "awq", "quant_method 'fp8'"),
])
def test_quantization_that_the_checkpoint_does_not_ship_is_refused_as_serve_refuses_it(
        tmp_path, capsys, checkpoint, flag, has):
    model = _llama(tmp_path / "llama", checkpoint)
    code, out = _plan_cli(capsys, model, "--gpu", "24", "-q", flag)
    assert code == 1 and f"--quantization {flag} does not match the checkpoint: its config.json has {has}" in out
    p = plan(PlanRequest(model, gpu="24", quantization=flag))
    assert p.fits and p.engine_refuses and p.checkpoint_mismatch and p.quantization == flag  # the int4 build's bytes
    # a preset's serve line loads dummy weights, which take any int4 build; the checkpoint's own method is served
    assert _plan_cli(capsys, "deepseek-llm-7b", "-q", flag)[0] == 0
    if checkpoint and checkpoint["quant_method"] == "awq":
        assert _plan_cli(capsys, model, "--gpu", "24", "-q", "awq")[0] == 0


def test_a_block_size_serve_refuses_is_refused(capsys):
    code, out = _plan_cli(capsys, "deepseek-llm-7b", "--max-model-len", "4096", "--block-size", "7")
    assert code == 1 and "note: " in out and "must be a power of two" in out
    assert _plan_cli(capsys, "deepseek-llm-7b", "--max-model-len", "4096", "--block-size", "32")[0] == 0


def test_v3_on_eight_h100s_is_advised_int4_and_told_the_weights_do_not_fit(tmp_path, capsys):
    code, out = _plan_cli(capsys, "deepseek-v3", "--gpu", "h100", "-tp", "8")
    p = plan(PlanRequest("deepseek-v3", gpu="h100", tensor_parallel_size=8))
    assert code == 1 and p.weights_bytes > p.budget_bytes
    assert (f"does NOT fit: the weights alone do not fit: {p.weights_bytes / GIB:.1f} GiB per GPU against the "
            f"{p.budget_bytes / GIB:.1f} GiB budget") in out
    assert "not one sequence of max_model_len has room" not in out
    # FP8 as shipped needs 16 GPUs; the int4 build fits the same 8 (a preset: serve's dummy weights take it)
    int4 = [a for a in p.advice if a["change"] == "int4 weights"]
    assert int4 and int4[0]["flags"] == "--quantization awq" and int4[0]["num_gpus"] == 8, p.advice
    assert plan(PlanRequest("deepseek-v3", gpu="h100", tensor_parallel_size=8, quantization="awq")).fits
    # An FP8 checkpoint on disk is not int4: the advice names an int4 checkpoint of the model, not a flag that
    # serve would refuse for this one.
    model = _fp8_v3(tmp_path / "v3-fp8")
    small = dict(gpu="0.0042", max_model_len=256, max_num_seqs=1)  # 4.5 MB: the int4 build fits, FP8 not
    fp8, awq = plan(PlanRequest(model, **small)), plan(PlanRequest(model, **small, quantization="awq"))
    assert fp8.quantization == "fp8" and not fp8.fits and awq.fits and awq.engine_refuses
    int4 = [a for a in fp8.advice if a["change"] == "int4 weights"]
    assert int4 and int4[0]["flags"] is None and "an AWQ int4 checkpoint of this model would fit" in int4[0]["detail"]
    code, out = _plan_cli(capsys, model, "--gpu", "0.0042", "--max-model-len", "256", "--max-num-seqs", "1")
    assert code == 1 and "  - int4 weights: an AWQ int4 checkpoint of this model would fit" in out


def test_the_kv_cache_gets_what_the_engine_gives_it():
    # ModelRunner._profile_gpu_blocks: total x utilization - the profile step's peak (weights, activations);
    # the CUDA context and the decode graphs (captured after the cache is allocated) live outside that budget,
    # on one GPU as under tensor parallelism.
    for tp in (1, 2):
        p = plan(PlanRequest("deepseek-llm-7b", gpu="h100", tensor_parallel_size=tp, max_model_len=4096))
        assert p.kv_cache_bytes == p.budget_bytes - p.weights_bytes - p.activation_bytes
        assert p.kv_tokens == p.kv_cache_bytes // (p.kv_bytes_per_token * 16) * 16
        assert (p.cuda_graph_bytes > 0) == (tp == 1)


def test_plan_help_names_every_flag_with_serves_words_and_default(capsys):
    from deepserve.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    engine = next(a for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions
                  if "--block-size" in a.option_strings).container
    serve = {a.dest: a.help for a in engine._group_actions}
    for flag, dest, default in (("-tp", "tensor_parallel_size", "1"), ("-pp", "pipeline_parallel_size", "1"),
                                ("--dtype", "dtype", "auto"), ("--gpu-memory-utilization", "gpu_memory_utilization",
                                                               "0.9"),
                                ("--max-num-seqs", "max_num_seqs", "256"),
                                ("--max-num-batched-tokens", "max_num_batched_tokens", "8192"),
                                ("--block-size", "block_size", "16")):
        assert " ".join(serve[dest].split()) in out, flag  # serve's words ...
        after = out.split(" ".join(serve[dest].split()), 1)[1]
        assert after.lstrip().startswith(f"(default: {default}") or f"(default: {default}" in serve[dest], flag
