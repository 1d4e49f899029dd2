"""`deepserve plan MODEL`: the memory per GPU, what fits, and the `deepserve serve` line to run."""

from __future__ import annotations

import argparse
import json
import shlex

from deepserve.planner.advice import load_bound
from deepserve.planner.gpus import GIB, GPUS


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="capacity plan: memory per GPU, sequences that fit, serve flags")
    p.add_argument("model", help="checkpoint folder, its config.json, or a preset (e.g. deepseek-v2-lite)")
    p.add_argument("--gpu", default="h200", help=f"{', '.join(GPUS)}, or a size in GiB (default: h200)")
    # The flags that mirror serve's carry serve's words (entrypoints/cli.py add_engine_args; a test holds them
    # equal) and the default the plan assumes, which is serve's.
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs each layer is split over (default: 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages (consecutive layers per stage) (default: 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype) or fp8 (fp8_e4m3), as serve takes them; bf16 / fp16 plan as auto on "
                        "a model of that dtype")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="weights' and activations' dtype (auto: the checkpoint's 16-bit type on a GPU, float32 on "
                        "CPU) (default: auto)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory the engine may use (weights, activations, KV cache) "
                        "(default: 0.9)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step (default: 8192 with chunked prefill, else max_model_len)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument("--enforce-eager", action="store_true", help="plan without the CUDA-graph reserve")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8", "awq", "gptq", "none"],
                   help="as deepserve serve's (default: the checkpoint's; FP8 checkpoints stay FP8); awq / gptq "
                        "plan the model's int4 build (4-bit weights, fp16 scales and zeros per group of 128)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="plan the routed experts whole, a tensor-parallel rank holding its share of them (as "
                        "serve's flag): then the expert count, not the expert width, must divide by -tp")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)


def cmd_plan(ns: argparse.Namespace) -> int:
    from deepserve.planner.estimate import PlanRequest, plan

    result = plan(PlanRequest(
        model=ns.model, gpu=ns.gpu, tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size, max_model_len=ns.max_model_len,
        kv_cache_dtype=ns.kv_cache_dtype, dtype=ns.dtype, gpu_memory_utilization=ns.gpu_memory_utilization,
        max_num_seqs=ns.max_num_seqs, block_size=ns.block_size, max_num_batched_tokens=ns.max_num_batched_tokens,
        enforce_eager=ns.enforce_eager, quantization=ns.quantization, enable_expert_parallel=ns.enable_expert_parallel,
    ))
    print(json.dumps(result.to_dict(), indent=2) if ns.json else format_plan(result))
    return 0 if result.fits and not result.engine_refuses else 1  # scripts can gate a rollout on it


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_plan(p) -> str:
    f = p.formulas
    lines = [
        f"model        {p.model} ({p.architecture}, {p.num_params / 1e9:.2f} B parameters, {p.dtype}"
        + (f", {p.quantization} weights)" if p.quantization else ")"),
        f"GPUs         {p.num_gpus} × {p.gpu} ({p.gpu_memory_bytes / GIB:.1f} GiB), TP {p.request.tensor_parallel_size}"
        f" × PP {p.request.pipeline_parallel_size}" + (", experts whole across the TP ranks (EP)"
                                                        if p.request.enable_expert_parallel else "")
        + f"; KV cache {p.kv_cache_dtype}, max_model_len {p.max_model_len:,}",
        "",
        "per GPU",
        f"  budget       {_gib(p.budget_bytes)}  GPU memory × {p.request.gpu_memory_utilization:g}",
        f"  weights      {_gib(p.weights_bytes)}  {f['weights']}",
        f"  activations  {_gib(p.activation_bytes)}  {f['activations']}",
        f"  KV cache     {_gib(p.kv_cache_bytes)}  {f['kv_cache']}",
        f"  KV per token {p.kv_bytes_per_token:,} bytes  {f['kv_bytes_per_token']}",
        f"  CUDA graphs  {_gib(p.cuda_graph_bytes)}  {f['cuda_graphs']}",
        "",
        f"KV tokens that fit   {p.kv_tokens:,} ({p.num_blocks:,} blocks of {p.request.block_size})",
        f"sequences of {p.max_model_len:,}  {p.max_sequences:,}"
        + (f" (the scheduler runs at most --max-num-seqs {p.request.max_num_seqs})" if p.fits else ""),
        "",
    ]
    if p.fits:
        lines += ["fits in memory, but deepserve serve refuses the command (see the note below):" if p.engine_refuses
                  else "fits. run:", "  " + shlex.join(p.serve_command)]
        if "--nnodes" in p.serve_command:
            lines += ["  (that is node 0, with NODE0_ADDRESS its address; on node k the same with --node-rank k)"]
        if "dummy" in p.serve_command:
            lines += ["  (a preset: --load-format dummy serves random weights in the model's shape; for the real "
                      "model, put its checkpoint folder in the preset's place and leave --load-format out)"]
    else:
        lines += [f"does NOT fit: {_why_not(p)}. What would:"]
        lines += [f"  - {a['change']}: " + (f"{a['flags']} — " if a["flags"] else "") + a["detail"] for a in p.advice]
    if p.fp8_dequantized:
        lines += [f"FP8: {p.fp8_dequantized}"]
    lines += [f"note: {w}" for w in p.warnings]
    return "\n".join(lines)


def _why_not(p) -> str:
    """The first thing that does not fit, largest first: the weights, then the step's activations, then
    the fp8-at-load peak (its note has the numbers), then the KV cache of one sequence."""
    if p.weights_bytes > p.budget_bytes:
        return (f"the weights alone do not fit: {p.weights_bytes / GIB:.1f} GiB per GPU against the "
                f"{p.budget_bytes / GIB:.1f} GiB budget")
    if p.kv_cache_bytes < 0:
        return (f"the weights and activations do not fit: {(p.weights_bytes + p.activation_bytes) / GIB:.1f} GiB "
                f"per GPU against the {p.budget_bytes / GIB:.1f} GiB budget")
    if load_bound(p):
        return "the weights do not fit while loading (see the note below)"
    return "not one sequence of max_model_len has room in the KV cache"
