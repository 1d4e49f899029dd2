"""The host tier of the KV cache (--swap-space): host buffers for every layer's cache, and the block copies
between the two tiers that the scheduler lists in SchedulerOutput (swap-outs and prefix stores: GPU ->
host; swap-ins and prefix loads: host -> GPU).

Layout. A GPU cache is [2, blocks, ...] (key and value planes) or [blocks, ...] (MLA); seen as bytes, each
(plane, block) is one contiguous row, row p * blocks + b. The host tier is block-major, [host blocks,
planes, ...]: host block h's planes are rows h * planes .. h * planes + planes - 1, so a run of consecutive
host blocks is one contiguous span. Copies move raw bytes, so an FP8 cache swaps like any other.

Batched copies, one direction at a time: GPU -> host is one index_select per layer that gathers the
step's rows into a GPU staging tensor, then one memcpy per run of consecutive host blocks; host -> GPU is
one memcpy per run into staging, then one index_copy_ per layer. On the CPU (tests, the reference path)
each direction is one index_select + index_copy_ per layer, in program order.

Ordering (HostTier.run, called by the runner just before each step's forward). The scheduler's contract is
"a step's swap-outs, then its swap-ins, then its forward": a swap-in's fresh GPU block may be one a
swap-out still has to read, and a host block a swap-out writes may be one a swap-in reads. Only those
pairs, and swap-outs of blocks the forward writes, need that order; the rest commute. So the step's
swap-outs are split: "first" ones (reading a block the forward or a swap-in writes, or writing a host
block a swap-in reads) and "behind" ones (all others). On the CPU they run in the order first, swap-ins,
behind: plain copies. On CUDA:
1. The copies go on a side stream that first waits for everything queued on the forward's stream so
   far: the KV a swap-out reads was written by earlier forwards (under async scheduling step n-1 may
   still be running), and a block a swap-in fills may still be written by an earlier forward's row of
   a request that was freed meanwhile (a finished request keeps its row in the step launched after it).
2. On that one stream: first swap-outs, swap-ins, an event ("ready"), then the behind swap-outs and their
   event. The forward's stream waits for "ready" only: the forward reads the loaded blocks and may
   overwrite the first swap-outs' blocks; the behind swap-outs overlap the forward.
3. Behind swap-outs still running are remembered with the GPU blocks they read; every later step whose
   forward writes one of those blocks makes its stream wait for their event first (once it has, every
   later forward comes after it too). Later copies are on the same stream, so they follow in issue
   order: step n's swap-in reads a host block before step n+1's swap-out overwrites it.
Nothing here runs inside a CUDA graph capture; a decode graph's replay is queued after these waits like
any other kernel on the forward's stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepserve.engine.request import SchedulerOutput
from deepserve.layers.kv_cache_spec import KVCacheSpec

Pairs = Sequence[tuple[int, int]]


def allocate_host_caches(specs: list[KVCacheSpec], num_host_blocks: int, block_size: int,
                         pin: bool) -> list[torch.Tensor]:
    """One host tensor per layer, [host blocks, planes, block_size, *entry] in the layer's dtype; never read
    before a copy writes it, so left uninitialised."""
    return [torch.empty((num_host_blocks, spec.planes, block_size, *spec.entry_shape), dtype=spec.dtype,
                        pin_memory=pin) for spec in specs]


def gpu_rows(cache: torch.Tensor, planes: int) -> torch.Tensor:
    """The cache as bytes, one row per (plane, block): [planes * blocks, bytes per block and plane]."""
    num_blocks = cache.shape[1] if planes > 1 else cache.shape[0]
    return cache.view(torch.uint8).view(planes * num_blocks, -1)


def host_rows(host: torch.Tensor) -> torch.Tensor:
    """The host tier as bytes, one row per (block, plane): [blocks * planes, bytes per block and plane]."""
    return host.view(torch.uint8).view(host.shape[0] * host.shape[1], -1)


@dataclass
class CopyPlan:
    """One direction's copies for every layer of one layout (planes, GPU blocks): built once per step."""

    planes: int
    gpu_rows: torch.Tensor  # [pairs * planes] int64 on the cache's device: each pair's GPU rows, pair by pair
    host_rows: torch.Tensor | None  # the same for the host rows (CPU caches only)
    runs: list[tuple[int, int, int]]  # host_runs of the pairs' host blocks (CUDA caches only)


def plan_copies(pairs: Pairs, num_gpu_blocks: int, planes: int, device: torch.device, gpu_first: bool,
                by_runs: bool | None = None) -> CopyPlan:
    """The plan of `pairs`: (gpu block, host block) pairs if gpu_first, else (host block, gpu block). By runs
    of host blocks (staging + one memcpy per run) on CUDA, by host row indices elsewhere; `by_runs` forces
    one (the tests run the CUDA path's arithmetic on CPU tensors)."""
    gpu_blocks, host_blocks = ([a for a, _ in pairs], [b for _, b in pairs])
    if not gpu_first:
        gpu_blocks, host_blocks = host_blocks, gpu_blocks
    gpu = torch.tensor([p * num_gpu_blocks + g for g in gpu_blocks for p in range(planes)], dtype=torch.int64)
    if device.type == "cuda":
        gpu = gpu.pin_memory().to(device, non_blocking=True)
    if by_runs if by_runs is not None else device.type == "cuda":
        return CopyPlan(planes, gpu, None, host_runs(host_blocks))
    host = torch.tensor([h * planes + p for h in host_blocks for p in range(planes)], dtype=torch.int64)
    return CopyPlan(planes, gpu, host, [])


def host_runs(host_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first host block, position in the list, length) of each run of consecutive host blocks."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(host_blocks):
        if runs and h == runs[-1][0] + runs[-1][2]:
            first, pos, n = runs[-1]
            runs[-1] = (first, pos, n + 1)
        else:
            runs.append((h, i, 1))
    return runs


def last_writer_wins(pairs: Pairs) -> list[tuple[int, int]]:
    """Swap-outs sorted by host block, each host block once, written by its last pair (pairs are in the
    order the scheduler decided them: a host block freed and taken again is written again later)."""
    return sorted({h: (g, h) for g, h in pairs}.values(), key=lambda pair: pair[1])


def copy_out(cache: torch.Tensor, host: torch.Tensor, plan: CopyPlan) -> None:
    """The host blocks of `plan` <- its GPU blocks, on the current stream (host blocks distinct)."""
    src, dst, planes = gpu_rows(cache, plan.planes), host_rows(host), plan.planes
    if plan.host_rows is not None:  # by row indices (CPU)
        dst.index_copy_(0, plan.host_rows, src.index_select(0, plan.gpu_rows))
        return
    staging = src.index_select(0, plan.gpu_rows)  # [pairs * planes, row bytes], in pair order
    for first, pos, n in plan.runs:
        dst[first * planes : (first + n) * planes].copy_(staging[pos * planes : (pos + n) * planes], non_blocking=True)


def copy_in(host: torch.Tensor, cache: torch.Tensor, plan: CopyPlan) -> None:
    """The GPU blocks of `plan` <- its host blocks, on the current stream (GPU blocks distinct)."""
    src, dst, planes = host_rows(host), gpu_rows(cache, plan.planes), plan.planes
    if plan.host_rows is not None:  # by row indices (CPU)
        dst.index_copy_(0, plan.gpu_rows, src.index_select(0, plan.host_rows))
        return
    staging = torch.empty((plan.gpu_rows.shape[0], dst.shape[1]), dtype=torch.uint8, device=cache.device)
    for first, pos, n in plan.runs:
        staging[pos * planes : (pos + n) * planes].copy_(src[first * planes : (first + n) * planes], non_blocking=True)
    dst.index_copy_(0, plan.gpu_rows, staging)


def copy_blocks_reference(cache: torch.Tensor, host: torch.Tensor, pairs: Pairs, planes: int, to_host: bool) -> None:
    """The per-block definition the batched copies must equal: one copy per pair and plane, in order."""
    gpu = cache if planes > 1 else cache.unsqueeze(0)  # [planes, blocks, ...]
    for a, b in pairs:
        for p in range(planes):
            if to_host:
                host[b, p].copy_(gpu[p, a])
            else:
                gpu[p, b].copy_(host[a, p])


def split_swap_outs(outs: Pairs, ins: Pairs, written: set[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(first, behind): the swap-outs that must precede the step's swap-ins and forward — they read a GPU
    block the forward writes or a swap-in fills, or write a host block a swap-in reads — and the rest."""
    if not outs:
        return [], []
    overwritten = written | {g for _, g in ins}
    read = {h for h, _ in ins}
    first, behind = [], []
    for g, h in outs:
        (first if g in overwritten or h in read else behind).append((g, h))
    return first, behind


def blocks_written(out: SchedulerOutput, block_size: int) -> set[int]:
    """GPU blocks the step's forward writes KV into: each scheduled request's blocks over its new tokens."""
    written: set[int] = set()
    for s in out.scheduled:
        if s.num_new_tokens:
            last = (s.start + s.num_new_tokens - 1) // block_size
            written.update(s.request.block_ids[s.start // block_size : last + 1])
    return written


class HostTier:
    """The host caches of every attention layer and the copies of each step (ordering: module docstring)."""

    def __init__(self, specs: list[KVCacheSpec], num_host_blocks: int, block_size: int,
                 device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host_caches = allocate_host_caches(specs, num_host_blocks, block_size, pin=cuda)
        self.planes = [spec.planes for spec in specs]
        self.block_size = block_size
        self.stream = torch.cuda.Stream(device) if cuda else None
        # Swap-outs that may still be running: the GPU blocks they read, and their event.
        self.running_outs: list[tuple[set[int], torch.cuda.Event]] = []

    def run(self, out: SchedulerOutput, caches: list[torch.Tensor]) -> None:
        """Queue the step's copies, and make the current (forward's) stream wait for those it depends on."""
        if not out.blocks_to_swap_out and not out.blocks_to_swap_in and not self.running_outs:
            return
        written = blocks_written(out, self.block_size)
        ins = sorted(out.blocks_to_swap_in)  # by host block: longer runs; their GPU blocks are distinct
        first, behind = split_swap_outs(last_writer_wins(out.blocks_to_swap_out), ins, written)
        if self.stream is None:  # CPU: plain copies, in that order
            self._copy(caches, first, ins)
            self._copy(caches, behind, [])
            return
        forward = torch.cuda.current_stream()
        self._wait_for_overwritten(written, forward)  # rule 3, for earlier steps' behind swap-outs
        if not first and not ins and not behind:
            return
        self.stream.wait_stream(forward)  # rule 1
        with torch.cuda.stream(self.stream):
            self._copy(caches, first, ins)
            ready = _record() if first or ins else None
            self._copy(caches, behind, [])
            if behind:
                self.running_outs.append(({g for g, _ in behind}, _record()))
        if ready is not None:
            forward.wait_event(ready)  # rule 2

    def _copy(self, caches: list[torch.Tensor], outs: Pairs, ins: Pairs) -> None:
        """One direction at a time, every layer; the plan is built once per layout (the layers share one)."""
        for pairs, to_host in ((outs, True), (ins, False)):
            if not pairs:
                continue
            plans: dict[tuple[int, int], CopyPlan] = {}
            for cache, host, planes in zip(caches, self.host_caches, self.planes, strict=True):
                num_gpu_blocks = cache.shape[1] if planes > 1 else cache.shape[0]
                plan = plans.get((planes, num_gpu_blocks))
                if plan is None:
                    plan = plans[planes, num_gpu_blocks] = plan_copies(pairs, num_gpu_blocks, planes, cache.device,
                                                                       gpu_first=to_host)
                if to_host:
                    copy_out(cache, host, plan)
                else:
                    copy_in(host, cache, plan)

    def _wait_for_overwritten(self, written: set[int], forward: torch.cuda.Stream) -> None:
        """Rule 3: the forward waits for the behind swap-outs still running whose GPU blocks it writes."""
        still = []
        for blocks, done in self.running_outs:
            if done.query():
                continue
            if blocks.isdisjoint(written):
                still.append((blocks, done))
            else:
                forward.wait_event(done)
        self.running_outs = still


def _record() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


