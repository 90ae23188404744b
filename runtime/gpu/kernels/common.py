"""Small helpers shared by the Triton launchers (no Triton import here)."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact (ieee) dots; tf32 would cost ~3 decimal digits."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on the CPU: keep grids small
