"""FP4 experts at decode and verify sizes (W4A16, DeepSeek-V4's routed experts) on mma.sync: TileLang
launches whose warps run `fp4_warp.cuh`, over the layout and contract of `triton_fp4.launch_fp4`.

Why next to `triton_fp4.py`: there `tl.dot_scaled` streams 1.1 TB/s at 64 tokens (36% of copy, H100)
with the SMs' instruction issue 70-78% busy, as its lowering moves each weight through shared memory
twice. Here the codes go from DRAM into registers and become mma operands by a few integer ops
(`fp4_warp.cuh` says how): the weights fill the mma rows and a block's 8-32 pairs its columns, so a
decode step, where an expert sees a few tokens, wastes no mma rows on padding.

The same two launches as the Triton kernels: gate/up + SwiGLU (its epilogue clamps and writes H), then
down + routing weight (its epilogue writes each pair's row of Y). Grid: (layout blocks, column tiles);
blocks past `num_rows` exit, so the grid is fixed per batch size (CUDA graphs). What it takes
(`supported`): bf16 activations, weights and scales in their tiled form (`fp4.tile_experts`, which
`RoutedExperts` keeps on a GPU: each warp load is then 512 contiguous bytes), K of both matmuls a
multiple of 128 SUB, and column counts that fill the warps' tiles; anything else runs the Triton form."""

# No `from __future__ import annotations`: TileLang reads the prim_func parameter annotations at
# decoration time.
import functools
from pathlib import Path

import torch

from runtime.gpu.kernels.fused_moe.layout import MoELayout
from runtime.gpu.kernels.registry import is_hopper as _hopper
from runtime.gpu.kernels.registry import tilelang_importable as _importable
from runtime.gpu.quant import fp4

WARPS = 4  # warps a CTA: gate/up columns 16 a warp (gate and up rows: 32), down rows 32 a warp
STEP_K = 128  # K a step per SUB: one tile (`fp4.TILE_K`), 16 code bytes a thread and row
TOKEN_TILES = (1, 2, 4)  # 8-pair mma column tiles a block (the layout's block_m / 8)
STAGES = 2  # steps of weights in flight a thread (ptxas: 168 registers at 2 tiles of 8 pairs)
X_STAGED = True  # activations loaded with the weights STAGES steps ahead (else as used, from L1)
# tiles of 128 k a step (unrolled in one step's registers). None: `knobs` chooses. 1 by default until
# the tiled kernels are timed (benchmarks.kernels.fp4_mma_sweep); on row-major weights SUB 2 with one
# step in flight took 901 us against 1,031 at 64 tokens and 1,452 against 1,391 at 256 (H200).
SUB: int | None = 1


_WARP_SOURCE = (Path(__file__).parent / "fp4_warp.cuh").read_text()


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _hopper(device) and _importable()


def supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales, block_m: int) -> bool:  # noqa: ANN001
    """What the kernels are built for (see the module docstring)."""
    _, hidden, half_inter = fp4.stacked_shape(w2)
    inter = 2 * half_inter
    return (
        available(x.device)
        and x.dtype == torch.bfloat16
        and block_m % 8 == 0
        and block_m // 8 in TOKEN_TILES
        and hidden % (STEP_K * (SUB or 1)) == 0
        and inter % (STEP_K * (SUB or 1)) == 0
        and inter % (16 * WARPS) == 0
        and hidden % (32 * WARPS) == 0
        and x.stride(1) == 1
        and x.stride(0) % 8 == 0
        and x.data_ptr() % 16 == 0
        and all(fp4.is_tiled(t) and t.is_contiguous() for t in (w13, w2, *scales))
    )


def config(cfg, num_pairs: int, num_experts: int, x, w13, w2, scales, tile: bool = True):  # noqa: ANN001, ANN201
    """A `MoEConfig` with fp4_step "mma" made what the launch runs, the one place that checks `supported`.
    With `tile` (`choose_config`'s FP4 tile): blocks of 8 pairs up to 16 pairs an expert on average
    (fewer registers, more CTAs an SM: faster than 16-pair blocks even where some experts need two,
    `benchmarks.kernels.fp4_mma_sweep` at 256 tokens), 16 up to 48 (verify steps). Without (a config the
    caller gave: tests, tuning) its block_m stays. Where the kernels do not apply, the Triton "scaled"
    form at the config's tile."""
    from dataclasses import replace

    block_m = cfg.block_m
    if tile:
        per_expert = num_pairs / max(1, num_experts)
        if per_expert > 48:
            return replace(cfg, fp4_step="scaled")
        block_m = 8 if per_expert <= 16 else 16
    if not supported(x, w13, w2, scales, block_m):
        return replace(cfg, fp4_step="scaled")
    return replace(cfg, block_m=block_m)


def _tiled(num_experts: int, rows: int, k: int, part: str) -> list[int]:
    """The shape of an expert stack's codes or scales in the tiled form (`fp4.tile_experts`), which
    fp4_warp.cuh's CODE_TILE / SCALE_TILE bytes a tile follow."""
    return [num_experts, rows // fp4.TILE_ROWS, k // fp4.TILE_K, fp4.TILE_ROWS, fp4.TILE_COLS[part]]


@functools.cache
def _gate_up_kernel(
    num_experts: int, inter: int, hidden: int, token_tiles: int, has_limit: bool, knobs: tuple
):
    import tilelang
    import tilelang.language as T

    stages, staged, sub = knobs
    tokens = T.dynamic("tokens")
    rows = T.dynamic("rows")
    blocks = T.dynamic("blocks")
    x_stride = T.dynamic("x_stride")
    fn = (
        f"fp4_moe::gate_up<{token_tiles}, {WARPS}, {stages}, {str(staged).lower()}, {sub}, "
        f"{str(has_limit).lower()}>"
    )

    @T.prim_func
    def fp4_gate_up(
        X: T.StridedTensor([tokens, hidden], [x_stride, 1], "bfloat16"),
        W: T.Tensor(_tiled(num_experts, 2 * inter, hidden, "codes"), "uint8"),
        WS: T.Tensor(_tiled(num_experts, 2 * inter, hidden, "scales"), "uint8"),
        H: T.Tensor([rows, inter], "bfloat16"),
        Pairs: T.Tensor([rows], "int32"),
        BlockExpert: T.Tensor([blocks], "int32"),
        NumRows: T.Tensor([1], "int32"),
        num_pairs: T.int32,
        topk: T.int32,
        limit: T.float32,
    ):
        with T.Kernel(blocks, inter // (16 * WARPS), threads=32 * WARPS) as (bx, by):
            T.import_source(_WARP_SOURCE)
            T.call_extern(
                "handle", fn, T.address_of(X[0, 0]), T.cast(x_stride, "int64"), T.address_of(W[0, 0, 0, 0, 0]),
                T.address_of(WS[0, 0, 0, 0, 0]), T.address_of(H[0, 0]), T.address_of(Pairs[0]),
                T.address_of(BlockExpert[0]), T.address_of(NumRows[0]), num_pairs, topk, inter, hidden, limit,
                bx, by, T.get_thread_binding(),
            )  # fmt: skip

    return tilelang.compile(fp4_gate_up, target="cuda")


@functools.cache
def _down_kernel(num_experts: int, inter: int, hidden: int, token_tiles: int, knobs: tuple):
    import tilelang
    import tilelang.language as T

    stages, staged, sub = knobs
    rows = T.dynamic("rows")
    blocks = T.dynamic("blocks")
    num_out = T.dynamic("num_out")
    fn = f"fp4_moe::down<{token_tiles}, {WARPS}, {stages}, {str(staged).lower()}, {sub}>"

    @T.prim_func
    def fp4_down(
        H: T.Tensor([rows, inter], "bfloat16"),
        W: T.Tensor(_tiled(num_experts, hidden, inter, "codes"), "uint8"),
        WS: T.Tensor(_tiled(num_experts, hidden, inter, "scales"), "uint8"),
        Y: T.Tensor([num_out, hidden], "bfloat16"),
        Pairs: T.Tensor([rows], "int32"),
        BlockExpert: T.Tensor([blocks], "int32"),
        NumRows: T.Tensor([1], "int32"),
        TopkW: T.Tensor([num_out], "float32"),
        num_pairs: T.int32,
    ):
        with T.Kernel(blocks, hidden // (32 * WARPS), threads=32 * WARPS) as (bx, by):
            T.import_source(_WARP_SOURCE)
            T.call_extern(
                "handle", fn, T.address_of(H[0, 0]), T.address_of(W[0, 0, 0, 0, 0]),
                T.address_of(WS[0, 0, 0, 0, 0]),
                T.address_of(Y[0, 0]), T.address_of(Pairs[0]), T.address_of(BlockExpert[0]),
                T.address_of(NumRows[0]), T.address_of(TopkW[0]), num_pairs, hidden, inter,
                bx, by, T.get_thread_binding(),
            )  # fmt: skip

    return tilelang.compile(fp4_down, target="cuda")


def knobs(num_pairs: int, num_experts: int, inter: int, hidden: int) -> tuple[int, bool, int]:
    """(steps in flight, activations staged, SUB) of a launch, read per launch (the sweep and the
    tests set the module's). SUB left to choose: 2 with one step in flight where experts see 2 pairs or
    fewer on average (each warp's loads of a row are then 128-byte runs, and their latency is what the
    step waits on), else 1 with STAGES."""
    sub = SUB
    if sub is None:
        sub = 2 if num_pairs <= 2 * num_experts and inter % 256 == 0 and hidden % 256 == 0 else 1
        return (1 if sub == 2 else STAGES), X_STAGED, sub
    return STAGES, X_STAGED, sub


def launch(x, w13, w2, h, y, weights, lay: MoELayout, topk: int, limit: float | None, scales) -> None:  # noqa: ANN001
    """`triton_fp4.launch_fp4`'s contract for a config `config` kept at "mma"; h [rows, I] and y [T*k, D]
    bf16."""
    (w13_s, w2_s), num_experts = scales, w13.shape[0]
    inter, hidden = h.shape[1], y.shape[1]
    tiles = lay.block_m // 8
    chosen = knobs(lay.num_pairs, num_experts, inter, hidden)
    gate_up = _gate_up_kernel(num_experts, inter, hidden, tiles, limit is not None, chosen)
    gate_up(x, w13, w13_s, h, lay.sorted_pairs, lay.block_expert, lay.num_rows, lay.num_pairs, topk,
            0.0 if limit is None else float(limit))  # fmt: skip
    down = _down_kernel(num_experts, inter, hidden, tiles, chosen)
    down(h, w2, w2_s, y, lay.sorted_pairs, lay.block_expert, lay.num_rows, weights, lay.num_pairs)
