"""The per-step sampling and input kernels outside the decode graph, timed on the GPU (device time, from
CUDA-graph replays of 20 calls): the fused sampler with its vocabulary split (kernels/sampling.vocab_splits)
against one program a row and torch.argmax, and the one-launch placeholder fill against the torch ops it
replaces. Each variant is checked against torch first.

    python bench/sampling_probe.py            # one H200: < 1 minute; a table of µs a call last
"""

from __future__ import annotations

import sys
from pathlib import Path

import bench_env
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepserve.kernels import sampling as ks  # noqa: E402
from deepserve.runner.model_runner import fill_placeholders_torch as torch_fill  # noqa: E402


def timed_us(fn) -> float:
    """Device µs of one call (bench_env's graph timing: 20 calls a graph, the median of 20 replays). A decode
    step's sampling runs while the host is already ahead (async scheduling), so the device time is what the step
    pays; timing single eager calls measures their Python launch cost instead (~30-80 µs here)."""
    return bench_env.graph_per_call_us([fn], min_calls=20, repeats=20)


def main() -> int:
    dev = torch.device("cuda")
    rows_out, failures = [], 0
    for batch in (1, 4, 16, 64, 256):
        for vocab in (102_400, 129_280):
            logits = torch.randn(batch, vocab, device=dev).to(torch.bfloat16)
            t = torch.ones(batch, device=dev)
            g = torch.ones(batch, dtype=torch.bool, device=dev)
            want = logits.float().argmax(-1)
            variants = {
                "torch argmax (fp32 copy)": lambda: logits.float().argmax(-1),  # noqa: B023
                "fused, one program a row": lambda: ks.gumbel_sample(logits, t, g, 5, splits=1),  # noqa: B023
                "fused, split, greedy": lambda: ks.gumbel_sample(logits, t, g, 5, all_greedy=True),  # noqa: B023
                "fused, split, noise": lambda: ks.gumbel_sample(logits, t, ~g, 5),  # noqa: B023
            }
            for name, fn in variants.items():
                if "noise" not in name and not torch.equal(fn(), want):
                    failures += 1
                    print(f"MISMATCH {name} batch {batch} vocab {vocab}")
                rows_out.append((f"B={batch} V={vocab}", name, ks.vocab_splits(batch, vocab), timed_us(fn)))
    for tokens, rows in ((1, 1), (64, 64), (256, 256)):
        ids = torch.full((tokens,), -1, dtype=torch.int64, device=dev) - torch.arange(tokens, device=dev) % rows
        sampled = torch.randint(0, 100_000, (rows,), device=dev)
        if not torch.equal(ks.fill_placeholders(ids, sampled), torch_fill(ids.cpu(), sampled.cpu()).to(dev)):
            failures += 1
            print(f"MISMATCH placeholders {tokens}")
        rows_out.append((f"T={tokens}", "placeholders, torch ops", 0, timed_us(lambda: torch_fill(ids, sampled))))  # noqa: B023
        rows_out.append((f"T={tokens}", "placeholders, one kernel", 0,
                         timed_us(lambda: ks.fill_placeholders(ids, sampled))))  # noqa: B023
    print(f"\nchecks: {failures} failed")
    print(f"{'shape':22} {'variant':28} {'splits':>6} {'us':>8}")
    for shape, name, splits, us in rows_out:
        print(f"{shape:22} {name:28} {splits:>6} {us:>8.1f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
