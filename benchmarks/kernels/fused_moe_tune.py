"""Block sizes of the fused MoE (`fused_moe/triton.py`) swept at decode and verify token counts for
DeepSeek-V2-Lite's experts (64, top-6, D 2048, I 1408) and V3's (256, top-8, D 7168, I 2048) in bf16,
and V4-Flash's (256, top-6, D 4096, I 2048) as stored (`v4`: packed FP4 with a UE8M0 scale per 32,
random codes; every form of the FP4 K step, `MoEConfig.fp4_step`): each config timed by
CUDA-graph replay of the whole op (layout, gate/up, down, sum), uniform random routing, against
`choose_config`'s pick. The bandwidth column is over the weight (and scale) bytes of the experts the
batch reaches.
    python -m benchmarks.kernels.fused_moe_tune [--tokens 8,64,256,1024] [--models v2lite,v3,v4]
Large sweeps compile in parallel first: n processes with `--compile-only --shard i/n`, then one timing
process finds every kernel in Triton's cache (`benchmarks/device/v4_fp4_tune.sh`)."""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.kernels.timing import ceilings
from runtime.gpu.kernels.fused_moe.triton import MoEConfig, choose_config, fused_moe
from runtime.gpu.kernels.fused_moe.triton_fp4 import FP4_STEPS
from runtime.gpu.quant import fp4 as fp4_quant

MODELS = {"v2lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048), "v4": (256, 6, 4096, 2048)}
FP4_MODELS = {"v4"}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def space(args: argparse.Namespace, fp4: bool) -> list[MoEConfig]:
    """The configs swept: block_m x block_n x block_k x (warps:stages) (x the FP4 K-step forms)."""
    schedules = [tuple(int(v) for v in ws.split(":")) for ws in args.schedules.split(",")]
    tiles = itertools.product(_ints(args.block_m), _ints(args.block_n), _ints(args.block_k), schedules)
    steps = args.fp4_steps.split(",") if fp4 else ["values"]
    return [
        MoEConfig(bm, bn, bk, warps, stages, fp4_step=step)
        for (bm, bn, bk, (warps, stages)), step in itertools.product(tiles, steps)
    ]


def _experts(e: int, d: int, i: int, fp4: bool, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(w13, w2, w13 scales, w2 scales): bf16 normal weights, or random e2m1 codes with scales of
    2^-7 to 2^-2, tiled (scales None for bf16)."""
    if not fp4:
        w13 = torch.empty(e, 2 * i, d, device=dev, dtype=torch.bfloat16).normal_(0, d**-0.5)
        w2 = torch.empty(e, d, i, device=dev, dtype=torch.bfloat16).normal_(0, i**-0.5)
        return w13, w2, None, None
    group = fp4_quant.GROUP

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (e, rows, cols // 2), device=dev, dtype=torch.uint8)
        return codes, torch.randint(120, 126, (e, rows, cols // group), device=dev, dtype=torch.uint8)

    (w13, s13), (w2, s2) = packed(2 * i, d), packed(d, i)
    return fp4_quant.tile_layer(w13, w2, s13, s2)  # the form served models keep (RoutedExperts.tile_fp4)


def replay_us(fn, reps: int = 20) -> float:  # noqa: ANN001
    """Median of 5 timings of a CUDA graph holding `reps` calls, per call."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8,64,256,1024")
    p.add_argument("--models", default="v2lite,v3")
    p.add_argument("--block-m", default="16,32,64,128", help="the block_m values swept")
    p.add_argument("--block-n", default="64,128,256")
    p.add_argument("--block-k", default="64,128")
    p.add_argument("--schedules", default="4:3,4:4,8:3,8:4", help="warps:stages pairs")
    p.add_argument("--fp4-steps", default=",".join(FP4_STEPS), help="the FP4 K-step forms swept")
    p.add_argument(
        "--shard", default="0/1", help="i/n: only every n-th config from the i-th (to compile in parallel)"
    )
    p.add_argument(
        "--compile-only", action="store_true",
        help="run each config once, untimed: fills Triton's cache for a timing process after it",
    )  # fmt: skip
    p.add_argument("--top", type=int, default=5, help="the fastest configs printed per point")
    p.add_argument("--best-out", help="append each point's fastest config to this file, one line each")
    args = p.parse_args()
    shard, shards = _ints(args.shard.replace("/", ","))
    dev = torch.device("cuda")
    copy = 0.0 if args.compile_only else ceilings(dev, small=False)[0]
    if not args.compile_only:
        print(f"copy ceiling {copy / 1e9:.0f} GB/s")
    for model in args.models.split(","):
        e, k, d, i = MODELS[model]
        fp4 = model in FP4_MODELS
        w13, w2, s13, s2 = _experts(e, d, i, fp4, dev)
        per_expert = 3 * d * i * 2 if not fp4 else 3 * d * i // 2 * (1 + 2 / fp4_quant.GROUP)
        for tokens in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator(device=dev).manual_seed(tokens)
            x = torch.randn(tokens, d, device=dev, generator=g).to(torch.bfloat16)
            ids = torch.rand(tokens, e, device=dev, generator=g).topk(k, -1).indices
            topk_w = torch.rand(tokens, k, device=dev, generator=g)
            reached = ids.unique().numel()
            touched = reached * per_expert  # weight (and scale) bytes of the experts reached
            op = functools.partial(fused_moe, x, w13, w2, topk_w, ids, w13_scale=s13, w2_scale=s2)
            want = op()
            default = choose_config(tokens * k, e, dev, torch.bfloat16, fp4=fp4)
            results = []
            configs = [default] + [c for c in space(args, fp4) if c != default]
            for cfg in configs[shard::shards]:
                try:
                    got = op(config=cfg)
                    if args.compile_only:
                        continue
                    # relative L2 error: forms differ in accumulation order, and the random experts'
                    # outputs run to 1e5, where elementwise tolerances flag cancellations
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    if not err < 1e-2:
                        print(f"  {cfg}: WRONG", flush=True)
                        continue
                    us = replay_us(functools.partial(op, config=cfg))
                except Exception as exc:  # noqa: BLE001 - out of shared memory: skip the config
                    if "OutOfResources" not in type(exc).__name__ and "shared memory" not in str(exc):
                        raise
                    continue
                results.append((us, cfg))
            if args.compile_only:
                print(f"{model} T={tokens}: compiled {len(configs[shard::shards])} configs", flush=True)
                continue
            results.sort(key=lambda r: r[0])
            base = next((us for us, cfg in results if cfg == default), float("nan"))
            print(
                f"{model} T={tokens} pairs={tokens * k} experts reached {reached}/{e}, {len(results)} configs:"
            )
            print(f"  choose_config {default}: {base:.1f} us, {touched / base / 1e3:.0f} GB/s")
            for us, cfg in results[: args.top]:
                print(
                    f"  {us:8.1f} us {touched / us / 1e3:6.0f} GB/s ({touched / us / copy * 1e8:.0f}% of copy) {cfg}"
                )
            if args.best_out and results:
                best = results[0][1]
                with open(args.best_out, "a") as f:
                    tile = f"{best.block_m},{best.block_n},{best.block_k},{best.num_warps},{best.num_stages}"
                    f.write(f"{model} {tokens} {tile} {best.fp4_step} {results[0][0]:.1f}\n")
            torch.cuda.empty_cache()
        del w13, w2, s13, s2


if __name__ == "__main__":
    main()
