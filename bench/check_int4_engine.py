"""AWQ / GPTQ int4 through the whole engine on the GPU, on tiny random checkpoints packed in the published
formats (tests/loader/int4_pack.py): AWQ Llama, GPTQ act-order DeepSeek-V3 (int4 routed and shared
experts through the fused MoE) and AWQ V2-Lite-like. The CPU runs the same int4 numerics through the torch
reference; on the GPU the W4A16 Triton GEMM and the fused MoE's int4 path run. Both in bf16.

    python bench/check_int4_engine.py        # one line per case; non-zero exit on a failure

Judged per prompt token, and per decoded token with one sequence a step (the one-token GEMV, which prompts
never reach; against the CPU's prefill of the same tokens): the GPU's int4 logprobs may be no further from
the CPU's than 2 times the GPU run of the same weights unquantized (--quantization none: dequantized at
load) is from its CPU run, plus 0.01. The weights are the same numbers both ways (the int4 math is exact;
the factored one-token GEMV skips only the reference's rounding of each weight to bf16), so mostly summation
order differs; a wrong code, group or row costs tenths. Greedy tokens, CUDA graphs against eager, are
printed.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_check import COMMON, MLA, decode_error, greedy, prompt_logprobs  # noqa: E402

from tests.loader.int4_pack import write_int4_checkpoint  # noqa: E402

WIDE = dict(COMMON, hidden_size=256, intermediate_size=384)


def error(path: str, engine: dict) -> float:
    want = torch.tensor(prompt_logprobs(path, "cpu", "bfloat16", **engine))
    return (torch.tensor(prompt_logprobs(path, "cuda", "bfloat16", **engine)) - want).abs().mean().item()


def check(name: str, path: str) -> bool:
    got, yardstick = error(path, {}), error(path, {"quantization": "none"})
    ok = got <= 2 * yardstick + 0.01
    print(f"{name:22s} {'OK' if ok else 'MISMATCH'} mean prompt logprob error, GPU int4 vs CPU int4 {got:.4f} "
          f"(dequantized, GPU vs CPU: {yardstick:.4f})", flush=True)
    # Decode, one sequence at a time: the one-token GEMV (DEEPSERVE_INT4_GEMV_MAX_M) and its numerics
    # (DEEPSERVE_INT4_GEMV_FACTORED), which the prompt logprobs above never reach, against the CPU reference's
    # prefill of the same tokens; the same rule, the unquantized model's decode as the yardstick.
    got_decode, yardstick_decode = decode_error(path, {}), decode_error(path, {"quantization": "none"})
    decode_ok = got_decode <= 2 * yardstick_decode + 0.01
    print(f"{name:22s} {'OK' if decode_ok else 'MISMATCH'} mean decode logprob error (one token a step), GPU int4 "
          f"vs CPU int4 {got_decode:.4f} (dequantized: {yardstick_decode:.4f})", flush=True)
    ok = ok and decode_ok
    graphs, eager = greedy(path, "cuda", "bfloat16"), greedy(path, "cuda", "bfloat16", enforce_eager=True)
    same = sum(a == b for a, b in zip(graphs, eager, strict=True))
    print(f"{name:22s} greedy tokens, CUDA graphs vs eager: {same}/{len(graphs)} sequences equal", flush=True)
    return ok


def main() -> int:
    ok = True
    torch.manual_seed(0)
    models = {
        "llama-awq": (LlamaForCausalLM(LlamaConfig(**WIDE, num_key_value_heads=2)), ("awq", 4, 128, False, False)),
        "v3-gptq-act-order": (DeepseekV3ForCausalLM(DeepseekV3Config(**WIDE, **dict(
            MLA, q_lora_rank=48, n_group=2, topk_group=1, moe_intermediate_size=128))), ("gptq", 4, 32, False, True)),
        "v2-lite-like-awq": (DeepseekV2ForCausalLM(DeepseekV2Config(**WIDE, **dict(
            MLA, q_lora_rank=None, topk_method="greedy", moe_intermediate_size=128))), ("awq", 4, 64, False, False)),
        # groups of 128: at decode the routed experts take the tensor-core GEMV (kernels/int4_moe_mma.py)
        "v2-lite-like-awq-g128": (DeepseekV2ForCausalLM(DeepseekV2Config(**WIDE, **dict(
            MLA, q_lora_rank=None, topk_method="greedy", moe_intermediate_size=128))), ("awq", 4, 128, False, False)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, fmt) in models.items():
            model.save_pretrained(f"{tmp}/{name}-f32")
            write_int4_checkpoint(f"{tmp}/{name}-f32", f"{tmp}/{name}", f"{tmp}/{name}-ref", *fmt)
            ok &= check(name, f"{tmp}/{name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
