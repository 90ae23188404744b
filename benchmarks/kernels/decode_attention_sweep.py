"""Sweep the Triton decode kernel's block size, warps, pipeline stages and split count on CUDA, each
configuration checked against the reference: `python -m benchmarks.kernels.decode_attention_sweep`.

Small batches are launch-bound under do_bench (about 10 us to issue a launch on the device host), but a
decode step replays a CUDA graph: `--graph` times 32 back-to-back calls (one per Llama-8B layer)
captured in one graph, the cost the step actually pays. `--kv-dtype fp8 --tilelang` times the TileLang
stage 1 (`decode_attention/tilelang.py`) next to the Triton kernel's default launch."""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton

from benchmarks.kernels.timing import round_robin_medians
from runtime.gpu.kernels.common import choose_num_splits
from runtime.gpu.kernels.decode_attention import triton as kernel
from runtime.gpu.kernels.decode_attention.reference import decode_attention as reference
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio, paged_case

SHAPES = [
    (256, 1024, (1, 2)),
    (64, 4096, (1, 2, 4)),
]  # (B, context, splits); batch 1: --graph --batch-sizes 1


GRAPH_CALLS = 32


def graph_time_ms(fn) -> float:
    """Per-call time of `fn` replayed GRAPH_CALLS times inside one CUDA graph."""
    fn()  # compile outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                fn()
    return triton.testing.do_bench(graph.replay, rep=60) / GRAPH_CALLS


def print_compiled(fp8: bool) -> None:
    """Shared memory, registers and the async copies / waits of stage 1's loop as compiled for the
    default launch: how many K/V buffers Triton's pipeliner keeps, and how many programs fit an SM."""
    import re

    case = paged_case(
        [1023] * 8, [1] * 8, 32, 8, 128, torch.bfloat16, "cuda", q_strided=False,
        kv_dtype=torch.float8_e4m3fn if fp8 else None,
    )  # fmt: skip
    q, k_pool, v_pool, r2t, rows, seq_lens, scale = case.decode_args()[:7]
    compiled = kernel.stage1(q, k_pool, v_pool, r2t, rows, seq_lens, scale, 1)[2]
    size = k_pool.element_size()
    print(
        f"LAUNCH {kernel.LAUNCH[size]} prefetch={kernel.PREFETCH_SLOTS[size]}: shared "
        f"{compiled.metadata.shared} B, {compiled.n_regs} registers, {compiled.n_spills} spills"
    )
    for line in compiled.asm["ttgir"].splitlines():
        if re.search(r"async_copy_global_to_local|async_wait|local_alloc", line):
            print("  " + line.strip()[:160])


TILELANG_SHAPES = [(256, 1024), (256, 1536), (64, 4096), (128, 2048), (32, 8192), (8, 1024)]


def sweep_tilelang(page_size: int, rounds: int = 1) -> None:
    """fp8 pools: the TileLang stage 1 at its best split count, and the Triton kernel's default launch on
    the same case (its best split count), per layer of the Llama-3.1-8B shape. A case's runs are timed
    `rounds` times in `timing.round_robin` order and keep their medians."""
    from runtime.gpu.kernels.decode_attention import tilelang

    for batch, ctx in TILELANG_SHAPES:
        case = paged_case(
            [ctx - 1] * batch, [1] * batch, 32, 8, 128, torch.bfloat16, "cuda", q_strided=True,
            kv_dtype=torch.float8_e4m3fn, page_size=page_size,
        )  # fmt: skip
        args = case.decode_args()
        want = reference(*args).float()
        kv_gb = 2 * batch * ctx * 8 * 128 / 1e9
        splits = sorted({1, 2, 4, 8, choose_num_splits(batch, 8, ctx, args[0].device)})
        runs = []  # (impl, splits, fn, error / tolerance), each checked once
        for sp in splits:
            fns = [
                ("triton", functools.partial(kernel.decode_attention, *args, num_splits=sp)),
                ("tilelang", functools.partial(_tilelang_call, tilelang, args, sp, page_size)),
            ]
            for impl, fn in fns:
                runs.append((impl, sp, fn, close_ratio(fn().float(), want, *TOLERANCE[torch.bfloat16])))
        medians = round_robin_medians(
            [functools.partial(triton.testing.do_bench, fn, rep=40) for _, _, fn, _ in runs], rounds
        )
        for ms in medians:
            if isinstance(ms, Exception):
                raise ms
        best = {}
        for ms, (impl, sp, _, err) in zip(medians, runs, strict=True):
            best[impl] = min(best.get(impl, (ms, impl, sp, err)), (ms, impl, sp, err))
        for ms, impl, sp, err in sorted(best.values()):
            print(
                f"B={batch} ctx={ctx} {impl} splits={sp}: {ms * 1e3:.1f} us, "
                f"{kv_gb / ms:.2f} TB/s of fp8 KV, error / bf16 tolerance {err:.2f}"
            )


def _tilelang_call(tilelang, args, num_splits: int, page_size: int) -> torch.Tensor:
    """The TileLang stage 1, then Triton's stage 2 (the merge runs at one split too)."""
    mid_o, mid_lse = tilelang.stage1(*args, num_splits, page_size=page_size)
    return kernel.merge_splits(mid_o, mid_lse, args[5], torch.empty_like(args[0]), tilelang.BLOCK_N)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--graph", action="store_true", help="time inside a CUDA graph (small batches)")
    parser.add_argument("--batch-sizes", default=None, help="e.g. 1,8: only these shapes")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="KV pool dtype")
    parser.add_argument("--prefetch", default="0,1", help="PREFETCH_SLOTS values to time")
    parser.add_argument(
        "--page-size", type=int, default=1, help="the pool's pages are shuffled, not the tokens"
    )
    parser.add_argument(
        "--compiled", action="store_true", help="print what stage 1 compiles to (default launch), then exit"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--tilelang: time each case's runs round-robin this often (median)",
    )
    parser.add_argument(
        "--tilelang",
        action="store_true",
        help="fp8: time the TileLang stage 1 against Triton's default launch",
    )
    args_cli = parser.parse_args()
    if args_cli.compiled:
        return print_compiled(args_cli.kv_dtype == "fp8")
    if args_cli.tilelang:
        return sweep_tilelang(args_cli.page_size, args_cli.rounds)
    shapes = SHAPES
    if args_cli.batch_sizes:
        wanted = {int(b) for b in args_cli.batch_sizes.split(",")}
        shapes = [(b, 1024, (2, 4, 8, 16, 32, 64)) for b in sorted(wanted)]
    bench = graph_time_ms if args_cli.graph else (lambda fn: triton.testing.do_bench(fn, rep=40))
    fp8 = args_cli.kv_dtype == "fp8"
    size = 1 if fp8 else 2
    defaults = kernel.LAUNCH[size]
    default_prefetch = kernel.PREFETCH_SLOTS[size]
    for batch, ctx, splits in shapes:
        kv_dtype = torch.float8_e4m3fn if fp8 else None
        case = paged_case(
            [ctx - 1] * batch,
            [1] * batch,
            32,
            8,
            128,
            torch.bfloat16,
            "cuda",
            q_strided=False,
            kv_dtype=kv_dtype,
            page_size=args_cli.page_size,
        )
        args = case.decode_args()
        want = reference(*args).float()
        kv_bytes = 2 * batch * ctx * 8 * 128 * size
        results = []
        grid = ((32, 64), (2, 4), (1, 2, 4)) if args_cli.graph else ((32, 64, 128), (4, 8), (2, 3, 4))
        if fp8 and not args_cli.graph:  # with prefetch, stages - 1 K/V buffers (--compiled shows them)
            grid = ((64, 128, 256), (4, 8), (2, 3, 4, 5))
        prefetches = [bool(int(v)) for v in args_cli.prefetch.split(",")]
        for (bn, warps, stages), sp, prefetch in itertools.product(
            itertools.product(*grid), splits, prefetches
        ):
            kernel.LAUNCH[size] = (bn, warps, stages)
            kernel.PREFETCH_SLOTS[size] = prefetch
            try:
                got = kernel.decode_attention(*args, num_splits=sp)
            except triton.runtime.errors.OutOfResources:  # e.g. BLOCK_N 256 x 5 stages of K/V
                continue
            err = close_ratio(got.float(), want, *TOLERANCE[torch.bfloat16])
            ms = bench(lambda sp=sp, args=args: kernel.decode_attention(*args, num_splits=sp))
            results.append((ms, bn, warps, stages, sp, prefetch, err))
        now = [r for r in results if r[1:4] == defaults and r[5] == default_prefetch]
        best_per_prefetch = [min(r for r in results if r[5] == v) for v in prefetches]
        for ms, bn, warps, stages, sp, prefetch, err in sorted(results)[:3] + best_per_prefetch + now[:1]:
            print(
                f"B={batch} ctx={ctx} page={args_cli.page_size} BLOCK_N={bn} warps={warps} stages={stages} "
                f"splits={sp} prefetch={int(prefetch)}{' fp8' if fp8 else ''}: "
                f"{ms * 1e3:.1f} us, {kv_bytes / ms / 1e6:.0f} GB/s, error / bf16 tolerance {err:.2f}"
            )
    kernel.LAUNCH[size] = defaults
    kernel.PREFETCH_SLOTS[size] = default_prefetch


if __name__ == "__main__":
    main()
