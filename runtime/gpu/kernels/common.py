"""Small helpers shared by the Triton launchers (no Triton import here)."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # split-KV decode: no split shorter than this
MAX_SPLITS = 64


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact (ieee) dots; tf32 would cost ~3 decimal digits."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on the CPU: keep grids small


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split-KV decode: enough (row, kv head, split) programs to fill the GPU twice over, no split
    under MIN_SPLIT_TOKENS, a power of two so few variants compile. Host-only: no device sync."""
    want = -(-2 * num_sms(device) // max(1, batch * num_kv_heads))
    cap = max(1, -(-max_seq_len // MIN_SPLIT_TOKENS))
    return min(next_pow2(max(1, min(want, cap))), MAX_SPLITS)
