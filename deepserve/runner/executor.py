"""Tensor parallelism across processes on one host: rank 0 here, ranks 1..tp-1 as spawned workers.

`MultiprocExecutor` is a Runner (engine/core.py). Rank 0 is the engine core's own process: it owns
a ModelRunner like the others and is the only rank that samples (the LM head all-gathers the
logits, so every rank could). For each Runner call it wakes the workers (one semaphore each), then
broadcasts one plain command over torch.distributed (worker.py, step_message.py); the layers'
all-reduce / all-gather inside the forward keep the ranks in lockstep.

Failure is bounded: a dead worker is seen before each command and, mid-step, as the collective
failing; a frozen one as the process group timeout (DEEPSERVE_TP_TIMEOUT_S). Either way the error
names the rank. Workers stop when the executor is garbage-collected, at interpreter exit, or when
this process dies (they watch it).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
import weakref
from typing import Any

import torch.distributed as dist

from deepserve.config import EngineConfig
from deepserve.engine.request import SchedulerOutput
from deepserve.runner import worker
from deepserve.runner.model_runner import ModelRunner, RunnerOutput
from deepserve.runner.step_message import describe_step

logger = logging.getLogger(__name__)

STALE_HEARTBEAT_S = 3.0


class TensorParallelError(RuntimeError):
    """A rank died or stopped answering; the engine cannot continue."""


def _env_seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Workers:
    """The spawned processes and what they share with rank 0 (no reference to the executor, so
    that the finalizer can hold it)."""

    def __init__(self, world: int, port: int, backend: str, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.go = [ctx.Semaphore(0) for _ in range(world)]  # index = rank; go[0] unused
        self.progress = ctx.Array("q", world, lock=False)  # commands each worker finished (1 = loaded)
        self.heartbeat = ctx.Array("d", world, lock=False)
        self.procs = {}
        for rank in range(1, world):
            p = ctx.Process(target=worker.worker_main, name=f"deepserve-tp{rank}", daemon=True,
                            args=(rank, world, port, backend, timeout_s, self.go[rank], self.stop,
                                  self.progress, self.heartbeat))
            p.start()
            self.procs[rank] = p

    def dead(self) -> dict[int, int]:
        return {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}

    def frozen(self) -> list[int]:
        now = time.time()
        return [r for r in self.procs if self.heartbeat[r] and now - self.heartbeat[r] > STALE_HEARTBEAT_S]

    def wake(self) -> None:
        for rank in self.procs:
            self.go[rank].release()


def _shutdown(workers: _Workers) -> None:
    workers.stop.set()
    workers.wake()
    for rank in workers.frozen():
        workers.procs[rank].kill()  # a stopped process would never see the stop signal
    deadline = time.monotonic() + 5.0
    for p in workers.procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in workers.procs.values():
        if p.is_alive():
            p.kill()  # SIGKILL: also ends a stopped (frozen) process
            p.join(2.0)
    if dist.is_initialized():
        dist.destroy_process_group()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group (another tensor-parallel "
                               "engine?); shut it down first (`del llm`) — one tensor-parallel engine per process")
        self.world = config.parallel.tensor_parallel_size
        self.timeout_s = _env_seconds("DEEPSERVE_TP_TIMEOUT_S", 300.0)
        self.failed: TensorParallelError | None = None
        backend = "nccl" if config.model.device == "cuda" else "gloo"
        port = _free_port()
        self.workers = _Workers(self.world, port, backend, self.timeout_s)
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)  # also runs at exit
        try:
            if backend == "nccl":
                import torch

                torch.cuda.set_device(0)
            self.group = worker.init_group(0, self.world, port, backend, self.timeout_s)
            worker.broadcast_object(config, self.group)
            self.runner = ModelRunner(worker.runner_config(config))
            self._wait_loaded(_env_seconds("DEEPSERVE_TP_LOAD_TIMEOUT_S", 3600.0))
        except BaseException:
            self.shutdown()
            raise
        self.steps = 0

    def shutdown(self) -> None:
        self._finalizer()

    def _wait_loaded(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while min(self.workers.progress[r] for r in self.workers.procs) < 1:
            self._check_alive("loading the model")
            if time.monotonic() > deadline:
                late = [r for r in self.workers.procs if self.workers.progress[r] < 1]
                raise TensorParallelError(f"tensor-parallel rank(s) {late} did not load the model within "
                                          f"{limit_s:.0f} s (DEEPSERVE_TP_LOAD_TIMEOUT_S)")
            time.sleep(0.05)

    def _check_alive(self, doing: str) -> None:
        dead = self.workers.dead()
        if dead:
            self.failed = TensorParallelError(
                "; ".join(f"tensor-parallel rank {r} exited (exit code {c}) while {doing}" for r, c in dead.items())
                + "; its error, if any, is in this process's stderr. The engine cannot continue: restart it")
            raise self.failed

    def _diagnose(self, doing: str, error: BaseException) -> TensorParallelError:
        # A dead peer's exit code can lag the collective's failure by a moment.
        deadline = time.monotonic() + 3.0
        while not (self.workers.dead() or self.workers.frozen()) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            self._check_alive(doing)
        except TensorParallelError as e:
            return e
        frozen = self.workers.frozen()
        who = f"rank(s) {frozen} stopped responding (no heartbeat)" if frozen else "a rank did not answer"
        return TensorParallelError(f"tensor-parallel {who} while {doing}: {error}. Collectives time out after "
                                   f"{self.timeout_s:.0f} s (DEEPSERVE_TP_TIMEOUT_S); restart the engine")

    def _run(self, msg: dict[str, Any], doing: str, fn: Any) -> Any:
        """Send `msg` to every worker, then run rank 0's half `fn()`; any failure names the rank."""
        if self.failed is not None:
            raise self.failed
        self._check_alive(doing)
        try:
            self.workers.wake()
            worker.broadcast_object(msg, self.group)
            result = fn()
        except TensorParallelError:
            raise
        except Exception as e:  # a collective failed or timed out
            self.failed = self._diagnose(doing, e)
            raise self.failed from e
        return result

    def determine_num_blocks(self) -> int:
        return self._run({"op": "num_blocks"}, "measuring the KV cache",
                         lambda: worker.agree_num_blocks(self.runner, self.group))

    def initialize_cache(self, num_blocks: int) -> None:
        self._run({"op": "init_cache", "num_blocks": num_blocks}, "allocating the KV cache",
                  lambda: self.runner.initialize_cache(num_blocks))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        return self._run(describe_step(out), f"running step {self.steps}", lambda: self.runner.execute(out))
