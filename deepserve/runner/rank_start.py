"""How the ranks other than rank 0 start (tensor / pipeline parallel, one process each).

By default from a fork server (multiprocessing's "forkserver"): one helper process, started with the
first rank, imports torch and transformers' configuration classes once; every rank is then a fork of it
(copy-on-write, milliseconds) instead of a fresh interpreter importing them again, about 5.6 s per rank
on the project's 2-core sandbox, which a tensor-parallel engine's start waited for (its rank 0 waits for
every rank to join). The helper never touches CUDA (importing torch does not initialize it), so a
forked rank picks its GPU as a spawned one does.

Two things differ from spawning, and both are kept as they were:
- Environment: a fork server's child inherits the helper's environment, fixed when the helper started.
  Each rank instead applies the environment its parent has when it starts the rank, before importing
  any deepserve module (several read switches at import, e.g. layers/fusion.py). Only torch and
  transformers were imported with the helper's.
- Parent: the helper, not the engine process, is the rank's parent in the process tree;
  multiprocessing.parent_process() is still the process that started the rank (a pipe from it), which is
  what worker._exit_with_parent watches. The helper itself exits with its owner.

DEEPSERVE_RANK_START_METHOD=spawn starts every rank as a fresh interpreter, as before.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
from typing import Any

from deepserve import envs

# Third-party only: deepserve's own modules must be imported under the rank's environment.
FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "transformers.models.llama.configuration_llama",
    "transformers.models.qwen2.configuration_qwen2",
    "transformers.models.deepseek_v2.configuration_deepseek_v2",
    "transformers.models.deepseek_v3.configuration_deepseek_v3",
)
METHODS = ("forkserver", "spawn")


def rank_context() -> Any:
    """The multiprocessing context ranks start from (DEEPSERVE_RANK_START_METHOD)."""
    method = envs.DEEPSERVE_RANK_START_METHOD
    if method not in METHODS:
        raise ValueError(f"DEEPSERVE_RANK_START_METHOD must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # effective until the helper has started
        return ctx
    return mp.get_context("spawn")


def start_rank(ctx: Any, target: str, args: tuple, name: str) -> Any:
    """Start `target` ("module.function") with `args` in a daemonic process of `ctx`, under this process's
    environment as it is now; the started process."""
    proc = ctx.Process(target=_rank_main, name=name, daemon=True, args=(target, dict(os.environ), args))
    proc.start()
    return proc


def _rank_main(target: str, environ: dict[str, str], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    module, _, function = target.rpartition(".")
    getattr(importlib.import_module(module), function)(*args)
