"""Kernel compiles that happen after start-up, counted and named.

Start-up is meant to compile every Triton kernel variant and torch.compile'd chain that serving will use
(the KV-sizing step, the prefill warm-up, the decode-graph captures). A variant first met while serving
compiles inside that step: seconds for a cold cache, ~0.1 s from a warm one, and every request in the
batch waits. Triton picks a variant by its constexpr tile choices (the fused MoE's tiles change with the
tokens per expert) and by the specialization of integer arguments (== 1, divisible by 16), so a
prefill length start-up did not run can compile one.

The watch hooks Triton's compile hooks (chaining any hook already set, e.g. inductor's) and reads
dynamo's graph counter; it counts only after `arm()` (the end of start-up), and `snapshot()` is what
the benchmarks report beside their figures (bench/RESULTS.md: W1's first run on a fresh machine read
lower than later runs of the same tree, which is what this measures).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Process-wide: one per process (`WATCH`); install() is idempotent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed = False
        self._armed = False
        self._started: dict[tuple[int, str], float] = {}  # (thread, kernel) -> when its compile began
        self.count = 0
        self.seconds = 0.0
        self.kernels: Counter[str] = Counter()
        self._dynamo_at_arm = 0

    def install(self) -> bool:
        """Chain onto Triton's compile hooks; False where Triton has none (old Triton, no Triton)."""
        with self._lock:
            if self._installed:
                return True
            try:
                from triton import knobs
                runtime = knobs.runtime
                previous_pre, previous_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook
            except (ImportError, AttributeError):
                return False

            def before(*args: Any, **kwargs: Any) -> Any:
                self._begin(_kernel_name(kwargs))
                # A true result tells Triton to skip the compile: only the hook we replaced may say so.
                return previous_pre(*args, **kwargs) if previous_pre is not None else None

            def after(*args: Any, **kwargs: Any) -> Any:
                self._end(_kernel_name(kwargs))
                return previous_post(*args, **kwargs) if previous_post is not None else None

            runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
            self._installed = True
            return True

    def arm(self) -> None:
        """Start counting (call when start-up has compiled what it meant to)."""
        with self._lock:
            self._armed = True
            self.count, self.seconds = 0, 0.0
            self.kernels.clear()
            self._dynamo_at_arm = _dynamo_graphs()

    def snapshot(self) -> dict[str, Any]:
        """Compiles since arm(): Triton kernel variants (count, seconds, by kernel) and dynamo graphs."""
        with self._lock:
            return {"triton_compiles": self.count, "triton_compile_s": round(self.seconds, 3),
                    "triton_kernels": dict(self.kernels),
                    "dynamo_graphs": _dynamo_graphs() - self._dynamo_at_arm if self._armed else 0}

    def _begin(self, name: str) -> None:
        with self._lock:
            self._started[(threading.get_ident(), name)] = time.perf_counter()

    def _end(self, name: str) -> None:
        with self._lock:
            began = self._started.pop((threading.get_ident(), name), None)
            if not self._armed:
                return
            seconds = time.perf_counter() - began if began is not None else 0.0
            self.count += 1
            self.seconds += seconds
            self.kernels[name] += 1
            first = self.kernels[name] == 1
        if first:  # once per kernel: the log says which kernel a slow step waited on
            logger.warning("Triton compiled %s after start-up (%.2f s; a shape start-up did not run; the "
                           "step that met it waited)", name, seconds)


def compiles_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What two snapshots differ by: the compiles that happened between them."""
    kernels = {name: n - before["triton_kernels"].get(name, 0) for name, n in after["triton_kernels"].items()}
    return {"triton_compiles": after["triton_compiles"] - before["triton_compiles"],
            "triton_compile_s": round(after["triton_compile_s"] - before["triton_compile_s"], 3),
            "triton_kernels": {name: n for name, n in kernels.items() if n},
            "dynamo_graphs": after["dynamo_graphs"] - before["dynamo_graphs"]}


def _kernel_name(kwargs: dict[str, Any]) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None)
    module = getattr(getattr(fn, "module", None), "__name__", None) or getattr(fn, "module", None)
    if name is None:
        return "unknown"
    return f"{module}.{name}" if isinstance(module, str) else str(name)


def _dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (0 when torch._dynamo was never imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    return int(utils.counters["stats"].get("unique_graphs", 0))


WATCH = CompileWatch()
