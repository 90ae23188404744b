"""The GPU's SM clock and power during a benchmark, sampled with `nvidia-smi` when this machine has one.

Why it is in every results file: a throughput run on an H200 is power-capped, and under sustained load
the SM clock settles anywhere between about 1,500 and 1,700 MHz depending on the machine. Throughput
follows it (docs/PERF.md, "Llama-3.1-8B shape, one H200: end to end": the same kernels read 12,470
tok/s at 1,513 MHz and 13,029 at 1,627), so figures from different machines compare only with their
clocks beside them. The samples cover the benchmark window only (not the warm-up); a GPU idling at the
start or end of the window is left out by keeping samples drawing at least LOADED_FRACTION of the
run's peak power."""

from __future__ import annotations

import ipaddress
import shutil
import signal
import subprocess
from statistics import mean
from urllib.parse import urlsplit

QUERY = "index,clocks.sm,power.draw"
LOADED_FRACTION = 0.5  # of the highest power seen on that GPU in the window


def parse(lines: list[str]) -> dict[int, list[tuple[float, float]]]:
    """`nvidia-smi --query-gpu=index,clocks.sm,power.draw --format=csv,noheader,nounits` lines ->
    {gpu index: [(SM clock MHz, power W), ...]}; lines with a missing field ("[N/A]") are skipped."""
    samples: dict[int, list[tuple[float, float]]] = {}
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            index, clock, power = int(parts[0]), float(parts[1]), float(parts[2])
        except ValueError:
            continue
        samples.setdefault(index, []).append((clock, power))
    return samples


def summarize(samples: dict[int, list[tuple[float, float]]]) -> dict | None:
    """Per GPU: the SM clock (mean, min, max) and power (mean, max) over its loaded samples."""
    out = {}
    for index, rows in sorted(samples.items()):
        peak = max(p for _, p in rows)
        loaded = [(c, p) for c, p in rows if p >= LOADED_FRACTION * peak]
        clocks = [c for c, _ in loaded]
        powers = [p for _, p in loaded]
        out[str(index)] = {
            "samples": len(rows),
            "loaded_samples": len(loaded),
            "sm_clock_mhz": {"mean": mean(clocks), "min": min(clocks), "max": max(clocks)},
            "power_w": {"mean": mean(powers), "max": max(powers)},
        }
    return out or None


def first_gpu(summary: dict | None) -> dict | None:
    """The first GPU's entry of `summarize`'s dict (the one a single-GPU server runs on), or None."""
    return next(iter(summary.values())) if summary else None


def describe(summary: dict | None) -> str | None:
    """One line for the end-of-run table: the first GPU's loaded clock and power."""
    g = first_gpu(summary)
    if g is None:
        return None
    c, p = g["sm_clock_mhz"], g["power_w"]
    return f"{c['mean']:.0f} MHz ({c['min']:.0f}-{c['max']:.0f}), {p['mean']:.0f} W"


def is_local(url: str) -> bool:
    """Whether the server at `url` runs on this machine (a loopback host), so that this machine's GPUs
    are the ones it ran on; a remote server's clock cannot be sampled from here."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class GpuSampler:
    """`with GpuSampler() as s: ...` samples every `interval_ms` in a background nvidia-smi; afterwards
    `s.summary` holds `summarize`'s dict, or None when there is no nvidia-smi or it printed nothing."""

    def __init__(self, interval_ms: int = 500, command: str = "nvidia-smi", enabled: bool = True) -> None:
        self.interval_ms = interval_ms
        self.command = command
        self.enabled = enabled
        self.proc: subprocess.Popen | None = None
        self.summary: dict | None = None

    def __enter__(self) -> GpuSampler:
        exe = shutil.which(self.command) if self.enabled else None
        if exe is not None:
            args = [
                exe,
                f"--query-gpu={QUERY}",
                "--format=csv,noheader,nounits",
                f"--loop-ms={self.interval_ms}",
            ]
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)  # how its loop mode is meant to be stopped (Ctrl+C)
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.summary = summarize(parse(out.splitlines()))
