"""Why W1's first run in a fresh engine is slower than its second, when no kernel compiles inside it:
W1 three times in one engine, with the CUDA caching allocator's counters for each run (cudaMalloc /
cudaFree calls, allocation retries: a retry frees every cached block, a device-wide synchronization).

    python bench/first_run_probe.py --model r1-distill-qwen-7b [--runs 3]
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/first_run_probe.py ...   # a variant
"""

from __future__ import annotations

import argparse
import json
import os

COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="r1-distill-qwen-7b")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="the later runs would otherwise find every W1 prompt in the prefix cache")
    args = parser.parse_args()
    import torch

    from deepserve import LLM, SamplingParams
    from deepserve.bench import workloads
    from deepserve.bench.throughput import measure_throughput

    llm = LLM(model=args.model, load_format="dummy", max_model_len=4096, skip_tokenizer_init=True,
              enable_prefix_caching=not args.no_prefix_caching)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    workload = workloads.w1()
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for i in range(args.runs):
        before = torch.cuda.memory_stats()
        w1 = measure_throughput(llm, workload)
        after = torch.cuda.memory_stats()
        counts = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
        print(json.dumps({"model": args.model, "alloc_conf": alloc_conf, "run": i + 1,
                          "w1": round(w1["output_tokens_per_second"]), "elapsed_s": round(w1["elapsed_time"], 2),
                          "compiles": w1["kernel_compiles_during_run"], **counts}))


if __name__ == "__main__":
    main()
