"""Capacity planning: will a model fit on a GPU setup, how many sequences, and with which flags.

`plan(PlanRequest(...))` returns a `Plan`; `deepserve plan` prints it. The weights and KV cache
figures come from the engine's own model classes built on the meta device, so they are the bytes
the engine will allocate, not a rule of thumb.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Plan", "PlanRequest", "plan"]


def __getattr__(name: str) -> Any:
    # Imported on first use: the estimate builds models on the meta device (torch), and `deepserve
    # --help` imports this package's CLI, which must not wait seconds for torch.
    if name in __all__:
        from deepserve.planner import estimate

        return getattr(estimate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
