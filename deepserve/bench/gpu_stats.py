"""Device-side measurements around a benchmark: peak memory and energy (NVML) where available."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from deepserve import envs


@dataclass
class EnergyMeter:
    """Joules drawn by the engine's GPUs (the first `num_gpus` visible ones) between start() and stop(),
    from NVML's total-energy counters."""

    num_gpus: int = 1
    joules: float | None = None
    _handles: list = field(default_factory=list, repr=False)
    _start_mj: list[int] = field(default_factory=list, repr=False)

    def start(self) -> None:
        with contextlib.suppress(Exception):  # no NVML (CPU, missing pynvml): energy stays None
            import pynvml

            pynvml.nvmlInit()
            self._handles = _visible_handles(pynvml, self.num_gpus)
            self._start_mj = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles]

    def stop(self) -> float | None:
        if self._handles and len(self._start_mj) == len(self._handles):
            import pynvml

            now = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles]
            self.joules = sum(b - a for a, b in zip(self._start_mj, now, strict=True)) / 1000.0
        return self.joules


def _visible_handles(pynvml, count: int) -> list:
    # NVML numbers every GPU of the host; CUDA numbers only CUDA_VISIBLE_DEVICES, in its order.
    visible = envs.CUDA_VISIBLE_DEVICES
    idents = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    return [pynvml.nvmlDeviceGetHandleByIndex(int(i)) if i.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(i)
            for i in idents[:count]]


def peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
