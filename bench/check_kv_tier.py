"""The --swap-space host tier on a GPU: its batched side-stream copies, their speed, the tier's start-up,
and the tier end to end.

    python bench/check_kv_tier.py            # about 2 minutes on one H200; non-zero exit on a wrong result

1. copies: HostTier.run on CUDA (gather of every layer into host-block-shaped staging + one memcpy per run of
   host blocks, and back; staging chunks and host-memory chunks smaller than the step, the later chunks
   still being pinned in the background) against the per-block definition computed on the CPU, for an
   MHA bf16 and an MLA FP8 layout; with the ordering hazards of a real step made live: the "previous
   forward" writes a block the swap-out reads (queued behind a 50 ms sleep, so a side stream that did not
   wait would read the old bytes), the "forward" overwrites a swapped-out block and reads the swapped-in
   ones right after `run` returns, and the next step's "forward" overwrites a block whose swap-out runs
   behind the first forward.
2. speed: swap-out and swap-in of N blocks for a Llama-8B-like cache (32 layers of [2, blocks, 16, 8, 128]
   bf16, 2 MiB a block) and a DeepSeek-V3-like one (61 layers of [blocks, 16, 576] bf16, 1.1 MiB a block),
   host blocks in one run and scattered, three ways side by side: "new" (HostTier: host blocks hold every
   layer, one memcpy per run of host blocks), "per-layer" (the previous batched path: a host tensor per
   layer, a gather and one memcpy per run per layer) and "per-block" (one non_blocking copy per block, layer
   and plane); GB/s over the bytes moved. Then how much of a 256-block swap-out hides behind a bf16 matmul
   loop standing in for a forward (overlap 1.0: fully hidden; 0: none): new, new when the forward writes
   the swapped-out blocks (it waits for their gather only), the same with 16 loads in the step (the
   stores that fit in half the staging are held behind the loads), and per-layer.
   start-up: seconds until the new tier's first chunk is usable and until all of it is pinned, the
   longest small GPU step (matmul + sync) of the engine's thread meanwhile (does a registration on the
   background thread hold it up?), against torch's pin_memory allocation of the same bytes as
   per-layer tensors.
3. end to end (tiny random Llama-GQA and DeepSeek-V2-like MLA checkpoints, float32, CUDA graphs on, sync and
   async scheduling): under a GPU cache too small to keep a prompt, the prompt is served, then a filler that
   takes every block, then the prompt again: the second serving must find the evicted blocks in the host
   tier (host-hit tokens > 0, its prefill only the tokens after the hits) and give the tokens of an engine
   whose cache kept the prompt on the GPU. And forced preemption with swap: equal to the roomy engine, no
   token recomputed.
The table comes last.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_check import COMMON, VARIANTS  # noqa: E402

from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.engine.request import Request, ScheduledRequest, SchedulerOutput  # noqa: E402
from deepserve.layers.kv_cache_spec import KVCacheSpec  # noqa: E402
from deepserve.runner.kv_swap import (  # noqa: E402
    HostTier,
    copy_blocks_reference,
    gpu_planes,
    last_writer_wins,
    split_swap_outs,
)

CUDA = torch.device("cuda")
ROWS: list[tuple[str, str, str]] = []  # (case, OK / FAIL / measured, detail)


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    nbytes = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), dtype=torch.uint8, device=device).view(dtype)


def plane_view(t: torch.Tensor, planes: int) -> torch.Tensor:
    return (t if planes > 1 else t.unsqueeze(0)).view(torch.uint8)  # [planes, blocks, ...] bytes


def host_layers(tier: HostTier) -> list[torch.Tensor]:
    """Each layer's host blocks [host blocks, planes, ...], over every chunk (copies on the CPU)."""
    return [torch.cat([tier.layer_view(layer, c) for c in range(len(tier.host.chunks))])
            for layer in range(len(tier.slots))]


def writer_step(block: int, block_size: int) -> list[ScheduledRequest]:
    """A scheduled request whose one new token lands in `block` (the forward overwrites it)."""
    req = Request("w", [0] * block_size, SamplingParams())
    req.block_ids = [block]
    return [ScheduledRequest(req, 1, block_size - 1)]


def check_copies(name: str, spec: KVCacheSpec, layers: int = 4, num_gpu: int = 1024, num_host: int = 1200) -> None:
    g = torch.Generator().manual_seed(0)
    bs = 16
    caches = [random_cache(spec.shape(num_gpu, bs), spec.dtype, CUDA) for _ in range(layers)]
    # 4 host-memory chunks (3 pinned in the background while the copies are queued) and staging chunks of
    # 128 blocks: runs split at chunk edges, staging reused within one step.
    tier = HostTier([spec] * layers, num_host, bs, CUDA, staging_blocks=128, blocks_per_chunk=300)
    tier.host.wait_all()  # random host bytes first, so a block the copies never touch is checked too
    for c in range(len(tier.host.chunks)):
        tier.host.chunk(c).copy_(torch.randint(0, 256, tier.host.chunk(c).shape, dtype=torch.uint8))
    perm = torch.randperm(num_gpu, generator=g).tolist()
    hosts = list(range(100, 400)) + torch.randperm(num_host, generator=g)[:200].tolist()  # one run, then scattered
    outs = list(zip(perm[:500], hosts, strict=True)) + [(perm[500], hosts[3])]  # host block hosts[3] written twice
    ins = list(zip(torch.randint(0, num_host, (400,), generator=g).tolist(), perm[501:901], strict=True))
    ins.append((hosts[0], perm[901]))  # a host block written by this step's swap-out, read by its swap-in
    pre_written, overwritten = outs[1][0], outs[0][0]
    want_caches = [c.to("cpu", copy=True) for c in caches]
    want_hosts = host_layers(tier)
    # The previous forward writes a block the swap-out reads, queued behind a sleep: the side stream must wait.
    torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz
    for cache, want in zip(caches, want_caches, strict=True):
        gpu_planes(cache, spec.planes)[:, pre_written].fill_(7)
        gpu_planes(want, spec.planes)[:, pre_written].fill_(7)
    tier.run(SchedulerOutput(writer_step(overwritten, bs), blocks_to_swap_out=outs, blocks_to_swap_in=ins), caches)
    # The forward: overwrites a block a swap-out reads and reads the swapped-in blocks (rule 2).
    loaded_gpu = torch.tensor([gpu for _, gpu in ins], device=CUDA)
    seen = []
    for cache in caches:
        gpu_planes(cache, spec.planes)[:, overwritten].fill_(9)
        seen.append(plane_view(cache, spec.planes).index_select(1, loaded_gpu).cpu())
    # The next step's forward overwrites a block that a swap-out running behind this step's forward reads
    # (rule 3): queued at once, it must still wait for that copy.
    behind = split_swap_outs(last_writer_wins(outs), sorted(ins), {overwritten})[1]
    late = behind[0][0]
    tier.run(SchedulerOutput(writer_step(late, bs)), caches)
    for cache in caches:
        gpu_planes(cache, spec.planes)[:, late].fill_(11)
    torch.cuda.synchronize()
    for want, host in zip(want_caches, want_hosts, strict=True):
        copy_blocks_reference(want, host, outs, spec.planes, to_host=True)
        copy_blocks_reference(want, host, ins, spec.planes, to_host=False)
    ok = True
    for cache, host, want, want_host, got_loaded in zip(caches, host_layers(tier), want_caches, want_hosts, seen,
                                                        strict=True):
        ok &= torch.equal(host.view(torch.uint8), want_host.view(torch.uint8))
        ok &= torch.equal(got_loaded, plane_view(want, spec.planes).index_select(1, loaded_gpu.cpu()))
        gpu_planes(want, spec.planes)[:, overwritten].fill_(9)
        gpu_planes(want, spec.planes)[:, late].fill_(11)
        ok &= torch.equal(plane_view(cache, spec.planes).cpu(), plane_view(want, spec.planes))
    ROWS.append((f"copies {name}", "OK" if ok else "FAIL",
                 f"{len(outs)} out ({len(behind)} behind the forward) + {len(ins)} in blocks x {layers} layers "
                 "= per-block definition, hazards live"))


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


class PerLayerTier:
    """The previous batched path, for comparison: a pinned host tensor per layer [host blocks, planes, ...];
    per layer a gather into staging and one memcpy per run of host blocks (and back), on the current stream."""

    def __init__(self, spec: KVCacheSpec, layers: int, num_host: int, bs: int) -> None:
        self.hosts = [torch.empty((num_host, spec.planes, bs, *spec.entry_shape), dtype=spec.dtype, pin_memory=True)
                      for _ in range(layers)]
        self.planes = spec.planes

    def run(self, caches: list[torch.Tensor], pairs, to_host: bool) -> None:
        gpu_blocks = [a if to_host else b for a, b in pairs]
        host_blocks = [b if to_host else a for a, b in pairs]
        runs: list[list[int]] = []  # [first host block, position, length]
        for i, h in enumerate(host_blocks):
            if runs and h == runs[-1][0] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([h, i, 1])
        index = torch.tensor(gpu_blocks, dtype=torch.int64).pin_memory().to(CUDA, non_blocking=True)
        for cache, host in zip(caches, self.hosts, strict=True):
            gpu = gpu_planes(cache, self.planes)  # [planes, blocks, row]
            rows = host.view(torch.uint8).view(host.shape[0], self.planes, -1)
            if to_host:
                staging = gpu.index_select(1, index).transpose(0, 1).contiguous()
                for first, pos, n in runs:
                    rows[first : first + n].copy_(staging[pos : pos + n], non_blocking=True)
            else:
                staging = torch.empty((len(pairs), *rows.shape[1:]), dtype=torch.uint8, device=CUDA)
                for first, pos, n in runs:
                    staging[pos : pos + n].copy_(rows[first : first + n], non_blocking=True)
                gpu.index_copy_(1, index, staging.transpose(0, 1))


def per_block(caches: list[torch.Tensor], hosts: list[torch.Tensor], pairs, planes: int, to_host: bool) -> None:
    """The copies as they were before batching: one non_blocking copy per block, layer and plane."""
    for cache, host in zip(caches, hosts, strict=True):
        gpu = cache if planes > 1 else cache.unsqueeze(0)
        for a, b in pairs:
            for p in range(planes):
                if to_host:
                    host[b, p].copy_(gpu[p, a], non_blocking=True)
                else:
                    gpu[p, b].copy_(host[a, p], non_blocking=True)


def small_step(x: torch.Tensor) -> float:
    """Seconds of one small matmul and a sync: stands in for an engine step's launches."""
    start = time.perf_counter()
    x @ x
    torch.cuda.synchronize()
    return time.perf_counter() - start


def speed_row(label: str, n: int, block_bytes: int, t_out: float, t_in: float) -> None:
    gb = n * block_bytes / 1e9
    ROWS.append((label, "measured", f"out {gb / t_out:6.1f} GB/s ({t_out * 1e3:7.2f} ms)  in {gb / t_in:6.1f} GB/s "
                                    f"({t_in * 1e3:7.2f} ms)"))


def bench_speed(name: str, spec: KVCacheSpec, layers: int, num_gpu: int = 4096, num_host: int = 2048) -> None:
    bs = 16
    caches = [spec.allocate(num_gpu, bs, CUDA) for _ in range(layers)]
    x = torch.randn(1024, 1024, device=CUDA)
    small_step(x)  # cuBLAS warm-up
    idle = [small_step(x) for _ in range(50)]
    start = time.perf_counter()
    tier = HostTier([spec] * layers, num_host, bs, CUDA)
    t_first = time.perf_counter() - start
    busy = []  # the engine's thread keeps launching and syncing while the rest is pinned
    while tier.host.num_ready_blocks < num_host:
        busy.append(small_step(x))
    tier.host.wait_all()
    t_all = time.perf_counter() - start
    start = time.perf_counter()
    old = PerLayerTier(spec, layers, num_host, bs)
    t_old = time.perf_counter() - start
    block_bytes = layers * bs * spec.bytes_per_token
    ROWS.append((f"start-up {name} {num_host * block_bytes / 2**30:.1f} GiB tier", "measured",
                 f"new: first chunk {t_first:.2f} s, all pinned {t_all:.2f} s (background; meanwhile the "
                 f"longest of {len(busy)} small GPU steps took {max(busy, default=0) * 1e3:.1f} ms, idle "
                 f"{max(idle) * 1e3:.1f} ms); per-layer pin_memory {t_old:.2f} s"))
    side = torch.cuda.Stream()
    for n in (16, 256, 2048):
        gpu_ids = torch.randperm(num_gpu)[:n].tolist()
        layouts = {"one run": list(range(n)), "scattered": sorted(torch.randperm(num_host)[:n].tolist())}
        for label, host_ids in layouts.items():
            outs, ins = list(zip(gpu_ids, host_ids, strict=True)), list(zip(host_ids, gpu_ids, strict=True))
            t_out = timed(lambda o=outs: tier.run(SchedulerOutput(blocks_to_swap_out=o), caches))
            t_in = timed(lambda i=ins: tier.run(SchedulerOutput(blocks_to_swap_in=i), caches))
            speed_row(f"speed {name} N={n} {label} new", n, block_bytes, t_out, t_in)
            t_out = timed(lambda o=outs: old.run(caches, o, True))
            t_in = timed(lambda i=ins: old.run(caches, i, False))
            speed_row(f"speed {name} N={n} {label} per-layer", n, block_bytes, t_out, t_in)
        if n <= 256:  # the per-block path launches n x layers x planes copies: slow to time at 2048
            outs, ins = list(zip(gpu_ids, range(n), strict=True)), list(zip(range(n), gpu_ids, strict=True))
            t_out = timed(lambda o=outs: per_block(caches, old.hosts, o, spec.planes, True))
            t_in = timed(lambda i=ins: per_block(caches, old.hosts, i, spec.planes, False))
            speed_row(f"speed {name} N={n} one run per-block", n, block_bytes, t_out, t_in)
    # Overlap: a swap-out of 256 scattered blocks beside a matmul loop on the forward's stream.
    a = torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16)
    outs = list(zip(torch.randperm(num_gpu)[:256].tolist(), sorted(torch.randperm(num_host)[:256].tolist()),
                    strict=True))

    def forward() -> None:
        for _ in range(8):
            a @ a

    def old_out() -> None:  # the per-layer path on a side stream that waits for the forward's, as HostTier's did
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            old.run(caches, outs, True)

    # The same swap-outs as "first" ones: the step's forward writes their GPU blocks (as a prefix store's
    # block is written by the request it was evicted for), so it waits for their gather, not their memcpy.
    writer = Request("w", [0] * (len(outs) * bs), SamplingParams())
    writer.block_ids = [g for g, _ in outs]
    writes_them = [ScheduledRequest(writer, len(outs) * bs, 0)]
    # With 16 loads in the same step (a host prefix hit evicting those blocks): as many stores as fit in half
    # the staging are held (the forward waits for their gather), the rest precede the loads.
    out_gpu, out_host = {g for g, _ in outs}, {h for _, h in outs}
    loads = list(zip([h for h in range(num_host) if h not in out_host][:16],
                     [g for g in range(num_gpu) if g not in out_gpu][:16], strict=True))
    t_fwd = timed(forward)
    for label, swap_out in (("new", lambda: tier.run(SchedulerOutput(blocks_to_swap_out=outs), caches)),
                            ("new, forward writes them",
                             lambda: tier.run(SchedulerOutput(writes_them, blocks_to_swap_out=outs), caches)),
                            ("new, forward writes them, 16 loads",
                             lambda: tier.run(SchedulerOutput(writes_them, blocks_to_swap_out=outs,
                                                              blocks_to_swap_in=loads), caches)),
                            ("per-layer", old_out)):
        t_out = timed(swap_out)
        t_both = timed(lambda s=swap_out: (s(), forward()))
        overlap = (t_fwd + t_out - t_both) / min(t_fwd, t_out)
        ROWS.append((f"overlap {name} 256 scattered {label}", "measured",
                     f"forward {t_fwd * 1e3:.2f} ms, swap-out {t_out * 1e3:.2f} ms, both {t_both * 1e3:.2f} ms: "
                     f"overlap {overlap:.2f}"))
    tier.close()


PROMPT = torch.randint(0, 512, (161,), generator=torch.Generator().manual_seed(1)).tolist()  # 10 full blocks
FILLER = torch.randint(0, 512, (230,), generator=torch.Generator().manual_seed(2)).tolist()  # + 24: 16 blocks
TINY = dict(num_gpu_blocks_override=18, block_size=16, max_model_len=256)
# The engines below use a 0.25 GiB tier: one chunk, registered before the engine starts, so no registration
# of one engine's tier runs on its background thread while the next engine captures its CUDA graphs.
# --e2e-on-cpu: only part 3, on the CPU reference path (to check this script where there is no GPU).
E2E_DEVICE = "cpu" if "--e2e-on-cpu" in sys.argv else "cuda"


def counting_llm(path: str, **kw) -> tuple[LLM, list[int]]:
    """An engine on E2E_DEVICE and the list each of its steps appends its computed token count to."""
    llm = LLM(path, device=E2E_DEVICE, dtype="float32", skip_tokenizer_init=True, **kw)
    runner, computed = llm.llm_engine.core.runner, []
    launch = runner.launch  # every step goes through it

    def counted(out, *args):
        computed.append(sum(s.num_new_tokens for s in out.scheduled))
        return launch(out, *args)

    runner.launch = counted
    return llm, computed


def serve_three(path: str, **kw) -> tuple[list[list[int]], int, int]:
    """PROMPT, FILLER, PROMPT one at a time: outputs, the second PROMPT's prefill tokens, host-hit tokens."""
    llm, computed = counting_llm(path, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for prompt in (PROMPT, FILLER, PROMPT):
        computed.clear()
        outs.append(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
    return outs, computed[0], llm.llm_engine.stats().prefix_cache_host_hits_total


def check_end_to_end(name: str, path: str) -> None:
    for sync in (True, False):
        mode = "sync" if sync else "async"
        outs, prefill, host_hits = serve_three(path, swap_space=0.25, async_scheduling=not sync, **TINY)
        roomy, roomy_prefill, _ = serve_three(path, num_gpu_blocks_override=256, block_size=16, max_model_len=256,
                                              async_scheduling=not sync)
        expect_prefill = len(PROMPT) - 16 * ((len(PROMPT) - 1) // 16)
        ok = host_hits > 0 and prefill == expect_prefill and outs == roomy and outs[2] == outs[0]
        ROWS.append((f"e2e {name} host prefix hit ({mode})", "OK" if ok else "FAIL",
                     f"host-hit tokens {host_hits}, second prefill {prefill} (roomy GPU {roomy_prefill}), "
                     f"tokens {'equal' if outs == roomy else 'DIFFER'}"))
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (150, 90, 200, 120, 60, 170)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    for label, kw in (("swap", dict(swap_space=0.25, **TINY)), ("roomy", dict(num_gpu_blocks_override=256,
                                                                             block_size=16, max_model_len=256))):
        llm, computed = counting_llm(path, **kw)
        outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]
        results[label] = (outs, sum(computed), llm.llm_engine.stats())
    no_recompute = sum(len(p) + 32 - 1 for p in prompts)
    outs, computed, stats = results["swap"]
    ok = outs == results["roomy"][0] and computed == no_recompute and stats.num_swapped_in_blocks_total > 0
    ROWS.append((f"e2e {name} preemption swap", "OK" if ok else "FAIL",
                 f"preemptions {stats.num_preemptions_total}, blocks in {stats.num_swapped_in_blocks_total}, "
                 f"computed {computed} (no recompute: {no_recompute})"))


def main() -> int:
    if E2E_DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --e2e-on-cpu for part 3 alone)")
        return 2
    if E2E_DEVICE == "cuda":
        check_copies("mha-bf16", KVCacheSpec((8, 128), 2, torch.bfloat16))
        check_copies("mla-fp8", KVCacheSpec((576,), 1, torch.float8_e4m3fn))
        bench_speed("llama-8b-like", KVCacheSpec((8, 128), 2, torch.bfloat16), layers=32)
        torch.cuda.empty_cache()  # the first layout's caches went with its call
        bench_speed("v3-like-mla", KVCacheSpec((576,), 1, torch.bfloat16), layers=61)
        torch.cuda.empty_cache()
    for name in ("llama-gqa", "dsv2-lite-like"):
        config_cls, model_cls, extra = VARIANTS[name]
        torch.manual_seed(0)
        model = model_cls(config_cls(**COMMON, **extra))
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            try:
                check_end_to_end(name, path)
            except Exception as e:  # one broken model must not hide the other's results
                ROWS.append((f"e2e {name}", "FAIL", f"{type(e).__name__}: {e}"))
    width = max(len(r[0]) for r in ROWS)
    print(f"\n{'case':{width}s}  result    detail")
    for case, result, detail in ROWS:
        print(f"{case:{width}s}  {result:8s}  {detail}")
    return 1 if any(r[1] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
