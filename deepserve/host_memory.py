"""This machine's memory, as a container sees it, and the --swap-space check against it.

The host KV tier (--swap-space, per GPU) is pinned host memory: asking for more than the machine has
ends in the kernel's OOM killer or a failed pin minutes into start-up, after the weights loaded. The
check runs with the engine config, before anything loads. Limits are vLLM's: over 70 % of the memory is
refused, over 40 % is warned about (the weights' staging, the tokenizer, the server need the rest).
"""

from __future__ import annotations

import logging
import os

SWAP_SPACE_REFUSE_FRACTION = 0.7
SWAP_SPACE_WARN_FRACTION = 0.4
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")

logger = logging.getLogger(__name__)


def total_host_memory_bytes() -> int | None:
    """Physical memory, or the container's cgroup limit where that is lower; None where neither is known."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = None
    limits = [physical] if physical else []
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 writes a huge number for none
            limits.append(int(text))
    return min(limits) if limits else None


def check_swap_space(swap_space_gib: float, ranks_on_node: int, total: int | None = None) -> None:
    """Refuse a host tier of more than SWAP_SPACE_REFUSE_FRACTION of this machine's memory, all of this
    node's GPUs counted (each holds swap_space GiB); warn past SWAP_SPACE_WARN_FRACTION."""
    total = total_host_memory_bytes() if total is None else total
    if swap_space_gib <= 0 or not total:
        return
    need = swap_space_gib * 2**30 * ranks_on_node
    share = need / total
    what = (f"--swap-space (swap_space) {swap_space_gib:g} GiB per GPU x {ranks_on_node} GPU(s) on this node = "
            f"{need / 2**30:.1f} GiB of pinned host memory, {share:.0%} of this machine's {total / 2**30:.1f} GiB")
    if share > SWAP_SPACE_REFUSE_FRACTION:
        raise ValueError(f"{what}: more than {SWAP_SPACE_REFUSE_FRACTION:.0%} is refused; use at most "
                         f"{SWAP_SPACE_REFUSE_FRACTION * total / 2**30 / ranks_on_node:.1f} GiB")
    if share > SWAP_SPACE_WARN_FRACTION:
        logger.warning("%s: over %.0f%% leaves little for the rest of the process", what,
                       100 * SWAP_SPACE_WARN_FRACTION)
