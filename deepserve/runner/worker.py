"""A tensor-parallel worker: ranks 1..tp-1, each a process of its own.

Lifecycle (rank 0's side is executor.py):
  1. join the process group, receive the EngineConfig from rank 0 (object broadcast);
  2. build the model — layers read the rank and world size at construction — and load its slices;
  3. mark itself loaded in `progress`, then loop: wait for rank 0's go-ahead on this rank's
     semaphore, receive one command, run it, until `stop` is set or rank 0's process is gone.
Waiting on a semaphore, not inside a collective, keeps an idle engine from tripping the process
group's timeout: the timeout then bounds only a step in flight.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deepserve.config import EngineConfig

HEARTBEAT_INTERVAL_S = 0.5


def init_group(rank: int, world: int, port: int, backend: str, timeout_s: float) -> Any:
    """Join the default group; return the group that carries control messages (gloo, on the host)."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    # Object broadcasts and the block-count reduction are host-side; under NCCL they get a gloo twin.
    return dist.new_group(backend="gloo") if backend == "nccl" else None


def broadcast_object(obj: Any, group: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def runner_config(config: EngineConfig) -> EngineConfig:
    # Collectives are not captured in CUDA graphs here: every rank runs eager under TP.
    return dataclasses.replace(config, model=dataclasses.replace(config.model, enforce_eager=True))


def agree_num_blocks(runner: Any, group: Any) -> int:
    """Every rank measures its own room; all take the smallest so block ids mean the same everywhere."""
    n = torch.tensor([runner.determine_num_blocks()], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
    return int(n.item())


def run_command(runner: Any, msg: dict[str, Any], group: Any) -> None:
    """A worker's half of one command; rank 0 runs the same collectives in the same order."""
    from deepserve.runner.step_message import rebuild_step

    op = msg["op"]
    if op == "num_blocks":
        agree_num_blocks(runner, group)
    elif op == "init_cache":
        runner.initialize_cache(msg["num_blocks"])
    elif op == "step":
        runner.execute_without_sampling(rebuild_step(msg))
    else:
        raise ValueError(f"unknown tensor-parallel command {op!r}")


def _beat(heartbeat: Any, rank: int) -> None:
    # A frozen process (stopped, or stuck outside Python) stops beating; rank 0 names it on a timeout.
    while True:
        heartbeat[rank] = time.time()
        time.sleep(HEARTBEAT_INTERVAL_S)


def _wait_for_go(go: Any, stop: Any) -> bool:
    """True when rank 0 has a command; False to exit (shutdown, or rank 0's process is gone)."""
    parent = mp.parent_process()
    while not go.acquire(timeout=1.0):
        if stop.is_set() or (parent is not None and not parent.is_alive()):
            return False
    return not stop.is_set()


def worker_main(rank: int, world: int, port: int, backend: str, timeout_s: float,
                go: Any, stop: Any, progress: Any, heartbeat: Any) -> None:
    threading.Thread(target=_beat, args=(heartbeat, rank), daemon=True).start()
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        # Ranks share the host's cores; without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = init_group(rank, world, port, backend, timeout_s)
    config = broadcast_object(None, group)
    from deepserve.runner.model_runner import ModelRunner

    runner = ModelRunner(runner_config(config))
    done = 1
    progress[rank] = done  # loaded
    while _wait_for_go(go, stop):
        run_command(runner, broadcast_object(None, group), group)
        done += 1
        progress[rank] = done
    dist.destroy_process_group()
