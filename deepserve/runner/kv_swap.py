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

Ordering on CUDA (HostTier.run, called by the runner just before each step's forward):
1. The copies go on a side stream that first waits for everything queued on the forward's stream so
   far: the KV a swap-out reads was written by earlier forwards (under async scheduling step n-1 may
   still be running), and a block a swap-in fills may still be written by an earlier forward's row of
   a request that was freed meanwhile (a finished request keeps its row in the step launched after it).
2. Swap-outs, then swap-ins, on that one stream (the scheduler's contract: a swap-in's fresh GPU block may
   be one a swap-out still has to read; a host block written by a step's swap-out may be read by that
   step's swap-in). Across steps the same stream keeps issue order: step n's swap-in reads a host block
   before step n+1's swap-out overwrites it.
3. The forward's stream waits for the swap-in event of its step before the forward (it reads those
   blocks), and for a swap-out event only if the step writes one of the GPU blocks that swap-out reads
   (blocks freed or evicted and handed out again): other swap-outs overlap the forward. Swap-outs still
   running are remembered with their blocks and checked by every later step until their event is done.
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
        outs = last_writer_wins(out.blocks_to_swap_out)
        ins = sorted(out.blocks_to_swap_in)  # by host block: longer runs; their GPU blocks are distinct
        if self.stream is None:  # CPU: plain copies, in program order
            self._copy(caches, outs, ins)
            return
        forward = torch.cuda.current_stream()
        if outs or ins:
            self.stream.wait_stream(forward)  # rule 1
            with torch.cuda.stream(self.stream):
                self._copy(caches, outs, [])
                if outs:
                    self.running_outs.append(({g for g, _ in outs}, _record()))
                self._copy(caches, [], ins)
                loaded = _record() if ins else None
            if loaded is not None:
                forward.wait_event(loaded)  # rule 3: the forward reads the loaded blocks
        self._wait_for_overwritten(out, forward)

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

    def _wait_for_overwritten(self, out: SchedulerOutput, forward: torch.cuda.Stream) -> None:
        """Rule 3 for swap-outs: the forward waits for those still running whose GPU blocks it writes.
        Once the forward's stream waits for one, every later forward comes after it too."""
        if not self.running_outs:
            return
        written = blocks_written(out, self.block_size)
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


