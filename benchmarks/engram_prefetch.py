"""Engram prefetch on the CPU: decode step time with an injected per-lookup delay, prefetch on and off.

A runner over SmolLM2-135M-Instruct with an Engram block at a deep layer (tables from the seed, the
`host` placement with one shard over the mailbox: the lookup thread's path, which `device` tables no
longer take since they are read inside the step; one torch thread) decodes `--batch` rows; every lookup sleeps `--delay-ms` (default: 40% of
the step time measured without delay, i.e. shorter than a step) on the lookup thread. With prefetch on,
the lookup starts as the batch is built and runs while the layers below the Engram layer compute; off,
it starts when that layer asks. Variants interleave (A B A B) so drift hits both. Prints median step
time and the time the forward waited for rows per step; writes --out as JSON.

    PYTHONPATH=. python -m benchmarks.engram_prefetch --out out/engram_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec
import numpy as np
import torch

from runtime.config import RunnerConfig
from runtime.engram.config import EngramOptions
from runtime.gpu.convert import default_model_path
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing.plans import plan_builder, random_prompt, seq_start

HOST = EngramOptions("host", shards=1)


def build(layer: int, batch: int) -> ModelRunner:
    block = {"layer_ids": [layer], "n_embed_per_ngram": 256, "n_head_per_ngram": 8,
             "engram_vocab_size": [100_003, 100_003], "seed": 1}  # fmt: skip
    cfg = RunnerConfig(
        str(default_model_path()), num_kv_slots=8192, max_reqs=batch, max_model_len=1024, cpu_threads=1,
        hf_overrides={"engram": block}, engram=HOST,
    )  # fmt: skip
    return ModelRunner(cfg)


class Decoder:
    """`batch` rows prefilled with random prompts (a row per step), then decode steps that carry the
    addresses the scheduler would compute (`engram=False`: a model without Engram, no addresses)."""

    def __init__(self, runner: ModelRunner, batch: int, prompt: int, engram: bool = True) -> None:
        # the scheduler's slot layout for the runner's page size
        self.runner, self.pb = runner, plan_builder(runner, list(range(1, runner.kv_pool.num_slots)))
        self.engram = engram
        self.rows = list(range(1, batch + 1))
        self.seqs = [random_prompt(prompt, seed=r, vocab=4000) for r in self.rows]
        for r, s in zip(self.rows, self.seqs, strict=True):
            runner.execute(self.pb.plan([r], [0], [prompt], s, added=[seq_start(r, s)]))

    def step(self) -> float:
        n = len(self.rows)
        pos = len(self.seqs[0])
        nxt = [int(x) for x in np.random.default_rng(pos).integers(3, 4000, size=n)]
        for s, t in zip(self.seqs, nxt, strict=True):
            s.append(t)
        plan = self.pb.plan(self.rows, [pos] * n, [1] * n, nxt)
        if self.engram:
            hasher = self.runner.engram.hasher
            addr = np.concatenate([hasher.addresses(s, pos, 1) for s in self.seqs]).astype("<i8")
            plan = msgspec.structs.replace(plan, engram_addr=addr.tobytes())
        t0 = time.perf_counter()
        self.runner.execute(plan)
        return time.perf_counter() - t0

    def release(self) -> None:
        self.runner.execute(self.pb.plan([], [], [], [], released=self.rows))


def measure(dec: Decoder, opts: EngramOptions, steps: int) -> dict:
    eng = dec.runner.engram
    eng.opts = opts
    wait0, times = eng.stats.wait_s, [dec.step() for _ in range(steps)]
    return {"step_ms": 1e3 * statistics.median(times), "wait_ms": 1e3 * (eng.stats.wait_s - wait0) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", type=int, default=20, help="the Engram layer (SmolLM2 has 30)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=15, help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--delay-ms", type=float, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    runner = build(a.layer, a.batch)
    dec = Decoder(runner, a.batch, a.prompt)
    measure(dec, HOST, 3)  # warm
    base = measure(dec, HOST, a.steps)["step_ms"]
    delay = a.delay_ms if a.delay_ms is not None else 0.4 * base
    variants = {
        "no delay, prefetch": EngramOptions("host", 1, prefetch=True),
        "delay, prefetch": EngramOptions("host", 1, prefetch=True, lookup_delay_s=delay / 1e3),
        "delay, no prefetch": EngramOptions("host", 1, prefetch=False, lookup_delay_s=delay / 1e3),
    }
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, opts in variants.items():
            runs[name].append(measure(dec, opts, a.steps))
    runner.engram.close()
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("step_ms", "wait_ms")}
        for name, rs in runs.items()
    }
    result = {"delay_ms": delay, "layer": a.layer, "batch": a.batch, "summary": summary, "runs": runs}
    print(f"injected delay per lookup: {delay:.1f} ms (Engram at layer {a.layer} of 30, batch {a.batch})")
    for name, s in summary.items():
        print(
            f"  {name:20s} step {s['step_ms']:7.2f} ms   forward waited for rows {s['wait_ms']:6.2f} ms/step"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
