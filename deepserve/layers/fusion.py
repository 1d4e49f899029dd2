"""Elementwise chains (RMSNorm, rope, SiLU-and-mul) fused into single GPU kernels by torch.compile, or by
the hand-written Triton kernels of kernels/elementwise.py (the default on GPUs; DEEPSERVE_TRITON_ELEMENTWISE=0
for torch.compile's).

In eager mode each of these is 5-20 tiny kernels; a decode step of a 30-layer model launches over a
thousand of them, and even inside a CUDA graph each costs a few microseconds. Compiled, each chain is
one kernel. CPU calls, and any process with DEEPSERVE_TORCH_COMPILE=0, run the plain function, which
is also the reference the compiled kernel computes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from deepserve import envs

F = TypeVar("F", bound=Callable)
logger = logging.getLogger(__name__)


def compiled_on_cuda(fn: F) -> F:
    """`fn` compiled (dynamic shapes, whole graph) when its first tensor argument is on a GPU."""
    compiled: Callable | None = None

    failed = False

    @functools.wraps(fn)
    def wrapper(*args: object) -> object:
        nonlocal compiled, failed
        first = args[0]
        if failed or not (isinstance(first, torch.Tensor) and first.is_cuda) or not _enabled():
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        try:
            return compiled(*args)
        except Exception as exc:  # a compiler failure must cost speed, never a request
            if torch.cuda.is_current_stream_capturing():
                raise
            failed = True
            logger.warning("torch.compile of %s failed (%s: %s); running it eagerly", fn.__name__,
                           type(exc).__name__, exc)
            return fn(*args)

    return wrapper  # type: ignore[return-value]


def triton_on_cuda(kernel_name: str) -> Callable[[F], F]:
    """`fn` as kernels/elementwise.py's `kernel_name` on GPU tensors when DEEPSERVE_TRITON_ELEMENTWISE is on
    (the default: no dynamo at start-up), else as compiled_on_cuda(fn). Decided once, at import: with the
    switch off this returns compiled_on_cuda(fn) itself, so that path gains no call. The
    kernel takes fn's arguments and computes fn's result (fn is its reference, `__wrapped__`)."""

    def decorate(fn: F) -> F:
        compiled = compiled_on_cuda(fn)
        if not TRITON_ELEMENTWISE:
            return compiled

        @functools.wraps(fn)
        def wrapper(*args: object) -> object:
            if _on_gpu(args[0]):
                from deepserve.kernels import elementwise  # Triton is imported where it runs, not by the layers

                return getattr(elementwise, kernel_name)(*args)
            return compiled(*args)

        wrapper.triton_kernel = kernel_name  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


TRITON_ELEMENTWISE = envs.DEEPSERVE_TRITON_ELEMENTWISE  # read once, when the layers are decorated


def _on_gpu(first: object) -> bool:
    return isinstance(first, torch.Tensor) and first.is_cuda


@functools.cache
def _enabled() -> bool:
    import torch._dynamo.config as dynamo_config

    # Each (model shape, layer kind) specializes once; a process serving one model needs a few, a
    # test process that builds many models more than the default limit of 8.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    return envs.DEEPSERVE_TORCH_COMPILE
