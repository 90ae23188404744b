"""N-gram speculation against plain decoding on the CPU, side by side in one run (docs/PERF.md,
"Speculative decoding (CPU)").

Both variants' servers run at once (`conduit serve` on the embedded SmolLM2-135M-Instruct, one torch
thread each); every (workload, streams) point runs on one and then the other, back to back, in an order
swapped every round, so a machine whose load drifts weighs on both alike. Two workloads at 1 and 8
concurrent streams through loadgen (chat endpoint, greedy, the answers' natural lengths, which are the
same for both variants: the speculation is lossless): `repetitive` (prompts whose answers repeat what the prompt holds: lists, code,
a sentence to copy) and `chat` (ordinary questions). Per run: output tok/s, TPOT, and from the server's
/metrics the drafts verified and accepted and the mean accepted length. Everything lands under
--out-dir (loadgen JSON per run, server logs, summary.json).

    python -m benchmarks.speculative_cpu --rounds 2 --out-dir out/speculative_cpu   # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

from benchmarks.gateway_cache_aware import scrape, wait_idle
from loadgen.cli import build_parser as loadgen_parser
from loadgen.launch import conduit_serve, free_port, launch
from loadgen.serve import run as loadgen_run

REPETITIVE = [
    "Repeat this sentence exactly five times: The quick brown fox jumps over the lazy dog.",
    "Write the numbers from 1 to 40, separated by commas.",
    "Copy this list twice: apples, pears, plums, grapes, lemons, cherries, figs, dates.",
    "Complete the Python code:\n\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\ndef div(a, b):",
    "Write the alphabet in capital letters, separated by spaces, two times.",
    "Repeat after me three times: I will not waste time. I will not waste time.",
    "List the days of the week, then list them again in the same order.",
    "Write a multiplication table for 7, from 7 x 1 to 7 x 12, one line each.",
]
CHAT = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue? Answer briefly.",
    "What is a good name for a black cat?",
    "Explain what a prime number is to a child.",
    "What should I pack for a weekend at the beach?",
    "How do plants make their food?",
    "Suggest a short poem title about autumn.",
]
VARIANTS = {"plain": [], "ngram": ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4"]}
SPEC = (
    "conduit_spec_draft_tokens_total",
    "conduit_spec_accepted_tokens_total",
    "conduit_spec_verify_rows_total",
)


def write_dataset(path: Path, prompts: list[str], output_len: int) -> None:
    path.write_text("".join(json.dumps({"prompt": p, "output_len": output_len}) + "\n" for p in prompts))


def bench(url: str, dataset: Path, n: int, concurrency: int, out: Path) -> dict:
    args = loadgen_parser().parse_args([
        "serve", "--base-url", url, "--backend", "chat", "--dataset-name", "jsonl", "--dataset-path", str(dataset),
        "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--temperature", "0", "--no-ignore-eos",
        "--disable-tqdm", "--out", str(out),
    ])  # fmt: skip
    before = scrape(url)
    asyncio.run(loadgen_run(args))
    after = wait_idle(url)
    res = json.loads(out.read_text())["metrics"]
    spec = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC}
    rows = spec["conduit_spec_verify_rows_total"]
    return {
        "output_tok_s": res["output_throughput"],
        "tpot_ms": res["tpot_ms"]["mean"],
        "completed": res["completed"],
        "drafted": spec["conduit_spec_draft_tokens_total"],
        "accepted": spec["conduit_spec_accepted_tokens_total"],
        "accept_length": (spec["conduit_spec_accepted_tokens_total"] + rows) / rows if rows else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--out-dir", default="out/speculative_cpu")
    a = p.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"repetitive": out / "repetitive.jsonl", "chat": out / "chat.jsonl"}
    write_dataset(data["repetitive"], REPETITIVE, a.output_len)
    write_dataset(data["chat"], CHAT, a.output_len)
    results = []
    with contextlib.ExitStack() as stack:
        urls = {}
        for variant, flags in VARIANTS.items():  # both servers up at once, each on one torch thread
            port = free_port()
            cmd = conduit_serve(port, "--cpu-threads", "1", *flags)
            urls[variant] = stack.enter_context(
                launch(cmd, port, out / f"{variant}.server.log", timeout=600)
            ).url
        for r in range(a.rounds):
            for workload, path in data.items():
                for conc in (1, 8):
                    # the variants back to back, their order swapped every round (A B, B A, ...): a
                    # machine whose load drifts over minutes weighs on both alike
                    order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
                    for variant in order:
                        name = f"{variant}-{workload}-c{conc}-r{r}"
                        n = 2 * len(REPETITIVE) if conc == 8 else 4
                        row = bench(urls[variant], path, n, conc, out / f"{name}.json")
                        row |= {"variant": variant, "workload": workload, "concurrency": conc, "round": r}
                        print(json.dumps(row), flush=True)
                        results.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "results": results,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for workload in data:
        for conc in (1, 8):
            tok = {
                v: [
                    x["output_tok_s"]
                    for x in results
                    if (x["variant"], x["workload"], x["concurrency"]) == (v, workload, conc)
                ]
                for v in VARIANTS
            }  # noqa: E501
            ratio = sum(tok["ngram"]) / max(1e-9, sum(tok["plain"]))
            print(f"{workload:10s} c={conc}: plain {tok['plain']} ngram {tok['ngram']} -> x{ratio:.3f}")


if __name__ == "__main__":
    main()
