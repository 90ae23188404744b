"""Per-kernel device time of a decode step (Llama-3.1-8B preset, dummy bf16 weights, 1K context unless
--context-len; --kv-cache-dtype fp8_e4m3 for an fp8 pool) at batch 1 and 256, with the graph and eager
step times side by side: `python -m loadgen.profile_decode` on a CUDA machine. Both the graph replay and
the eager step are profiled (CUPTI sees the kernels a graph launches): per-kernel device time, kernels
per step, and the gaps between kernels (the span from the first kernel's start to the last one's end,
minus kernel time). `--prefill 16x1000` profiles a prefill step instead: 16 fresh prompts of 1000 tokens
each, with `--batch-sizes` rows decoding alongside (0 for none), as the mixed steps of a chunked-prefill
server are."""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from loadgen.kernel_table import kernel_table
from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.mailbox.messages import SamplingParams, SeqStart, StepPlan

CTX = 1024
ROOM = 64  # decode positions per row past the context


def _layout(ctx: int, page: int) -> tuple[int, int]:
    """(first row's first slot, slots per row): rows hold whole pages, back to back after page 0 (its
    slot 0 is the padding slot), so a row's pages are contiguous and page-aligned."""
    return (page if page > 1 else 1), -(-(ctx + ROOM) // page) * page


def _runner(
    batch: int, graph: bool, ctx: int, kv_cache_dtype: str, prefill: int = 0, length: int = 0, page: int = 1
) -> ModelRunner:
    first, stride = _layout(ctx, page)
    cfg = RunnerConfig(
        "llama-3.1-8b",
        device="cuda",
        load_format="dummy",
        num_kv_slots=first + batch * stride + prefill * length + 8 + page,
        page_size=page,
        max_reqs=batch + prefill,
        max_model_len=max(ctx + ROOM, length),
        cuda_graph=graph,
        kv_cache_dtype=kv_cache_dtype,
    )
    return ModelRunner(cfg)


def _steps(batch: int, ctx: int, prompts: int = 0, length: int = 0, page: int = 1):
    """Plans: the first registers `batch` rows with `ctx` cached slots and feeds each one token, then they
    decode. Behind them (the scheduler puts decode rows first), every step prefills `prompts` fresh
    prompts of `length` tokens each: their rows are released and admitted again every step, reusing
    their slots, so every step is the same prefill."""
    params = SamplingParams(temperature=0)
    first, stride = _layout(ctx, page)
    base = [first + i * stride for i in range(batch)]
    dec_rows = list(range(1, batch + 1))
    pre_rows = list(range(batch + 1, batch + prompts + 1))
    pre_base = first + batch * stride
    ids = [(7 * i) % 30000 + 1 for i in range(prompts * length)]
    pre_loc = list(range(pre_base, pre_base + prompts * length))
    pos, step = ctx - 1, 0
    while True:
        first = step == 0
        added = [SeqStart(r, params, [1], [], []) for r in pre_rows]
        if first:
            added = [
                SeqStart(i + 1, params, [1], list(range(b, b + ctx)), []) for i, b in enumerate(base)
            ] + added
        yield StepPlan(
            step,
            added,
            [] if first else pre_rows,
            dec_rows + pre_rows,
            [pos] * batch + [0] * prompts,
            [1] * batch + [length] * prompts,
            [not first] * batch + [False] * prompts,
            ([5] * batch if first else []) + ids,
            [b + pos for b in base] + pre_loc,
            [True] * (batch + prompts),
        )
        pos, step = pos + 1, step + 1


def _report(prof, steps: int = 5) -> None:
    print(kernel_table(prof, steps))


def _measure(runner: ModelRunner, plans, warm: int, timed: int, profiled: int) -> tuple[float, profile]:
    """Run `warm` steps, time `timed` more (ms per step), then profile `profiled` more under CUPTI."""
    for _ in range(warm):
        runner.execute(next(plans))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(timed):
        runner.execute(next(plans))
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / timed * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            runner.execute(next(plans))
        torch.cuda.synchronize()
    return ms, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,256", help="comma-separated")
    parser.add_argument("--cuda-graph", choices=("on", "off", "both"), default="both")
    parser.add_argument("--context-len", type=int, default=CTX, help="cached tokens per row")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8_e4m3")
    parser.add_argument("--prefill", default="", help="PROMPTSxLENGTH: profile a prefill step (eager)")
    parser.add_argument("--page-size", type=int, default=1, help="the KV pool's (rows hold whole pages)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.prefill:
        prompts, length = (int(x) for x in args.prefill.split("x"))
        for batch in batches:
            runner = _runner(
                batch, False, args.context_len, args.kv_cache_dtype, prompts, length, args.page_size
            )
            plans = _steps(batch, args.context_len, prompts, length, args.page_size)
            ms, prof = _measure(runner, plans, 3, 5, 3)
            print(f"prefill {prompts}x{length} + {batch} decode rows: {ms:.3f} ms/step, "
                  f"{prompts * length / ms:.1f}k prompt tok/s", flush=True)  # fmt: skip
            _report(prof, steps=3)
            del runner
            torch.cuda.empty_cache()
        return
    graphs = {"on": (True,), "off": (False,), "both": (True, False)}[args.cuda_graph]
    for batch in batches:
        for graph in graphs:
            runner = _runner(batch, graph, args.context_len, args.kv_cache_dtype, page=args.page_size)
            ms, prof = _measure(runner, _steps(batch, args.context_len, page=args.page_size), 6, 20, 5)
            print(f"B={batch} graph={graph}: {ms:.3f} ms/step", flush=True)
            _report(prof)
            del runner
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
