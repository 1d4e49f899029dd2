"""The host tier of the KV cache (--swap-space): host blocks holding every layer's KV of one GPU block, and
the block copies between the two tiers that the scheduler lists in SchedulerOutput (swap-outs and prefix
stores: GPU -> host; swap-ins and prefix loads: host -> GPU).

Layout. A GPU cache is [2, blocks, ...] (key and value planes) or [blocks, ...] (MLA); seen as bytes it is
[planes, blocks, row bytes]. A host block is one contiguous span of raw bytes with every layer's planes of
one GPU block, layer after layer (`layer_slots`): so one host block, scattered or not, is one large copy
(about 1-2 MiB for 8B-to-671B models) instead of one small copy per layer and plane. Copies move raw
bytes, so an FP8 cache swaps like any other. The host memory is chunked and pinned in the background
(host_memory.HostBlocks).

Batched copies, one direction at a time, in staging chunks of up to `staging_blocks` pairs sorted by host
block: GPU -> host is a gather of the chunk's GPU blocks of every layer into a GPU staging buffer laid out
like host blocks (an index_select per layer), then one memcpy per run of consecutive host blocks; host ->
GPU is one memcpy per run into staging, then an index_copy_ per layer. The CPU (tests, the reference
path) runs the same code in program order.

Ordering (HostTier.run, called by the runner just before each step's forward). The scheduler's contract is
"a step's swap-outs, then its swap-ins, then its forward": a swap-in's fresh GPU block may be one a
swap-out still has to read, and a host block a swap-out writes may be one a swap-in reads. Only those
pairs, and swap-outs of blocks the forward writes, need that order; the rest commute. So the step's
swap-outs are split: "first" ones (reading a block the forward or a swap-in writes, or writing a host
block a swap-in reads) and "behind" ones (all others). A prefix store's GPU block was evicted to be
handed out again, mostly to a request of the same step whose forward writes it: such a store is "first"
and its gather precedes that forward (its memcpy need not, rule 2). The CPU runs the sequence of rule 2
in program order (plain copies; every order it allows equals the per-block definition). On CUDA:
1. The copies go on a side stream (high priority, so its short gather kernels are not queued behind the
   forward's) that first waits for everything queued on the forward's stream so far: the KV a swap-out
   reads was written by earlier forwards (under async scheduling step n-1 may still be running), and a
   block a swap-in fills may still be written by an earlier forward's row of a request that was freed
   meanwhile (a finished request keeps its row in the step launched after it).
2. On that one stream: first swap-outs, swap-ins, an event ("ready"), then the behind swap-outs. The
   forward's stream waits for "ready" only: the forward reads the loaded blocks and may overwrite the
   first swap-outs' blocks. A swap-out reads its GPU block only in its gather into staging, so in a step
   without swap-ins "ready" is recorded right after the first swap-outs' last gather, and their memcpys
   to the host overlap the forward like the behind swap-outs. In a step with swap-ins (a prefix hit on
   the host takes fresh GPU blocks, whose eviction stores other prefix blocks in the same step), the
   first swap-outs that no swap-in conflicts with are "held" (as many as fit in half the staging):
   gathered into the end of the staging before the swap-ins, which use the rest, and copied to the host
   after "ready". The forward then waits for their gather and the swap-ins, not for their memcpys.
3. Behind swap-outs whose gather may still be running are remembered with the GPU blocks they read and
   the event after that gather; every later step whose forward writes one of those blocks makes its
   stream wait for that event first (once it has, every later forward comes after it too). Later copies
   are on the same stream, so they follow in issue order: step n's swap-in reads a host block before
   step n+1's swap-out overwrites it, and a staging chunk is reused only after the copies of the
   previous chunk that read or wrote it.
Nothing here runs inside a CUDA graph capture; a decode graph's replay is queued after these waits like
any other kernel on the forward's stream.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepserve.engine.request import SchedulerOutput
from deepserve.layers.kv_cache_spec import KVCacheSpec
from deepserve.runner.host_memory import HostBlocks

Pairs = Sequence[tuple[int, int]]
STAGING_BYTES = 128 << 20  # GPU staging for one chunk of copies (allocated at the first copy, then kept)
_HIGH_PRIORITY = -1  # torch maps it to the device's highest stream priority


@dataclass(frozen=True)
class LayerSlot:
    """Where one layer lives in a host block: `planes` rows of `row_bytes` bytes from `offset`."""

    offset: int
    planes: int
    row_bytes: int
    dtype: torch.dtype
    row_shape: tuple[int, ...]  # (block_size, *entry): one plane of one block

    @property
    def nbytes(self) -> int:
        return self.planes * self.row_bytes


def layer_slots(specs: list[KVCacheSpec], block_size: int) -> tuple[list[LayerSlot], int]:
    """Each layer's slot in a host block, layer after layer, and the bytes of one host block."""
    slots, offset = [], 0
    for spec in specs:
        row_bytes = block_size * spec.bytes_per_token // spec.planes
        slots.append(LayerSlot(offset, spec.planes, row_bytes, spec.dtype, (block_size, *spec.entry_shape)))
        offset += spec.planes * row_bytes
    return slots, offset


def gpu_planes(cache: torch.Tensor, planes: int) -> torch.Tensor:
    """The cache as bytes: [planes, blocks, bytes per block and plane]."""
    num_blocks = cache.shape[1] if planes > 1 else cache.shape[0]
    return cache.view(torch.uint8).view(planes, num_blocks, -1)


def staged(rows: torch.Tensor, slot: LayerSlot) -> torch.Tensor:
    """A layer's part of host-block-shaped rows [n, block bytes]: [n, planes, row bytes] (a view)."""
    return rows[:, slot.offset : slot.offset + slot.nbytes].view(rows.shape[0], slot.planes, slot.row_bytes)


def gather(caches: list[torch.Tensor], slots: list[LayerSlot], gpu_blocks: torch.Tensor, rows: torch.Tensor) -> None:
    """rows[i] <- every layer's GPU block gpu_blocks[i], laid out as a host block."""
    for cache, slot in zip(caches, slots, strict=True):
        staged(rows, slot).copy_(gpu_planes(cache, slot.planes).index_select(1, gpu_blocks).transpose(0, 1))


def scatter(rows: torch.Tensor, caches: list[torch.Tensor], slots: list[LayerSlot], gpu_blocks: torch.Tensor) -> None:
    """Every layer's GPU block gpu_blocks[i] <- rows[i] (GPU blocks distinct)."""
    for cache, slot in zip(caches, slots, strict=True):
        gpu_planes(cache, slot.planes).index_copy_(1, gpu_blocks, staged(rows, slot).transpose(0, 1))


def copy_blocks_reference(cache: torch.Tensor, host: torch.Tensor, pairs: Pairs, planes: int, to_host: bool) -> None:
    """The per-block definition the batched copies must equal, for one layer whose host view is
    [host blocks, planes, ...] (HostTier.layer_view): one copy per pair and plane, in order."""
    gpu = cache if planes > 1 else cache.unsqueeze(0)  # [planes, blocks, ...]
    for a, b in pairs:
        for p in range(planes):
            if to_host:
                host[b, p].copy_(gpu[p, a])
            else:
                gpu[p, b].copy_(host[a, p])


def last_writer_wins(pairs: Pairs) -> list[tuple[int, int]]:
    """Swap-outs sorted by host block, each host block once, written by its last pair (pairs are in the
    order the scheduler decided them: a host block freed and taken again is written again later)."""
    return sorted({h: (g, h) for g, h in pairs}.values(), key=lambda pair: pair[1])


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
    """The host blocks of every attention layer and the copies of each step (ordering: module docstring)."""

    def __init__(self, specs: list[KVCacheSpec], num_host_blocks: int, block_size: int, device: torch.device,
                 staging_blocks: int | None = None, blocks_per_chunk: int | None = None,
                 allocate: Callable[[int], tuple[torch.Tensor, bool]] | None = None) -> None:
        cuda = device.type == "cuda"
        self.slots, self.block_bytes = layer_slots(specs, block_size)
        self.host = HostBlocks(num_host_blocks, self.block_bytes, device, pin=cuda,
                               blocks_per_chunk=blocks_per_chunk, allocate=allocate)
        self.block_size = block_size
        self.staging_blocks = max(1, min(num_host_blocks, staging_blocks or STAGING_BYTES // self.block_bytes))
        self._staging: torch.Tensor | None = None  # [staging_blocks, block bytes] on the caches' device
        self.stream = torch.cuda.Stream(device, priority=_HIGH_PRIORITY) if cuda else None
        # Swap-outs that may still be running: the GPU blocks they read, and their event.
        self.running_outs: list[tuple[set[int], torch.cuda.Event]] = []
        # At teardown: wait for the copies still in flight, then unregister the pinned memory.
        self._finalizer = weakref.finalize(self, _close, self.stream, self.host)

    def layer_view(self, layer: int, chunk: int = 0) -> torch.Tensor:
        """Layer `layer` of the host blocks in chunk `chunk`, typed: [blocks, planes, block_size, *entry]
        (the per-block definition and the tests read the tier through it)."""
        slot = self.slots[layer]
        rows = self.host.chunk(chunk)  # waits until it is allocated
        return staged(rows, slot).view(slot.dtype).view(rows.shape[0], slot.planes, *slot.row_shape)

    def run(self, out: SchedulerOutput, caches: list[torch.Tensor]) -> None:
        """Queue the step's copies, and make the current (forward's) stream wait for those it depends on."""
        if not out.blocks_to_swap_out and not out.blocks_to_swap_in and not self.running_outs:
            return
        written = blocks_written(out, self.block_size)
        ins = sorted(out.blocks_to_swap_in)  # by host block: longer runs; their GPU blocks are distinct
        first, behind = split_swap_outs(last_writer_wins(out.blocks_to_swap_out), ins, written)
        first, held = self._hold_for_ins(first, ins)
        cuda = self.stream is not None
        if cuda:
            forward = torch.cuda.current_stream()
            self._wait_for_overwritten(written, forward)  # rule 3, for earlier steps' behind swap-outs
            if not first and not held and not ins and not behind:
                return
            self.stream.wait_stream(forward)  # rule 1
        # The CPU runs the same sequence in program order (no streams, no events).
        with torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext():
            gathered = self._copy_outs(caches, first)
            held_rows = self._gather_held(caches, held)
            self._copy_ins(caches, ins, self.staging_blocks - len(held))
            ready = _record() if cuda and ins else gathered
            self._memcpy_out(held, held_rows)
            gathered_behind = self._copy_outs(caches, behind)
            if cuda and behind:
                self.running_outs.append(({g for g, _ in behind}, gathered_behind))
        if ready is not None:
            forward.wait_event(ready)  # rule 2

    def _hold_for_ins(self, first: Pairs, ins: Pairs) -> tuple[Pairs, Pairs]:
        """(first, held): of a step's first swap-outs, those that only the forward makes urgent (no swap-in
        fills their GPU block or reads their host block) are "held" when the step has swap-ins, as many as
        fit in half the staging: gathered before the swap-ins, copied to the host after them (rule 2)."""
        if not ins or not first:
            return first, []
        filled, read = {g for _, g in ins}, {h for h, _ in ins}
        held = [(g, h) for g, h in first if g not in filled and h not in read][: self.staging_blocks // 2]
        if not held:
            return first, []
        keep = set(held)
        return [pair for pair in first if pair not in keep], held

    def _staging_rows(self, num: int, device: torch.device, end: bool = False) -> torch.Tensor:
        """The first (or, `end`, the last) `num` rows of the staging buffer, allocated at the first copy."""
        if self._staging is None:
            self._staging = torch.empty((self.staging_blocks, self.block_bytes), dtype=torch.uint8, device=device)
        return self._staging[self.staging_blocks - num :] if end else self._staging[:num]

    def _copy_outs(self, caches: list[torch.Tensor], pairs: Pairs) -> torch.cuda.Event | None:
        """Swap-outs (sorted by host block, distinct host blocks) in staging chunks, on the current stream;
        on CUDA the event recorded after the last chunk's gather: from then on their GPU blocks may be
        overwritten (the memcpys to the host read the staging buffer, which only later copies on this
        stream reuse)."""
        gathered = None
        for start in range(0, len(pairs), self.staging_blocks):
            chunk = pairs[start : start + self.staging_blocks]
            rows = self._staging_rows(len(chunk), caches[0].device)
            gather(caches, self.slots, _index([g for g, _ in chunk], rows.device), rows)
            if self.stream is not None and start + self.staging_blocks >= len(pairs):
                gathered = _record()
            self._memcpy_out(chunk, rows)
        return gathered

    def _gather_held(self, caches: list[torch.Tensor], held: Pairs) -> torch.Tensor | None:
        """The held swap-outs gathered into the last rows of the staging, which the swap-ins leave alone."""
        if not held:
            return None
        rows = self._staging_rows(len(held), caches[0].device, end=True)
        gather(caches, self.slots, _index([g for g, _ in held], rows.device), rows)
        return rows

    def _memcpy_out(self, pairs: Pairs, rows: torch.Tensor | None) -> None:
        """The host blocks of `pairs` <- their gathered rows: one memcpy per run of host blocks."""
        if not pairs:
            return
        for first, pos, n in self.host.runs([h for _, h in pairs]):
            self.host.span(first, n).copy_(rows[pos : pos + n], non_blocking=True)

    def _copy_ins(self, caches: list[torch.Tensor], pairs: Pairs, chunk_blocks: int) -> None:
        """Swap-ins (sorted by host block, distinct GPU blocks) in staging chunks of `chunk_blocks` (the
        first rows of the staging), on the current stream."""
        for start in range(0, len(pairs), chunk_blocks):
            chunk = pairs[start : start + chunk_blocks]
            rows = self._staging_rows(len(chunk), caches[0].device)
            for first, pos, n in self.host.runs([h for h, _ in chunk]):
                rows[pos : pos + n].copy_(self.host.span(first, n), non_blocking=True)
            scatter(rows, caches, self.slots, _index([g for _, g in chunk], rows.device))

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

    def close(self) -> None:
        self._finalizer()


def _index(blocks: list[int], device: torch.device) -> torch.Tensor:
    index = torch.tensor(blocks, dtype=torch.int64)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


def _record() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


def _close(stream: torch.cuda.Stream | None, host: HostBlocks) -> None:
    try:
        if stream is not None:
            stream.synchronize()
        host.close()
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already; the process frees it all
        pass
