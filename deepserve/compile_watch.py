"""Kernel compiles that happen after start-up, counted and named.

Start-up is meant to compile every Triton kernel variant and torch.compile'd chain that serving will use
(the KV-sizing step, the prefill warm-up, the decode-graph captures). A variant first met while serving
is compiled (or read from the disk cache) inside that step, and every request in the batch waits.
Triton picks a variant by its constexpr tile choices (the fused MoE's tiles change with the tokens per
expert) and by the specialization of integer arguments (== 1, divisible by 16), so a prefill length
start-up did not run can need one.

The watch adds itself to Triton's kernel-load hook chain and reads dynamo's graph counter; it counts
only after `arm()` (the end of start-up), and `snapshot()` is what the benchmarks report beside their
figures. Why: W1 of one tree read up to 13 % apart between repeats on one H200 (bench/RESULTS.md, gate
run 6's A/B); whether compiles inside the timed run explain it is what this measures.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Process-wide: one per process (`WATCH`); install() is idempotent.

    Counted at Triton's kernel-load hooks: each compiled variant is loaded onto the device once per
    process, at its first launch, right after it was compiled or read from the disk cache, so a load
    after start-up is a variant start-up did not meet. (Triton's compile hooks would also give the
    compile's duration, but with one set Triton serializes every variant's constants to JSON before
    compiling it, which a constexpr that is not JSON would turn into a failed launch.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed = False
        self._armed = False
        self.count = 0
        self.kernels: Counter[str] = Counter()
        self._dynamo_at_arm = 0

    def install(self) -> bool:
        """Add to Triton's kernel-load hook chain; False where Triton has none (old Triton, no Triton)."""
        with self._lock:
            if self._installed:
                return True
            try:
                from triton import knobs
                knobs.runtime.kernel_load_end_hook.add(self._loaded)
            except (ImportError, AttributeError):
                return False
            self._installed = True
            return True

    def arm(self) -> None:
        """Start counting (call when start-up has compiled what it meant to)."""
        with self._lock:
            self._armed = True
            self.count = 0
            self.kernels.clear()
            self._dynamo_at_arm = _dynamo_graphs()

    def snapshot(self) -> dict[str, Any]:
        """Since arm(): Triton kernel variants first loaded (count, by kernel) and dynamo graphs compiled."""
        with self._lock:  # watching False: no hook installed (CPU, or a Triton without the hook): counts unknown
            return {"watching": self._installed, "triton_compiles": self.count, "triton_kernels": dict(self.kernels),
                    "dynamo_graphs": _dynamo_graphs() - self._dynamo_at_arm if self._armed else 0}

    def _loaded(self, module: Any, function: Any, name: str, metadata_group: Any, hash: Any) -> None:
        with self._lock:
            if not self._armed:
                return
            self.count += 1
            self.kernels[str(name)] += 1
            first = self.kernels[str(name)] == 1
        if first:  # once per kernel: the log says which kernel a slow step waited on
            logger.warning("Triton kernel %s: a variant compiled (or read from the disk cache) after start-up; "
                           "the step that met its shape waited for it", name)


def compiles_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What two snapshots differ by: the compiles that happened between them."""
    kernels = {name: n - before["triton_kernels"].get(name, 0) for name, n in after["triton_kernels"].items()}
    return {"watching": after["watching"], "triton_compiles": after["triton_compiles"] - before["triton_compiles"],
            "triton_kernels": {name: n for name, n in kernels.items() if n},
            "dynamo_graphs": after["dynamo_graphs"] - before["dynamo_graphs"]}


def _dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process (0 when torch._dynamo was never imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    return int(utils.counters["stats"].get("unique_graphs", 0))


WATCH = CompileWatch()
