"""FP8 block-scaled GEMM (1x128 activation scales, 128x128 weight scales) in TileLang, DeepGEMM's way.

Why a second kernel next to `triton.py`: Hopper runs FP8 at full rate only through wgmma fed from
TMA-loaded shared memory by a producer warpgroup, and DeepGEMM's "promotion" needs the fp8 tensor-core
sums kept apart from the running total. Here each CTA owns a BLOCK_M x BLOCK_N output tile and walks K
one 128-wide scale group per step (T.Pipelined: TileLang adds a TMA producer warpgroup and
`num_stages` shared buffers with mbarriers):

- `acc` = A_tile @ B_tile^T by wgmma, float32, cleared at each group (clear_accum: the first wgmma
  overwrites). The fp8 tensor cores keep only ~14 bits of the float32 sum, so it never spans more
  than 128 products.
- promotion, on CUDA cores: total += acc * (x_scale[row, g] * w_scale[n_block, g]). The row scales
  are read from global memory (L2) into registers before the wgmma is issued, so their latency
  hides under it.

The consumer threads are one or two warpgroups (`threads` 128 / 256); with BLOCK_M = 128 and two,
each owns 64 rows x BLOCK_N (wgmma m64nNk32, DeepGEMM's split), so acc and total are 64 registers a
thread each at BLOCK_N = 128. Large M goes to `program_persistent` instead: the same tile with the
warp roles written out, one CTA per SM, and a second accumulator so each promotion runs under the
next group's wgmma (in the pipelined kernel the tensor cores idle through every promotion). CTAs are rasterized in panels (T.use_swizzle) so concurrently running
tiles share A and B rows in L2. Small M: few output tiles, so the K groups are split over `split_k`
CTAs that write float32 partials, summed afterwards (as in `triton.py`).

Rows past M and columns past N: the TMA loads zero-fill them, their scales read as 0, and the store
skips them (the TMA store clips; where N's rows are not 16-byte aligned, TileLang emits guarded
stores). K must be a multiple of 128 (TMA row alignment, whole groups); other shapes,
non-contiguous inputs and dtypes the kernel is not built for go to the Triton kernel.

Kernels compile on first use per (N, K, out dtype, config); M is dynamic."""

# No `from __future__ import annotations`: TileLang reads the prim_func parameter annotations
# (T.Tensor shapes built from local variables) at decoration time.
import functools
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from runtime.gpu.kernels.common import num_sms
from runtime.gpu.kernels.fp8_gemm.reference import FP8, GROUP

_TL_OUT = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 128  # 64 or 128: 64 rows per consumer warpgroup along M at most
    block_n: int = 128  # divides 128, so one weight-scale block covers the tile's columns
    num_stages: int = 4
    threads: int = 256  # consumer threads (TileLang adds a 128-thread TMA producer warpgroup)
    split_k: int = 1  # CTAs per output tile along K; must divide K / 128
    panel: int = 10  # rasterization panel width in M tiles (T.use_swizzle)
    # "" = the T.Pipelined kernel (`program`); "pd" = persistent and warp-specialized, one CTA per SM
    # walking output tiles, with the promotion under the next wgmma (`program_persistent`).
    schedule: str = ""

    def __post_init__(self) -> None:
        assert self.block_m in (64, 128) and self.block_n in (16, 32, 64, 128), self
        assert self.threads in (128, 256) and self.num_stages >= 1 and self.split_k >= 1, self
        assert self.schedule in ("", "pd"), self
        assert not self.schedule or (self.block_m, self.threads, self.split_k) == (128, 256, 1), self

    def label(self) -> str:
        panel = f"p{self.panel}" if self.panel != 10 else ""
        sched = f"-{self.schedule}" if self.schedule else ""
        return f"{self.block_m}x{self.block_n}s{self.num_stages}t{self.threads}k{self.split_k}{panel}{sched}"

    @staticmethod
    def parse(label: str) -> "TileConfig":
        """The inverse of `label`, e.g. "128x128s4t256k1", "128x128s4t256k1p16" or "128x128s4t256k1-pd"."""
        import re

        got = re.fullmatch(r"(\d+)x(\d+)s(\d+)t(\d+)k(\d+)(?:p(\d+))?(?:-(pd))?", label)
        assert got, f"not a tile label: {label!r}"
        bm, bn, st, th, sk, panel, sched = got.groups()
        return TileConfig(int(bm), int(bn), int(st), int(th), int(sk), int(panel or 10), sched or "")


def choose_config(m: int, n: int, k: int, device: torch.device) -> TileConfig:
    """From `python -m benchmarks.kernels.fp8_gemm --configs` on the H200 (docs/PERF.md): M > 128
    takes DeepGEMM's 128 x 128 tile on two math warpgroups, 4 stages, at every measured shape (64-wide N
    tiles fill the last wave better at N = 2112 but ran 20% slower), in the persistent kernel that
    promotes under the next wgmma ("pd": 4-8% faster at M = 4096) when K has an even number of 128-wide
    groups, else in the pipelined one. M <= 128: a 64-row tile on one
    warpgroup, 128 then 64 columns wide, the first that fills >= 80% of the SMs without splitting K;
    when neither does, 64 x 64 with the fewest K splits that do (split-K costs a float32 pass)."""
    sms = num_sms(device)
    if m > 128:
        return TileConfig(schedule="pd") if (k // GROUP) % 2 == 0 else TileConfig()
    for cfg in (TileConfig(64, 128, 4, 128), TileConfig(64, 64, 4, 128)):
        if -(-m // cfg.block_m) * -(-n // cfg.block_n) >= 0.8 * sms:
            return cfg
    return with_split(TileConfig(64, 64, 4, 128), m, n, k, sms)


def with_split(cfg: TileConfig, m: int, n: int, k: int, sms: int) -> TileConfig:
    """`cfg` with the fewest K splits (dividing K / 128, each >= 4 groups) whose CTAs fill >= 80% of the
    SMs; the most such splits when none does."""
    groups = k // GROUP
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    cands = [s for s in range(1, 17) if groups % s == 0 and groups // s >= 4] or [1]
    split = next((s for s in cands if tiles * s >= 0.8 * sms), cands[-1])
    return replace(cfg, split_k=split)


def supported(x_fp8: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> bool:
    k = x_fp8.shape[1]
    return (
        x_fp8.dtype == FP8
        and w.dtype == FP8
        and k % GROUP == 0
        and k > 0
        and out_dtype in _TL_OUT
        and x_fp8.stride(1) == 1
        and w.stride(1) == 1
    )


def program(n: int, k: int, out_dtype: str, cfg: TileConfig):
    """The TileLang prim_func for (N, K, out dtype, config); M is dynamic. Split K > 1: the output is a
    float32 partial [split, M, N]."""
    import tilelang.language as T

    assert k % GROUP == 0 and n > 0, (n, k)
    groups = k // GROUP
    assert groups % cfg.split_k == 0, (groups, cfg)
    per_split = groups // cfg.split_k
    bm, bn, split = cfg.block_m, cfg.block_n, cfg.split_k
    fp8, accum = "float8_e4m3", "float32"
    # two warpgroups over 64 rows each (DeepGEMM), or over the columns when the tile has 64 rows
    full_rows = bm >= 64 * (cfg.threads // 128)
    policy = T.GemmWarpPolicy.FullRow if full_rows else T.GemmWarpPolicy.FullCol
    m = T.dynamic("m")

    @T.macro
    def tile(X, XS, W, WS, total, m0, n0, bz):
        A = T.alloc_shared((bm, GROUP), fp8)
        B = T.alloc_shared((bn, GROUP), fp8)
        acc = T.alloc_fragment((bm, bn), accum)
        scale = T.alloc_fragment((bm,), accum)
        T.clear(total)
        for i in T.Pipelined(per_split, num_stages=cfg.num_stages):
            g = bz * per_split + i
            T.copy(X[m0, g * GROUP], A)
            T.copy(W[n0, g * GROUP], B)
            w_s = WS[n0 // GROUP, g]
            for r in T.Parallel(bm):  # rows past M (zero-filled by TMA) get scale 0
                scale[r] = T.if_then_else(m0 + r < m, XS[m0 + r, g], 0) * w_s
            T.gemm(A, B, acc, transpose_B=True, policy=policy, clear_accum=True)
            for r, c in T.Parallel(bm, bn):  # promotion
                total[r, c] += acc[r, c] * scale[r]

    if split == 1:

        @T.prim_func
        def fp8_block_gemm(
            X: T.Tensor((m, k), fp8),
            XS: T.Tensor((m, groups), accum),
            W: T.Tensor((n, k), fp8),
            WS: T.Tensor((T.ceildiv(n, GROUP), groups), accum),
            C: T.Tensor((m, n), out_dtype),
        ):
            with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=cfg.threads) as (bx, by):
                C_s = T.alloc_shared((bm, bn), out_dtype)
                total = T.alloc_fragment((bm, bn), accum)
                T.use_swizzle(panel_size=cfg.panel)
                tile(X, XS, W, WS, total, by * bm, bx * bn, 0)
                T.copy(total, C_s)
                T.copy(C_s, C[by * bm, bx * bn])  # skips rows past M, columns past N

        return fp8_block_gemm

    @T.prim_func
    def fp8_block_gemm_split(
        X: T.Tensor((m, k), fp8),
        XS: T.Tensor((m, groups), accum),
        W: T.Tensor((n, k), fp8),
        WS: T.Tensor((T.ceildiv(n, GROUP), groups), accum),
        P: T.Tensor((split, m, n), accum),
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), split, threads=cfg.threads) as (bx, by, bz):
            total = T.alloc_fragment((bm, bn), accum)
            T.use_swizzle(panel_size=cfg.panel)
            tile(X, XS, W, WS, total, by * bm, bx * bn, bz)
            for r, c in T.Parallel(bm, bn):
                if by * bm + r < m and bx * bn + c < n:
                    P[bz, by * bm + r, bx * bn + c] = total[r, c]

    return fp8_block_gemm_split


def program_persistent(n: int, k: int, out_dtype: str, cfg: TileConfig, ctas: int):
    """The persistent, warp-specialized kernel: `ctas` CTAs (one per SM) walk the output tiles in
    rasterized panels; a CTA's TMA producer loads the next tile's first K groups while its math
    warpgroups still promote and store the last one.

    Threads 0-127 and 128-255 are the math warpgroups (rows 0-63 and 64-127 of the tile), 256-383 the
    producer. Each math warpgroup keeps two accumulators and promotes group g while group g + 1's wgmma
    runs (K must hold an even number of groups): 5-11% faster than the pipelined kernel at M = 4096 on
    the H200 (docs/PERF.md). Promoting after each wgmma instead (schedule "p", timed and removed) left
    the tensor cores idle during every promotion, a quarter of the wgmma's time (128 products per
    promoted sum, fp8 MMA at 32x the FFMA rate), and was no faster than the pipelined kernel."""
    import tilelang.language as T

    assert k % GROUP == 0 and n > 0 and cfg.schedule, (n, k, cfg)
    groups = k // GROUP
    bm, bn, stages, panel = cfg.block_m, cfg.block_n, cfg.num_stages, cfg.panel
    rows = bm // 2  # per math warpgroup
    fp8, accum = "float8_e4m3", "float32"
    assert groups % 2 == 0, (k, cfg)
    tiles_n = -(-n // bn)
    # a TMA store needs 16-byte aligned rows in C
    tma_store = n * {"bfloat16": 2, "float16": 2, "float32": 4}[out_dtype] % 16 == 0
    m = T.dynamic("m")

    @T.macro
    def locate(at, t, tiles_m):
        """at = tile t's (first row, first column): panels of `panel` M tiles walked column by column,
        so the CTAs running at once share A rows and B rows in L2. Kept in registers: recomputing the
        divisions at every use would cost more than the promotion."""
        per_panel = panel * tiles_n
        first = (t // per_panel) * panel
        height = T.min(tiles_m - first, panel)
        local = t % per_panel
        at[0] = (first + local % height) * bm
        at[1] = (local // height) * bn

    @T.macro
    def produce(X, W, A, B, full, empty, at, tiles_m, my_tiles, cid):
        for j in T.serial(my_tiles):
            locate(at, cid + j * ctas, tiles_m)
            m0, n0 = at[0], at[1]
            for g in T.serial(groups):
                it = j * groups + g
                s = it % stages
                T.barrier_wait(empty[s], ((it // stages) & 1) ^ 1)
                T.tma_copy(X[m0 : m0 + bm, g * GROUP : (g + 1) * GROUP], A[s, :, :], barrier=full[s])
                T.tma_copy(W[n0 : n0 + bn, g * GROUP : (g + 1) * GROUP], B[s, :, :], barrier=full[s])
                T.barrier_arrive(full[s])

    @T.macro
    def load_scales(XS, WS, scale, m0, n0, r0, g):
        w_s = WS[n0 // GROUP, g]
        for r in T.Parallel(rows):  # rows past M (zero-filled by TMA) get scale 0
            scale[r] = T.if_then_else(m0 + r0 + r < m, XS[m0 + r0 + r, g], 0) * w_s

    @T.macro
    def issue(A, B, full, acc, r0, it):
        s = it % stages
        T.barrier_wait(full[s], (it // stages) & 1)
        T.wgmma_gemm(A[s, r0 : r0 + rows, :], B[s, :, :], acc, transpose_B=True, clear_accum=True)

    @T.macro
    def promote(total, acc, scale):
        for r, c in T.Parallel(rows, bn):
            total[r, c] += acc[r, c] * scale[r]

    @T.macro
    def multiply(XS, WS, C, A, B, C_s, full, empty, regs, at, tiles_m, my_tiles, cid, r0):
        """One math warpgroup: rows r0 .. r0 + 63 of every tile of this CTA."""
        total, acc, scale, acc2, scale2 = regs
        for j in T.serial(my_tiles):
            locate(at, cid + j * ctas, tiles_m)
            m0, n0 = at[0], at[1]
            base = j * groups
            T.clear(total)
            # Each wgmma runs while the other accumulator is promoted; every wait is a wait for all (at
            # the loop's back edge nothing is in flight): with a wgmma in flight across the back edge
            # ptxas cannot tell which accumulator a promotion reads and serializes every wgmma (C7514).
            # acc2 starts at 0 with scale 0, so the first pair's promotion of it adds nothing, without a
            # branch.
            T.clear(acc2)
            T.fill(scale2, 0)
            for h in T.serial(groups // 2):
                g = 2 * h
                load_scales(XS, WS, scale, m0, n0, r0, g)
                issue(A, B, full, acc, r0, base + g)
                promote(total, acc2, scale2)  # group g - 1
                T.wait_wgmma(0)
                T.barrier_arrive(empty[(base + g) % stages])
                load_scales(XS, WS, scale2, m0, n0, r0, g + 1)
                issue(A, B, full, acc2, r0, base + g + 1)
                promote(total, acc, scale)  # group g
                T.wait_wgmma(0)
                T.barrier_arrive(empty[(base + g + 1) % stages])
            promote(total, acc2, scale2)
            if tma_store:
                # The last tile's store must have read C_s before it is overwritten; waiting here
                # rather than right after issuing the store keeps it off the next tile's first
                # wgmma (about 3% at M = 4096).
                T.tma_store_wait()
                T.copy(total, C_s)
                T.tma_copy(C_s, C[m0 + r0 : m0 + r0 + rows, n0 : n0 + bn])
            else:  # rows not 16-byte aligned: TileLang's guarded stores
                T.copy(total, C_s)
                T.copy(C_s, C[m0 + r0 : m0 + r0 + rows, n0 : n0 + bn])
        if tma_store:
            T.tma_store_wait()  # C_s must outlive the CTA's last store

    def registers():
        """One math warpgroup's fragments: the running total, the two wgmma accumulators and their row
        scales."""
        acc2 = T.alloc_fragment((rows, bn), accum)
        scale2 = T.alloc_fragment((rows,), accum)
        return (
            T.alloc_fragment((rows, bn), accum),
            T.alloc_fragment((rows, bn), accum),
            T.alloc_fragment((rows,), accum),
            acc2,
            scale2,
        )

    @T.prim_func
    def fp8_block_gemm_persistent(
        X: T.Tensor((m, k), fp8),
        XS: T.Tensor((m, groups), accum),
        W: T.Tensor((n, k), fp8),
        WS: T.Tensor((T.ceildiv(n, GROUP), groups), accum),
        C: T.Tensor((m, n), out_dtype),
    ):
        with T.Kernel(ctas, threads=384) as cid:
            A = T.alloc_shared((stages, bm, GROUP), fp8)
            B = T.alloc_shared((stages, bn, GROUP), fp8)
            C_s0 = T.alloc_shared((rows, bn), out_dtype)  # each math warpgroup stores its rows
            C_s1 = T.alloc_shared((rows, bn), out_dtype)
            full = T.alloc_barrier([128] * stages)  # the producer's threads, after issuing the stage's TMA
            empty = T.alloc_barrier([256] * stages)  # both math warpgroups, after their wgmma
            regs0 = registers()
            regs1 = registers()
            tiles_m = T.ceildiv(m, bm)
            my_tiles = T.ceildiv(T.max(tiles_m * tiles_n - cid, 0), ctas)
            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(232, 1)
                at = T.alloc_local([2], "int32")
                multiply(XS, WS, C, A, B, C_s0, full, empty, regs0, at, tiles_m, my_tiles, cid, 0)
            elif tx < 256:
                T.set_max_nreg(232, 1)
                at = T.alloc_local([2], "int32")
                multiply(XS, WS, C, A, B, C_s1, full, empty, regs1, at, tiles_m, my_tiles, cid, rows)
            else:
                T.set_max_nreg(40, 0)
                at = T.alloc_local([2], "int32")
                produce(X, W, A, B, full, empty, at, tiles_m, my_tiles, cid)

    return fp8_block_gemm_persistent


@functools.cache
def _kernel(n: int, k: int, out_dtype: str, cfg: TileConfig):
    import tilelang

    if cfg.schedule:
        func = program_persistent(n, k, out_dtype, cfg, num_sms(torch.device("cuda")))
    else:
        func = program(n, k, out_dtype, cfg)
    return tilelang.compile(func, target="cuda")


# ------------------------------------------------------------------ compiling ahead of the first call

# Row counts standing for every M: `choose_config` depends on M only through the number of 64-row tiles
# (1 up to 64 rows, 2 up to 128) and whether M exceeds 128.
CONFIG_M = (1, 65, 129)


def keys_for(shapes, out_dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """The `_kernel` arguments that calls with weights of `shapes` ((N, K) pairs) can reach."""
    out = _TL_OUT[out_dtype]
    keys = {
        (n, k, out, choose_config(m, n, k, device))
        for n, k in shapes
        if k % GROUP == 0 and k > 0
        for m in CONFIG_M
    }
    return sorted(keys, key=str)


def compile_one(key: tuple) -> str:
    """Compile one `_kernel` (in a worker process: TileLang's disk cache keeps the result). Returns a log
    line; a failure is reported, not raised (the first call then compiles, or fails, in the caller)."""
    t0 = time.perf_counter()
    n, k, out, cfg = key
    try:
        _kernel(n, k, out, cfg)
    except Exception as e:  # noqa: BLE001 - reported to the caller
        return f"FAILED N={n} K={k} {cfg.label()}: {brief(e)}"
    return f"N={n} K={k} {cfg.label()}: {time.perf_counter() - t0:.0f} s"


def brief(e: Exception) -> str:
    """The exception's type and one line of it: what follows TileLang's "Compilation error:" (nvcc's
    message; the exception also holds the whole source), else its last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    at = next((i for i, ln in enumerate(lines) if ln.startswith("Compilation error")), None)
    line = lines[at + 1] if at is not None and at + 1 < len(lines) else (lines[-1] if lines else "")
    return f"{type(e).__name__}: {line[:300]}"


def precompile(keys: list[tuple], workers: int, marks: Path | None = None) -> list[str]:
    """Compile `keys` in `workers` spawned processes (0: here, one by one), then load each that compiled
    here from TileLang's disk cache (fast), so no first call compiles (5-10 s per kernel). Returns one
    log line per key, "FAILED ..." for those that did not compile.

    `marks`: a folder where a file per kernel records that it compiled on this machine before; those
    are only loaded here (starting the worker processes alone costs ~8 s), the rest go to the workers.
    A mark whose TileLang cache entry was cleared since costs an in-process compile, nothing worse."""
    if not keys:
        return []
    mark = {key: marks / _mark_name(key) for key in keys} if marks else {}
    todo = [key for key in keys if not (marks and mark[key].exists())]
    if todo and workers > 0:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx) as pool:
            done = dict(zip(todo, pool.map(compile_one, todo), strict=True))
    else:
        done = {key: compile_one(key) for key in todo}
    lines = []
    for key in keys:
        line = done.get(key) or f"N={key[0]} K={key[1]} {key[3].label()}: compiled before"
        if not line.startswith("FAILED"):
            _kernel(*key)
            if marks:
                marks.mkdir(parents=True, exist_ok=True)
                mark[key].touch()
        lines.append(line)
    return lines


def _mark_name(key: tuple) -> str:
    """Per TileLang version: its disk cache is too."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tl_version = version("tilelang")
    except PackageNotFoundError:
        tl_version = "unknown"
    n, k, out, cfg = key
    return f"tilelang-{tl_version}-fp8_block_gemm-{n}x{k}-{out}-{cfg.label()}"


def fp8_block_gemm(x_fp8, x_scale, w, w_scale, out_dtype=torch.bfloat16, out=None, config=None):
    """`Fp8BlockGemm` (`config`: the tile, `choose_config`'s when None; the fp8 bench's `--configs` and
    `--tiles` compare them). K not a multiple of 128 and other inputs `supported` does not cover go to
    the Triton kernel."""
    if not supported(x_fp8, w, out_dtype):
        from runtime.gpu.kernels.fp8_gemm import triton

        return triton.fp8_block_gemm(x_fp8, x_scale, w, w_scale, out_dtype, out)
    m, k = x_fp8.shape
    n = w.shape[0]
    assert w.shape[1] == k, (x_fp8.shape, w.shape)
    assert x_scale.shape == (m, k // GROUP) and w_scale.shape == (-(-n // GROUP), k // GROUP)
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device) if out is None else out
    assert out.shape == (m, n) and out.dtype == out_dtype, (out.shape, out.dtype)
    if m == 0 or n == 0:
        return out
    cfg = config or choose_config(m, n, k, x_fp8.device)
    kernel = _kernel(n, k, _TL_OUT[out_dtype], cfg)
    # no-ops for the engine's tensors (row-major activations, scales and weights)
    x_fp8, w = x_fp8.contiguous(), w.contiguous()
    x_scale, w_scale = x_scale.float().contiguous(), w_scale.float().contiguous()
    if cfg.split_k > 1:
        part = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=out.device)
        kernel(x_fp8, x_scale, w, w_scale, part)
        from runtime.gpu.kernels.fp8_gemm.triton import sum_splits

        return sum_splits(part, out)
    dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    kernel(x_fp8, x_scale, w, w_scale, dst)
    if dst is not out:
        out.copy_(dst)
    return out
