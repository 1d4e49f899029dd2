"""Capacity planning: will a model fit on a GPU setup, how many sequences, and with which flags.

`plan(PlanRequest(...))` returns a `Plan`; `deepserve plan` prints it. The weights and KV cache
figures come from the engine's own model classes built on the meta device, so they are the bytes
the engine will allocate, not a rule of thumb.
"""

from __future__ import annotations

from deepserve.planner.estimate import Plan, PlanRequest, plan

__all__ = ["Plan", "PlanRequest", "plan"]
