"""Rank 0's shutdown never waits on a lock a killed worker held. Node 0's workers check the stop flag
before every command; a worker SIGKILLed in the middle of that check must not leave the flag locked.
Here a child takes whatever lock the flag has (an mp.Event's: its condition's lock) and is SIGKILLed
holding it; then the shutdown sets the flag, which must return at once."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from types import SimpleNamespace

from deepserve.runner.executor import _shutdown, stop_flag


def _hold_the_flags_lock(stop, held) -> None:
    lock = getattr(stop, "_cond", None) or getattr(stop, "get_lock", lambda: None)()
    if lock is not None:
        lock.acquire()
    held.set()
    time.sleep(60)


def test_shutdown_after_a_worker_was_killed_in_its_stop_check():
    ctx = mp.get_context("spawn")
    stop, held = stop_flag(ctx), ctx.Event()
    child = ctx.Process(target=_hold_the_flags_lock, args=(stop, held), daemon=True)
    child.start()
    assert held.wait(30)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    workers = SimpleNamespace(remote=None, multinode=False, healthy=False, stop=stop, wake=lambda: None,
                              frozen=lambda: [], procs={}, release_graphs=None)
    done = threading.Event()
    threading.Thread(target=lambda: (_shutdown(workers), done.set()), daemon=True).start()
    assert done.wait(10), "shutdown blocked on the stop flag's lock"
    assert stop.value == 1
