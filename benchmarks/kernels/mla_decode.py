"""MLA decode against FlashMLA (its H200 figures, or FlashMLA itself in the same run), in one command that fits one device call:

    python -m benchmarks.kernels.mla_decode [--impls tilelang triton flash_mla] [--no-check] [--no-bench]

1. compiles the TileLang kernels it will use in parallel worker processes (TileLang's disk cache then
   serves the main process), so compilation costs one kernel's time, not ten;
2. checks every implementation against the reference: h_q 16 / 128, ragged lengths (0, 1, 63, 64, 65,
   not multiples of the page), fixed split counts 1 / 7 / 64 and the host's choice, bf16 and fp16,
   through the op signature (per-token req_to_token) and the block-table entry point (page 64);
3. times the target points (h_q 128 at batch 64 / 128, h_q 16 at batch 128; contexts 1K..32K) through
   both entry points: `op` = `mla_decode(q, pool, req_to_token, ...)`, the engine's call, and `table`
   = `mla_decode_paged(..., block_table, page=64)`, FlashMLA's inputs.

Page layouts (`--pages`): `shuffled` scatters every row's pages over the pool (the default, as a
serving pool fragments); `contiguous` gives rows consecutive pages, the block table FlashMLA's own
benchmark builds for its reference figures. On the H200 the two time within 1% of each other.
`l2`, a diagnostic, has every row read row 0's pages through the block table, so the tiles stay in L2:
set against `shuffled` it gives the DRAM share of the kernel's time.

`--impls flash_mla` (where DeepSeek's `flash_mla` is importable, e.g. built from source) times FlashMLA
itself beside ours, each point's runs round-robin: `table` calls it on the case's block table with its
scheduler metadata built once per case (its own benchmark's way), `op` through the registry's adapter
(the metadata built in every call). Every line then also reads as a percentage of FlashMLA's time at
the same point and timer in this run (`vs here`), which machine-to-machine clock differences do not
move as they move the ratio to the fixed FLASH_MLA figures. FlashMLA launches with programmatic
dependent launch (its kernel overlaps the previous one's tail): under `do_bench`, whose previous kernel
is the cache-clearing write, some of its medians read up to 4x its graph median (docs/PERF.md, "MLA
decode against FlashMLA"), so compare against it under `graph`.

Accounting as FlashMLA's and TileLang's benchmarks: FLOPs = 2 sum(seqlen) h_q (576 + 512), bytes = KV +
Q + O. Each check or point runs under its own try, so one failure does not hide the rest.

Timers (`--timers`, each a column of runs, round-robin with the rest):
- `graph`: the median of CUDA-graph replays (`timing.bench_ms`, triton's do_bench_cudagraph): about
  100 ms of back-to-back launches, so the GPU runs at its power-capped clock under sustained load.
- `do_bench`: the median of triton's do_bench, the method FlashMLA's reference figures were measured
  with: every launch follows a 256 MB cache-clearing write, so L2 starts cold, and the GPU is not under
  continuous tensor-core load. Only this timer compares like with like against FLASH_MLA."""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import sys
import time
import weakref
from concurrent.futures import ProcessPoolExecutor

import torch

from benchmarks.kernels.timing import bench_ms, ceilings, round_robin_medians
from runtime.gpu.kernels.mla_decode import reference
from runtime.gpu.kernels.mla_decode.testing import mla_case
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio

R, DPE = 512, 64
# FlashMLA's published H200 figures for its dense decode, median of triton do_bench: FLOP/s at h_q 128,
# bytes/s at h_q 16
FLASH_MLA = {
    (128, 64, 1024): 446e12, (128, 64, 4096): 578e12, (128, 64, 16384): 570e12, (128, 64, 32768): 588e12,
    (128, 128, 1024): 469e12, (128, 128, 4096): 575e12, (128, 128, 16384): 537e12, (128, 128, 32768): 525e12,
    (16, 128, 4096): 3.56e12, (16, 128, 32768): 4.11e12,
}  # fmt: skip
POINTS = [(128, 64, c) for c in (1024, 4096, 16384, 32768)] + [
    (128, 128, c) for c in (1024, 4096, 16384, 32768)
]
POINTS += [(16, 128, c) for c in (1024, 4096, 16384, 32768)]
SCALE = (R + DPE) ** -0.5
CHECKS = [  # lens, h_q, dtype, num_splits (None: the host's choice), entry point
    ([1, 63, 64, 65, 1000, 3000, 0, 129], 128, torch.bfloat16, None, "op"),
    ([1, 63, 64, 65, 1000, 3000, 0, 129], 128, torch.bfloat16, 1, "op"),
    ([0, 63, 64, 65, 3000], 128, torch.bfloat16, 7, "op"),
    ([0, 63, 64, 65, 3000], 128, torch.bfloat16, 64, "op"),
    ([300, 1, 0, 129, 5000, 64], 16, torch.bfloat16, None, "op"),
    ([300, 1, 0, 129, 5000, 64], 16, torch.bfloat16, 1, "op"),
    ([300, 1, 0, 129], 16, torch.float16, None, "op"),
    ([8192] + [8000 - 97 * i for i in range(63)], 128, torch.bfloat16, None, "op"),
    ([1, 63, 64, 65, 1000, 3000, 0, 129], 128, torch.bfloat16, 1, "table"),
    ([1, 63, 64, 65, 1000, 3000, 0, 129], 128, torch.bfloat16, None, "table"),
    ([300, 1, 0, 129, 5000, 64], 16, torch.bfloat16, 1, "table"),
]


def _tl_keys() -> list[tuple]:
    """The TileLang kernels the checks and points will use (`tilelang_kernel.kernel`'s arguments): bf16 at
    page 1 (the op) and 64 (a block table), with and without splits, and fp16 at page 1 (a check); and
    the verify rows' variants (q_len 2, 4, 8) that the GPU tests run."""
    from runtime.gpu.kernels.common import LOG2E

    keys = set()
    for hq, dtype, table_dtype, page in (
        (128, "bfloat16", "int64", 1), (16, "bfloat16", "int64", 1), (16, "float16", "int64", 1),
        (128, "bfloat16", "int32", 64), (16, "bfloat16", "int32", 64),
    ):  # fmt: skip
        for split in (False, True):
            keys.add((hq, 1, R, DPE, dtype, table_dtype, "int64", "int64", page, split, float(SCALE * LOG2E)))
    for q_len in (2, 4, 8):  # verify rows (tests/gpu/test_kernels_mla.py)
        for hq in (16, 128):
            for table_dtype, page in (("int64", 1), ("int32", 64)):
                for split in (False, True):
                    keys.add((hq, q_len, R, DPE, "bfloat16", table_dtype, "int64", "int64", page, split,
                              float(SCALE * LOG2E)))  # fmt: skip
    return sorted(keys)


def _compile_one(key: tuple) -> str:
    t0 = time.perf_counter()
    try:
        from runtime.gpu.kernels.mla_decode import tilelang_kernel

        tilelang_kernel.kernel(*key)
    except Exception as e:  # noqa: BLE001 - reported, the main process will hit it again
        return f"{key}: {type(e).__name__}: {str(e).splitlines()[-1][:200] if str(e) else ''}"
    return f"{key[0]:>3} {key[4]} {key[5]} page {key[8]} split {key[9]}: {time.perf_counter() - t0:.0f} s"


def prewarm(workers: int) -> None:
    keys = _tl_keys()
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(keys)), mp_context=ctx) as pool:
        for line in pool.map(_compile_one, keys):
            print(f"# compiled {line}", flush=True)
    print(f"# {len(keys)} TileLang kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def _impl(name: str):
    """(op-signature fn, block-table fn of (case, num_splits)) of an implementation."""
    if name == "tilelang":
        from runtime.gpu.kernels.mla_decode import tilelang as m
    elif name == "triton":
        from runtime.gpu.kernels.mla_decode import triton as m
    elif name == "flash_mla":
        from runtime.gpu.kernels.mla_decode import flash_mla as m

        return m.mla_decode, _flash_mla_table
    else:
        raise ValueError(name)
    return m.mla_decode, functools.partial(_paged_table, m.mla_decode_paged)


def _paged_table(paged, c, num_splits=None):
    """Our launcher on the case's block table (page 64). The case's rows tensor, not one built here: a
    call timed with it would time an arange kernel too."""
    return paged(
        c.q, c.pool[:, 0], c.block_table, c.block_rows, c.seq_lens, c.scale, R, c.page_size, num_splits
    )


_flash_meta: list = [None, None]  # (weak reference to a case, FlashMLA's scheduler metadata for it)


def _flash_mla_table(c, num_splits=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA itself on the case's block table, as its own benchmark calls it: the scheduler metadata
    is built once per case, outside the timed call (an engine builds it once per step for every layer).
    The split count is FlashMLA's own (the metadata), whatever `num_splits` says."""
    from runtime.gpu.kernels.mla_decode import flash_mla as fm

    ref, meta = _flash_meta
    if ref is None or ref() is not c:
        meta = fm.scheduler_metadata(c.cache_seqlens, c.q.shape[1], 1)
        _flash_meta[:] = [weakref.ref(c), meta]
    out, lse = fm.call(
        c.q.unsqueeze(1), c.k_cache(), c.block_table, c.cache_seqlens, R, *meta, c.scale, False
    )
    return out[:, 0], lse[:, :, 0]


def _run(name: str, entry: str, c, num_splits=None):
    op, table = _impl(name)
    if entry == "op":
        return op(*c.args(), num_splits=num_splits, return_lse=True)
    return table(c, num_splits)


def check(names: list[str]) -> int:
    failures = 0
    for lens, hq, dtype, splits, entry in CHECKS:
        c = mla_case(lens, hq, dtype, "cuda", page_size=64, seed=len(lens) + hq)
        want, want_lse = reference.mla_decode(*c.args(), return_lse=True)
        fin = want_lse.isfinite()
        for name in names:
            label = f"{name:<8} {entry:<5} h={hq:<3} {str(dtype)[6:]:<8} splits={splits!s:<4} B={len(lens)} max={max(lens)}"
            try:
                got, lse = _run(name, entry, c, splits)
                torch.cuda.synchronize()
                ratio = close_ratio(got, want, *TOLERANCE[dtype])
                lse_ok = torch.equal(lse.isfinite(), fin)
                lse_ratio = close_ratio(lse[fin], want_lse[fin], 1e-3, 1e-3) if lse_ok else float("inf")
                ok = ratio <= 1.0 and lse_ratio <= 1.0
                failures += not ok
                print(
                    f"check {label}: {'ok  ' if ok else 'FAIL'} out {ratio:.3f}x tol, lse {lse_ratio:.3f}x tol"
                )
            except Exception as e:  # noqa: BLE001 - keep going, report
                failures += 1
                print(f"check {label}: ERROR {type(e).__name__}: {str(e)[:300]}")
        del c
    print(f"# checks: {failures} failed")
    return failures


def bench(
    names: list[str],
    entries: list[str],
    points: list[tuple],
    rounds: int = 1,
    timers: tuple[str, ...] = ("graph",),
    layouts: tuple[str, ...] = ("shuffled",),
) -> None:
    """Time every (implementation, entry, timer) at every point and page layout: a point's runs are
    timed `rounds` times in `timing.round_robin` order and report their medians. Ours run the seesaw
    schedule on the block table (pages of 64) and the three-role one on the per-token table."""

    print(
        f"{'impl':<8} {'entry':<5} {'timer':<8} {'pages':<10} {'h_q':>3} {'B':>4} {'ctx':>6} {'us':>8} {'TFLOP/s':>8} {'TB/s':>6} {'FlashMLA':>10} {'ratio':>6} {'vs here':>8}"
    )
    for (hq, batch, ctx), layout in [(p, lay) for p in points for lay in layouts]:
        try:
            c = mla_case(
                [ctx] * batch, hq, torch.bfloat16, "cuda", 64, R, DPE, nan_fill=False,
                shuffle_pages=layout != "contiguous",
            )  # fmt: skip
            if layout == "l2":  # every row reads row 0's pages (the table entry only; a diagnostic)
                c.block_table[:] = c.block_table[0].clone()
        except Exception as e:  # noqa: BLE001
            print(f"h={hq} B={batch} ctx={ctx}: case ERROR {type(e).__name__}: {e}")
            continue
        flops = 2 * c.kv_tokens * hq * (2 * R + DPE)
        nbytes = (c.kv_tokens * (R + DPE) + batch * hq * (2 * R + DPE)) * c.pool.element_size()
        anchor = FLASH_MLA.get((hq, batch, ctx))
        lines = [
            (name, entry, timer)
            for name in names
            for entry in entries
            for timer in timers
            if not (name == "triton" and entry == "table")
            and (layout != "l2" or entry == "table")  # l2 rewires the block table alone
        ]
        if not lines:
            continue
        medians = round_robin_medians([functools.partial(_time, line, c) for line in lines], rounds)
        # FlashMLA timed in this run (when installed): each line's figure against it, same timer
        here = {
            timer: ms
            for (name, entry, timer), ms in zip(lines, medians, strict=True)
            if name == "flash_mla" and entry == "table" and not isinstance(ms, Exception)
        }
        for (name, entry, timer), ms in zip(lines, medians, strict=True):
            head = f"{name:<8} {entry:<5} {timer:<8} {layout:<10} {hq:>3} {batch:>4} {ctx:>6}"
            if isinstance(ms, Exception):
                print(f"{head} ERROR {type(ms).__name__}: {str(ms)[:300]}")
                continue
            fl, bw = flops / (ms * 1e-3), nbytes / (ms * 1e-3)
            mine = bw if hq == 16 else fl
            ref = (
                ""
                if anchor is None
                else (f"{anchor / 1e12:.2f} TB/s" if hq == 16 else f"{anchor / 1e12:.0f} TF")
            )
            ratio = "" if anchor is None else f"{100 * mine / anchor:.0f}%"
            vs_here = f"{100 * here[timer] / ms:.1f}%" if timer in here else ""
            print(
                f"{head} {ms * 1e3:8.1f} {fl / 1e12:8.1f} {bw / 1e12:6.2f} {ref:>10} {ratio:>6} {vs_here:>8}",
                flush=True,
            )
        del c
        torch.cuda.empty_cache()


def _time(line: tuple, c) -> float:
    """One timing of a point's line (impl, entry, timer), in ms."""
    name, entry, timer = line
    _run(name, entry, c)  # compile / warm up outside the graph
    return bench_ms(lambda: _run(name, entry, c), c.q.device, graph=timer == "graph")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", nargs="*", default=["tilelang"])
    p.add_argument("--entries", nargs="*", default=["op", "table"])
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--compile-workers", type=int, default=12, help="0: compile lazily in this process")
    p.add_argument(
        "--points", nargs="*", default=None, help="h_q:batch:context, e.g. 128:64:4096 (default: all)"
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="time each point's runs round-robin this often (median)"
    )
    p.add_argument(
        "--timers", nargs="*", choices=("graph", "do_bench"), default=["graph"],
        help="graph: CUDA-graph replays under sustained load; do_bench: FlashMLA's method (module doc)",
    )  # fmt: skip
    p.add_argument(
        "--pages", nargs="*", choices=("shuffled", "contiguous", "l2"), default=["shuffled"],
        help="shuffled: every row's pages scattered over the pool; contiguous: consecutive pages in row "
        "order, the block table of FlashMLA's own benchmark (its reference figures' input); l2 (a "
        "diagnostic, block-table entry only): every row reads row 0's pages, so the tiles stay in L2",
    )  # fmt: skip
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("needs a CUDA device\n")
        return 2
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    copy_bw, peak = ceilings(torch.device("cuda"), small=False)
    print(f"# this machine: device copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    points = POINTS if a.points is None else [tuple(int(x) for x in p.split(":")) for p in a.points]
    if "tilelang" in a.impls and a.compile_workers > 0:
        prewarm(a.compile_workers)
    failures = 0 if a.no_check else check(a.impls)
    if not a.no_bench:
        bench(a.impls, a.entries, points, a.rounds, tuple(a.timers), tuple(a.pages))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
