"""Timing helpers the kernel benchmarks share: a median timer (do_bench or CUDA-graph replays),
round-robin ordering of several runs, and the machine's ceilings (copy bandwidth, matmul peaks)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch


def bench_ms(fn: Callable[[], object], device: torch.device, graph: bool = False) -> float:
    """Median ms. `graph`: replay a CUDA graph of the call, so host launch overhead is excluded (as in
    the engine's graph-captured decode); falls back to plain launches if the call cannot be captured."""
    if device.type == "cuda":
        import triton.testing

        if graph:
            try:
                return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            except Exception:  # e.g. a host sync inside: not capturable
                torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < 0.2:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def round_robin(n: int, rounds: int) -> Iterator[int]:
    """The order to time n runs `rounds` times: 0..n-1, each round starting one run later. The GPU's
    clock falls as it warms under a long run, so a fixed order favours whoever goes first (on the H200
    the run timed first read 1-3% faster than the same kernel timed later)."""
    for r in range(rounds):
        for i in range(n):
            yield (r + i) % n


def round_robin_medians(timings: Sequence[Callable[[], float]], rounds: int) -> list[float | Exception]:
    """Each timing's median over `rounds` calls made in `round_robin` order. A timing that raises is not
    called again and its exception stands in for its median."""
    times: list[list[float]] = [[] for _ in timings]
    failed: dict[int, Exception] = {}
    for i in round_robin(len(timings), rounds):
        if i in failed:
            continue
        try:
            times[i].append(timings[i]())
        except Exception as e:  # noqa: BLE001
            failed[i] = e
    return [failed[i] if i in failed else statistics.median(t) for i, t in enumerate(times)]


def ceilings(device: torch.device, small: bool) -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s)."""
    n = (64 if small else 2048) << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * n / (bench_ms(lambda: dst.copy_(src), device) * 1e-3)
    m = 1024 if small else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(m, m, device=device).to(dtype) for _ in range(2))
    peak = 2 * m**3 / (bench_ms(lambda: a @ b, device) * 1e-3)
    return copy_bw, peak


def fp8_ceiling(device: torch.device, small: bool) -> float | None:
    """FP8 e4m3 matmul FLOP/s (torch._scaled_mm, per-tensor scales, 8192^3); None where unsupported."""
    if device.type != "cuda":
        return None
    try:
        m = 1024 if small else 8192
        a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn).T
        one = torch.ones((), device=device)
        ms = bench_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device)
        f = 2 * m**3 / (ms * 1e-3)
        print(
            f"# ceilings: fp8 matmul {f / 1e12:.1f} TFLOP/s (torch._scaled_mm, %mm of fp8 ops is against this)"
        )
        return f
    except Exception as e:  # noqa: BLE001 - an old torch / GPU: fall back to the bf16 peak
        print(f"# fp8 matmul ceiling unavailable ({type(e).__name__}); fp8 %mm is against bf16")
        return None
