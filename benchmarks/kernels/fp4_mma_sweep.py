"""The FP4 experts' mma kernels (`fused_moe/tilelang_fp4.py`) at V4-Flash's experts (256, top-6, D 4096,
I 2048; random codes, scales 2^-7 to 2^-2, in the tiled form served models keep): steps in flight a
thread x block size x activations staged or loaded as used, against the Triton `dot_scaled` form at
`choose_config`'s tile on the tiled and the row-major form, in one process. Each form
is the whole op (layout, gate/up, down, sum) timed by CUDA-graph replay; the bandwidth column is over the
code and scale bytes of the experts the batch reaches. docs/PERF.md, "The FP4 experts on mma.sync".
    python -m benchmarks.kernels.fp4_mma_sweep [--tokens 8,64,256] [--forms 2:8:1,3:8:0] [--no-scaled]
A form is stages:block_m:staged[:sub] (tilelang_fp4.STAGES, the layout's block_m, tilelang_fp4.X_STAGED,
tilelang_fp4.SUB: 128-k tiles a step, 1 if not given)."""

from __future__ import annotations

import argparse
import functools
import logging
from dataclasses import replace

import torch
import triton.testing

from benchmarks.kernels.timing import ceilings
from runtime.gpu.kernels.fused_moe import tilelang_fp4
from runtime.gpu.kernels.fused_moe.triton import choose_config, fused_moe
from runtime.gpu.quant import fp4

EXPERTS, TOPK, HIDDEN, INTER = 256, 6, 4096, 2048


def _graph_ms(fn) -> float:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=100)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8,64,256")
    p.add_argument("--forms", default="2:8:1,1:8:1:2,2:8:1:2,3:8:1,2:16:1,1:16:1:2")
    p.add_argument("--no-scaled", action="store_true", help="skip the Triton form")
    args = p.parse_args()
    logging.getLogger("TileLang").setLevel(logging.ERROR)  # recompiles per form are the point here
    dev = torch.device("cuda")
    print(f"copy ceiling {ceilings(dev, small=False)[0] / 1e9:.0f} GB/s")
    e, d, i = EXPERTS, HIDDEN, INTER
    w13 = torch.randint(0, 256, (e, 2 * i, d // 2), device=dev, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (e, d, i // 2), device=dev, dtype=torch.uint8)
    s13 = torch.randint(120, 126, (e, 2 * i, d // 32), device=dev, dtype=torch.uint8)
    s2 = torch.randint(120, 126, (e, d, i // 32), device=dev, dtype=torch.uint8)
    tiled = fp4.tile_layer(w13, w2, s13, s2)
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, d, device=dev).to(torch.bfloat16)
        topk_w, ids = torch.softmax(torch.randn(tokens, e, device=dev), -1).topk(TOPK, -1)
        ids = ids.to(torch.int32)
        reached = ids.unique().numel()
        gbytes = reached * 3 * d * i * (0.5 + 1 / 32) / 1e9
        base = choose_config(tokens * TOPK, e, dev, x.dtype, fp4=True)
        run = functools.partial(fused_moe, x, tiled[0], tiled[1], topk_w, ids, 10.0, *tiled[2:])
        row_major = functools.partial(fused_moe, x, w13, w2, topk_w, ids, 10.0, s13, s2)
        scaled = replace(base, fp4_step="scaled")
        forms = (
            []
            if args.no_scaled
            else [("scaled, row-major", scaled, row_major), ("scaled, tiled", scaled, run)]
        )
        for spec in args.forms.split(","):
            parts = [int(v) for v in spec.split(":")]
            stages, block_m, staged, sub = parts + [1] * (4 - len(parts))
            cfg = replace(base, fp4_step="mma", block_m=block_m)
            name = f"mma {stages} steps, staged {staged}, sub {sub}, {block_m}-pair blocks"
            forms.append((name, cfg, (stages, bool(staged), sub)))
        for name, cfg, how in forms:
            if isinstance(how, tuple):  # an mma form's knobs
                tilelang_fp4.STAGES, tilelang_fp4.X_STAGED, tilelang_fp4.SUB = how
            ms = _graph_ms(functools.partial(run if isinstance(how, tuple) else how, config=cfg))
            print(
                f"T={tokens:4d} {name:40s} {ms * 1e3:8.1f} us {gbytes / ms * 1e3:6.0f} GB/s ({reached} experts)"
            )


if __name__ == "__main__":
    main()
