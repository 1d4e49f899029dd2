"""Programmatic dependent launch (kernels/pdl.py) over a one-token decode step's chain of kernels, as the
engine's graph runs them: DeepSeek-LLM-7B's 30 layers with AWQ-like int4 weights (groups of 128, tiled) and a
bf16 paged cache of 1,024 keys, each layer's own weights and cache (HBM, not L2), one CUDA graph a step:

    add_rms_norm -> qkv GEMV -> rope + KV store -> decode attention -> split merge -> o GEMV
    -> add_rms_norm -> gate_up GEMV -> SiLU-and-mul -> down GEMV

Variants (each a fresh capture; the step's outputs must equal the base's bit for bit, exit 1 if not):
  base        every launch plain (the engine's default today)
  small       the small kernels (norms, rope + store, attention, merge, SiLU) with programmatic dependence
  small+g1    and the int4 TMA GEMVs launched with it (weights asked for before the wait; int4_tma_gemv PDL 1)
  small+g3    and the TMA GEMVs also let the next launch start after their loop (PDL 3)
  DEEPSERVE_PDL  what the engine launches with that switch on: small+g3 with every GEMV (the 8 MB o projection
              too, which otherwise stays on the register kernel) on the TMA kernel
Timed as rounds of every variant in turn (drift falls on all alike); the table gives the median ms a step.

    python bench/pdl_chain_probe.py [--layers 30] [--rounds 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import bench_env
import torch
from gemv_probe import GROUP, int4_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.kernels import elementwise as ew  # noqa: E402
from deepserve.kernels import pdl  # noqa: E402
from deepserve.kernels import triton_paged_attention as pa  # noqa: E402
from deepserve.kernels.int4_mma_gemv import TILED_CONFIG, tile_scales, tile_words, w4a16_mma_gemv  # noqa: E402
from deepserve.kernels.rope_kv_store import rope_and_store_kv  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, INTER = 4096, 32, 128, 11008
CONTEXT, PAGE, BOUND = 1024, 16, 4096  # keys before the new one; the graphs' max_seq_len bound
EPS = 1e-6


@dataclass
class Layer:
    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: tuple
    o: tuple
    gate_up: tuple
    down: tuple
    cache: torch.Tensor


def tiled(n: int, k: int, seed: int) -> tuple:
    (q, s, z), = int4_weights(n, k, 1, seed)
    return tile_words(q), tile_scales(s, z)


def build(layers: int) -> list[Layer]:
    out = []
    blocks = (CONTEXT + 1 + PAGE - 1) // PAGE
    for i in range(layers):
        out.append(Layer(
            norm1=1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16),
            norm2=1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16),
            qkv=tiled(3 * HIDDEN, HIDDEN, 4 * i), o=tiled(HIDDEN, HIDDEN, 4 * i + 1),
            gate_up=tiled(2 * INTER, HIDDEN, 4 * i + 2), down=tiled(HIDDEN, INTER, 4 * i + 3),
            cache=torch.randn(2, blocks, PAGE, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)))
    return out


KINDS = ("norm", "rope", "attn", "merge", "silu")


def step_fn(layers: list[Layer], x0: torch.Tensor, res0: torch.Tensor, cfg, small_pdl: bool | set,
            trace: list | None = None, chained: bool = False):
    """One step's chain, returning (x, residual); pdl.ON decides the small kernels' launches at each call.
    small_pdl: True / False for every small kernel, or the set of KINDS that take it (--diagnose); trace: a
    list that gets (layer, name, a copy) of every intermediate (eager runs only)."""
    kinds = set(KINDS) if small_pdl is True else set(small_pdl or ())
    merge = pa._merge

    def kind(name):
        pdl.ON = name in kinds

    def note(i, name, t):
        if trace is not None:  # a reference, not a copy: no kernel between the chain's (the memory is kept)
            trace.append((i, name, t))
        return t

    def merge_with_its_switch(*args):
        kind("merge")
        return merge(*args)
    positions = torch.tensor([CONTEXT], device="cuda")
    slots = torch.tensor([CONTEXT], device="cuda", dtype=torch.int64)
    tables = torch.arange(layers[0].cache.shape[1], device="cuda", dtype=torch.int32)[None]
    lens = torch.tensor([CONTEXT + 1], device="cuda", dtype=torch.int32)
    cos_sin = torch.randn(BOUND, HEAD_DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def gemv(x, w):
        pdl.ON = chained  # w4a16_mma_gemv: every GEMV on the TMA kernel in PDL mode 3 (the engine's DEEPSERVE_PDL)
        return w4a16_mma_gemv(x, w[0], w[1], None, GROUP, None, cfg, tiled=True)

    def run():
        x, res = x0, res0
        pa._merge = merge_with_its_switch
        try:
            for i, layer in enumerate(layers):
                kind("norm")
                h, res = ew.add_rms_norm(x, res, layer.norm1, EPS)
                note(i, "norm1", h)
                qkv = note(i, "qkv", gemv(h, layer.qkv))
                q, k, v = qkv.view(1, 3 * HEADS, HEAD_DIM).split(HEADS, dim=1)
                kind("rope")
                q, _ = rope_and_store_kv(positions, q, k, v, cos_sin, HEAD_DIM, False, layer.cache, slots)
                note(i, "rope", q)
                kind("attn")
                attn = pa.paged_decode_attention(q, layer.cache, tables, lens, HEAD_DIM ** -0.5, max_seq_len=BOUND)
                note(i, "attn+merge", attn)
                o = note(i, "o", gemv(attn.view(1, HIDDEN), layer.o))
                kind("norm")
                h, res = ew.add_rms_norm(o, res, layer.norm2, EPS)
                note(i, "norm2", h)
                gu = note(i, "gate_up", gemv(h, layer.gate_up))
                kind("silu")
                a = note(i, "silu", ew.silu_and_mul(gu))
                x = note(i, "down", gemv(a, layer.down))
        finally:
            pdl.ON = False
            pa._merge = merge
        return x, res

    return run


VARIANTS = {  # name: (small kernels with PDL, TMA GEMV PDL mode, every GEMV on the TMA kernel in mode 3)
    "base": (False, 0, False),
    "small": (True, 0, False),
    "small+g1": (True, 1, False),
    "small+g3": (True, 3, False),
    "DEEPSERVE_PDL": (True, 0, True),  # what the engine launches with the switch on
}


def diagnose(layers: list[Layer], x0: torch.Tensor, res0: torch.Tensor) -> None:
    """Eager runs with one kind of small kernel at a time taking programmatic dependence: the first intermediate
    that differs from the plain run's (CUDA_LAUNCH_BLOCKING=1 tells a race from a difference in the code)."""
    cfg = TILED_CONFIG
    base = [t.clone() for t in step_fn(layers, x0, res0, cfg, set())()]
    for kinds in [{k} for k in KINDS] + [set(KINDS), set()]:
        outs = []
        for _ in range(3):
            got = step_fn(layers, x0, res0, cfg, kinds)()
            outs.append(all(torch.equal(a, b) for a, b in zip(got, base, strict=True)))
        print(json.dumps(dict(diagnose=sorted(kinds), final_equal_3_runs=outs)), flush=True)
    want: list = []
    step_fn(layers, x0, res0, cfg, set(), want)()
    got: list = []
    step_fn(layers, x0, res0, cfg, set(KINDS), got)()
    torch.cuda.synchronize()
    first = next(((i, name) for (i, name, a), (_, _, b) in zip(want, got, strict=True) if not torch.equal(a, b)), None)
    print(json.dumps(dict(diagnose="every kind, intermediates kept", first_difference=first)), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diagnose", action="store_true", help="only find which kernel's launch changes the results")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    env = bench_env.environment(torch.device("cuda"))
    print(json.dumps(env), flush=True)
    torch.manual_seed(0)
    layers = build(ns.layers)
    x0 = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res0 = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    if ns.diagnose:
        diagnose(layers, x0, res0)
        return 0
    fns, wrong = {}, []
    want = None
    for name, (small, mode, chained) in VARIANTS.items():
        fn = step_fn(layers, x0, res0, replace(TILED_CONFIG, tma_pdl=mode), small, chained=chained)
        eager = fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in out]
        if want is None:
            want = [t.clone() for t in eager]
        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and \
            all(torch.equal(a, b) for a, b in zip(eager, want, strict=True))
        print(json.dumps(dict(check=name, equal_to_base=same)), flush=True)
        if not same:
            wrong.append(name)
        fns[name] = (graph, (fn, out))  # the step's own tensors (block table, lengths...) live as long as its graph
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ns.rounds):
        for name, (graph, _) in fns.items():
            graph.replay()
            per = []
            for _ in range(ns.repeats):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                per.append(start.elapsed_time(end))
            times[name].append(statistics.median(per))
            print(json.dumps(dict(variant=name, ms=times[name][-1])), flush=True)
    base = statistics.median(times["base"])
    rows = []
    print(f"\nDeepSeek-LLM-7B-like int4 decode chain, {ns.layers} layers, 1 token, {CONTEXT} keys: ms a step "
          f"(median of {ns.rounds} rounds x {ns.repeats} replays)")
    print("| variant | ms a step | per round | vs base |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(dict(variant=name, ms=med, rounds=ts))
        print(f"| {name} | {med:.3f} | {' / '.join(f'{t:.3f}' for t in ts)} | {med / base - 1:+.1%} |")
    print(f"checks: {len(VARIANTS) - len(wrong)} equal to base, {len(wrong)} not" + (f": {wrong}" if wrong else ""))
    if ns.json:
        ns.json.write_text(json.dumps(dict(env=env, rows=rows, wrong=wrong), indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
