"""`loadgen sched`: the scheduler's host cost per step with a null model, no GPU and no torch forward.

A real SchedulerActor is driven directly: its plans go to a `NullRunner` (one constant token per
sampled row, returned at once) and the StepOutputs are handed back, exactly as the worker would. The
radix cache is filled with `--cache-tokens` tokens first (many sequences sharing prefixes), then
`--running` requests are admitted and decoded in steady state (every request decodes each step). Reported
per step, in microseconds: `plan` (BatchPlanner.plan: building the StepPlan, allocating KV) and `host`
(the scheduler's whole handling of one StepOutput: stop checks, outputs, stats, and planning the next
step). Median and p90 over `--steps` steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time

from runtime.actors.scheduler.actor import SchedulerActor
from runtime.actors.scheduler.testing import NullRunner, tokenized
from runtime.config import ServerConfig
from runtime.mailbox.messages import StepPlan


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--running", default="1,64,256,1024", help="running-request counts to measure")
    p.add_argument("--cache-tokens", type=int, default=100_000, help="tokens held by the radix cache")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300, help="measured decode steps per point")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--json", help="also write the results to this file")


class _Driver:
    """Stands in for the actor system around the scheduler: captures what it sends."""

    def __init__(self, sched: SchedulerActor) -> None:
        self.plans: list[StepPlan] = []
        sched.send = self.send  # type: ignore[method-assign]

    async def send(self, to: str, msg) -> None:
        if to == "worker":
            self.plans.append(msg)


def _fill_cache(sched: SchedulerActor, tokens: int, rng: random.Random) -> list[list[int]]:
    """Insert sequences of 512 tokens, grouped in families of 8 sharing a 256-token prefix."""
    cache, alloc, ps = sched.cache, sched.allocator, sched.allocator.page_size
    seqs: list[list[int]] = []
    while cache.evictable_tokens < tokens:
        if len(seqs) % 8 == 0:
            stem = [rng.randrange(50_000) for _ in range(256)]
        seq = stem + [rng.randrange(50_000) for _ in range(256)]
        pages = alloc.alloc(len(seq) // ps)
        slots = [pages[i // ps] * ps + i % ps for i in range(len(seq))]
        matched = cache.insert(seq, slots)
        alloc.free(pages[: matched // ps])
        seqs.append(seq)
    return seqs


async def measure(n: int, args) -> dict:
    rng = random.Random(n)
    steps, plen = args.steps, args.prompt_len
    max_new = steps + 64
    slots = args.cache_tokens + n * (plen + max_new + 2 * args.page_size) + 4096
    cfg = ServerConfig(
        max_total_tokens=slots,
        max_running_requests=n,
        page_size=args.page_size,
        chunked_prefill_size=max(8192, n * plen),
        disable_overlap=args.disable_overlap,
        max_queued_requests=n + 1,
    )
    sched = SchedulerActor(cfg, slots, max_model_len=plen + max_new + 16)
    drv = _Driver(sched)
    seqs = _fill_cache(sched, args.cache_tokens, rng)
    for i in range(n):  # half of the prompts hit a cached prefix, as a chat workload would
        head = rng.choice(seqs)[: plen // 2] if i % 2 else []
        prompt = head + [rng.randrange(50_000) for _ in range(plen - len(head))]
        await sched.handle(tokenized(f"b{i}", prompt, max_new))
    runner, done = NullRunner(), 0
    plan_s, host_s = [], []
    while done < steps + 8:
        plan = drv.plans[done]
        out = runner.execute(plan)
        before = sched.plan_s
        t0 = time.perf_counter()
        await sched.handle(out)
        t1 = time.perf_counter()
        done += 1
        steady = len(sched.planner.running) == n and not any(r.prefilling for r in sched.planner.running)
        if steady and len(plan.rows) == n:
            plan_s.append(sched.plan_s - before)
            host_s.append(t1 - t0)
    assert len(plan_s) >= steps // 2, "the batch never reached steady state"
    cache = sched.cache
    return {
        "running": n,
        "cache_tokens": cache.evictable_tokens + cache.protected_tokens,
        "plan_us_p50": statistics.median(plan_s) * 1e6,
        "plan_us_p90": statistics.quantiles(plan_s, n=10)[-1] * 1e6,
        "host_us_p50": statistics.median(host_s) * 1e6,
        "host_us_p90": statistics.quantiles(host_s, n=10)[-1] * 1e6,
        "steps": len(plan_s),
    }


def main(args) -> int:
    results = [asyncio.run(measure(int(n), args)) for n in args.running.split(",")]
    print(
        f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
        f"page_size {args.page_size}, overlap {'off' if args.disable_overlap else 'on'}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'running':>8} {'cache tok':>10} {'plan p50 us':>12} {'plan p90 us':>12} {'host p50 us':>12} "
        f"{'host p90 us':>12}"
    )
    for r in results:
        print(
            f"{r['running']:>8} {r['cache_tokens']:>10} {r['plan_us_p50']:>12.1f} {r['plan_us_p90']:>12.1f} "
            f"{r['host_us_p50']:>12.1f} {r['host_us_p90']:>12.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
