"""`loadgen ab`: one benchmark against several server configurations on this machine, side by side.

Each variant is a server command line (by default `conduit serve` with the variant's flags, and its
own environment variables if given). Rounds interleave the variants (A B A B ...) so drift of the
machine (clocks, a cold first start) falls on all of them alike; each run starts its server on a free
loopback port, waits for /health, runs exactly what `loadgen serve` runs with the same arguments, and
stops the server before the next one starts. Per run: `<out-dir>/<variant>-r<round>.json`,
`.server.log`, and `.png` when --plot is given (its path is not used). --base-url, --host, --port and
--out do not apply. At the end every variant's runs are printed next to the first variant's, round by
round (the ratio column is variant / first), then a summary: each variant's output throughput per
round, its mean, and the ratio of that mean to the first variant's.

    python -m loadgen ab --out-dir out/ab --rounds 2 \\
        --variant bf16 "--model llama-3.1-8b --load-format dummy --device cuda" \\
        --variant fp8kv "--model llama-3.1-8b --load-format dummy --device cuda --kv-cache-dtype fp8_e4m3" \\
        --variant-env fp8kv CONDUIT_KERNEL_DECODE_ATTENTION=triton \\
        --backend completions --dataset-name random-ids --num-prompts 512 --random-input-len 1000 \\
        --random-output-len 1000 --random-range-ratio 1.0 --max-concurrency 256
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import shlex
from pathlib import Path

from loadgen import gpu_clock, report
from loadgen.errors import LoadgenError
from loadgen.launch import conduit_serve, free_port, launch

SERVER_CMD = shlex.join(conduit_serve("{port}"))


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("variants")
    g.add_argument("--variant", nargs=2, action="append", required=True, metavar=("NAME", "FLAGS"),
                   help="a server configuration: its name and the flags appended to --server-cmd")  # fmt: skip
    g.add_argument("--variant-env", nargs=2, action="append", default=[], metavar=("NAME", "KEY=VALUE"),
                   help="an environment variable for one variant's server (repeatable)")  # fmt: skip
    g.add_argument("--server-cmd", default=SERVER_CMD,
                   help="command that serves on 127.0.0.1:{port} (default: conduit serve)")  # fmt: skip
    g.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all variants")
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    g.add_argument("--out-dir", required=True, help="one results JSON (and log, plot) per run")


def plan(args) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv template, env) per variant, checked: unique names, env entries naming a variant."""
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        raise LoadgenError(f"--variant names must differ, got {names}")
    env: dict[str, dict[str, str]] = {name: {} for name in names}
    for name, kv in args.variant_env:
        key, sep, value = kv.partition("=")
        if name not in env or not sep or not key:
            raise LoadgenError(f"--variant-env {name} {kv}: needs a --variant name and KEY=VALUE")
        env[name][key] = value
    if "{port}" not in args.server_cmd:
        raise LoadgenError("--server-cmd must contain {port}")
    if args.rounds < 1:
        raise LoadgenError("--rounds must be >= 1")
    return [
        (name, shlex.split(args.server_cmd) + shlex.split(flags), env[name]) for name, flags in args.variant
    ]


def run(args) -> int:
    from loadgen.serve import run as serve

    variants = plan(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[str]] = {name: [] for name, _, _ in variants}
    status = 0
    for rnd in range(1, args.rounds + 1):
        for name, template, env in variants:
            port = free_port()
            cmd = [part.replace("{port}", str(port)) for part in template]
            stem = out_dir / f"{name}-r{rnd}"
            print(f"=== {name}, round {rnd}: {shlex.join(cmd)}", flush=True)
            run_args = copy.copy(args)
            run_args.base_url, run_args.out = f"http://127.0.0.1:{port}", f"{stem}.json"
            run_args.plot = f"{stem}.png" if args.plot else None
            with launch(cmd, port, Path(f"{stem}.server.log"), args.server_timeout, env):
                status = max(status, asyncio.run(serve(run_args)))
            results[name].append(run_args.out)
    first = variants[0][0]
    for name, _, _ in variants[1:]:
        for rnd, (a, b) in enumerate(zip(results[first], results[name], strict=True), 1):
            print(f"\n{name} vs {first}, round {rnd}")
            print(report.compare(report.load_json(a), report.load_json(b), first, name))
    print("\n" + summary(results))
    return status


def summary(results: dict[str, list[str]]) -> str:
    """Output throughput of every run, the mean per variant and its ratio to the first variant's; then,
    where nvidia-smi was sampled, each run's mean SM clock under load (throughput follows it)."""
    docs = {name: [report.load_json(p) for p in paths] for name, paths in results.items()}
    rows = {name: [d["metrics"]["output_throughput"] for d in ds] for name, ds in docs.items()}
    means = {name: sum(v) / len(v) for name, v in rows.items()}
    base = next(iter(means.values()))
    lines = [f"{'output tok/s':<16}{'rounds':>30}{'mean':>12}{'x first':>9}"]
    for name, values in rows.items():
        per_round = " ".join(f"{v:,.1f}" for v in values)
        ratio = f"{means[name] / base:.3f}" if base else "-"
        lines.append(f"{name[:16]:<16}{per_round:>30}{means[name]:>12,.1f}{ratio:>9}")
    if any(d.get("gpu") for ds in docs.values() for d in ds):
        lines.append(f"{'SM clock (MHz)':<16}{'rounds':>30}")
        for name, ds in docs.items():
            gpus = [gpu_clock.first_gpu(d.get("gpu")) for d in ds]
            clocks = [f"{g['sm_clock_mhz']['mean']:,.0f}" if g else "-" for g in gpus]
            lines.append(f"{name[:16]:<16}{' '.join(clocks):>30}")
    return "\n".join(lines)
