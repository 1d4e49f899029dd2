"""The baseline every speed-up is measured against: HF transformers `generate` on the same shapes,
random bf16 weights, static batches sorted by prompt length, left padding (BENCHMARKS.md)."""

from __future__ import annotations

import time
from typing import Any

import torch

from deepserve.bench.workloads import Workload


def run_hf_baseline(hf_config: Any, workload: Workload, batch_size: int, device: str = "cuda") -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
    start = time.perf_counter()
    for lo in range(0, len(order), batch_size):
        _generate_batch(model, workload, order[lo : lo + batch_size], device)
    elapsed = time.perf_counter() - start
    num_out = workload.num_output_tokens  # tokens asked for; padding steps past a request's end don't count
    return {"workload": workload.name, "engine": "hf-transformers", "batch_size": batch_size,
            "elapsed_time": elapsed, "num_output_tokens": num_out, "output_tokens_per_second": num_out / elapsed}


@torch.inference_mode()
def _generate_batch(model, workload: Workload, ids: list[int], device: str) -> None:
    prompts = [workload.prompts[i] for i in ids]
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        input_ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    new = max(workload.params[i].max_tokens for i in ids)
    model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                   do_sample=True, temperature=0.6, top_p=1.0, top_k=0, pad_token_id=0)
