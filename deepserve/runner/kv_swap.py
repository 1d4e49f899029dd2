"""The host tier of the KV cache (--swap-space): host buffers shaped like each layer's cache, and the
block copies between the two that the scheduler lists in SchedulerOutput.

On CUDA the host buffers are pinned and every copy is `non_blocking` on the current stream, queued before
the step's forward: the stream orders a swap-out's read of a GPU block before the forward that reuses
it, and a swap-in before the forward that reads it, with no host sync. Copies move raw bytes, so an
FP8 cache (float8_e4m3fn, which some CPU ops lack) swaps like any other.
"""

from __future__ import annotations

import torch

from deepserve.layers.kv_cache_spec import KVCacheSpec


def allocate_host_caches(specs: list[KVCacheSpec], num_host_blocks: int, block_size: int,
                         pin: bool) -> list[torch.Tensor]:
    """One host tensor per layer with the layer's cache layout and num_host_blocks blocks; never read
    before a swap-out writes it, so left uninitialised."""
    return [torch.empty(spec.shape(num_host_blocks, block_size), dtype=spec.dtype, pin_memory=pin)
            for spec in specs]


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]], planes: int) -> None:
    """dst block b <- src block a for each (a, b) in `pairs`, on the current stream. A cache is
    [2, blocks, ...] (key and value planes) or [blocks, ...] (`planes` 1); each block of each plane is
    contiguous, so each copy is one flat memcpy."""
    if not pairs:
        return
    src, dst = src.view(torch.uint8), dst.view(torch.uint8)  # raw bytes: the cache tensors are contiguous
    if planes == 1:
        src, dst = src.unsqueeze(0), dst.unsqueeze(0)  # [1, blocks, ...]
    for a, b in pairs:
        for p in range(src.shape[0]):
            dst[p, b].copy_(src[p, a], non_blocking=True)
