"""kernels/head_matmul.py against torch.bmm (cuBLAS) on the absorbed MLA decode's two products, as a decode step
runs them: one CUDA graph holds every layer's pair (q_nope through W_UK, the latents through W_UV), each layer
with its own weights so they come from HBM, not L2. Checks each product against torch.bmm first.

    python bench/head_matmul_probe.py          # one H200, < 1 minute; µs a layer (both products) last
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import bench_env
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepserve.kernels.head_matmul import head_matmul  # noqa: E402

SHAPES = {"V2-Lite": (16, 27), "V3": (128, 8)}  # heads, layers (V3: the gate's 8-layer slice)
DN, DV, C = 128, 128, 512


def bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # the layer's torch path (layers/mla._per_head)
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def layer_pair(fn, q_nope, o_latent, w_uk, w_uv):
    return fn(q_nope, w_uk.transpose(1, 2)), fn(o_latent, w_uv)


def main() -> int:
    dev, failures, rows = torch.device("cuda"), 0, []
    for model, (heads, layers) in SHAPES.items():
        w = torch.randn(layers, heads, DN + DV, C, device=dev, dtype=torch.bfloat16) / C ** 0.5
        w_uk, w_uv = w[:, :, :DN], w[:, :, DN:]  # per layer [H, Dn, C], [H, Dv, C] views, as layers/mla.py
        for tokens in (1, 2, 4, 8):
            q = torch.randn(tokens, heads, DN + 64, device=dev, dtype=torch.bfloat16)
            q_nope = q[:, :, :DN]
            o_latent = torch.randn(tokens, heads, C, device=dev, dtype=torch.bfloat16)
            for a, b in zip(layer_pair(head_matmul, q_nope, o_latent, w_uk[0], w_uv[0]),
                            layer_pair(bmm, q_nope, o_latent, w_uk[0], w_uv[0]), strict=True):
                err = (a.float() - b.float()).abs().max().item()
                if err > 2e-2 * b.float().abs().max().item():
                    failures += 1
                    print(f"MISMATCH {model} B={tokens}: {err}")
            for name, fn in (("torch.bmm", bmm), ("head_matmul", head_matmul)):
                # each layer's own weights, all in one graph (bench_env's timing: the median of 50 replays)
                pairs = [functools.partial(layer_pair, fn, q_nope, o_latent, w_uk[i], w_uv[i]) for i in range(layers)]
                rows.append((model, tokens, name, bench_env.graph_per_call_us(pairs, min_calls=layers, repeats=50)))
    print(f"\nchecks: {failures} failed")
    print(f"{'model':8} {'tokens':>6} {'variant':12} {'us a layer (both products)':>28}")
    for model, tokens, name, us in rows:
        print(f"{model:8} {tokens:>6} {name:12} {us:>28.2f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
