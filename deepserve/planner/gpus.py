"""GPU memory sizes, in bytes, as CUDA reports them (`torch.cuda.mem_get_info()`'s total).

The marketing figure ("141 GB") is decimal, and nvidia-smi's MiB total is above what CUDA can hand out too
(H100 80GB HBM3: 81,559 MiB against CUDA's 81,079; H200: 143,771 against 139.80 GiB); the engine sizes its
cache from CUDA's total, so the planner uses that number where it was read on the part (H100: mem_get_info;
H200: the 139.80 GiB of torch's out-of-memory messages, two decimals, so within 5 MiB), and nvidia-smi's for the
others (read elsewhere: an A100-40GB's CUDA total was 40,339-40,441 MiB against 40,960).
"""

from __future__ import annotations

MIB = 2**20
GIB = 2**30

# Compute capability: FP8 tensor cores from 8.9 (Ada, Hopper); below, serve refuses FP8 checkpoints
# unless --quantization none dequantizes them (layers/quantization.resolve_quantization).
CAPABILITY: dict[str, tuple[int, int]] = {"h200": (9, 0), "h100": (9, 0), "a100-80g": (8, 0), "a100-40g": (8, 0),
                                          "h20": (9, 0), "l40s": (8, 9)}

GPUS: dict[str, int] = {
    "h200": 143_155 * MIB,     # H200 SXM, 141 GB HBM3e: 139.80 GiB in torch's out-of-memory messages
    "h100": 81_079 * MIB,      # H100 SXM, 80 GB HBM3: mem_get_info on the device tool's H100 (2026-12-05)
    "a100-80g": 81_920 * MIB,  # A100 80 GB
    "a100-40g": 40_960 * MIB,  # A100 40 GB
    "h20": 97_871 * MIB,       # H20, 96 GB
    "l40s": 46_068 * MIB,      # L40S, 48 GB GDDR6
}


def gpu_capability(gpu: str) -> tuple[int, int] | None:
    """The named GPU's compute capability; None for a bare size (assumed FP8-capable)."""
    return CAPABILITY.get(gpu.strip().lower())


def gpu_memory_bytes(gpu: str) -> tuple[str, int]:
    """(display name, bytes) for a GPU name from GPUS or a size in GiB such as "80" or "80GiB"."""
    key = gpu.strip().lower()
    if key in GPUS:
        return key, GPUS[key]
    number = key.removesuffix("gib").removesuffix("gb").strip()
    try:
        gib = float(number)
    except ValueError:
        raise ValueError(f"unknown --gpu {gpu!r}; use one of {', '.join(GPUS)} or a size in GiB such as 80") from None
    if gib <= 0:
        raise ValueError(f"--gpu size must be positive, got {gpu!r}")
    return f"{gib:g} GiB", int(gib * GIB)
