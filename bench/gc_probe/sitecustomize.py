"""A probe of Python's garbage collector, loaded by every interpreter started with this folder on PYTHONPATH
(the API server, the engine core process and ranks inherit it): one line on stderr for each full
(generation 2) collection, with the process id and how long the collection stopped that process.

    PYTHONPATH=bench/gc_probe deepserve serve --api-key sk-local-demo 2> server.log &
    deepserve bench serve ... --request-rate inf ...      # then: grep GCPROBE server.log

With GCPROBE_TYPES=1 and a frozen heap (DEEPSERVE_GC_FREEZE=1) it also counts what the collection walked,
by type (slow: for finding what serving keeps alive, not for timing). bench/RESULTS.md (fourth session of
2026-12-02) has what it showed on our CPU.
"""

import collections
import gc
import os
import sys
import time

_started: dict[str, float] = {}


def _on_collection(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _started["t"] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started.get("t", time.perf_counter())) * 1e3
    walked = ""
    if os.environ.get("GCPROBE_TYPES") and gc.get_freeze_count():
        objects = gc.get_objects(generation=2)
        walked = f" walked={len(objects)} top={collections.Counter(type(o).__name__ for o in objects).most_common(8)}"
    sys.stderr.write(f"GCPROBE pid={os.getpid()} gen=2 ms={ms:.1f} collected={info['collected']}{walked}\n")


gc.callbacks.append(_on_collection)
