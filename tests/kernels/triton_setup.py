"""What every kernel test module needs: Triton (or a skip), the kernel module, the device.

tests/conftest.py has already switched Triton to its interpreter where there is no GPU, before any
kernel module was imported, so the kernels run on the CPU there."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
MARKS = [pytest.mark.gpu] if ON_GPU else []


def import_kernels(module: str) -> ModuleType:
    pytest.importorskip("triton")
    return importlib.import_module(module)
