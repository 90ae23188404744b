"""Soak on the CPU: a real `conduit serve` (SmolLM2-135M-Instruct) under steady closed-loop load for a
long time, sampling every --interval seconds: RSS of the server and its engine process, KV pages in
use, requests done and failed, wrong answers, and the window's latency percentiles (TTFT and end to end).

Every request is greedy on one of a few fixed prompts, so each answer must equal the first one seen for
its prompt (a changed answer counts as wrong). At the end the load stops and the KV pages must all come
back. Writes <out>/soak.jsonl (one line per sample), <out>/summary.json and the plot (--plot).

    python benchmarks/soak_cpu.py --minutes 30 --out out/soak --plot docs/img/soak_cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.launch import conduit_serve, free_port, launch  # noqa: E402

PROMPTS = [
    "Write one sentence about the sea.",
    "List three fruits.",
    "What is the capital of Italy?",
    "Explain what a CPU does in one sentence.",
    "Name a famous painter.",
    "Give me a word that rhymes with light.",
]


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def rss_mib(pid: int) -> float:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**20


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Load:
    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.done = self.failed = self.wrong = 0
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.answers: dict[int, str] = {}
        self.errors: dict[str, int] = {}

    async def one(self, s: aiohttp.ClientSession, k: int) -> None:
        body = {
            "messages": [{"role": "user", "content": PROMPTS[k]}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        t0 = time.monotonic()
        first = None
        text = []
        try:
            async with s.post(f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                    if piece:
                        first = first or time.monotonic()
                        text.append(piece)
        except Exception as e:  # counted, never fatal: the soak reports failures
            self.failed += 1
            self.errors[str(e)[:80]] = self.errors.get(str(e)[:80], 0) + 1
            return
        end = time.monotonic()
        answer = "".join(text)
        if self.answers.setdefault(k, answer) != answer:
            self.wrong += 1
        self.done += 1
        self.e2e.append(end - t0)
        if first is not None:
            self.ttft.append(first - t0)

    async def client(self, s: aiohttp.ClientSession, i: int, stop: asyncio.Event) -> None:
        k = i
        while not stop.is_set():
            await self.one(s, k % len(PROMPTS))
            k += 1

    def window(self) -> dict:
        out = {
            "ttft_p50": pct(self.ttft, 0.5),
            "ttft_p99": pct(self.ttft, 0.99),
            "e2e_p50": pct(self.e2e, 0.5),
            "e2e_p99": pct(self.e2e, 0.99),
            "requests": len(self.e2e),
        }
        self.ttft, self.e2e = [], []
        return out


async def soak(url: str, pid: int, args, out: Path) -> dict:
    load = Load(url, args.max_tokens)
    stop = asyncio.Event()
    samples = []
    t_start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        clients = [asyncio.create_task(load.client(s, i, stop)) for i in range(args.concurrency)]
        with open(out / "soak.jsonl", "w") as f:
            while (elapsed := time.monotonic() - t_start) < args.minutes * 60:
                await asyncio.sleep(args.interval)  # the sampling period
                m = await asyncio.to_thread(metrics, url)
                sample = {
                    "t_s": round(time.monotonic() - t_start, 1),
                    "rss_mib": round(rss_mib(pid), 1),
                    "kv_pages_used": m.get("conduit_kv_pages_used"),
                    "running": m.get("conduit_num_requests_running"),
                    "done": load.done,
                    "failed": load.failed,
                    "wrong": load.wrong,
                    **load.window(),
                }
                samples.append(sample)
                f.write(json.dumps(sample) + "\n")
                f.flush()
                print(json.dumps(sample), flush=True)
        stop.set()
        await asyncio.gather(*clients)
    deadline = time.monotonic() + 60
    while (m := metrics(url))["conduit_kv_pages_used"] != 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # polling the server's gauge after the load stopped
    return {"samples": samples, "load": load, "kv_after": m["conduit_kv_pages_used"], "elapsed_s": elapsed}


def summarize(result: dict, args, server_args: list[str]) -> dict:
    samples, load = result["samples"], result["load"]
    fifth = max(1, len(samples) // 5)
    first, last = samples[:fifth], samples[-fifth:]

    def med(rows, key):
        vals = [r[key] for r in rows if r[key] is not None]
        return round(statistics.median(vals), 4) if vals else None

    return {
        "minutes": round(result["elapsed_s"] / 60, 1),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "server_args": server_args,
        "requests_done": load.done,
        "requests_failed": load.failed,
        "answers_changed": load.wrong,
        "errors": load.errors,
        "rss_mib_first_fifth": med(first, "rss_mib"),
        "rss_mib_last_fifth": med(last, "rss_mib"),
        "rss_mib_max": max(r["rss_mib"] for r in samples),
        "kv_pages_used_max": max(r["kv_pages_used"] or 0 for r in samples),
        "kv_pages_after_load": result["kv_after"],
        "e2e_p50_s_first_fifth": med(first, "e2e_p50"),
        "e2e_p50_s_last_fifth": med(last, "e2e_p50"),
        "e2e_p99_s_first_fifth": med(first, "e2e_p99"),
        "e2e_p99_s_last_fifth": med(last, "e2e_p99"),
        "ttft_p50_s_first_fifth": med(first, "ttft_p50"),
        "ttft_p50_s_last_fifth": med(last, "ttft_p50"),
    }


def plot(samples: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    fig, ax = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    rss = [s["rss_mib"] for s in samples]
    ax[0].plot(t, rss)
    ax[0].set_ylim(min(rss) - 100, max(rss) + 100)  # growth would show; noise of 0.1 MiB does not
    ax[0].ticklabel_format(axis="y", useOffset=False)
    ax[0].set_ylabel("RSS (MiB)\nserver + engine")
    ax[1].plot(t, [s["kv_pages_used"] for s in samples])
    ax[1].set_ylabel("KV pages used")
    for key, label in (("e2e_p50", "E2E p50"), ("e2e_p99", "E2E p99"), ("ttft_p50", "TTFT p50"),
                       ("ttft_p99", "TTFT p99")):  # fmt: skip
        ax[2].plot(t, [s[key] for s in samples], label=label)
    ax[2].set_ylabel("latency (s)")
    ax[2].legend(loc="upper right", fontsize=8)
    ax[3].plot(t, [s["done"] for s in samples], label="done")
    ax[3].plot(t, [s["failed"] for s in samples], label="failed")
    ax[3].plot(t, [s["wrong"] for s in samples], label="answer changed")
    ax[3].set_ylabel("requests (cumulative)")
    ax[3].set_xlabel("minutes")
    ax[3].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=15.0, help="seconds between samples")
    p.add_argument("--concurrency", type=int, default=4, help="clients, each one request at a time")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default="out/soak")
    p.add_argument("--plot", default=None, help="PNG path")
    p.add_argument("--server-args", default="--cpu-threads 1", help="flags for conduit serve")
    p.add_argument("--replot", metavar="SOAK_JSONL", help="only draw --plot from a finished run's samples")
    args = p.parse_args()
    if args.replot:
        samples = [json.loads(line) for line in Path(args.replot).read_text().splitlines()]
        minutes = round(samples[-1]["t_s"] / 60, 1)
        plot(samples, args.plot, f"Soak (CPU): SmolLM2-135M, {args.concurrency} clients, {minutes} min")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server_args = args.server_args.split()
    with launch(conduit_serve(port, *server_args), port, out / "server.log") as server:
        result = asyncio.run(soak(server.url, server.proc.pid, args, out))
    summary = summarize(result, args, server_args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if args.plot:
        plot(result["samples"], args.plot, f"Soak (CPU): SmolLM2-135M, {args.concurrency} clients, "
             f"{summary['minutes']} min")  # fmt: skip
    ok = (
        not summary["requests_failed"]
        and not summary["answers_changed"]
        and not summary["kv_pages_after_load"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
