"""Elementwise chains (RMSNorm, rope, SiLU-and-mul) fused into single GPU kernels by torch.compile.

In eager mode each of these is 5-20 tiny kernels; a decode step of a 30-layer model launches over a
thousand of them, and even inside a CUDA graph each costs a few microseconds. Compiled, each chain is
one kernel. CPU calls, and any process with DEEPSERVE_TORCH_COMPILE=0, run the plain function, which
is also the reference the compiled kernel computes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compiled_on_cuda(fn: F) -> F:
    """`fn` compiled (dynamic shapes, whole graph) when its first tensor argument is on a GPU."""
    compiled: Callable | None = None

    @functools.wraps(fn)
    def wrapper(*args: object) -> object:
        nonlocal compiled
        first = args[0]
        if not (isinstance(first, torch.Tensor) and first.is_cuda) or not _enabled():
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(*args)

    return wrapper  # type: ignore[return-value]


@functools.cache
def _enabled() -> bool:
    return os.environ.get("DEEPSERVE_TORCH_COMPILE", "1") != "0"
