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

Either way a rank starts by importing the user's main script again (multiprocessing's rule for both
methods): a script that builds LLM(tensor_parallel_size>1) outside `if __name__ == "__main__":` builds it
once more in every rank, which would start ranks of its own. start_rank refuses that in one line and exits
the rank with MAIN_GUARD_EXIT_CODE, so rank 0 (executor.py) can say what to change instead of waiting.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
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
# A rank's exit code when it was started from a main script without the entry-point guard; 1 is any error.
MAIN_GUARD_EXIT_CODE = 3
MAIN_GUARD_HINT = ('a script that uses LLM(tensor_parallel_size>1) must guard its entry point with '
                   '`if __name__ == "__main__":` (each rank imports the main script again; see README.md, '
                   '"Offline inference")')


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


def start_rank(ctx: Any, target: str, args: tuple, name: str, kwargs: dict[str, Any] | None = None) -> Any:
    """Start `target` ("module.function") with `args` (and `kwargs`) in a daemonic process of `ctx`, under this
    process's environment as it is now; the started process."""
    if importing_main_in_a_child():
        _leave_unguarded()
    proc = ctx.Process(target=_rank_main, name=name, daemon=True, args=(target, dict(os.environ), args, kwargs))
    proc.start()
    return proc


def importing_main_in_a_child() -> bool:
    """True while this process is a rank (or any multiprocessing child) still importing the main script:
    the same test multiprocessing makes before refusing to start a process then."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def _leave_unguarded() -> None:
    # Python's own refusal (RuntimeError, "...before the current process has finished its bootstrapping
    # phase") is 20 lines that never say which call or what to change, and its exit code (1) looks like any
    # other error to rank 0. os._exit, not SystemExit: a forkserver child exits 1 whatever SystemExit says.
    print(f"deepserve: a tensor-parallel rank was started from a main script that builds the engine at import: "
          f"{MAIN_GUARD_HINT}", file=sys.stderr, flush=True)
    os._exit(MAIN_GUARD_EXIT_CODE)


def _rank_main(target: str, environ: dict[str, str], args: tuple, kwargs: dict[str, Any] | None = None) -> None:
    os.environ.clear()
    os.environ.update(environ)
    module, _, function = target.rpartition(".")
    getattr(importlib.import_module(module), function)(*args, **(kwargs or {}))
