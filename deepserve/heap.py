"""The Python heap of a long-running process: keep the garbage collector's full passes off the serving path.

A process that has imported torch, transformers and the server holds some 200-500 thousand objects the
collector tracks, all of them alive until the process exits. CPython's oldest generation is collected
when enough objects have survived into it, and that pass walks every tracked object: 170-314 ms each
on our 2-core CPU sandbox, four of them in the API server during each 19-20 s saturation run of the
demo model (bench/RESULTS.md; bench/gc_probe/ shows how), every stream stopped meanwhile. `gc.freeze()`
after start-up moves what exists then into a permanent generation the collector never walks, so a full
pass only sees objects made while serving. Cyclic garbage made later is still collected; what start-up
left is collected once, first. On one H200, W3's saturation point through HTTP (Qwen-7B) read 98.4 % of the
offline W1 with the freeze and 89.5 % without, same machine, and the two pauses (222 and 182 ms) in which
no stream got a token after the last request had started were gone: on by default (DEEPSERVE_GC_FREEZE=0
turns it off). The freeze's own collection takes ~0.25 s once per process at the end of start-up (234 and
247 ms in that run's log). Objects that exist then and later become cyclic garbage stay until the process
exits (e.g. an API key table replaced by a reload, if it held a cycle): a bounded, one-time cost per such
event. At exit the heap is unfrozen, so the interpreter's last collections free it as before.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from deepserve import envs

logger = logging.getLogger(__name__)


def freeze_startup_heap(where: str) -> int:
    """Collect once, then freeze every surviving object out of future collections (a no-op with
    DEEPSERVE_GC_FREEZE=0). Call once per process, when start-up is over and before serving: only in the
    serving processes (API server, engine core, other ranks), never in `LLM(...)`, whose process is the
    user's: frozen objects in reference cycles are not freed while it runs (a deleted engine's GPU memory
    with them).
    Returns how many objects this call froze (0 when off)."""
    if not envs.DEEPSERVE_GC_FREEZE:
        return 0
    t0 = time.perf_counter()
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    # Back into the collector's reach at exit, so the interpreter's last collections free them as before:
    # left frozen, extension modules that count their objects at shutdown (Triton's nanobind bindings)
    # print "leaked instances" warnings on every stop of the server.
    atexit.register(gc.unfreeze)
    frozen = gc.get_freeze_count() - before
    logger.info("%s: %d start-up objects kept out of garbage collection (%.0f ms)", where, frozen,
                (time.perf_counter() - t0) * 1e3)
    return frozen


@contextmanager
def heap_frozen_while_generating() -> Iterator[None]:
    """`LLM.generate`'s run with every object that exists at its start out of the collector's full passes
    (DEEPSERVE_GC_FREEZE_GENERATE=1; off until measured): on one H200 such passes over the offline process's
    heap took 259-339 ms, one or two inside each W1 (bench/step_trace.py). Unlike the serving processes'
    freeze this one ends with the call (gc.unfreeze: both are O(1) list splices), so the user's process frees
    its cycles as before once generate returns. Nothing is done when the heap is frozen already (a serving
    process, or a generate running on another thread): unfreezing would undo that freeze. That check walks the
    frozen objects (gc.get_freeze_count), a pass per call, only with the switch on. Two generates on two
    threads: the first to return unfreezes, and the other runs the rest of its call unfrozen."""
    if not envs.DEEPSERVE_GC_FREEZE_GENERATE or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
