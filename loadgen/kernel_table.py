"""Per-kernel device time of a few profiled steps, as a table: what `loadgen steps --profile-steps` and
`loadgen.profile_decode` print. CUPTI reports the kernels a CUDA graph replay launches too. A profile of
CPU activity only (a CPU run) gives the ops' own host time instead."""

from __future__ import annotations

from collections import defaultdict


def kernel_table(prof, steps: int, cuda: bool = True, top: int = 25, width: int = 70) -> str:  # noqa: ANN001 - a torch profiler
    """The `top` kernels by device time per step (names cut to `width`), with the step's total kernel time
    and kernel count; `cuda` False: the CPU ops by their own host time."""
    import torch

    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    per_kernel: dict[str, float] = defaultdict(float)
    count = 0
    for e in prof.events():
        if e.device_type == kind:
            per_kernel[e.name[:width]] += (e.device_time_total if cuda else e.self_cpu_time_total) / steps
            count += 1
    total = sum(per_kernel.values()) or 1.0
    lines = [
        f"  kernel time per step {total / 1e3:.3f} ms, {count / steps:.0f} device ops per step; top kernels:"
    ]
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / 1e3:8.3f} ms  {100 * us / total:5.1f}%  {name}")
    return "\n".join(lines)
