"""Every environment variable deepserve reads: its name, default and meaning, in one place.

`envs.NAME` reads the variable when asked (processes spawned with a changed environment and tests that
set one see it). Code on a per-step path reads a switch once, at import or construction, and keeps the
value. Engine behaviour a user chooses is a flag or an `LLM(...)` argument, not a variable: these are
escape hatches for debugging and tests, deployment plumbing, and settings for spawned processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _flag(name: str, default: bool) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "1" if default else "0") not in ("0", "", "false", "False")


def _float(name: str, default: float) -> Callable[[], float]:
    return lambda: float(os.environ.get(name, default))


def _str(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "DEEPSERVE_DEMO_MODEL_DIR": (_str("DEEPSERVE_DEMO_MODEL_DIR"),
                                 "where the built-in demo model is written (default: the user cache)"),
    "DEEPSERVE_API_KEY": (_str("DEEPSERVE_API_KEY"), "an API key `deepserve serve` accepts beside --api-key(s)"),
    "DEEPSERVE_TP_TIMEOUT_S": (_float("DEEPSERVE_TP_TIMEOUT_S", 300.0),
                               "how long a collective or the multi-node rendezvous may wait, in seconds"),
    "DEEPSERVE_TP_HEARTBEAT_TIMEOUT_S": (_float("DEEPSERVE_TP_HEARTBEAT_TIMEOUT_S", 10.0),
                                         "how long a silent remote node is given before it counts as dead"),
    "DEEPSERVE_TP_LOAD_TIMEOUT_S": (_float("DEEPSERVE_TP_LOAD_TIMEOUT_S", 3600.0),
                                    "how long node 0 waits for every rank to load its weights, in seconds"),
    "DEEPSERVE_TORCH_COMPILE": (_flag("DEEPSERVE_TORCH_COMPILE", True),
                                "0: run the elementwise chains (norms, rope, SiLU-and-mul) eagerly where torch.compile "
                                "would (CPU; GPUs with DEEPSERVE_TRITON_ELEMENTWISE=0)"),
    "DEEPSERVE_TRITON_ELEMENTWISE": (_flag("DEEPSERVE_TRITON_ELEMENTWISE", True),
                                     "RMSNorm, SiLU-and-mul and rope run as the Triton kernels of "
                                     "kernels/elementwise.py on GPUs (no dynamo at start-up); 0: "
                                     "torch.compile's versions, for comparison"),
    "DEEPSERVE_PDL": (_flag("DEEPSERVE_PDL", True),
                      "Hopper GPUs, one-token steps: the small kernels (RMSNorm, SiLU-and-mul, rope + KV store, "
                      "decode attention and its split merge) and the int4 / FP8 tensor-core GEMVs are launched "
                      "with programmatic dependence, so each launch overlaps the kernel before it "
                      "(kernels/pdl.py; one H200: LLM-7B AWQ W2 TPOT -8.4 %, `-q fp8` -8.0 %); 0: plain launches"),
    "DEEPSERVE_PDL_MLA_MOE": (_flag("DEEPSERVE_PDL_MLA_MOE", True),
                              "with DEEPSERVE_PDL, the MLA and MoE paths' kernels take part too (the MLA decode "
                              "attention, the absorbed head products, the router's logits, the routing, the int4 "
                              "routed experts' GEMV, the fused MoE's kernels, the slot sum; kernels/pdl.py). "
                              "On by default: W2 TPOT V2-Lite AWQ -8.8 %, V2-Lite bf16 -4.7 %, V3 FP8 slice -0.8 %, "
                              "W1 +0.8 / +0.6 / 0.0 % (one H100, two A/B repeats each); 0: off"),
    "DEEPSERVE_PDL_KV_PREFETCH": (_flag("DEEPSERVE_PDL_KV_PREFETCH", False),
                                  "with DEEPSERVE_PDL, a one-token decode attention launch (MLA: with "
                                  "DEEPSERVE_PDL_MLA_MOE) asks its first tile of cache rows into L2 before "
                                  "waiting for the kernel before it (kernels/pdl.py). Default 0: LLM-7B AWQ W2 "
                                  "TPOT +2.0 % with it (one H100, one A/B)"),
    "DEEPSERVE_SHARED_EXPERTS_FUSION": (_flag("DEEPSERVE_SHARED_EXPERTS_FUSION", False),
                                        "1: DeepSeek's shared experts run as n_shared_experts more routed experts "
                                        "every token picks with weight 1, inside the fused MoE's launches "
                                        "(layers/moe.py DeepseekMoE; not under expert parallelism). Default 0: W1 "
                                        "-1.8 % V2-Lite AWQ, -2.0 % V3 FP8 slice (one H200, bench/RESULTS.md "
                                        "2026-12-05b)"),
    "DEEPSERVE_FUSED_QKV_A": (_flag("DEEPSERVE_FUSED_QKV_A", True),
                              "an MLA layer's first query projection (q_a_proj, or q_proj without a q LoRA) and "
                              "kv_a_proj_with_mqa, which read the same input, are stacked into one linear after "
                              "loading: one GEMV launch instead of two at decode (models/deepseek_v2.py; q_proj "
                              "only at tensor parallelism 1). On: W2 TPOT -3.1 % V2-Lite AWQ, -1.7 % V3 FP8 slice "
                              "(one H200, bench/RESULTS.md 2026-12-05b); 0 keeps them apart"),
    "DEEPSERVE_FUSED_ROUTING": (_flag("DEEPSERVE_FUSED_ROUTING", True),
                                "0: MoE routing by torch ops instead of the Triton routing kernel, and the "
                                "router's logits by cuBLAS at decode sizes too (kernels/moe_routing.router_logits)"),
    "DEEPSERVE_FUSED_SAMPLING": (_flag("DEEPSERVE_FUSED_SAMPLING", True),
                                 "0: sampling by torch ops instead of the fused Triton pass"),
    "DEEPSERVE_HEAD_MATMUL": (_flag("DEEPSERVE_HEAD_MATMUL", True),
                              "absorbed MLA decode at one token on GPUs runs its per-head products through W_UK and "
                              "W_UV (at most 2 MB each: V2-Lite's) in one Triton launch each (kernels/head_matmul.py) "
                              "instead of torch.bmm (cuBLAS); 0: torch.bmm"),
    "DEEPSERVE_SAMPLING_SPLIT": (_flag("DEEPSERVE_SAMPLING_SPLIT", True),
                                 "1 (default): small batches split each row's vocabulary among programs in the "
                                 "fused sampler, and all-greedy steps whose rows split take it too (one H200: 1 x "
                                 "102,400 logits 3.8 µs against torch.argmax's 24.1; LLM-7B AWQ W2 TPOT 2.29 -> "
                                 "2.25 ms); 0: one program a row, torch.argmax for every all-greedy step"),
    "DEEPSERVE_FP8_CUBLAS_MIN_M": (_float("DEEPSERVE_FP8_CUBLAS_MIN_M", 257),
                                   "FP8 linears with at least this many tokens run torch._scaled_mm (cuBLAS), "
                                   "fewer the Triton kernels; a huge value keeps every call on Triton"),
    "DEEPSERVE_FP8_CUBLAS_BLOCKWISE": (_flag("DEEPSERVE_FP8_CUBLAS_BLOCKWISE", True),
                                       "block-scaled FP8 linears with >= DEEPSERVE_FP8_CUBLAS_MIN_M tokens run "
                                       "torch._scaled_mm's block-wise scaling (cuBLAS) where it computes them "
                                       "correctly (K a multiple of 512, N of 16; M padded to 4), Triton elsewhere. "
                                       "Default on: 8192^3 1,309 TFLOP/s against Triton's 891 on the H200; "
                                       "0 keeps every call on Triton"),
    "DEEPSERVE_MMA_GEMV_ONE_SPLIT": (_flag("DEEPSERVE_MMA_GEMV_ONE_SPLIT", True),
                                     "the tensor-core decode GEMVs (int4 and FP8) give each 16-row tile one program "
                                     "of up to 8 warps that splits K inside itself and stores the tile, where the "
                                     "tiles are enough to keep the SMs busy (mma_gemv_common.one_split_warps), "
                                     "instead of split-K programs summed through a workspace and a counter. "
                                     "0: split-K everywhere (the launch before)"),
    "DEEPSERVE_FP8_GEMV_MAX_M": (_float("DEEPSERVE_FP8_GEMV_MAX_M", 1),
                                 "FP8 linears with at most this many tokens (up to 16) stream the weight through "
                                 "kernels/fp8_gemv.py, activations unquantized; 0: off (every call W8A8 unless the "
                                 "tensor-core GEMV, DEEPSERVE_FP8_MMA_GEMV_MAX_M, takes it first). Default 1: "
                                 "per GEMM on the H200 faster than the W8A8 path on every shape at 1 token, on some "
                                 "at 2, mostly slower above; W2 TPOT DeepSeek-LLM-7B -q fp8 3.39 ms with it"),
    "DEEPSERVE_FP8_MMA_GEMV_MAX_M": (_float("DEEPSERVE_FP8_MMA_GEMV_MAX_M", 8),
                                     "FP8 linears with at most this many tokens (up to 8) on a Hopper GPU run the "
                                     "tensor-core GEMV (kernels/fp8_mma_gemv.py: bf16 / fp16 activations, K a "
                                     "multiple of 128, scale blocks of whole 16 x 128 tiles) before the CUDA-core "
                                     "one; 0: off. On one H200 a DeepSeek-LLM-7B step's FP8 GEMVs took 2.18 / 2.23 / "
                                     "2.23 / 2.26 ms at 1 / 2 / 4 / 8 tokens against 2.22 / 3.18 / 2.80 / 2.76 "
                                     "without it, V3's dense shapes 12 % less time at one token; V3 8-layer slice "
                                     "W2 TPOT 2.55 against 2.60 ms (bench/fp8_gemv_probe.py, bench/ab.py)"),
    "DEEPSERVE_INT4_GEMV_MAX_M": (_float("DEEPSERVE_INT4_GEMV_MAX_M", 1),
                                  "int4 (AWQ / GPTQ) linears with at most this many tokens run the split-K GEMV "
                                  "kernel (kernels/int4_gemv.py) instead of the tile kernel; 0: never. Default 1: "
                                  "with its one-token tiles (64 x 128, 8 programs an SM, prefetching) W2 TPOT "
                                  "DeepSeek-LLM-7B AWQ 4.46 ms against 6.21 with the tile kernel (one H200, same "
                                  "machine)"),
    "DEEPSERVE_INT4_MMA_GEMV_MAX_M": (_float("DEEPSERVE_INT4_MMA_GEMV_MAX_M", 8),
                                      "int4 linears with at most this many tokens (up to 8) on a Hopper GPU run the "
                                      "tensor-core GEMV (kernels/int4_mma_gemv.py: 4-bit, no act order, groups and K "
                                      "multiples of 128; other checkpoints keep the kernels below); 0: off. On one "
                                      "H200 a DeepSeek-LLM-7B step's int4 GEMVs took 1.92 / 1.95 / 2.02 / 2.35 ms at "
                                      "1 / 2 / 4 / 8 tokens (row layout; tiled: DEEPSERVE_INT4_TILED) against 2.56 "
                                      "/ 5.16 / 5.14 / 5.16 without it (bench/gemv_probe.py --sweep)"),
    "DEEPSERVE_INT4_TILED": (_flag("DEEPSERVE_INT4_TILED", True),
                             "int4 linears that the tensor-core GEMV takes (above; bf16 / fp16 activations, N a "
                             "multiple of 16, K whole groups) keep their "
                             "weights in its tiled layout after loading (kernels/int4_mma_gemv.tile_words: each "
                             "warp's round one contiguous 1 KB read, no activation re-pairing); the other int4 "
                             "kernels read it too. On one H200 a DeepSeek-LLM-7B step's int4 GEMVs 1.68 / 1.77 / "
                             "1.79 / 1.99 ms at 1 / 2 / 4 / 8 tokens against 1.90 / 2.00 / 2.03 / 2.36 in the row "
                             "layout (bench/gemv_probe.py --sweep); 0: the row layout"),
    "DEEPSERVE_INT4_GEMV_FACTORED": (_flag("DEEPSERVE_INT4_GEMV_FACTORED", True),
                                     "the one-token int4 GEMV multiplies each packed word's codes by the inputs and "
                                     "scales once per word (s * (sum x q - z sum x), kernels/int4_gemv.py), the "
                                     "weight not rounded to bf16 first; 0: the reference's rounding. On one H200 a "
                                     "one-token step of DeepSeek-LLM-7B AWQ took 3.68 ms of graph replay with it, "
                                     "4.18 without"),
    "DEEPSERVE_INT4_GEMV_MAGIC": (_flag("DEEPSERVE_INT4_GEMV_MAGIC", True),
                                  "with the factored numerics, the one-token int4 GEMV makes each 4-bit code the "
                                  "float 2 + q / 64 by one byte permute (kernels/int4_tile._magic_tile) instead "
                                  "of a bit-field extract, an or and a subtraction; bf16 / fp16 inputs only. "
                                  "Default on: on one H200 a DeepSeek-LLM-7B step's one-token GEMVs 2.83 -> 2.48 ms "
                                  "(bench/gemv_probe.py); 0: the factored loop"),
    "DEEPSERVE_SPLIT_K_FUSED_SUM": (_flag("DEEPSERVE_SPLIT_K_FUSED_SUM", True),
                                    "the decode GEMVs (FP8 and int4) add their split-K partials in the program "
                                    "that finishes each output tile (kernels/split_k.py) instead of a second "
                                    "kernel; the same sum, bit for bit; 0: the second kernel. On one H200 a "
                                    "one-token step of DeepSeek-LLM-7B -q fp8 took 2.95 ms of graph replay with "
                                    "it, 3.14 without"),
    "DEEPSERVE_FUSED_ROPE_KV_STORE": (_flag("DEEPSERVE_FUSED_ROPE_KV_STORE", True),
                                      "MHA/GQA layers (Llama, Qwen2, DeepSeek-LLM) rotate q and k and store k and v "
                                      "in the KV cache in one launch on GPUs (kernels/rope_kv_store.py) instead of "
                                      "four; the same numbers, bit for bit. Default on: on one H200 greedy output "
                                      "equals the CPU reference with it, and a same-machine A/B read DeepSeek-LLM-7B "
                                      "W1 +1.4 %, W2 TPOT -3.0 %, TTFT -11.8 %, Qwen-7B W1 +0.5 %; 0: four launches. "
                                      "MLA layers (DeepSeek-V2/V3) likewise rotate q_pe and k_pe and store the latent "
                                      "entry in one launch (mla_rope_and_store) instead of four"),
    "DEEPSERVE_INT4_CUBLAS_MIN_M": (_float("DEEPSERVE_INT4_CUBLAS_MIN_M", 64),
                                    "int4 linears with at least this many tokens dequantize the weight and run "
                                    "cuBLAS (kernels/int4_dequant.py) instead of the tile kernel; 0: never. Default "
                                    "64: W1 DeepSeek-LLM-7B AWQ 5,041 out tok/s against 4,067 with the tile kernel "
                                    "(one H200, same machine)"),
    "DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS": (_float("DEEPSERVE_INT4_MOE_GEMV_MAX_TOKENS", 0),
                                           "int4 routed experts for at most this many tokens run one GEMV per "
                                           "assignment (kernels/int4_moe_gemv.py) instead of the fused MoE tiles; "
                                           "0: never (the default: with 1 and the tiles then, n32 k128, V2-Lite AWQ "
                                           "W2 TPOT 4.25 ms against 4.08, one H200)"),
    "DEEPSERVE_INT4_MOE_MMA_WARPS": (_float("DEEPSERVE_INT4_MOE_MMA_WARPS", 2),
                                     "warps a program of the int4 routed experts' tensor-core GEMV (1, 2, 4 or 8), "
                                     "splitting each assignment's inputs among them (kernels/int4_moe_mma.py); 2: "
                                     "V2-Lite AWQ W2 TPOT -8.8 % against 1 (one H200, bench/RESULTS.md 2026-12-05b)"),
    "DEEPSERVE_INT4_MOE_MMA_MAX_ASSIGNMENTS": (_float("DEEPSERVE_INT4_MOE_MMA_MAX_ASSIGNMENTS", 24),
                                              "int4 routed experts with at most this many assignments (tokens x "
                                              "experts a token) run the tensor-core GEMV once per assignment on "
                                              "Hopper (kernels/int4_moe_mma.py) instead of the fused MoE tiles, "
                                              "where that pays (int4_moe_mma.mma_moe_pays: assignments <= 3x the "
                                              "experts they hit on average); 0: never. Default 24: V2-Lite AWQ W2 "
                                              "TPOT 3.46 -> 2.92 ms on one H200 (same machine); per call the "
                                              "kernel also wins up to 256 (V3's experts, 32 tokens), not yet "
                                              "shown in the engine"),
    "DEEPSERVE_INT4_TMA_GEMV_STAGES": (_float("DEEPSERVE_INT4_TMA_GEMV_STAGES", 2),
                                       "one-token int4 GEMVs on Hopper over the tiled layout with groups of 128 and "
                                       "at least 16 MB of codes stage the weights through shared memory with the copy "
                                       "engine (TMA), this many rounds ahead (kernels/int4_tma_gemv.py); 0: off "
                                       "(the warps load them themselves). Default 2: LLM-7B AWQ W2 TPOT 2.34 -> "
                                       "2.29 ms on one H200 (same machine)"),
    "DEEPSERVE_INT4_TMA_GEMV_PDL": (_float("DEEPSERVE_INT4_TMA_GEMV_PDL", 0),
                                    "with DEEPSERVE_INT4_TMA_GEMV_STAGES: 1 launches those GEMVs with programmatic "
                                    "dependence (the weights asked for before waiting on the previous kernel), 2 "
                                    "also lets the next launch start early, 0 (default) plain launches: in the "
                                    "engine's decode graph 1 was not faster (bench/RESULTS.md)"),
    "DEEPSERVE_GC_FREEZE": (_flag("DEEPSERVE_GC_FREEZE", True),
                            "when start-up ends, the API server, the engine core process and the other ranks "
                            "collect once and freeze the surviving objects out of Python's garbage collection "
                            "(deepserve/heap.py), so its full passes walk only what serving made; 0: off. On by "
                            "default: W3 saturation on one H200 read 98.4 % of offline W1 with it, 89.5 % "
                            "without (same machine, bench/RESULTS.md)"),
    "DEEPSERVE_GC_FREEZE_GENERATE": (_flag("DEEPSERVE_GC_FREEZE_GENERATE", False),
                                     "1: the offline LLM.generate keeps the objects that exist when it starts out "
                                     "of the collector's full passes until it returns (deepserve/heap.py); on one "
                                     "H200 such passes took 259-339 ms inside W1. Off until measured"),
    "DEEPSERVE_CORE_SEND_THREAD": (_flag("DEEPSERVE_CORE_SEND_THREAD", False),
                                   "1: the engine core process sends its step outputs to the API server from a "
                                   "thread of its own (engine/core_process.py), so a busy API event loop no longer "
                                   "stops the engine once the socket's buffer is full; off: on one H200 it added "
                                   "nothing to the heap freeze (W3 saturation 97.6 % with both, 98.4 % freeze "
                                   "alone, one run each)"),
    "DEEPSERVE_GRAMMAR_OVERLAP": (_flag("DEEPSERVE_GRAMMAR_OVERLAP", False),
                                  "1: with async scheduling, structured output's masks for a step are filled on a "
                                  "thread of their own while the engine collects the step before, and the step's "
                                  "sampling is queued after that (engine/core.py); off: correct on one H200 "
                                  "but no change to structured output's cost (W1 with a schema at 0.85-0.86 of "
                                  "the same work unconstrained with it, 0.81-0.85 without, same machine)"),
    "DEEPSERVE_GRAMMAR_WARMUP": (_flag("DEEPSERVE_GRAMMAR_WARMUP", True),
                                 "structured output's llguidance view of the tokenizer is built at start-up "
                                 "(engine/grammar.py GrammarCompiler.warm_up), not by the first request with a "
                                 "schema, regex or grammar; on one H200, W1 with a JSON schema on every request "
                                 "(a fresh engine's first run) rose from 0.88 to 0.92-0.95 of the same work "
                                 "unconstrained, the offline engine's start-up took ~2 s longer and its second "
                                 "schema runs 0.7-4 % slower (not settled); 0: built at first use"),
    "DEEPSERVE_PINNED_GRAMMAR_MASKS": (_flag("DEEPSERVE_PINNED_GRAMMAR_MASKS", True),
                                       "structured output's masks are filled straight into pinned host buffers used "
                                       "in turn (layers/sampling_metadata.py MaskBuffers), so their copy to the GPU "
                                       "is queued without the host waiting (from pageable memory: 2.9 ms a "
                                       "full-batch step, up to 159 ms in a prefill step on one H200); 0: pageable "
                                       "copies. On one H200, W1 with a JSON schema on every request: 6,133 and "
                                       "6,076 out tok/s with it, 5,891 and 5,839 without (bench/trace_ab.sh)"),
    "DEEPSERVE_PREFILL_WARMUP": (_flag("DEEPSERVE_PREFILL_WARMUP", False),
                                 "1: start-up also runs prefill forwards of 1, 15, 16, 31, 32 ... up to "
                                 "max_num_batched_tokens - 1 tokens (ModelRunner.warm_up_prefill), so their kernel "
                                 "variants compile before the first request; off until measured on the H200. Set "
                                 "it alike on every node (each rank reads its own environment)"),
    "DEEPSERVE_RANK_START_METHOD": (lambda: os.environ.get("DEEPSERVE_RANK_START_METHOD", "forkserver"),
                                    "how ranks other than 0 start: forkserver (forks of one helper that imported "
                                    "torch once; runner/rank_start.py) or spawn (a fresh interpreter each)"),
    "DEEPSERVE_CACHE_DIR": (lambda: os.environ.get("DEEPSERVE_CACHE_DIR")
                            or os.path.join(os.path.expanduser("~"), ".cache", "deepserve"),
                            "where compiled Triton and inductor kernels are kept between runs (compile_cache.py)"),
    "TRITON_INTERPRET": (_flag("TRITON_INTERPRET", False),
                         "Triton's own: 1 runs the kernels in its interpreter (CPU tests); read when a kernel "
                         "module is imported"),
    "XDG_CACHE_HOME": (_str("XDG_CACHE_HOME"), "the user cache (the demo model goes under it)"),
    "CUDA_VISIBLE_DEVICES": (_str("CUDA_VISIBLE_DEVICES"),
                             "CUDA's own: which GPUs this process sees (the energy meter maps them to NVML's)"),
}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(VARIABLES)
