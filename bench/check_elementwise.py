"""The elementwise chains three ways on one GPU: torch.compile (today's default), the Triton kernels of
deepserve/kernels/elementwise.py (DEEPSERVE_TRITON_ELEMENTWISE=1) and eager torch, at the shapes of a
decode step (CUDA graphs) and of a prefill chunk, for Qwen-7B, DeepSeek-LLM-7B and V2-Lite.

Each case: the Triton kernel against the reference in fp32 (the layers' plain function on fp32 copies,
rounded once), then the median time per call from CUDA-graph replays (bench_env.graph_per_call_us), with
enough copies of the inputs to miss L2, and the effective bandwidth (bytes read + written / time).
Prints a table last; exits 1 if any kernel is wrong.

    python bench/check_elementwise.py [--json F]          # the H200 run, about a minute
    python bench/check_elementwise.py --smoke             # CPU: correctness only, small shapes, interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import bench_env
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # --smoke on CPU; must precede the first `import triton`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepserve.kernels import elementwise as ew  # noqa: E402
from deepserve.layers.activation import silu_and_mul  # noqa: E402
from deepserve.layers.fusion import compiled_on_cuda  # noqa: E402
from deepserve.layers.norm import add_rms_norm, rms_norm  # noqa: E402
from deepserve.layers.rotary import _apply_rope  # noqa: E402

L2_BYTES = 256 << 20  # inputs cycled per timing graph: 5x the H200's L2
MODELS = {  # hidden, intermediate, heads, kv heads, head_dim, rotary_dim, interleaved
    "Qwen-7B": (3584, 18944, 28, 4, 128, 128, False),
    "LLM-7B": (4096, 11008, 32, 32, 128, 128, False),
    "V2-Lite": (2048, 10944, 16, 16, 64, 64, True),  # MLA: rope over the 64-wide pe part
}
TOKENS = (1, 256, 4096)


def cases(model: str, tokens: int, device: torch.device):
    hidden, inter, heads, kv_heads, head_dim, rotary, interleaved = MODELS[model]
    dtype = torch.bfloat16
    cos_sin = torch.randn(8192, rotary, device=device)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)

    def silu_inputs():
        return (torch.randn(tokens, 2 * inter, device=device, dtype=dtype),)

    def norm_inputs():
        return torch.randn(tokens, hidden, device=device, dtype=dtype), weight, 1e-6

    def add_norm_inputs():
        return (torch.randn(tokens, hidden, device=device, dtype=dtype),
                torch.randn(tokens, hidden, device=device, dtype=dtype), weight, 1e-6)

    def rope_inputs():
        return (positions, torch.randn(tokens, heads, head_dim, device=device, dtype=dtype),
                torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype), cos_sin, rotary, interleaved)

    el = 2  # bf16 bytes
    yield "silu_and_mul", silu_and_mul, ew.silu_and_mul, silu_inputs, tokens * inter * 3 * el
    yield "rms_norm", rms_norm, ew.rms_norm, norm_inputs, tokens * hidden * 2 * el
    yield "add_rms_norm", add_rms_norm, ew.add_rms_norm, add_norm_inputs, tokens * hidden * 4 * el
    yield "rope", _apply_rope, ew.apply_rope, rope_inputs, tokens * (heads + kv_heads) * head_dim * 2 * el


def _fp32(args):
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _within_rounding(got, want) -> tuple[bool, float]:
    """(ok, worst error): each output within about two bf16 roundings of the largest reference value."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    ok, worst = True, 0.0
    for g, w in zip(got, want, strict=True):
        error = (g.float() - w.float()).abs().max().item() if g.numel() else 0.0
        ok = ok and error <= 2 * 2**-8 * (w.abs().max().item() if w.numel() else 0.0) + 1e-3
        worst = max(worst, error)
    return ok, worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: correctness at 1 and 3 tokens, no timing")
    ns = ap.parse_args()
    device = torch.device("cpu" if ns.smoke else "cuda")
    rows, ok = [], True
    for model in MODELS:
        for tokens in (1, 3) if ns.smoke else TOKENS:
            for name, layer_fn, kernel, make, nbytes in cases(model, tokens, device):
                reference = layer_fn.__wrapped__
                args = make()
                good, error = _within_rounding(kernel(*args), reference(*_fp32(args)))
                ok = ok and good
                if ns.smoke:
                    print(f"{model} T={tokens} {name}: {'ok' if good else 'WRONG'} (max error {error:.3g})")
                    continue
                copies = max(1, min(64, L2_BYTES // max(nbytes, 1)))
                inputs = [make() for _ in range(copies)]
                compiled = compiled_on_cuda(reference)
                timed = {}
                for label, fn in (("compile", compiled), ("triton", kernel), ("eager", reference)):
                    timed[label] = bench_env.graph_per_call_us([lambda a=a, f=fn: f(*a) for a in inputs], 20, 20)
                rows.append(dict(model=model, tokens=tokens, op=name, error=error, ok=good, bytes=nbytes, **timed))
                print(json.dumps(rows[-1]), flush=True)
    if ns.smoke:
        print("ALL CORRECT" if ok else "SOME WRONG")
        return 0 if ok else 1
    print(f"\n{'model':8} {'T':>5} {'op':13} {'compile us':>10} {'triton us':>10} {'eager us':>9} "
          f"{'triton/compile':>14} {'triton GB/s':>11}  check")
    for r in rows:
        print(f"{r['model']:8} {r['tokens']:>5} {r['op']:13} {r['compile']:>10.1f} {r['triton']:>10.1f} "
              f"{r['eager']:>9.1f} {r['triton'] / r['compile']:>14.2f} {r['bytes'] / r['triton'] / 1e3:>11.0f}  "
              + ("ok" if r["ok"] else f"WRONG {r['error']:.3g}"))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"env": bench_env.environment(device), "rows": rows}, indent=1))
    print("ALL CORRECT" if ok else "SOME WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
