"""Engram on the GPU machine: lookup throughput per placement, and the step-time overhead of Engram.

`lookup`: tables of the reference's demo shape (layers 1 and 15: 2 x 16 prime tables of ~646K rows x 64,
bf16) in the `device` placement and in `host` shards; per step of 4K-64K tokens, the time from the
step's addresses to its rows on the device: `fetch` (host: the shards gather into shared memory over
the mailbox, then one host-to-device copy) and, for a table the device reads (`device`, mapped `host`),
`gather` (addresses already on the device, one index: over PCIe from the registered host table), as
rows/s and GB/s; and the scheduler-side hashing time of the same addresses.

`steps`: a dummy DeepSeek-V4-Flash cut (`--hf-overrides`, default 8 layers) with an Engram block (demo
sizes, tables from the seed) on `--engram-layers` (default 2 and 6: V4.1 puts its two at layers 2 and
15 of 61, the first early and the second a quarter of the way down), decode at batch 1 / 16 / 64; one
model load: each placement in turn gets its Engram runtime and fresh CUDA graphs, then the Engram
layers are detached for the baseline. Placements `device` and `host` (mapped) run in CUDA graphs,
`host-mailbox` (the shards over the mailbox) and `split` eagerly. Prints median step time and the
overhead against the baseline with CUDA graphs (target: under 3% with host tables).

    python -m benchmarks.engram_lookup lookup --tokens 4096,16384,65536 --shards 4
    python -m benchmarks.engram_lookup steps --placements host,device,host-mailbox --tokenizer out/tokenizer
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from runtime.engram.config import EngramConfig, EngramOptions
from runtime.engram.hashing import NgramHasher
from runtime.engram.layer import EngramLayer
from runtime.engram.runtime import EngramRuntime, make_placement

DEMO = {"layer_ids": [1, 15], "max_ngram_size": 3, "n_embed_per_ngram": 512, "n_head_per_ngram": 8,
        "engram_vocab_size": [646400, 646400], "seed": 0}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, iters: int) -> tuple[float, torch.Tensor]:  # noqa: ANN001
    """Median seconds of `fn()` to its result on the device (two warm-up calls), and the last result."""
    for _ in range(2):
        out = fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t1 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t1)
    return statistics.median(times), out


def lookup(a: argparse.Namespace) -> dict:
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    block = json.loads(a.engram) if a.engram else DEMO
    cfg = EngramConfig.from_dict(block)
    hasher = NgramHasher(cfg, np.arange(a.vocab))  # the hash's cost does not depend on the compression
    print(
        f"tables: {hasher.total_rows} rows x {cfg.head_dim} ({hasher.total_rows * cfg.head_dim * dtype.itemsize / 1e9:.2f} GB)"
    )
    out: dict = {"rows_total": hasher.total_rows, "results": []}
    rng = np.random.default_rng(0)
    for name in a.placements.split(","):
        kwargs = {"shards": a.shards} if name == "host" else {}
        t0 = time.perf_counter()
        p = make_placement(name, cfg, hasher, device, dtype, **kwargs)
        print(f"{name}: ready in {time.perf_counter() - t0:.1f} s")
        try:
            for t in [int(x) for x in a.tokens.split(",")]:
                ids = rng.integers(0, a.vocab, size=t)
                h0 = time.perf_counter()
                addr = hasher.addresses(ids, 0, t)
                hash_s = time.perf_counter() - h0
                ways = [("fetch", lambda: p.fetch(addr)())]  # noqa: B023 (used in this iteration)
                if p.device_table is not None:
                    idx = torch.from_numpy(addr).to(device)
                    ways.append(("gather", lambda: p.device_table[idx]))  # noqa: B023
                for way, fn in ways:
                    s, rows = _median_s(fn, device, a.iters)
                    n = addr.size
                    r = {"placement": name, "way": way, "tokens": t, "rows": n, "fetch_ms": 1e3 * s,
                         "rows_per_s": n / s, "GB_per_s": rows.numel() * rows.element_size() / s / 1e9,
                         "hash_ms": 1e3 * hash_s}  # fmt: skip
                    out["results"].append(r)
                    print(f"  {name:6s} {way:6s} {t:6d} tokens  {n:8d} rows  {1e3 * s:8.2f} ms  "
                          f"{n / s / 1e6:8.2f} M rows/s  {r['GB_per_s']:6.2f} GB/s   hash {1e3 * hash_s:6.2f} ms")  # fmt: skip
        finally:
            p.close()
    return out


def _options(spec: str, shards: int) -> EngramOptions:
    """A placement of `--placements`: device | host (mapped on CUDA) | host-mailbox | split."""
    if spec == "host-mailbox":
        return EngramOptions("host", shards=shards, mapped=False)
    return EngramOptions(spec, shards=shards)


def steps(a: argparse.Namespace) -> dict:
    from benchmarks.engram_prefetch import Decoder
    from runtime.config import RunnerConfig
    from runtime.gpu.model_runner import ModelRunner

    engram = {
        **(json.loads(a.engram) if a.engram else DEMO),
        "layer_ids": [int(x) for x in a.engram_layers.split(",")],
    }
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    placements = a.placements.split(",")
    graphs = a.cuda_graph == "on" and a.device == "cuda"
    cfg = RunnerConfig(
        a.model, device=a.device, dtype=a.dtype, load_format="dummy", num_kv_slots=a.kv_slots,
        max_reqs=max(batch_sizes), max_model_len=a.context + 64, page_size=a.page_size, cuda_graph=False,
        hf_overrides={**json.loads(a.hf_overrides), "engram": engram}, engram=_options(placements[0], a.shards),
        tokenizer=a.tokenizer, max_prefill_tokens=a.prefill, cpu_threads=1 if a.device == "cpu" else None,
    )  # fmt: skip
    runner = ModelRunner(cfg)  # one load: each variant swaps the Engram runtime and the graphs
    hasher, device, dtype, rows = runner.engram.hasher, runner.device, runner.dtype, cfg.max_reqs + 1
    out: dict = {"engram_layers": engram["layer_ids"], "cuda_graph": graphs, "results": []}
    for i, name in enumerate([f"engram {p}" for p in placements] + ["no engram"]):
        if name == "no engram":
            runner.engram = None
            for parent in list(runner.model.modules()):  # the model without its Engram layers
                for child, module in list(parent.named_children()):
                    if isinstance(module, EngramLayer):
                        setattr(parent, child, None)
        elif i > 0:  # the first placement's runtime came with the runner
            runner.engram = EngramRuntime.create(
                hasher, _options(placements[i], a.shards), device, dtype, rows
            )
        in_graphs = graphs and (runner.engram is None or runner.engram.on_device is not None)
        runner.graphs = None
        torch.cuda.empty_cache() if a.device == "cuda" else None
        runner.graphs = runner.make_graphs(cfg.max_reqs) if in_graphs else None
        try:
            for b in batch_sizes:
                dec = Decoder(runner, b, a.context, engram=runner.engram is not None)
                for _ in range(3):
                    dec.step()
                times = [dec.step() for _ in range(a.steps)]
                r = {
                    "variant": name,
                    "batch": b,
                    "step_ms": 1e3 * statistics.median(times),
                    "graphs": in_graphs,
                }
                out["results"].append(r)
                print(
                    f"{name:20s} batch {b:4d}  decode step {r['step_ms']:8.2f} ms  ({'graphs' if in_graphs else 'eager'})"
                )
                dec.release()
        finally:
            if runner.engram is not None:
                runner.engram.close()
    by = {(r["variant"], r["batch"]): r["step_ms"] for r in out["results"]}
    for (variant, b), ms in by.items():
        if variant != "no engram":
            print(f"overhead {variant:20s} batch {b:4d}: {100 * (ms / by[('no engram', b)] - 1):+.1f}%")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("lookup")
    lp.add_argument("--tokens", default="4096,16384,65536")
    lp.add_argument("--placements", default="device,host")
    lp.add_argument("--shards", type=int, default=4)
    lp.add_argument("--iters", type=int, default=10)
    lp.add_argument("--vocab", type=int, default=129280)
    sp = sub.add_parser("steps")
    sp.add_argument("--model", default="deepseek-v4-flash")
    sp.add_argument("--hf-overrides", default='{"num_hidden_layers": 8, "num_nextn_predict_layers": 0}')
    sp.add_argument("--engram-layers", default="2,6")
    sp.add_argument("--placements", default="host,device,host-mailbox")
    sp.add_argument("--cuda-graph", choices=["on", "off"], default="on")
    sp.add_argument("--shards", type=int, default=4)
    sp.add_argument("--batch-sizes", default="1,16,64")
    sp.add_argument("--context", type=int, default=1024)
    sp.add_argument("--prefill", type=int, default=8192)
    sp.add_argument("--page-size", type=int, default=128)
    # the KV pool, and each Engram layer's convolution cache (a slot of hc_mult * hidden values each)
    sp.add_argument("--kv-slots", type=int, default=76800)  # 600 pages of 128: 64 rows of 1024 + steps
    sp.add_argument("--steps", type=int, default=20)
    sp.add_argument("--tokenizer", default=None)
    for p in (lp, sp):
        p.add_argument("--engram", default=None, help="an Engram block as JSON (default: the demo's)")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--out", default=None)
    a = ap.parse_args()
    result = lookup(a) if a.cmd == "lookup" else steps(a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), **result}, f, indent=2)


if __name__ == "__main__":
    main()
