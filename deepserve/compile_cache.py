"""Where compiled kernels are kept between runs: one documented directory for Triton's and inductor's caches.

Start-up compiles every Triton kernel configuration and torch.compile'd chain the model uses (the KV
sizing step and the decode-graph captures); with the caches warm, FP8 run 3 of the V3 slice spent 7.0 s
sizing and 15.7 s capturing against 11.0 and 30.5 s cold (bench/RESULTS.md). Without this, Triton writes to
~/.triton/cache and inductor to a temporary directory, which a container loses at every restart.

DEEPSERVE_CACHE_DIR (default ~/.cache/deepserve) holds `triton/` and `inductor/`; mount it on a volume to
keep compiled kernels across pods. TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR, when set, win: this only
fills them in. Set in the environment, so tensor-parallel workers started after it inherit it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from deepserve import envs

logger = logging.getLogger(__name__)


def configure_compile_caches() -> dict[str, str]:
    """Point Triton's and inductor's caches under DEEPSERVE_CACHE_DIR unless the user set them; returns
    the two directories in use. Call before the first kernel compiles."""
    root = envs.DEEPSERVE_CACHE_DIR
    chosen = {}
    for variable, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        if not os.environ.get(variable):
            path = os.path.join(root, sub)
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:  # a read-only home: keep the libraries' own defaults
                logger.warning("compile cache %s not writable (%s); %s left unset", path, exc, variable)
                continue
            os.environ[variable] = path
        chosen[variable] = os.environ[variable]
    return chosen


# Large packages every start imports: each one's bytecode either comes from a cache or is compiled from
# source again at every start. Start-up trace 1 on an H200 machine (bench/RESULTS.md) spent 8.6 s of a
# 40 s start in 3,939 calls of Python's compile(), by their number mostly imports compiled from source:
# an environment installed without bytecode (e.g. `uv pip install` without --compile-bytecode) that the
# process does not write to.
HEAVY_PACKAGES = ("torch", "transformers", "triton", "sympy")


def packages_without_bytecode(names: tuple[str, ...] = HEAVY_PACKAGES) -> list[str]:
    """The imported packages among `names` whose __init__ has no cached bytecode where this interpreter
    looks for it (next to the source, or under sys.pycache_prefix)."""
    missing = []
    for name in names:
        module = sys.modules.get(name)
        source = getattr(module, "__file__", None)
        if not source or not source.endswith(".py"):
            continue
        if not os.path.exists(importlib.util.cache_from_source(source)):
            missing.append(name)
    return missing


def warn_if_imports_compile(names: tuple[str, ...] = HEAVY_PACKAGES) -> list[str]:
    """Log what to do when the heavy packages' bytecode is not cached (every start then compiles them
    from source); returns those packages."""
    missing = packages_without_bytecode(names)
    if missing:
        where = sorted({os.path.dirname(os.path.dirname(sys.modules[n].__file__)) for n in missing})
        logger.warning(
            "no cached bytecode for %s: every start compiles them from source (seconds; up to 8.6 s of a 40 s "
            "start on one H200 machine). Compile once where they are installed: python -m compileall -q %s%s",
            ", ".join(missing), " ".join(where),
            " (or let Python write it: PYTHONDONTWRITEBYTECODE is set)" if sys.dont_write_bytecode else "")
    return missing
