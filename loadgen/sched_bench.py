"""`loadgen sched`: the scheduler's host cost per step with a null model, no GPU and no torch forward.

A real SchedulerActor is driven directly: its plans go to a `NullRunner` (one constant token per
sampled row, returned at once) and the StepOutputs are handed back, exactly as the worker would. The
radix cache is filled with `--cache-tokens` tokens first (many sequences sharing prefixes), then
`--running` requests are admitted and decoded in steady state (every request decodes each step). Reported
per step, in microseconds: `plan` (BatchPlanner.plan: building the StepPlan, allocating KV) and `host`
(the scheduler's whole handling of one StepOutput: stop checks, outputs, stats, and planning the next
step). Median and p90 over `--steps` steps, as thread CPU time (so a busy shared machine preempting the
benchmark does not inflate it) and, for the plan, also wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time

from runtime.actors.scheduler.actor import SchedulerActor
from runtime.actors.scheduler.testing import NullRunner, fake_capabilities, tokenized
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
        if isinstance(msg, StepPlan):
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
    sched = SchedulerActor(cfg)
    drv = _Driver(sched)
    await sched.handle(fake_capabilities(cfg, max_model_len=plen + max_new + 16))
    seqs = _fill_cache(sched, args.cache_tokens, rng)
    for i in range(n):  # half of the prompts hit a cached prefix, as a chat workload would
        head = rng.choice(seqs)[: plen // 2] if i % 2 else []
        prompt = head + [rng.randrange(50_000) for _ in range(plen - len(head))]
        await sched.handle(tokenized(f"b{i}", prompt, max_new))
    plan_cpu: list[float] = []
    inner = sched.planner.plan

    def timed_plan(*a, **kw):
        t = time.thread_time()
        out = inner(*a, **kw)
        plan_cpu.append(time.thread_time() - t)
        return out

    sched.planner.plan = timed_plan  # type: ignore[method-assign]
    runner, done = NullRunner(), 0
    plan_s, plan_c, host_c = [], [], []
    while done < steps + 8:
        plan = drv.plans[done]
        out = runner.execute(plan)
        before, planned = sched.plan_s, len(plan_cpu)
        t0 = time.thread_time()
        await sched.handle(out)
        t1 = time.thread_time()
        done += 1
        steady = len(sched.planner.running) == n and not any(r.prefilling for r in sched.planner.running)
        if steady and len(plan.rows) == n:
            plan_s.append(sched.plan_s - before)
            plan_c.append(sum(plan_cpu[planned:]))
            host_c.append(t1 - t0)
    assert len(plan_s) >= steps // 2, "the batch never reached steady state"
    cache = sched.cache
    return {
        "running": n,
        "cache_tokens": cache.evictable_tokens + cache.protected_tokens,
        "plan_cpu_us_p50": statistics.median(plan_c) * 1e6,
        "plan_cpu_us_p90": statistics.quantiles(plan_c, n=10)[-1] * 1e6,
        "plan_wall_us_p50": statistics.median(plan_s) * 1e6,
        "host_cpu_us_p50": statistics.median(host_c) * 1e6,
        "host_cpu_us_p90": statistics.quantiles(host_c, n=10)[-1] * 1e6,
        "steps": len(plan_s),
    }


def main(args) -> int:
    results = [asyncio.run(measure(int(n), args)) for n in args.running.split(",")]
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), ""
    )
    print(
        f"# {cpu or platform.machine()} ({os.cpu_count()} cpus), python {platform.python_version()}, "
        f"page_size {args.page_size}, overlap {'off' if args.disable_overlap else 'on'}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    cols = ("plan_cpu_us_p50", "plan_cpu_us_p90", "plan_wall_us_p50", "host_cpu_us_p50", "host_cpu_us_p90")
    print(f"{'running':>8} {'cache_tokens':>12} " + " ".join(f"{c:>16}" for c in cols))
    for r in results:
        print(f"{r['running']:>8} {r['cache_tokens']:>12} " + " ".join(f"{r[c]:>16.1f}" for c in cols))
    if args.json:
        from loadgen.report import strict

        with open(args.json, "w") as f:
            json.dump(strict(results), f, indent=2, allow_nan=False)
    return 0
