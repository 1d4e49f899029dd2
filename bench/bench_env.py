"""What the check scripts share: where they ran (device, versions, commit) and how they time GPU work."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch


def environment(device: torch.device, **extra: object) -> dict:
    import triton

    # gate.sh passes the commit it was sent: the device machine's copy of .git may be stale
    commit = os.environ.get("GATE_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # a copy without git
        commit = ""
    return dict(device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                torch=torch.__version__, triton=triton.__version__, commit=commit or None, **extra)


def graph_per_call_us(fns: list[Callable[[], object]], min_calls: int, repeats: int) -> float:
    """Median microseconds per call inside one CUDA graph of max(len(fns), min_calls) calls (cycling
    through fns), replayed `repeats` times between CUDA events: what a decode step's graph pays, with
    no Python or launch overhead. The capture also proves the calls make no host sync."""
    calls = [fns[i % len(fns)] for i in range(max(len(fns), min_calls))]
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))  # ms per replay -> us per call
    del graph
    return statistics.median(times)
