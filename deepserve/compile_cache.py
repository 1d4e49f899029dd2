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

import logging
import os

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
