"""The host tier's memory (--swap-space): host blocks of raw bytes in chunks that are pinned one after another
on a background thread, so the engine starts before the whole tier is pinned.

Pinning is slow (page faults, then the driver locks each page): tens of GiB take tens of seconds. So the
tier is split into chunks of about CHUNK_BYTES (256 MiB), all allocated on a daemon thread in order; the
constructor returns once the first is ready. Every host block exists from the start (the block manager
hands them out at once); a copy that touches a chunk not yet ready waits for it (`span`). The block manager
hands out low host blocks first, so a step waits only when the tier fills faster than it is pinned.

A chunk on CUDA is plain host memory (torch.empty: the exact size, where torch's pinned allocator may round
a size up to a power of two) registered with cudaHostRegister; where registering fails it falls back to torch's pinned
allocator. `close` unregisters after the copies that may still use the memory are done. The thread
starts after the engine captured its CUDA graphs: a registration during a capture (by default, captures
refuse unsafe calls from every thread) could break it. A second engine started in the same process while
the first one's tier is still being pinned could meet that; one engine per process (the server) cannot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# One registration each. Small enough that a copy which finds its chunk not ready, or a CUDA call of the
# engine's thread that the driver might hold behind a registration, waits a fraction of a second at the
# rate measured for torch's pinned allocator (32 GiB in 40 s); bench/check_kv_tier.py times both.
CHUNK_BYTES = 256 << 20
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, whichever device's thread registers it


def pinned_chunk(num_bytes: int) -> tuple[torch.Tensor, bool]:
    """A pinned uint8 tensor of num_bytes; True when it was registered (and must be unregistered)."""
    chunk = torch.empty(num_bytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(chunk.data_ptr(), num_bytes, _CUDA_HOST_REGISTER_PORTABLE)) == 0:
        return chunk, True
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True), False


class HostBlocks:
    """`num_blocks` host blocks of `block_bytes` bytes each, in chunks of `blocks_per_chunk` consecutive
    blocks; chunk c holds blocks c * blocks_per_chunk .. and is one contiguous uint8 tensor."""

    def __init__(self, num_blocks: int, block_bytes: int, device: torch.device, pin: bool,
                 blocks_per_chunk: int | None = None,
                 allocate: Callable[[int], tuple[torch.Tensor, bool]] | None = None) -> None:
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.blocks_per_chunk = blocks_per_chunk or max(1, CHUNK_BYTES // block_bytes)
        sizes = [min(self.blocks_per_chunk, num_blocks - first) for first in range(0, num_blocks,
                                                                                     self.blocks_per_chunk)]
        if allocate is None:
            allocate = (pinned_chunk if pin
                        else (lambda n: (torch.empty(n, dtype=torch.uint8), False)))
        self._allocate = allocate
        self.chunks: list[torch.Tensor | None] = [None] * len(sizes)
        self._registered: list[int] = []  # data pointers to unregister at close
        self._ready = [threading.Event() for _ in sizes]
        self._error: BaseException | None = None
        self._closed = False
        self.device = device
        # Every registration happens on this thread, the first one included (waited for here): a failed
        # one leaves its error in the thread's last-error state, where no CUDA call of the engine's finds it.
        self.thread: threading.Thread | None = None
        if sizes:
            self.thread = threading.Thread(target=self._fill_all, args=(sizes,), name="host-kv-pinning", daemon=True)
            self.thread.start()
            self.chunk(0)

    def _fill(self, index: int, num_blocks: int) -> None:
        chunk, registered = self._allocate(num_blocks * self.block_bytes)
        if registered:
            self._registered.append(chunk.data_ptr())
        self.chunks[index] = chunk.view(num_blocks, self.block_bytes)
        self._ready[index].set()

    def _fill_all(self, sizes: list[int]) -> None:
        start = time.perf_counter()
        try:
            if self.device.type == "cuda" and self.device.index is not None:
                # A new thread starts on device 0: its first CUDA call would make a context there.
                torch.cuda.set_device(self.device)
            for index in range(len(sizes)):
                if self._closed:
                    return
                self._fill(index, sizes[index])
            logger.info("host KV tier: all %d blocks (%.1f GiB) allocated%s in %.1f s on a background thread",
                        self.num_blocks, self.num_blocks * self.block_bytes / 2**30,
                        " and pinned" if self._registered or self.device.type == "cuda" else "",
                        time.perf_counter() - start)
        except BaseException as e:  # noqa: BLE001 - handed to the step that needs the chunk
            self._error = e
            for event in self._ready:
                event.set()

    @property
    def num_ready_blocks(self) -> int:
        """Host blocks whose chunk is allocated (and pinned): the ready chunks form a prefix."""
        ready = 0
        for index, event in enumerate(self._ready):
            if not event.is_set() or self.chunks[index] is None:
                break
            ready += self.chunks[index].shape[0]
        return ready

    def wait_all(self) -> None:
        for index in range(len(self.chunks)):
            self.chunk(index)

    def chunk(self, index: int) -> torch.Tensor:
        self._ready[index].wait()
        chunk = self.chunks[index]
        if chunk is None:
            raise RuntimeError(f"allocating the host KV tier (--swap-space) failed: {self._error!r}; "
                               "lower --swap-space or set it to 0") from self._error
        return chunk

    def span(self, first: int, num: int) -> torch.Tensor:
        """Blocks first .. first + num - 1 as one [num, block_bytes] tensor; they must lie in one chunk
        (`runs` splits at chunk edges). Waits until that chunk is ready."""
        index, offset = divmod(first, self.blocks_per_chunk)
        if offset + num > self.blocks_per_chunk:
            raise ValueError(f"host blocks {first}..{first + num - 1} cross a chunk edge")
        return self.chunk(index)[offset : offset + num]

    def runs(self, host_blocks: list[int]) -> list[tuple[int, int, int]]:
        """(first host block, position in the list, length) of each run of consecutive host blocks that
        lies in one chunk."""
        runs: list[tuple[int, int, int]] = []
        for i, h in enumerate(host_blocks):
            if runs and h == runs[-1][0] + runs[-1][2] and h % self.blocks_per_chunk:
                first, pos, n = runs[-1]
                runs[-1] = (first, pos, n + 1)
            else:
                runs.append((h, i, 1))
        return runs

    def close(self) -> None:
        """Stop pinning and unregister the registered chunks; the caller has made sure that no copy still
        uses them (HostTier.close synchronizes its stream first)."""
        self._closed = True
        if self.thread is not None:
            self.thread.join()
        cudart = torch.cuda.cudart() if self._registered else None
        for ptr in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered = []
