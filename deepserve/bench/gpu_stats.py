"""Device-side measurements around a benchmark: peak memory and energy (NVML) where available."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class EnergyMeter:
    """Joules drawn by GPU 0 between start() and stop(), from NVML's total-energy counter."""

    joules: float | None = None
    _handle: object | None = field(default=None, repr=False)
    _start_mj: int | None = field(default=None, repr=False)

    def start(self) -> None:
        with contextlib.suppress(Exception):  # no NVML (CPU, missing pynvml): energy stays None
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def stop(self) -> float | None:
        if self._handle is not None and self._start_mj is not None:
            import pynvml

            self.joules = (pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj) / 1000.0
        return self.joules


def peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
