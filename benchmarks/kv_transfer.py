"""KV transfer throughput of each disaggregation backend on this machine (docs/PERF.md, "Disaggregation:
KV transfer (CPU)").

What one disaggregated request costs to move: a prefill-side `MHAKVPool` of a real model's KV shape
(SmolLM2-135M by default, or Llama-3-8B's) holds a request of T tokens at random slots; per transfer
the timer covers `export_request` (gather of the request's slots), `KVSender.send` through the backend
to a `KVReceiver` in another process, and the receiver's `import_request` into its own pool at other
slots, up to the ack. Reported per backend and T: median latency over --repeats transfers (after one
warm-up), and GB/s = request KV bytes / latency.

    python -m benchmarks.kv_transfer --tokens 1024 16384 --out out/kv_transfer.json   # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import platform
import statistics
import subprocess
import time

import torch

from loadgen.launch import free_port
from runtime.disaggregation.base import FirstToken, KVReceiver, KVSender, make_backend
from runtime.gpu.kv_pool import MHAKVPool

SHAPES = {  # layers, KV heads, head dim
    "smollm2-135m": (30, 3, 64),
    "llama3-8b": (32, 8, 128),
}


def make_pool(shape: str, slots: int, dtype: torch.dtype) -> MHAKVPool:
    layers, heads, dim = SHAPES[shape]
    pool = MHAKVPool(layers, slots, heads, dim, dtype, "cpu")
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape).to(dtype))
    return pool


def receiver_main(backend: str, port: int, shape: str, slots: int, dtype: str, ready) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    pool = make_pool(shape, slots, getattr(torch, dtype))

    async def on_kv(header, received):
        n = received.tensors["slot.k.0"].shape[0]
        dest = torch.arange(slots - n, slots)  # other slots than the sender's
        pool.import_request(1, dest, received.tensors)
        return None

    async def run():
        rx = KVReceiver(make_backend(backend), on_kv)
        await rx.start("127.0.0.1", port)
        ready.send(True)
        await asyncio.Event().wait()

    asyncio.run(run())


async def measure(
    backend: str, port: int, pool: MHAKVPool, tokens: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Per transfer: the whole time, and the export's share of it."""
    sender = KVSender(make_backend(backend), timeout=600)
    slots = torch.randperm(pool.num_slots - 1)[:tokens] + 1
    out, exports = [], []
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            kv = pool.export_request(1, slots)
            t1 = time.perf_counter()
            await sender.send(f"127.0.0.1:{port}", i, kv, FirstToken(0))
            if i:  # the first one warms the link up (a process group for nccl)
                out.append(time.perf_counter() - t0)
                exports.append(t1 - t0)
    finally:
        sender.close()
    return out, exports


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["tcp", "shm", "nccl"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 16384])
    p.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    slots = max(args.tokens) * 2 + 1
    pool = make_pool(args.shape, slots, dtype)
    per_token = pool.bytes_per_token
    rows = []
    ctx = mp.get_context("spawn")
    for backend in args.backends:
        port = free_port()
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=receiver_main, args=(backend, port, args.shape, slots, args.dtype, theirs))
        proc.start()
        try:
            mine.recv()
            for tokens in args.tokens:
                times, exports = asyncio.run(measure(backend, port, pool, tokens, args.repeats))
                lat, export = statistics.median(times), statistics.median(exports)
                nbytes = tokens * per_token
                row = {"backend": backend, "tokens": tokens, "bytes": nbytes, "latency_ms": lat * 1e3,
                       "gb_per_s": nbytes / lat / 1e9, "export_ms": export * 1e3,
                       "all_ms": [t * 1e3 for t in times]}  # fmt: skip
                rows.append(row)
                print(f"{backend:5s} {tokens:6d} tokens {nbytes / 2**20:8.1f} MiB  {lat * 1e3:9.2f} ms  "
                      f"{row['gb_per_s']:6.2f} GB/s  (export {export * 1e3:.2f} ms)", flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.join(10)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": mp.cpu_count(),
        "shape": args.shape,
        "dtype": args.dtype,
        "kv_bytes_per_token": per_token,
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
