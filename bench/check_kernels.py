"""Correctness and speed of the Triton paged-attention kernels, in one run on one GPU (H200).

For every benchmark shape and every launch variant: fresh random inputs, the output poisoned with NaN
first (an unwritten element or a NaN fails), the result compared with the torch reference, then the
median time of one call. Effective bandwidth counts the KV cache read once plus q and out. A failing
case prints its error and the run goes on. The summary table comes last; JSON goes to
$OUT/kernels.json when OUT is set.

Cases come twice: with max_seq_len = the sequences' length (an eager step), and with max_seq_len =
4096 whatever the length (column "max"), as the decode CUDA graphs launch the kernels. Every call is
timed from CUDA-graph replays with CUDA events ("graph"): an eager call, as triton.testing.do_bench
times it, measures Python's launch overhead whenever the GPU needs less (tens of us: B=1, but also
Qwen-7B at B=64). A timing graph holds one call per copy of the KV cache (distinct blocks of one
cache), enough copies to overflow L2, so every call reads HBM as a decode layer does.

    python bench/check_kernels.py               # the H200 run, < 3 minutes
    python bench/check_kernels.py --smoke       # tiny shapes; on a CPU-only machine under TRITON_INTERPRET
    python bench/check_kernels.py --kv-dtype fp8 --no-variants   # the same cases over an FP8 cache

With --kv-dtype fp8 the caches hold float8_e4m3fn codes of the bf16 values divided by a per-layer scale
(KV_SCALE), the kernels get that scale, and the reference reads the same codes; bandwidth counts one
byte per cached element.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import bench_env
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # --smoke on CPU; must precede the first `import triton`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.kernels import triton_paged_attention as tpa  # noqa: E402

PEAK_GBS = 4200.0  # copy bandwidth measured on this H200 (BENCHMARKS.md), the 100 % mark
BLOCK_SIZE = 16
DEFAULT_VARIANTS_UNTIL_S = 120.0  # --variants-until: past this many seconds only the defaults are timed (< 3 min)
VARIANTS_UNTIL_S = DEFAULT_VARIANTS_UNTIL_S
START = time.perf_counter()
GQA_MODELS = {"DeepSeek-LLM-7B": (32, 32, 128), "R1-Distill-Qwen-7B": (28, 4, 128)}  # H, Hkv, D
MLA_MODELS = {"V2-Lite": (16, 512, 64), "V3": (128, 512, 64)}  # H, R, P
GRAPH_BOUND = 4096  # max_seq_len of the decode graphs (max_model_len) in the "graph" cases
GRAPH_MODELS = ("DeepSeek-LLM-7B", "R1-Distill-Qwen-7B", "V2-Lite")
ROTATE_BYTES = 256 << 20  # KV bytes a graph cycles through: 5x the H200's 50 MB L2, so calls miss L2
MAX_COPIES = 128  # cap on the KV copies (calls) in one timing graph: V2-Lite B=1 L=1024 cycles 150 MB
MIN_CALLS = 20  # calls per timing graph, so the graph launch itself is amortized
SPLIT_VARIANTS = (8, 16, 32, 64)  # forced split counts timed next to the default ...
SPLIT_VARIANTS_MAX_BATCH = 16  # ... up to this batch
MODELS: tuple[str, ...] | None = None  # --models: only these models' cases
LC = tpa.LaunchConfig
KV_SCALE = 0.05  # the FP8 caches' scale (k, v and latent alike): bf16 randn / 0.05 stays inside ±448
KV_DTYPE = torch.bfloat16  # --kv-dtype
# Alternatives timed next to the defaults (None = the default config); "nosplit" pins num_splits=1.
GQA_VARIANTS = {
    1: {"fma-n32": LC(block_n=32, block_h=1, num_warps=4, num_stages=2),
        "fma-n64": LC(block_n=64, block_h=1, num_warps=4, num_stages=2),
        "dot-n128-w8": LC(block_n=128, block_h=16, num_warps=8, num_stages=3)},
    7: {"dot-n32": LC(block_n=32, block_h=16, num_warps=4, num_stages=2),
        "dot-n128-w8": LC(block_n=128, block_h=16, num_warps=8, num_stages=3)},
}
MLA_VARIANTS = {
    16: {"h16-n32": LC(block_n=32, block_h=16, num_warps=4, num_stages=2),
         "h16-n16-w8": LC(block_n=16, block_h=16, num_warps=8, num_stages=2)},
    128: {"h16-n16": LC(block_n=16, block_h=16, num_warps=4, num_stages=2),
          "h64-n16-w8": LC(block_n=16, block_h=64, num_warps=8, num_stages=2)},
}

# Over an FP8 cache (--kv-dtype fp8): the default tiles (tuned on bf16 caches) widened to fp16 instead of
# bf16, and longer / deeper-pipelined key tiles (half the bytes per key).
FP8_GQA_VARIANTS = {
    group: {"f16": LC(block_n=64, block_h=16, num_warps=4, num_stages=2, fp8_widen="fp16"),
            "n128-s3": LC(block_n=128, block_h=16, num_warps=4, num_stages=3),
            "f16-n128-s3": LC(block_n=128, block_h=16, num_warps=4, num_stages=3, fp8_widen="fp16"),
            "f16-n128-w8": LC(block_n=128, block_h=16, num_warps=8, num_stages=3, fp8_widen="fp16")}
    for group in (1, 7)
}
FP8_MLA_VARIANTS = {  # the defaults: tpa.default_mla_config (the reload; 64-key tiles, one load, at 1-4 sequences)
    16: {"one-load": LC(block_n=32, block_h=16, num_warps=4, num_stages=2, fp8_widen="fp16"),
         # "rv" and "n64-w8" are also the defaults (from 5 sequences / up to 4): each case times one of them
         # twice, a read of the noise between two timings of one config
         "rv": LC(block_n=32, block_h=16, num_warps=4, num_stages=2, fp8_widen="fp16", reload_values=True),
         "n64-w8": LC(block_n=64, block_h=16, num_warps=8, num_stages=2, fp8_widen="fp16"),
         "rv-s3": LC(block_n=32, block_h=16, num_warps=4, num_stages=3, fp8_widen="fp16", reload_values=True),
         "rv-n64-w8": LC(block_n=64, block_h=16, num_warps=8, num_stages=2, fp8_widen="fp16", reload_values=True),
         "rv-w8": LC(block_n=32, block_h=16, num_warps=8, num_stages=2, fp8_widen="fp16", reload_values=True),
         "rv-w8-s3": LC(block_n=32, block_h=16, num_warps=8, num_stages=3, fp8_widen="fp16", reload_values=True),
         "rv-n16-s3": LC(block_n=16, block_h=16, num_warps=4, num_stages=3, fp8_widen="fp16", reload_values=True)},
    128: {"one-load-h32": LC(block_n=32, block_h=32, num_warps=8, num_stages=2, fp8_widen="fp16"),
          "rv-h32": LC(block_n=32, block_h=32, num_warps=8, num_stages=2, fp8_widen="fp16", reload_values=True)},
}


@dataclass
class Row:
    kernel: str
    model: str
    batch: int
    seq_len: int
    variant: str
    max_seq_len: int = 0  # the host bound passed to the kernel (sizes the split count)
    timing: str = ""  # "graph": CUDA-graph replays; "cpu": one interpreted call (--smoke)
    config: str = ""
    ok: bool = False
    rel_err: float | None = None
    time_us: float | None = None
    gbs: float | None = None
    pct_peak: float | None = None
    error: str = ""


def timed(fns: list[Callable[[], object]], device: torch.device) -> float:
    """Median microseconds of one call. fns: the same call on each copy of the inputs (graph timing
    cycles through them; the CPU run takes the first)."""
    if device.type != "cuda":  # --smoke on CPU: one interpreted call, only to exercise the script
        start = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - start) * 1e6
    return bench_env.graph_per_call_us(fns, MIN_CALLS, repeats=15)


def num_copies(kv_bytes: int, device: torch.device) -> int:
    # KV copies for graph timing: enough that cycling through them overflows L2.
    return min(MAX_COPIES, max(1, -(-ROTATE_BYTES // kv_bytes))) if device.type == "cuda" else 1


def timing_name(device: torch.device) -> str:
    return "graph" if device.type == "cuda" else "cpu"


def paged_inputs(batch: int, seq_len: int, device: torch.device, copies: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    # Every sequence seq_len long, blocks scattered over the cache as after a long-running server.
    # -> tables [copies, B, blocks per sequence] over distinct blocks, seq_lens [B], num_blocks of all copies
    per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = copies * batch * per_seq
    tables = torch.randperm(num_blocks, device=device).view(copies, batch, per_seq).int()
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    return tables, seq_lens, num_blocks


def as_kv_dtype(cache: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The bf16 cache in KV_DTYPE, and the scale tensors the FP8 kernels take (none for bf16)."""
    if KV_DTYPE == torch.bfloat16:
        return cache, {}
    scale = torch.tensor(KV_SCALE, dtype=torch.float32, device=cache.device)
    return tpa.quantize_kv(cache, KV_SCALE, KV_DTYPE), {"scale": scale}  # the engine's own quantization


def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    if not torch.isfinite(out).all():
        return False, float("nan")
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return err < 1e-2, err


def measure(row: Row, run: Callable[[torch.Tensor, torch.Tensor], object], out: torch.Tensor, ref: torch.Tensor,
            tables: torch.Tensor, nbytes: int, device: torch.device) -> Row:
    # run(out, block_tables); checked on the first copy of the inputs, timed over all of them.
    try:
        out.fill_(float("nan"))
        run(out, tables[0])
        row.ok, row.rel_err = check(out, ref)
        row.time_us = timed([lambda t=t: run(out, t) for t in tables], device)
        row.gbs = nbytes / row.time_us / 1e3
        row.pct_peak = 100 * row.gbs / PEAK_GBS
    except Exception as exc:  # one broken variant must not hide the others
        row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        traceback.print_exc(limit=2)
    print(f"  {row.kernel:10s} {row.model:19s} B={row.batch:<4d} L={row.seq_len:<5d} max={row.max_seq_len:<5d} "
          f"{row.timing:5s} {row.variant:12s} "
          f"{'ok ' if row.ok else 'BAD'} err={row.rel_err or 0:.1e} {row.time_us or 0:9.1f} us "
          f"{row.gbs or 0:7.0f} GB/s {row.error}", flush=True)
    return row


def variant_options(configs: dict[str, tpa.LaunchConfig], batch: int, default_splits: int, variants: bool
                    ) -> dict[str, dict]:
    # Keyword overrides per variant name: the default, the alternative configs, no split, and forced split
    # counts: for small batches the heuristic's neighbours, past SPLIT_VARIANTS_MAX_BATCH 2x and 4x its own.
    options: dict[str, dict] = {"default": {}}
    if variants and time.perf_counter() - START < VARIANTS_UNTIL_S:
        options.update({name: {"config": cfg} for name, cfg in configs.items()})
        options["nosplit"] = {"num_splits": 1}
        if batch <= SPLIT_VARIANTS_MAX_BATCH:
            options.update({f"splits{n}": {"num_splits": n} for n in SPLIT_VARIANTS if n != default_splits})
        else:  # larger batches: more splits than the occupancy target asks for (more programs an SM)
            options.update({f"splits-x{f}": {"num_splits": f * default_splits} for f in (2, 4)})
    return options


def gqa_case(model: str, batch: int, seq_len: int, bound: int, device: torch.device, variants: bool) -> list[Row]:
    heads, kv_heads, dim = GQA_MODELS[model]
    kv_bytes = 2 * batch * seq_len * kv_heads * dim * KV_DTYPE.itemsize
    tables, seq_lens, num_blocks = paged_inputs(batch, seq_len, device, num_copies(kv_bytes, device))
    kv_cache, scales = as_kv_dtype(torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim, device=device,
                                               dtype=torch.bfloat16))
    fp8 = {"k_scale": scales["scale"], "v_scale": scales["scale"]} if scales else {}
    query = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
    scale = dim ** -0.5
    ref = tpa.paged_decode_attention_ref(query, kv_cache, tables[0], seq_lens, scale, **fp8)
    nbytes = kv_bytes + 2 * 2 * query.numel()
    out = torch.empty_like(query)
    group = heads // kv_heads
    default_cfg = tpa.default_gqa_config(group, query.dtype, bool(scales))
    default_splits = tpa._num_splits(batch * kv_heads, bound, default_cfg.block_n, None, tpa.GQA_TARGET_PROGRAMS)
    rows = []
    configs = (FP8_GQA_VARIANTS if scales else GQA_VARIANTS).get(group, {})
    for name, kw in variant_options(configs, batch, default_splits, variants).items():
        cfg = kw.get("config") or default_cfg
        splits = tpa._num_splits(batch * kv_heads, bound, cfg.block_n, kw.get("num_splits"), tpa.GQA_TARGET_PROGRAMS)
        row = Row("decode", model, batch, seq_len, name, bound, timing_name(device), f"{cfg} splits={splits}")
        run = lambda o, t, kw=kw: tpa.paged_decode_attention(query, kv_cache, t, seq_lens, scale, out=o,
                                                             max_seq_len=bound, **kw, **fp8)
        rows.append(measure(row, run, out, ref, tables, nbytes, device))
    rows.append(store_kv_case(model, batch, kv_cache, device, fp8))
    return rows


def store_kv_case(model: str, tokens: int, kv_cache: torch.Tensor, device: torch.device,
                  fp8: dict[str, torch.Tensor]) -> Row:
    # One decode step's writes: T = batch tokens into distinct random slots, one of them padding (-1).
    slots_total = kv_cache.shape[1] * BLOCK_SIZE
    slots = torch.randperm(slots_total, device=device)[:tokens]
    slots[-1] = -1
    key, value = (torch.randn(tokens, *kv_cache.shape[3:], device=device, dtype=torch.bfloat16) for _ in range(2))
    row = Row("store_kv", model, tokens, 0, "default", timing=timing_name(device))
    try:
        expected = kv_cache.clone()
        tpa.store_kv_cache_ref(key, value, expected, slots, **fp8)
        tpa.store_kv_cache(key, value, kv_cache, slots, **fp8)
        row.ok, row.rel_err = torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8)), 0.0
        del expected
        row.time_us = timed([lambda: tpa.store_kv_cache(key, value, kv_cache, slots, **fp8)], device)
        row.gbs = 2 * 2 * key.numel() * key.element_size() / row.time_us / 1e3  # read + write K and V
        row.pct_peak = 100 * row.gbs / PEAK_GBS
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        traceback.print_exc(limit=2)
    print(f"  store_kv   {model:19s} T={tokens:<4d} {'ok ' if row.ok else 'BAD'} {row.time_us or 0:9.1f} us "
          f"{row.error}", flush=True)
    return row


def mla_case(model: str, batch: int, seq_len: int, bound: int, device: torch.device, variants: bool) -> list[Row]:
    heads, rank, rope = MLA_MODELS[model]
    kv_bytes = batch * seq_len * (rank + rope) * KV_DTYPE.itemsize
    tables, seq_lens, num_blocks = paged_inputs(batch, seq_len, device, num_copies(kv_bytes, device))
    cache, scales = as_kv_dtype(torch.randn(num_blocks, BLOCK_SIZE, rank + rope, device=device,
                                            dtype=torch.bfloat16))
    fp8 = {"kv_scale": scales["scale"]} if scales else {}
    q_latent = torch.randn(batch, heads, rank, device=device, dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, rope, device=device, dtype=torch.bfloat16)
    scale = (128 + rope) ** -0.5  # qk_nope_head_dim + qk_rope_head_dim of V2/V3
    ref = tpa.paged_mla_decode_attention_ref(q_latent, q_rope, cache, tables[0], seq_lens, scale, **fp8)
    nbytes = kv_bytes + 2 * (q_latent.numel() + q_rope.numel() + q_latent.numel())
    out = torch.empty_like(q_latent)
    default_cfg = tpa.default_mla_config(heads, bool(scales), batch)
    tiles = -(-heads // default_cfg.block_h)
    default_splits = tpa._num_splits(batch * tiles, bound, default_cfg.block_n, None, tpa.MLA_TARGET_PROGRAMS)
    rows = []
    configs = (FP8_MLA_VARIANTS if scales else MLA_VARIANTS).get(heads, {})
    for name, kw in variant_options(configs, batch, default_splits, variants).items():
        cfg = kw.get("config") or default_cfg
        tiles = -(-heads // cfg.block_h)
        splits = tpa._num_splits(batch * tiles, bound, cfg.block_n, kw.get("num_splits"), tpa.MLA_TARGET_PROGRAMS)
        row = Row("mla", model, batch, seq_len, name, bound, timing_name(device), f"{cfg} splits={splits}")
        run = lambda o, t, kw=kw: tpa.paged_mla_decode_attention(q_latent, q_rope, cache, t, seq_lens, scale,
                                                                 bound, out=o, **kw, **fp8)
        rows.append(measure(row, run, out, ref, tables, nbytes, device))
    rows.append(store_mla_case(model, batch, cache, device, fp8))
    return rows


def store_mla_case(model: str, tokens: int, cache: torch.Tensor, device: torch.device,
                   fp8: dict[str, torch.Tensor]) -> Row:
    slots = torch.randperm(cache.shape[0] * BLOCK_SIZE, device=device)[:tokens]
    slots[-1] = -1
    latent = torch.randn(tokens, cache.shape[2], device=device, dtype=torch.bfloat16)
    row = Row("store_mla", model, tokens, 0, "default", timing=timing_name(device))
    try:
        expected = cache.clone()
        tpa.store_mla_cache_ref(latent, expected, slots, **fp8)
        tpa.store_mla_cache(latent, cache, slots, **fp8)
        row.ok, row.rel_err = torch.equal(cache.view(torch.uint8), expected.view(torch.uint8)), 0.0
        row.time_us = timed([lambda: tpa.store_mla_cache(latent, cache, slots, **fp8)], device)
        row.gbs = 2 * latent.numel() * latent.element_size() / row.time_us / 1e3
        row.pct_peak = 100 * row.gbs / PEAK_GBS
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        traceback.print_exc(limit=2)
    print(f"  store_mla  {model:19s} T={tokens:<4d} {'ok ' if row.ok else 'BAD'} {row.time_us or 0:9.1f} us "
          f"{row.error}", flush=True)
    return row


def run_all(batches: tuple[int, ...], seq_lens: tuple[int, ...], graph_batches: tuple[int, ...],
            graph_lens: tuple[int, ...], graph_bound: int, device: torch.device, variants: bool) -> list[Row]:
    # The graph cases first: they are what this script is watched for, and variants stop after
    # VARIANTS_UNTIL_S. (case, model, batch, seq_len, max_seq_len) each.
    case_of = {m: c for m, c in {**{m: gqa_case for m in GQA_MODELS}, **{m: mla_case for m in MLA_MODELS}}.items()
               if MODELS is None or m in MODELS}
    plan = [(case_of[m], m, b, n, graph_bound) for m in GRAPH_MODELS if m in case_of for b in graph_batches
            for n in graph_lens]
    plan += [(case_of[m], m, b, n, n) for m in case_of for b in batches for n in seq_lens]
    rows: list[Row] = []
    for case, model, batch, seq_len, bound in plan:
        try:
            rows += case(model, batch, seq_len, bound, device, variants)
        except Exception as exc:  # input construction or the reference failed
            traceback.print_exc(limit=3)
            rows.append(Row(case.__name__, model, batch, seq_len, "-", bound, error=f"{type(exc).__name__}: {exc}"))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the MHA cache at B=256, L=2048 is 8.6 GB
    return rows


def summary(rows: list[Row]) -> str:
    # One line per case: the default variant, and the fastest correct variant when that is another one.
    lines = [f"{'kernel':9s} {'model':19s} {'B':>4s} {'L':>5s} {'max':>5s} {'time':5s} {'us':>8s} {'GB/s':>6s} "
             f"{'%peak':>5s} {'err':>7s}  best variant", "-" * 108]
    for r in rows:
        if r.variant not in ("default", "-"):
            continue
        key = (r.kernel, r.model, r.batch, r.seq_len, r.max_seq_len)
        same = [o for o in rows if (o.kernel, o.model, o.batch, o.seq_len, o.max_seq_len) == key]
        good = [o for o in same if o.ok and o.time_us]
        best = min(good, key=lambda o: o.time_us) if good else None
        best_text = f"{best.variant} {best.time_us:.1f} us" if best and best is not r else ""
        status = f"{r.rel_err:7.1e}" if r.ok else ("ERROR  " if r.error else "WRONG  ")
        lines.append(f"{r.kernel:9s} {r.model:19s} {r.batch:4d} {r.seq_len:5d} {r.max_seq_len:5d} {r.timing:5s} "
                     f"{r.time_us or 0:8.1f} "
                     f"{r.gbs or 0:6.0f} {r.pct_peak or 0:5.1f} {status}  {best_text}")
    bad = sum(not r.ok for r in rows)
    lines.append(f"{len(rows)} measurements, {bad} failed; peak = {PEAK_GBS:.0f} GB/s")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    return bench_env.environment(device, block_size=BLOCK_SIZE, peak_gbs=PEAK_GBS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to test the script itself")
    parser.add_argument("--no-variants", action="store_true", help="time the default launch configs only")
    parser.add_argument("--variants-until", type=float, default=DEFAULT_VARIANTS_UNTIL_S,
                        help="seconds into the run after which only the defaults are timed")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the caches' dtype")
    parser.add_argument("--models", type=lambda v: tuple(v.split(",")),
                        help=f"only these models' cases (comma-separated; of {', '.join([*GQA_MODELS, *MLA_MODELS])})")
    args = parser.parse_args()
    global MODELS, VARIANTS_UNTIL_S
    MODELS, VARIANTS_UNTIL_S = args.models, args.variants_until
    unknown = set(MODELS or ()) - {*GQA_MODELS, *MLA_MODELS}
    if unknown:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join([*GQA_MODELS, *MLA_MODELS])}")
    global KV_DTYPE
    KV_DTYPE = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("no CUDA device: only --smoke runs on CPU")
    torch.manual_seed(0)
    if args.smoke:  # the interpreter: a few tiny launches of each path
        batches, seq_lens, graph_batches, graph_lens, graph_bound = (1, 3), (40,), (1,), (40,), 256
    else:
        batches, seq_lens = (1, 64, 256), (1024, 2048)
        graph_batches, graph_lens, graph_bound = (1, 4, 16), (1024, 4096), GRAPH_BOUND
    rows = run_all(batches, seq_lens, graph_batches, graph_lens, graph_bound, device, variants=not args.no_variants)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"kernels{'-fp8' if args.kv_dtype == 'fp8' else ''}.json"
        path.write_text(json.dumps(dict(env=environment(device), rows=[asdict(r) for r in rows]), indent=1))
        print(f"wrote {path}")
    elapsed = time.perf_counter() - START
    print(f"\nTriton paged attention, {args.kv_dtype} cache, block_size {BLOCK_SIZE}, {elapsed:.0f} s")
    print(summary(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
