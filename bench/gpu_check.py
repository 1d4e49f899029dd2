"""GPU correctness on tiny random checkpoints: greedy tokens on CUDA (CUDA graphs on, eager, chunked
prefill) equal the CPU reference path, for every architecture variant; in bf16, prompt logprobs with
prefill on flash's varlen kernel are as close to the CPU's as with prefill on SDPA; with two or more GPUs also
tensor parallelism (NCCL), pipeline parallelism and expert parallelism. Prints one line per case
and exits non-zero on a mismatch. Run on a GPU machine: python bench/gpu_check.py"""

from __future__ import annotations

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
    Qwen2Config,
    Qwen2ForCausalLM,
)

from deepserve import LLM, SamplingParams

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=512)
VARIANTS = {
    "llama-mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4)),
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2)),
    "qwen2-gqa": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=1)),
}
MLA = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64,
           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
           num_key_value_heads=4)
VARIANTS.update({
    "dsv2-lite-like": (DeepseekV2Config, DeepseekV2ForCausalLM, dict(MLA, q_lora_rank=None, topk_method="greedy")),
    "dsv3-noaux": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(MLA, q_lora_rank=48, n_group=2, topk_group=1)),
})


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 16, 17, 40, 100, 3, 64]
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def greedy(path: str, device: str, dtype: str = "float32", **kw) -> list[list[int]]:
    llm = LLM(path, dtype=dtype, device=device, num_gpu_blocks_override=256, block_size=16,
              skip_tokenizer_init=True, max_num_seqs=16, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def prompt_logprobs(path: str, device: str, dtype: str, flash: bool = True, **engine) -> list[float]:
    """The logprob of every prompt token (positions 1..), prompts in 32-token chunks so steps mix fresh
    prompts with chunks over a cached prefix. flash=False sends prefill attention to SDPA instead of
    flash's varlen kernel (the reference the flash path is judged against); engine: more LLM arguments."""
    import deepserve.kernels.varlen_attention as varlen

    fits = varlen.flash_varlen_fits
    if not flash:
        varlen.flash_varlen_fits = lambda q, v: False
    try:
        llm = LLM(path, dtype=dtype, device=device, num_gpu_blocks_override=256, block_size=16,
                  skip_tokenizer_init=True, max_num_seqs=16, max_num_batched_tokens=32, enforce_eager=True, **engine)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    finally:
        varlen.flash_varlen_fits = fits
    return [o.prompt_logprobs[pos][ids[pos]].logprob for ids, o in zip(prompts(), outs, strict=True)
            for pos in range(1, len(ids))]


def decode_logprobs(path: str, device: str, dtype: str, steps: int = 16, **engine
                    ) -> tuple[list[list[int]], list[float]]:
    """Each prompt decoded greedily for `steps` tokens, one sequence at a time (max_num_seqs 1: every decode
    step multiplies a single token, so quantized linears take their one-token GEMVs), CUDA graphs as the
    engine chooses: (each prompt + its output, the logprob of every decoded token)."""
    llm = LLM(path, dtype=dtype, device=device, num_gpu_blocks_override=256, block_size=16,
              skip_tokenizer_init=True, max_num_seqs=1, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts(), outs, strict=True)]
    logprobs = [step[token].logprob for o in outs
                for token, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
    return sequences, logprobs


def teacher_forced_logprobs(path: str, device: str, dtype: str, sequences: list[list[int]], steps: int = 16,
                            **engine) -> list[float]:
    """The logprob of each sequence's last `steps` tokens given the tokens before them, read as prompt
    logprobs (prefill): what decode_logprobs should have read for the same tokens."""
    llm = LLM(path, dtype=dtype, device=device, num_gpu_blocks_override=256, block_size=16,
              skip_tokenizer_init=True, max_num_seqs=16, enforce_eager=True, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [o.prompt_logprobs[pos][ids[pos]].logprob for ids, o in zip(sequences, outs, strict=True)
            for pos in range(len(ids) - steps, len(ids))]


def decode_error(path: str, engine: dict, device: str = "cuda", reference: str = "cpu") -> float:
    """Mean |logprob| difference between `device`'s one-token decode and `reference`'s prefill of the same
    tokens, in bf16 (engine: LLM arguments for both)."""
    sequences, got = decode_logprobs(path, device, "bfloat16", **engine)
    want = teacher_forced_logprobs(path, reference, "bfloat16", sequences, **engine)
    return (torch.tensor(got) - torch.tensor(want)).abs().mean().item()


# The bf16 flash case runs on one MHA/GQA and one MLA variant: three engines each, which the gate's
# time budget affords for two (the fp32 cases of all five took ~85 s in gate run 2).
BF16_VARIANTS = ("llama-gqa", "dsv3-noaux")


def check_bf16_flash(name: str, path: str) -> bool:
    """bf16 on the GPU, prefill on flash's varlen kernel through the engine's own step bookkeeping: its
    prompt logprobs may be no further from the fp32 CPU reference, on average over every prompt token,
    than 1.5 times the same bf16 run with prefill on SDPA, plus 0.01 (bf16's own rounding differs
    between the two, and a near-tie in routing may flip in either; a wrong row or offset is far off)."""
    want = torch.tensor(prompt_logprobs(path, "cpu", "float32"))
    flash = (torch.tensor(prompt_logprobs(path, "cuda", "bfloat16")) - want).abs().mean().item()
    sdpa = (torch.tensor(prompt_logprobs(path, "cuda", "bfloat16", flash=False)) - want).abs().mean().item()
    ok = flash <= 1.5 * sdpa + 0.01
    print(f"{name:10s} {'bf16-flash':13s} {'OK' if ok else 'MISMATCH'} mean prompt logprob error {flash:.4f} "
          f"(SDPA path {sdpa:.4f})")
    return ok


def parallel_cases(name: str) -> list[tuple[str, dict]]:
    """Multi-GPU layouts (NCCL), only where the machine has the GPUs for them."""
    gpus = 0 if "--no-parallel" in sys.argv else torch.cuda.device_count()
    cases = [("cuda-tp2", {"tensor_parallel_size": 2}), ("cuda-pp2", {"pipeline_parallel_size": 2})]
    if name.startswith("ds"):  # MoE: the ranks split the routed experts
        cases.append(("cuda-tp2-ep", {"tensor_parallel_size": 2, "enable_expert_parallel": True}))
    if gpus >= 4:
        cases.append(("cuda-tp2-pp2", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}))
    return cases if gpus >= 2 else []


def cases(name: str) -> list[tuple[str, dict]]:
    """Every case, or those named by --cases a,b,c (labels as printed)."""
    every = [("cuda-graphs", {}), ("cuda-eager", {"enforce_eager": True}),
             ("cuda-chunked", {"max_num_batched_tokens": 32})] + parallel_cases(name)
    wanted = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--cases=")), None)
    return every if wanted is None else [c for c in every if c[0] in wanted.split(",")]


def main() -> int:
    failures = 0
    for name, (config_cls, model_cls, extra) in VARIANTS.items():
        torch.manual_seed(0)
        model = model_cls(config_cls(**COMMON, **extra))
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            want = greedy(path, "cpu")
            for label, kw in cases(name):
                try:
                    got = greedy(path, "cuda", **kw)
                except Exception as e:  # one broken layout must not hide the others' results
                    failures += 1
                    print(f"{name:10s} {label:13s} ERROR {type(e).__name__}: {e}")
                    continue
                same = sum(g == w for g, w in zip(got, want, strict=True))
                ok = same == len(want)
                failures += not ok
                print(f"{name:10s} {label:13s} {'OK' if ok else 'MISMATCH'} {same}/{len(want)} sequences equal")
            if name in BF16_VARIANTS and torch.cuda.is_available() and "--no-bf16" not in sys.argv:
                try:
                    failures += not check_bf16_flash(name, path)
                except Exception as e:
                    failures += 1
                    print(f"{name:10s} {'bf16-flash':13s} ERROR {type(e).__name__}: {e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
