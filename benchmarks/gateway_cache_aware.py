"""Cache-aware routing against round robin, side by side in one run (docs/PERF.md, "Gateway:
cache-aware routing (CPU)").

Starts N `conduit serve` replicas of the embedded SmolLM2-135M-Instruct on the CPU, then for each
policy in turn (rounds alternate the order's repeats: A B A B ...) flushes the replicas' prefix caches,
starts `conduit gateway --policy P` in front of them and runs loadgen's `shared-prefix` dataset through
it (several groups, each a long shared system prompt and short questions, shuffled together). Per run:
the replicas' prefix-cache hit rate (cached / admitted prompt tokens, the difference of their
/metrics counters over the run), TTFT mean / p50 / p99, request and output throughput, and the
gateway's routing decisions; then the dataset's first --check-outputs prompts are sent again, greedy,
and their answers compared across runs (the same text whichever replica and cache served them).
Everything lands under --out-dir (loadgen JSON per run, server and
gateway logs, summary.json).

    python -m benchmarks.gateway_cache_aware --rounds 2 --out-dir out/gateway_cache_aware   # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from loadgen.cli import build_parser as loadgen_parser
from loadgen.launch import Launched, conduit_serve, free_port, launch
from loadgen.serve import run as loadgen_run

CACHED = "conduit_engine_prefix_cache_hit_tokens_total"
PROMPT = "conduit_engine_prompt_tokens_total"


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def post(url: str, body: dict | None = None) -> int:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """Poll a replica's /metrics until nothing runs or waits and no KV page is held (its stats arrive a
    step after the last output; there is no event to wait on)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if (
            m.get("conduit_num_requests_running") == 0
            and m.get("conduit_num_requests_waiting") == 0
            and m.get("conduit_kv_pages_used") == 0
        ):
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not idle: {m}")
        time.sleep(0.1)


def flush(url: str) -> None:
    wait_idle(url)
    if (status := post(f"{url}/flush_cache")) != 200:
        raise RuntimeError(f"POST {url}/flush_cache answered {status}")


@contextlib.contextmanager
def replicas(n: int, out_dir: Path, flags: list[str], threads: int):
    """`n` conduit serve processes started together, `threads` torch threads each; all stopped on exit."""
    env = {"OMP_NUM_THREADS": str(threads)}
    managers = []
    for _ in range(n):
        port = free_port()
        log = out_dir / f"replica-{port}.log"
        managers.append(launch(conduit_serve(port, *flags), port, log, 600, env))
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(cm.__enter__) for cm in managers]
        servers: list[Launched] = []
        errors = []
        for cm, f in zip(managers, futures, strict=True):
            try:
                servers.append(f.result())
                stack.push(cm.__exit__)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]
        yield servers


def gateway_cmd(port: int, policy: str, workers: list[str]) -> list[str]:
    return [sys.executable, "-m", "runtime.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--worker-urls", *workers]  # fmt: skip


def one_run(args, policy: str, servers: list[Launched], out_dir: Path, tag: str, tokenizer: str) -> dict:
    urls = [s.url for s in servers]
    for u in urls:
        flush(u)
    before = [wait_idle(u) for u in urls]
    port = free_port()
    result = out_dir / f"{tag}.json"
    with launch(gateway_cmd(port, policy, urls), port, out_dir / f"{tag}.gateway.log", 60) as gw:
        lg = loadgen_parser().parse_args(
            ["serve", "--base-url", gw.url, "--tokenizer", tokenizer, "--dataset-name", "shared-prefix",
             "--gsp-num-groups", str(args.groups), "--gsp-prompts-per-group", str(args.per_group),
             "--gsp-system-prompt-len", str(args.system_len), "--gsp-question-len", str(args.question_len),
             "--gsp-output-len", str(args.output_len), "--request-rate", str(args.request_rate),
             "--max-concurrency", str(args.max_concurrency), "--warmup-requests", "0", "--seed", str(args.seed),
             "--disable-tqdm", "--out", str(result)]
        )  # fmt: skip
        status = asyncio.run(loadgen_run(lg))
        decisions = {
            k.split('kind="')[1].split('"')[0]: v
            for k, v in scrape(gw.url).items()
            if k.startswith("conduit_gateway_routing_decisions_total")
        }
        after = [wait_idle(u) for u in urls]
        # not counted above: the same answers, whichever replica and cache gave them?
        outputs = [
            greedy(gw.url, p.prompt, args.output_len)
            for p in check_prompts(lg, tokenizer, args.check_outputs)
        ]
    cached = sum(a[CACHED] - b[CACHED] for a, b in zip(after, before, strict=True))
    prompt = sum(a[PROMPT] - b[PROMPT] for a, b in zip(after, before, strict=True))
    per_replica = [round(a[PROMPT] - b[PROMPT]) for a, b in zip(after, before, strict=True)]
    m = json.loads(result.read_text())["metrics"]
    return {
        "policy": policy,
        "tag": tag,
        "loadgen_status": status,
        "hit_rate": cached / max(prompt, 1),
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "prompt_tokens_per_replica": per_replica,
        "decisions": decisions,
        "outputs": outputs,
        "completed": m["completed"],
        "failed": m["failed"],
        "duration_s": m["duration_s"],
        "ttft_ms": m["ttft_ms"],
        "request_throughput": m["request_throughput"],
        "output_throughput": m["output_throughput"],
    }


def check_prompts(lg: argparse.Namespace, tokenizer: str, n: int) -> list:
    """The first `n` prompts of the run's dataset (loadgen builds it the same way from its seed)."""
    import numpy as np

    from loadgen import datasets
    from loadgen.tokens import load_codec

    prompts = datasets.build(lg, load_codec(tokenizer), 1000, np.random.default_rng(lg.seed))
    return prompts[:n]


def greedy(url: str, prompt: str, max_tokens: int) -> str:
    """One request as loadgen's chat backend sends it, answered whole."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def table(runs: list[dict]) -> str:
    rows = [
        ("prefix-cache hit rate", lambda r: f"{r['hit_rate']:.1%}"),
        ("cached / prompt tokens", lambda r: f"{r['cached_tokens']:,.0f} / {r['prompt_tokens']:,.0f}"),
        ("prompt tokens per replica", lambda r: " ".join(f"{n:,}" for n in r["prompt_tokens_per_replica"])),
        ("TTFT mean (ms)", lambda r: f"{r['ttft_ms']['mean']:,.0f}"),
        ("TTFT p50 (ms)", lambda r: f"{r['ttft_ms']['median']:,.0f}"),
        ("TTFT p99 (ms)", lambda r: f"{r['ttft_ms']['p99']:,.0f}"),
        ("requests/s", lambda r: f"{r['request_throughput']:.3f}"),
        ("output tok/s", lambda r: f"{r['output_throughput']:.1f}"),
        ("duration (s)", lambda r: f"{r['duration_s']:.1f}"),
        ("completed / failed", lambda r: f"{r['completed']} / {r['failed']}"),
        ("decisions", lambda r: " ".join(f"{k}={v:.0f}" for k, v in sorted(r["decisions"].items()))),
    ]
    width = max(26, *(len(r["tag"]) + 2 for r in runs))
    lines = [f"{'':<28}" + "".join(f"{r['tag']:>{width}}" for r in runs)]
    for name, cell in rows:
        lines.append(f"{name:<28}" + "".join(f"{cell(r):>{width}}" for r in runs))
    return "\n".join(lines)


def machine() -> dict:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": sh("git rev-parse --short HEAD") + (" (dirty)" if sh("git status --porcelain") else ""),
        "cpu": sh("lscpu | sed -n 's/^Model name: *//p'"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out/gateway_cache_aware")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--rounds", type=int, default=1, help="each policy once per round, in the given order")
    p.add_argument("--groups", type=int, default=8, help="shared system prompts")
    p.add_argument("--per-group", type=int, default=6, help="questions per system prompt")
    p.add_argument("--system-len", type=int, default=512, help="tokens of each system prompt")
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=6)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--check-outputs",
        type=int,
        default=8,
        help="after each run, send the dataset's first N prompts again (greedy) and compare the answers "
        "across runs",
    )
    p.add_argument("--serve-flags", default="", help="extra `conduit serve` flags for every replica")
    p.add_argument(
        "--replica-threads",
        type=int,
        default=1,
        help="torch threads per replica (OMP_NUM_THREADS): 3 replicas on 2 cores run far faster with 1",
    )
    args = p.parse_args(argv)

    from runtime.gpu.convert import default_model_path  # the embedded model, converted once

    tokenizer = str(default_model_path())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(json.dumps(info), flush=True)
    runs = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the replicas and gateway stop
    with replicas(args.replicas, out_dir, args.serve_flags.split(), args.replica_threads) as servers:
        for s in servers:  # warm every replica once, so no run pays the first request's start-up
            post(f"{s.url}/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        for rnd in range(1, args.rounds + 1):
            for policy in args.policies:
                tag = f"{policy}-r{rnd}"
                print(f"=== {tag}", flush=True)
                runs.append(one_run(args, policy, servers, out_dir, tag, tokenizer))
    info["loadavg_end"] = os.getloadavg()
    summary = {"machine": info, "args": {k: v for k, v in vars(args).items()}, "runs": runs}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print()
    print(table(runs))
    same = [i for i in range(args.check_outputs) if len({r["outputs"][i] for r in runs}) == 1]
    print(
        f"\noutputs of the first {args.check_outputs} prompts, greedy: identical in every run for {len(same)}"
    )
    for i in sorted(set(range(args.check_outputs)) - set(same)):
        print(f"  prompt {i} differs: " + " | ".join(repr(r["outputs"][i][:60]) for r in runs))
    print(
        f"\nload average at start {info['loadavg']}, at end {info['loadavg_end']}; wrote {out_dir}/summary.json"
    )
    return max((r["loadgen_status"] for r in runs), default=0)


if __name__ == "__main__":
    sys.exit(main())
