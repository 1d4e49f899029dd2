"""A worker: every rank but 0 (tensor- and pipeline-parallel alike), each a process of its own.

Lifecycle (rank 0's side is executor.py):
  1. join the process group, receive the EngineConfig from rank 0 (a msgpack message, step_message.py);
  2. build the model — layers read the rank and world size at construction — and load its slices;
  3. mark itself loaded in `progress`, then loop: wait for rank 0's go-ahead on this rank's
     semaphore, receive one command, run it, until `stop` is set or rank 0's process is gone.
Waiting on a semaphore, not inside a collective, keeps an idle engine from tripping the process
group's timeout: the timeout then bounds only a step in flight.

Multi-node (`nnodes > 1`, docs/parallel.md): the world (tp x pp ranks, stage-major) is split into
equal contiguous blocks, one per node. Rank 0 cannot wake a process on another host through a
semaphore, so every worker waits for its next command inside the broadcast of a control group (gloo)
whose timeout is effectively unbounded; the model's collectives stay on the default group and keep
the bounded timeout. A worker on another node reports liveness by bumping a counter in
torch.distributed's rendezvous store (`heartbeat_key`); rank 0 names a rank whose counter stops.
Node k > 0 runs `run_node`: its ranks serve commands until rank 0 broadcasts "stop" (or is gone);
the ranks it spawned also exit when its main process dies, so a killed node leaves no rank behind.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from deepserve import envs
from deepserve.config import EngineConfig
from deepserve.errors import ConfigRefused
from deepserve.heap import freeze_startup_heap
from deepserve.runner.rank_start import rank_context, start_rank
from deepserve.runner.step_message import broadcast_message, config_from_message

HEARTBEAT_INTERVAL_S = 0.5
ERROR_BYTES = 1024  # the one-line error a rank on node 0 leaves for rank 0 (`error_slot`)
JOIN_TIMEOUT_S = 120.0  # the least time ranks get to join the process group (init_group)
IDLE_TIMEOUT = timedelta(days=365)  # the multi-node control group: an idle engine waits in it

logger = logging.getLogger(__name__)


def init_group(rank: int, world: int, addr: str, port: int, backend: str, timeout_s: float,
               multinode: bool = False) -> Any:
    """Join the default group; return the group that carries control messages (gloo, on the host).
    Joining may take up to JOIN_TIMEOUT_S however short the collectives' timeout (DEEPSERVE_TP_TIMEOUT_S)
    is: ranks start at different times (spawned processes import torch; other nodes start when they
    start), and a short collective timeout meant to catch a frozen rank once failed the join on a busy
    machine."""
    join = timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=join)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    if multinode:
        return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    # Object broadcasts and the block-count reduction are host-side; under NCCL they get a gloo twin.
    return dist.new_group(backend="gloo") if backend == "nccl" else None


def init_model_parallel(config: EngineConfig) -> None:
    """Under pipeline parallelism, every rank (0 included, in this order, right after the config
    broadcast) makes the per-stage tensor-parallel groups; under tensor parallelism alone, nothing."""
    from deepserve.distributed.parallel_state import init_model_parallel as init

    init(config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size)


def heartbeat_key(rank: int) -> str:
    return f"deepserve/heartbeat/{rank}"


def store_client(addr: str, port: int, timeout_s: float = 30.0) -> Any:
    """A client of the rendezvous store that rank 0's process group hosts at addr:port."""
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _store_beat(addr: str, port: int, rank: int) -> None:
    try:
        store = store_client(addr, port)
        while True:
            store.add(heartbeat_key(rank), 1)
            time.sleep(HEARTBEAT_INTERVAL_S)
    except Exception:  # the store is gone: rank 0 has stopped; the command loop finds out too
        return


def runner_config(config: EngineConfig) -> EngineConfig:
    """Each rank's ModelRunner config. Tensor-parallel ranks run eager unless --no-enforce-eager
    (EngineArgs.enforce_eager=False; the default there is eager): then the decode CUDA graphs capture the
    NCCL all-reduces too (every rank captures the same sizes in
    the same order at initialize_cache, and replays the same size each step, since all ranks see the
    same step); rank 0 frees its graphs before it destroys the process group (ModelRunner.release_graphs)
    and the other ranks leave without a teardown (`leave_now`). Still opt-in: on 2 x H200 (bench/
    RESULTS.md run 12) tiny checkpoints gave the tokens of one GPU with it, but a W1-sized run
    (R1-Distill-Qwen-7B, 256 sequences, 20 graph sizes) did not finish in 5 minutes, for a reason not
    yet found. Pipeline stages always run eager: their point-to-point sends sit between stages,
    outside any one rank's graph."""
    eager = config.model.enforce_eager or config.parallel.pipeline_parallel_size > 1
    return dataclasses.replace(config, model=dataclasses.replace(config.model, enforce_eager=eager))


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
    elif op == "init_host_cache":
        runner.initialize_host_cache(msg["num_host_blocks"])
    elif op == "step":
        runner.execute_without_sampling(rebuild_step(msg), msg.get("share_sampled", False))
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
        if stop.value or (parent is not None and not parent.is_alive()):
            return False
    return not stop.value


def error_slot(ctx: Any) -> Any:
    """Where a rank on node 0 leaves the one line that says why it failed: shared memory rank 0 reads
    when it finds the rank gone, so its own error ends with what failed rather than a pointer to stderr,
    where the rank's traceback sits above rank 0's."""
    return ctx.Array("c", ERROR_BYTES, lock=False)


def read_error(slot: Any) -> str:
    return slot.value.decode("utf-8", "replace") if slot is not None else ""


def _leave_error(slot: Any, error: BaseException) -> None:
    if slot is None:
        return
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    if isinstance(error, ConfigRefused):
        text = lines[0] if lines else text  # its message is the whole story, as printed
    data = text.encode("utf-8")[:ERROR_BYTES - 1]
    slot.value = data.decode("utf-8", "ignore").encode("utf-8")  # never half a character


def worker_process(*args: Any, error: Any = None) -> None:
    """Spawn target of a rank on node 0. It leaves at once (`leave_now`): 0 after a clean stop, 1
    after printing the error that ended it and leaving its one line in `error` (error_slot) for rank 0,
    which names the rank and quotes that line."""
    # From the start, not only after loading: an engine process that exits while its ranks load (its
    # server went away, core_process.run_core_process) must not leave them loading for nobody.
    threading.Thread(target=_exit_with_parent, name="deepserve-parent-watch", daemon=True).start()
    code = 1
    try:
        worker_main(*args)
        code = 0
    except ConfigRefused as e:
        # Input the loader checked (no weights, a bad key): rank 0 reads the same and reports it in one
        # line; a traceback per rank would bury that line.
        print(f"deepserve rank {args[0]} refused to start: {e}", file=sys.stderr)
        _leave_error(error, e)
    except BaseException as e:
        traceback.print_exc()
        _leave_error(error, e)
    finally:
        leave_now(code)


def leave_now(code: int) -> NoReturn:
    """How every rank but 0 ends: flush, then exit without tearing down the process group or the
    interpreter. A gloo teardown racing rank 0's own aborted ranks in CI (SIGABRT, "terminate called
    without an active exception": a worker on node 0 once, node 1's first rank later), an NCCL one
    waits forever while a decode graph holds the group's kernels, and the interpreter's teardown of
    torch adds about a second; the operating system closes the sockets and frees the GPU anyway."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_main(rank: int, world: int, port: int, backend: str, timeout_s: float,
                go: Any, stop: Any, progress: Any, heartbeat: Any, addr: str = "127.0.0.1",
                local_world: int | None = None, multinode: bool = False) -> None:
    """One rank other than 0. `go` None (multi-node): wait for commands inside the control broadcast
    and stop on the "stop" command; `progress` / `heartbeat` None: a rank on another node. Returns
    with its process group still up: the caller leaves at once (`leave_now`)."""
    if heartbeat is not None:
        threading.Thread(target=_beat, args=(heartbeat, rank), daemon=True).start()
    local_world = local_world or world
    if backend == "nccl":
        torch.cuda.set_device(rank % local_world)
    else:
        set_cpu_rank_threads(local_world)
    group = init_group(rank, world, addr, port, backend, timeout_s, multinode)
    if multinode:
        threading.Thread(target=_store_beat, args=(addr, port, rank), daemon=True).start()
    config = config_from_message(broadcast_message(None, group))
    init_model_parallel(config)
    from deepserve.runner.model_runner import ModelRunner

    runner = ModelRunner(runner_config(config))
    # The model and the imports stay out of full collections (the KV cache and graphs come later, by
    # command); a collection on any rank stalls every collective step.
    freeze_startup_heap(f"rank {rank}")
    done = 1
    if progress is not None:
        progress[rank] = done  # loaded
    if go is None:
        while (msg := broadcast_message(None, group))["op"] != "stop":
            run_command(runner, msg, group)
            done += 1
            if progress is not None:
                progress[rank] = done
    else:
        while _wait_for_go(go, stop):
            run_command(runner, broadcast_message(None, group), group)
            done += 1
            progress[rank] = done


def cpu_rank_threads(local_world: int) -> int:
    """Intra-op threads for a rank on the CPU. Ranks share the host's
    cores, so by default each takes its share (without it each would start one thread per core). A user's
    OMP_NUM_THREADS is the count instead (torch's own setting, which this used to override): on a shared or
    loaded machine more threads than free cores made runs 10-140x slower than one thread, and erratic. The
    count is applied, not left to torch, which read the variable when it was imported: in a rank forked from
    the fork server (rank_start.py) that was under the helper's environment, not the engine's."""
    share = max(1, (os.cpu_count() or 1) // local_world)
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        threads = int(value.split(",")[0]) if value else 0  # OpenMP's nested "4,2": torch uses the outer level
    except ValueError:
        threads = 0  # not a count (OpenMP ignores it): the share, not the all-cores count a forked rank has
    return threads if threads >= 1 else share


def set_cpu_rank_threads(local_world: int) -> None:
    torch.set_num_threads(cpu_rank_threads(local_world))


def _remote_rank(rank: int, world: int, addr: str, port: int, backend: str, timeout_s: float,
                 local_world: int) -> int:
    try:
        worker_main(rank, world, port, backend, timeout_s, None, None, None, None, addr, local_world, True)
    except Exception as e:
        logger.error("rank %d: lost the engine (node 0 at %s:%d, or a rank it depends on): %s: %s",
                     rank, addr, port, type(e).__name__, e)
        return 1
    return 0


def _exit_with_parent() -> None:
    # A spawned rank blocked in a collective cannot notice its node's main process dying (SIGKILL
    # runs no cleanup, and daemonic children are only reaped on a clean exit); without this it would
    # linger until node 0's sockets close, holding its memory and GPU.
    parent = mp.parent_process()
    if parent is None:
        return
    while parent.is_alive():
        time.sleep(1.0)
    os._exit(1)


def _remote_rank_process(*args: Any) -> None:
    """Spawn target of a node's other ranks; it leaves as worker_process does (`leave_now`)."""
    threading.Thread(target=_exit_with_parent, name="deepserve-parent-watch", daemon=True).start()
    leave_now(_remote_rank(*args))


def run_node(parallel: Any, backend: str, timeout_s: float | None = None) -> int:
    """Node `parallel.node_rank` > 0 of a multi-node engine: run its block of ranks (world / nnodes of
    the tp x pp, `parallel.node_ranks`; the first in this process, the others spawned) until node 0
    stops; 0 on a clean stop. The caller must then leave at once (`leave_now`): this process's group
    is still up."""
    if timeout_s is None:
        timeout_s = envs.DEEPSERVE_TP_TIMEOUT_S
    world, local = parallel.world_size, parallel.ranks_per_node
    ranks = parallel.node_ranks(parallel.node_rank)
    first = ranks[0]
    addr, port = parallel.master_addr, parallel.master_port
    tp = parallel.tensor_parallel_size
    logger.info("node %d: ranks %d..%d of %d (pipeline stage(s) %d..%d), rendezvous at %s:%d", parallel.node_rank,
                first, ranks[-1], world, first // tp, ranks[-1] // tp, addr, port)
    ctx = rank_context()
    procs = [start_rank(ctx, "deepserve.runner.worker._remote_rank_process",
                        (r, world, addr, port, backend, timeout_s, local), f"deepserve-rank{r}")
             for r in ranks[1:]]
    code = _remote_rank(first, world, addr, port, backend, timeout_s, local)
    for p in procs:
        p.join(30.0 if code == 0 else 5.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
        code = code or (p.exitcode != 0)
    return int(code)
