"""W2's TTFT in one engine process, async scheduling on or off (fifth session of 2026-12-02 in RESULTS.md):
DeepSeek-LLM-7B with -q fp8 on dummy weights, W2 (1,024-token prompts) with 64 outputs, then again with 2.
    DEEPSERVE_FP8_GEMV_MAX_M=1 python3 bench/ttft_probe.py 1     # 1: async scheduling on, 0: off
The second W2 draws the same prompts as the first (measure_latency seeds its generator alike), so its
requests hit the prefix cache."""

import os
import sys

from deepserve import LLM, SamplingParams
from deepserve.bench.latency import measure_latency

llm = LLM(model="deepseek-llm-7b", skip_tokenizer_init=True, quantization="fp8", load_format="dummy",
          max_model_len=4096, async_scheduling=(sys.argv[1] == "1"))
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
a = measure_latency(llm, output_len=64, warmups=2, iters=6)
b = measure_latency(llm, output_len=2, warmups=2, iters=6)
print("RESULT gemv", os.environ.get("DEEPSERVE_FP8_GEMV_MAX_M"), "async", sys.argv[1],
      f"ttft(64 out) {a['ttft_ms_median']:.1f} ttft(2 out, prefix hits) {b['ttft_ms_median']:.1f}",
      f"tpot {a['tpot_ms_median']:.2f}")
