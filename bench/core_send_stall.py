"""What a pause of the API server's event loop does to the engine core's step loop, on any machine (no GPU):
a stand-in core takes a step every --step-ms and emits --outputs outputs a step (one token each, as the real
StepOutputs frames: ~38 KB for 256), over a real unix socket to a reader that stops reading for --pause-ms
once (a full garbage collection in the API server, say), then reads on. Printed per mode (the step loop's
own sendall, DEEPSERVE_CORE_SEND_THREAD=0, or the sender thread, =1): the longest gap between two steps and
the steps taken during the pause.

    python bench/core_send_stall.py [--step-ms 10] [--outputs 256] [--pause-ms 250]
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from deepserve.engine.core import EngineCoreOutput  # noqa: E402
from deepserve.engine.core_process import AddRequests, Shutdown, read_frame, serve_core  # noqa: E402
from deepserve.engine.scheduler import SchedulerStats  # noqa: E402


class TimedCore:
    """A core whose step sleeps step_s and returns `outputs` one-token outputs; records when each step ended."""

    def __init__(self, step_s: float, outputs: int, steps: int) -> None:
        self.step_s, self.ids, self.left = step_s, [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(outputs)], steps
        self.times: list[float] = []

    def add_request(self, req) -> None:  # the run starts with one AddRequests; the core's work is fixed
        pass

    def abort_requests(self, ids) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(self.step_s)
        self.left -= 1
        self.times.append(time.monotonic())
        return [EngineCoreOutput(rid, [151_000 + i], None, None, None, None, 0) for i, rid in enumerate(self.ids)]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.ids), 0, 0.5, 0, 0, 0)


def run(mode: str, step_s: float, outputs: int, pause_s: float, steps: int) -> tuple[float, int]:
    before = os.environ.get("DEEPSERVE_CORE_SEND_THREAD")
    os.environ["DEEPSERVE_CORE_SEND_THREAD"] = mode
    try:
        return _run(step_s, outputs, pause_s, steps)
    finally:  # the caller's setting (a test session's) stays as it was
        if before is None:
            del os.environ["DEEPSERVE_CORE_SEND_THREAD"]
        else:
            os.environ["DEEPSERVE_CORE_SEND_THREAD"] = before


def _run(step_s: float, outputs: int, pause_s: float, steps: int) -> tuple[float, int]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    inbox: queue.Queue = queue.Queue()
    inbox.put(AddRequests([]))
    core = TimedCore(step_s, outputs, steps)
    loop = threading.Thread(target=serve_core, args=(core, theirs, inbox), daemon=True)
    loop.start()
    frames = ours.makefile("rb")
    for _ in range(steps // 4):  # read along, then stop reading for the pause
        read_frame(frames)
    paused_at = time.monotonic()
    time.sleep(pause_s)
    resumed_at = time.monotonic()
    while read_frame(frames) is not None and core.left > 0:
        pass
    inbox.put(Shutdown())
    loop.join(timeout=10)
    ours.close()
    theirs.close()
    gaps = [b - a for a, b in zip(core.times[:-1], core.times[1:], strict=True)]
    return max(gaps), sum(paused_at <= t < resumed_at for t in core.times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--outputs", type=int, default=256)
    ap.add_argument("--pause-ms", type=float, default=250.0)
    ap.add_argument("--steps", type=int, default=120)
    ns = ap.parse_args()
    print(f"steps of {ns.step_ms:.0f} ms with {ns.outputs} outputs; the reader pauses {ns.pause_ms:.0f} ms once "
          f"(a pause fits {ns.pause_ms / ns.step_ms:.0f} steps)")
    print("| send | longest gap between steps, ms | steps during the pause |\n|---|---|---|")
    for mode, label in (("0", "sendall on the step loop"), ("1", "sender thread")):
        gap, during = run(mode, ns.step_ms / 1e3, ns.outputs, ns.pause_ms / 1e3, ns.steps)
        print(f"| {label} | {gap * 1e3:.1f} | {during} |")


if __name__ == "__main__":
    main()
