"""FP8 block GEMM, every implementation side by side at DeepSeek-V3 shapes (M 64 / 128 / 4096; N x K
7168x2048, 4096x7168, 2112x7168). Each implementation (and config) is checked against the reference
on its first call at each shape, then timed (CUDA-graph replays, `timing.bench_ms`), and printed
as TFLOP/s, % of the FP8 matmul ceiling (torch._scaled_mm with per-tensor scales at 8192^3; the
`scaled_mm` row is the same call at the row's shape: no block scales, not checked) and the ratio to
DeepGEMM's published H800 figure for the shape.

    python -m benchmarks.kernels.fp8_gemm              # tilelang (chosen config), triton, deep_gemm
    python -m benchmarks.kernels.fp8_gemm --configs    # + TILELANG_CONFIGS (K splits per shape)
    python -m benchmarks.kernels.fp8_gemm --configs --compile-only   # fill the compile cache
    python -m benchmarks.kernels.ops --ops fp8_block_gemm [--fp8-configs]   # the same rows

TileLang kernels are compiled first, in parallel worker processes (TileLang's disk cache then serves
this one). A config that fails to compile, to run or the check prints its error and the rest go on;
the exit status is 1 when any did."""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

from benchmarks.kernels.timing import bench_ms, fp8_ceiling
from runtime.gpu.kernels.fp8_gemm import FP8_BLOCK_GEMM
from runtime.gpu.kernels.fp8_gemm.tilelang import TileConfig, brief, choose_config, with_split
from runtime.gpu.kernels.testing import close_ratio

NK = ((7168, 2048), (4096, 7168), (2112, 7168))
SHAPES = [(m, n, k) for m in (64, 128, 4096) for n, k in NK]
SMALL_SHAPES = [(4, 256, 512), (64, 320, 384)]
# DeepGEMM README (@327ec92), H800, dense 1x128 / 128x128 FP8 -> bf16, TFLOP/s
DEEP_GEMM_H800 = {
    (64, 2112, 7168): 206, (64, 4096, 7168): 287, (64, 7168, 2048): 295,
    (128, 2112, 7168): 352, (128, 4096, 7168): 533, (128, 7168, 2048): 510,
    (4096, 2112, 7168): 1127, (4096, 4096, 7168): 1410, (4096, 7168, 2048): 1168,
}  # fmt: skip
# --configs: TileLang tile shapes to compare (each gets the K split `with_split` picks for the shape).
# Kept short: every (config, N, K, split) is one compile.
TILELANG_CONFIGS = (
    TileConfig(128, 128, 4, 256),  # DeepGEMM's tile: two math warpgroups of 64 rows
    TileConfig(128, 128, 3, 256),
    TileConfig(128, 64, 4, 256),
    TileConfig(64, 128, 4, 256),  # two warpgroups over 64 columns each
    TileConfig(64, 128, 4, 128),
    TileConfig(64, 64, 4, 128),
)


def tilelang_configs(
    m: int, n: int, k: int, device: torch.device, configs: bool, tiles: list[TileConfig] | None = None
) -> list[TileConfig]:
    """The chosen config first, then (with `configs`) the others of TILELANG_CONFIGS at this shape, or
    of `tiles` (--tiles) when given."""
    from runtime.gpu.kernels.common import num_sms

    chosen = choose_config(m, n, k, device)
    if not configs and not tiles:
        return [chosen]
    others = [with_split(c, m, n, k, num_sms(device)) for c in tiles or TILELANG_CONFIGS]
    return [chosen] + [c for c in dict.fromkeys(others) if c != chosen]


def variants(name: str, m: int, n: int, k: int, device: torch.device, configs: bool, tiles=None):
    """(label, extra kwargs) to time for one implementation at one shape; `*` marks the config that
    `tilelang.choose_config` picks."""
    if name == "tilelang":
        cfgs = tilelang_configs(m, n, k, device, configs, tiles)
        return [
            (f"tilelang:{c.label()}" + ("*" if i == 0 else ""), {"config": c}) for i, c in enumerate(cfgs)
        ]
    return [(name, {})]


# ------------------------------------------------------------------ compiling ahead


def tilelang_keys(
    shapes: list[tuple[int, int, int]], device: torch.device, configs: bool, tiles=None
) -> list[tuple]:
    """The `tilelang._kernel` arguments the rows at `shapes` use (one compile each)."""
    keys = {
        (n, k, "bfloat16", c) for m, n, k in shapes for c in tilelang_configs(m, n, k, device, configs, tiles)
    }
    return sorted(keys, key=str)


def prewarm(keys: list[tuple], workers: int) -> None:
    """Compile every kernel the run will time, in parallel worker processes (`tilelang.precompile`)."""
    if not keys or workers <= 0:
        return
    from runtime.gpu.kernels.fp8_gemm.tilelang import precompile

    t0 = time.perf_counter()
    for line in precompile(keys, workers):
        print(f"# compiled {line}", flush=True)
    print(f"# {len(keys)} TileLang kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)


# ------------------------------------------------------------------ checking and timing


def inputs(m: int, n: int, k: int, device: torch.device) -> tuple:
    from runtime.gpu.kernels.fp8_gemm.reference import act_quant
    from runtime.gpu.quant.fp8 import quantize

    g = torch.Generator(device).manual_seed(m + n + k)
    xq, xs = act_quant(torch.randn(m, k, device=device, generator=g))
    wq, ws = quantize(torch.randn(n, k, device=device, generator=g) * 0.05, (128, 128))
    return xq, xs, wq, ws


def _scaled_mm(args: tuple):
    xq, _, wq, _ = args
    one = torch.ones((), device=xq.device)
    return lambda: torch._scaled_mm(xq, wq.T, one, one, out_dtype=torch.bfloat16)


def run(
    device: torch.device,
    shapes: list[tuple[int, int, int]] | None = None,
    impls: list[str] | None = None,
    configs: bool = False,
    graph: bool = True,
    peak: float | None = None,
    workers: int = 12,
    reference: bool = False,
    tiles: list[TileConfig] | None = None,
) -> int:
    """Print one row per (shape, implementation, config); returns the number of failures (compile, run
    or check). `impls` None: every available non-reference implementation (+ the reference when
    `reference` or on the CPU)."""
    from runtime.gpu.kernels.fp8_gemm.reference import fp8_block_gemm as ref_gemm

    shapes = shapes or (SHAPES if device.type == "cuda" else SMALL_SHAPES)
    names = impls or [
        i.name
        for i in FP8_BLOCK_GEMM.implementations()
        if i.available(device) and (i.name != "reference" or reference or device.type != "cuda")
    ]
    if "tilelang" in names:
        prewarm(tilelang_keys(shapes, device, configs, tiles), workers)
    print(
        f"{'impl (* = default config)':<32} {'shape':<22} {'us':>9} {'TFLOP/s':>8} {'%fp8mm':>6} "
        f"{'DG-H800':>7} {'xDG':>5}  check (max err / tolerance)"
    )
    failures = 0
    for m, n, k in shapes:
        args = inputs(m, n, k, device)
        want = ref_gemm(*args)
        tol = 2e-3 * want.abs().max().item()
        flops = 2 * m * n * k
        anchor = DEEP_GEMM_H800.get((m, n, k))
        shape = f"M={m} N={n} K={k}"
        rows = [("scaled_mm (no block scales)", None, {})] if device.type == "cuda" else []
        for name in names:
            try:
                fn = FP8_BLOCK_GEMM.named(name).load()
            except Exception as e:  # noqa: BLE001
                print(f"{name:<32} {shape:<22} import failed: {type(e).__name__}: {e}", flush=True)
                failures += 1
                continue
            rows += [(label, fn, kw) for label, kw in variants(name, m, n, k, device, configs, tiles)]
        for label, fn, kw in rows:
            try:
                if fn is None:
                    call, check = _scaled_mm(args), "-"
                    call()
                else:
                    call = functools.partial(fn, *args, **kw)
                    ratio = close_ratio(call(), want, tol, 1e-2)
                    check = f"{'ok' if ratio <= 1 else 'FAIL'} {ratio:.3f}"
                    failures += ratio > 1
                ms = bench_ms(call, device, graph and label != "reference")
            except Exception as e:  # noqa: BLE001 - a compile or launch failure: report, go on
                print(f"{label:<32} {shape:<22} ERROR {brief(e)}", flush=True)
                if fn is not None:  # (the scaled_mm ceiling row is information only)
                    failures += 1
                continue
            tf = flops / (ms * 1e-3) / 1e12
            pct = f"{100 * tf * 1e12 / peak:5.0f}%" if peak else "     -"
            dg = f"{anchor:7d} {tf / anchor:5.2f}" if anchor else f"{'-':>7} {'-':>5}"
            print(f"{label:<32} {shape:<22} {ms * 1e3:9.1f} {tf:8.1f} {pct} {dg}  {check}", flush=True)
        del args, want
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--impls", nargs="*", default=None, help="default: every available one")
    p.add_argument("--configs", action="store_true", help="also time TILELANG_CONFIGS")
    p.add_argument(
        "--tiles", nargs="*", default=None, help="TileLang tiles to time instead of TILELANG_CONFIGS"
    )
    p.add_argument("--shapes", nargs="*", default=None, help="M:N:K, e.g. 4096:2112:7168 (default: SHAPES)")
    p.add_argument("--no-graph", action="store_true", help="time plain launches, not CUDA graph replays")
    p.add_argument("--compile-workers", type=int, default=12, help="0: compile lazily in this process")
    p.add_argument("--compile-only", action="store_true", help="fill TileLang's compile cache, time nothing")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("no CUDA device; use --device cpu for a smoke test of the references\n")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}  torch {torch.__version__}", flush=True)
    shapes = [tuple(int(v) for v in s.split(":")) for s in a.shapes] if a.shapes else None
    tiles = [TileConfig.parse(t) for t in a.tiles] if a.tiles else None
    if a.compile_only:
        prewarm(tilelang_keys(shapes or SHAPES, device, a.configs, tiles), max(1, a.compile_workers))
        return 0
    peak = fp8_ceiling(device, small=device.type != "cuda")
    failures = run(
        device, shapes, a.impls, a.configs, not a.no_graph, peak, a.compile_workers, tiles=tiles
    )  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
