"""Tensor and pipeline parallelism across processes: rank 0 here, the other ranks as workers.

`MultiprocExecutor` is a Runner (engine/core.py). Rank 0 is the engine core's own process: it owns
a ModelRunner like the others and is the only rank that samples (the LM head all-gathers the
logits, so every rank could). For each Runner call it wakes the workers (one semaphore each), then
broadcasts one plain command over torch.distributed (worker.py, step_message.py); the layers'
all-reduce / all-gather inside the forward keep the ranks in lockstep.

Failure is bounded: a dead worker is seen before each command and, mid-step, as the collective
failing; a frozen one as the process group timeout (DEEPSERVE_TP_TIMEOUT_S). Either way the error
names the rank. Workers stop when the executor is garbage-collected, at interpreter exit, or when
this process dies (they watch it).

Pipeline parallelism (docs/parallel.md): the world is tensor_parallel_size x pipeline_parallel_size
ranks, rank = stage * tp + tp_rank; every rank makes the per-stage tensor-parallel groups after the
config broadcast, and stages pass activations point to point inside the forward (model_runner.py);
the last stage sends the sampling rows' logits to rank 0, which samples.

Multi-node (`nnodes > 1`): the world (tp x pp ranks) is split into nnodes equal contiguous blocks
(ParallelConfig.node_ranks); this process is node 0 and spawns only the rest of its own block; the
other nodes' ranks join the rendezvous at master_addr:master_port from `deepserve serve --node-rank
k` (worker.run_node). With TP=8 x PP=2 on two nodes, node 0 is stage 0 and node 1 stage 1. Every
worker then waits inside the control broadcast (no semaphores across hosts), shutdown broadcasts
"stop", and a rank on another node is named when its heartbeat counter in the rendezvous store
stops moving for DEEPSERVE_TP_HEARTBEAT_TIMEOUT_S.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist

from deepserve import envs
from deepserve.config import EngineConfig
from deepserve.engine.request import SchedulerOutput
from deepserve.runner import worker
from deepserve.runner.model_runner import ModelRunner, RunnerOutput
from deepserve.runner.rank_start import MAIN_GUARD_EXIT_CODE, MAIN_GUARD_HINT, rank_context, start_rank
from deepserve.runner.step_message import broadcast_message, config_to_message, describe_step

logger = logging.getLogger(__name__)

STALE_HEARTBEAT_S = 3.0


class TensorParallelError(RuntimeError):
    """A rank died or stopped answering; the engine cannot continue."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_flag(ctx: Any) -> Any:
    """The flag that tells node 0's workers to exit (`.value`, 0 or 1): a byte in shared memory with no
    lock. An mp.Event's lock, which every worker's check takes, stays held forever when a worker is
    SIGKILLed inside that check, and rank 0's shutdown then blocked in Event.set() for good (seen once
    in a full test run, test_worker_killed_mid_generation_is_named_quickly)."""
    return ctx.RawValue("b", 0)


class _Workers:
    """The spawned processes and what they share with rank 0 (no reference to the executor, so
    that the finalizer can hold it)."""

    def __init__(self, world: int, port: int, backend: str, timeout_s: float, addr: str = "127.0.0.1",
                 nnodes: int = 1) -> None:
        ctx = rank_context()
        local = world // nnodes
        self.multinode = nnodes > 1
        self.stop = stop_flag(ctx)
        self.go = [ctx.Semaphore(0) for _ in range(local)]  # index = rank; go[0] unused
        self.progress = ctx.Array("q", world, lock=False)  # commands each worker finished (1 = loaded)
        self.heartbeat = ctx.Array("d", world, lock=False)
        self.group: Any = None  # the control group, once rank 0 has joined
        self.healthy = False  # every rank loaded and none failed: shutdown may broadcast "stop"
        self.remote: _RemoteHeartbeats | None = None
        self.release_graphs: Any = None  # rank 0's ModelRunner.release_graphs, run before the group goes
        self.errors = {rank: worker.error_slot(ctx) for rank in range(1, local)}  # each rank's last words
        self.procs = {}
        for rank in range(1, local):  # node 0's block of ranks: 0 (this process) .. local - 1
            go = None if self.multinode else self.go[rank]
            self.procs[rank] = start_rank(ctx, "deepserve.runner.worker.worker_process",
                                          (rank, world, port, backend, timeout_s, go, self.stop, self.progress,
                                           self.heartbeat, addr, local, self.multinode), f"deepserve-rank{rank}",
                                          {"error": self.errors[rank]})

    def dead(self) -> dict[int, int]:
        return {r: p.exitcode for r, p in self.procs.items() if p.exitcode is not None}

    def unstarted(self) -> list[int]:
        """Ranks that have not begun worker_main yet (its first act is a heartbeat)."""
        return [r for r in self.procs if not self.heartbeat[r]]

    def error(self, rank: int) -> str:
        return worker.read_error(self.errors.get(rank))

    def frozen(self) -> list[int]:
        now = time.time()
        return [r for r in self.procs if self.heartbeat[r] and now - self.heartbeat[r] > STALE_HEARTBEAT_S]

    def wake(self) -> None:
        if self.multinode:
            return  # they wait inside the control broadcast
        for rank in self.procs:
            self.go[rank].release()


class _RemoteHeartbeats:
    """Watches the heartbeat counters the other nodes' ranks bump in the rendezvous store."""

    def __init__(self, addr: str, port: int, ranks: list[int], stale_s: float) -> None:
        self.ranks, self.stale_s = ranks, stale_s
        self.store = worker.store_client(addr, port)
        now = time.monotonic()
        self.last_poll = now
        self.seen = {r: (-1, now) for r in ranks}  # rank -> (counter, when it last changed)
        self.closed = False
        threading.Thread(target=self._poll_loop, name="deepserve-tp-heartbeats", daemon=True).start()

    def _poll_loop(self) -> None:
        while not self.closed:
            try:
                for r in self.ranks:
                    value = self.store.add(worker.heartbeat_key(r), 0)
                    if value != self.seen[r][0]:
                        self.seen[r] = (value, time.monotonic())
                self.last_poll = time.monotonic()
            except Exception:  # the store went away with the process group: shutting down
                return
            time.sleep(worker.HEARTBEAT_INTERVAL_S)

    def stale(self) -> list[int]:
        # Measured against the last poll, so a poller starved of the GIL never accuses anyone.
        return [r for r, (_, t) in self.seen.items() if self.last_poll - t > self.stale_s]


def _shutdown(workers: _Workers) -> None:
    if workers.remote is not None:
        workers.remote.closed = True
    told = workers.multinode and workers.healthy
    if told:
        workers.healthy = False
        try:
            broadcast_message({"op": "stop"}, workers.group)  # every rank, on every node
        except Exception as e:
            told = False
            logger.warning("could not tell the parallel ranks to stop: %s", e)
    workers.stop.value = 1
    workers.wake()
    # A stopped process never sees the stop signal; neither does a multi-node worker that was not
    # told "stop": it waits inside the control broadcast, which has no timeout.
    stuck = workers.frozen() if told or not workers.multinode else list(workers.procs)
    for rank in stuck:
        if workers.procs[rank].is_alive():  # polls first: a rank the fork server already reaped may have
            workers.procs[rank].kill()  # no zombie holding its pid, which could then be another process's
    deadline = time.monotonic() + 5.0
    for p in workers.procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in workers.procs.values():
        if p.is_alive():
            p.kill()  # SIGKILL: also ends a stopped (frozen) process
            p.join(2.0)
    if workers.release_graphs is not None:
        try:
            workers.release_graphs()
        except Exception as e:  # a failed rank can leave the device in error: still tear the group down
            logger.warning("could not free the decode CUDA graphs before shutdown: %s", e)
    if dist.is_initialized():
        dist.destroy_process_group()
    from deepserve.distributed.parallel_state import reset_model_parallel

    reset_model_parallel()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group (another tensor-parallel "
                               "engine?); shut it down first (`del llm`) — one tensor-parallel engine per process")
        par = config.parallel
        if par.node_rank != 0:
            raise ValueError(f"node {par.node_rank} does not run the engine: start it with `deepserve serve ... "
                             f"--node-rank {par.node_rank}`, which serves only its ranks (docs/parallel.md)")
        if par.pipeline_parallel_size > 1:
            from deepserve.distributed.layout import check_pp_fits

            check_pp_fits(config.model.hf_config, par.pipeline_parallel_size)
        self.pipeline = par.pipeline_parallel_size > 1
        self.parallel = par
        self.world = par.world_size
        self.local_world = par.ranks_per_node
        self.timeout_s = envs.DEEPSERVE_TP_TIMEOUT_S
        self.failed: TensorParallelError | None = None
        backend = "nccl" if config.model.device == "cuda" else "gloo"
        addr = par.master_addr if par.nnodes > 1 else "127.0.0.1"
        port = par.master_port or _free_port()
        self.workers = _Workers(self.world, port, backend, self.timeout_s, addr, par.nnodes)
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)  # also runs at exit
        try:
            if backend == "nccl":
                import torch

                torch.cuda.set_device(0)
            if par.nnodes > 1:
                logger.info("node 0: waiting for %d node(s) at %s:%d (ranks %d..%d)", par.nnodes - 1, addr, port,
                            self.local_world, self.world - 1)
            self._wait_started(max(self.timeout_s, worker.JOIN_TIMEOUT_S))
            self.group = worker.init_group(0, self.world, addr, port, backend, self.timeout_s, par.nnodes > 1)
            self.workers.group = self.group
            if par.nnodes > 1:
                self.workers.remote = _RemoteHeartbeats(
                    addr, port, [r for node in range(1, par.nnodes) for r in par.node_ranks(node)],
                    envs.DEEPSERVE_TP_HEARTBEAT_TIMEOUT_S)
            broadcast_message(config_to_message(config), self.group)
            worker.init_model_parallel(config)
            self.runner = ModelRunner(worker.runner_config(config))
            self.workers.release_graphs = self.runner.release_graphs
            self._wait_loaded(envs.DEEPSERVE_TP_LOAD_TIMEOUT_S)
            self.workers.healthy = True
        except BaseException:
            self.shutdown()
            raise
        self.steps = 0

    def shutdown(self) -> None:
        self._finalizer()

    def _wait_started(self, limit_s: float) -> None:
        """Wait until this node's ranks run (each beats once before it joins the process group), watching
        their processes: joining blocks inside torch, which cannot see a rank that died before it joined
        and waited for it until the join timed out ("1/2 clients joined", minutes on)."""
        deadline = time.monotonic() + limit_s
        while self.workers.unstarted():
            self._check_alive("starting", joined=False)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank(s) {self.workers.unstarted()} did not start within "
                                          f"{limit_s:.0f} s; restart the engine")
            time.sleep(0.05)

    def _wait_loaded(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while min((self.workers.progress[r] for r in self.workers.procs), default=1) < 1:
            self._check_alive("loading the model")
            if time.monotonic() > deadline:
                late = [r for r in self.workers.procs if self.workers.progress[r] < 1]
                raise TensorParallelError(f"tensor-parallel rank(s) {late} did not load the model within "
                                          f"{limit_s:.0f} s (DEEPSERVE_TP_LOAD_TIMEOUT_S)")
            time.sleep(0.05)

    def _remote_stale(self) -> list[int]:
        return self.workers.remote.stale() if self.workers.remote is not None else []

    def _rank_name(self, rank: int, node: bool) -> str:
        """'tensor-parallel rank 1', or under PP 'pipeline-parallel rank 2 (node 1, stage 1)': enough to
        find the process and the layers it held."""
        where = [f"node {rank // self.local_world}"] if node else []
        if self.pipeline:
            where.append(f"stage {rank // self.parallel.tensor_parallel_size}")
        kind = "pipeline-parallel" if self.pipeline else "tensor-parallel"
        return f"{kind} rank {rank}" + (f" ({', '.join(where)})" if where else "")

    def _check_alive(self, doing: str, joined: bool = True) -> None:
        dead = self.workers.dead()
        if dead:
            self._fail(TensorParallelError(
                "; ".join(self._death(r, c, doing, joined) for r, c in dead.items())
                + ". The engine cannot continue: restart it"))
        stale = self._remote_stale()
        if stale:
            remote = self.workers.remote
            self._fail(TensorParallelError(
                "; ".join(f"{self._rank_name(r, True)} sent no heartbeat for {remote.stale_s:.0f} s" for r in stale)
                + f" (DEEPSERVE_TP_HEARTBEAT_TIMEOUT_S) while {doing}: its process or node died, or the network "
                  "to it is down; its error, if any, is in that node's log. The engine cannot continue: restart "
                  "every node"))

    def _death(self, rank: int, code: int, doing: str, joined: bool) -> str:
        """One dead rank, with the one line it left (worker.error_slot) or, if none, where to look."""
        said = f"{self._rank_name(rank, False)} exited (exit code {code}) while {doing}"
        if code == MAIN_GUARD_EXIT_CODE:
            return f"{said}: {MAIN_GUARD_HINT}"
        error = self.workers.error(rank)
        if error:
            return f"{said}: {error}"
        if not joined:
            # Nothing recorded: it died before running any deepserve code, most often while importing the
            # main script again (Python's "...finished its bootstrapping phase" in stderr).
            return f"{said}, before running deepserve (its error is in this process's stderr); {MAIN_GUARD_HINT}"
        return f"{said}; its error, if any, is in this process's stderr"

    def _fail(self, error: TensorParallelError) -> None:
        self.failed = error
        self.workers.healthy = False
        raise error

    def _diagnose(self, doing: str, error: BaseException) -> TensorParallelError:
        # A dead peer's exit code (or a remote one's missing heartbeats) lags the collective's failure.
        wait = 3.0 + (self.workers.remote.stale_s + 1.0 if self.workers.remote is not None else 0.0)
        deadline = time.monotonic() + wait
        while not (self.workers.dead() or self.workers.frozen() or self._remote_stale()) \
                and time.monotonic() < deadline:
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
            broadcast_message(msg, self.group)
            result = fn()
        except TensorParallelError:
            raise
        except Exception as e:  # a collective failed or timed out
            self.workers.healthy = False
            self.failed = self._diagnose(doing, e)
            raise self.failed from e
        return result

    def determine_num_blocks(self) -> int:
        return self._run({"op": "num_blocks"}, "measuring the KV cache",
                         lambda: worker.agree_num_blocks(self.runner, self.group))

    def initialize_cache(self, num_blocks: int) -> None:
        self._run({"op": "init_cache", "num_blocks": num_blocks}, "allocating the KV cache",
                  lambda: self.runner.initialize_cache(num_blocks))

    def determine_num_host_blocks(self) -> int:
        # Rank 0's count: tensor-parallel ranks hold equal shards of every layer (swap_space is refused
        # under pipeline parallelism, where stages hold different layers).
        return self.runner.determine_num_host_blocks()

    def initialize_host_cache(self, num_host_blocks: int) -> None:
        self._run({"op": "init_host_cache", "num_host_blocks": num_host_blocks}, "allocating the host KV cache",
                  lambda: self.runner.initialize_host_cache(num_host_blocks))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.pipeline and any(s.request.sampling_params.prompt_logprobs is not None for s in out.scheduled):
            # Refused before any rank hears of the step, so the engine stays usable.
            raise ValueError("prompt_logprobs is not supported with pipeline_parallel_size > 1 yet; "
                             "use tensor_parallel_size alone for requests that ask for it")
        self.steps += 1
        return self._run(describe_step(out, self.runner.drafter is not None), f"running step {self.steps}",
                         lambda: self.runner.execute(out))

    def launch(self, out: SchedulerOutput, previous: Any = None) -> Any:
        """Async scheduling under tensor parallelism (one pipeline stage): every rank runs the step's
        forward; rank 0 samples and broadcasts the sampled tokens, which the workers keep for the
        next step's placeholder inputs. Rank 0 returns without waiting for the device."""
        if self.pipeline:
            raise RuntimeError("async scheduling is not supported with pipeline_parallel_size > 1")
        self.steps += 1
        msg = {**describe_step(out, self.runner.drafter is not None), "share_sampled": True}
        return self._run(msg, f"running step {self.steps}", lambda: self.runner.launch(out, previous, True))

    def wait(self, pending: Any) -> RunnerOutput:
        return self.runner.wait(pending)  # rank 0 alone: the tokens were sampled here

    def finish_launch(self, pending: Any) -> None:
        self.runner.finish_launch(pending)  # nothing left to queue: launch sampled (share_sampled)
