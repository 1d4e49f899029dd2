"""What every check script records about where it ran: device, versions, commit."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch


def environment(device: torch.device, **extra: object) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # a copy without git
        commit = ""
    return dict(device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                torch=torch.__version__, triton=triton.__version__, commit=commit or None, **extra)
