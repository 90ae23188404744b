"""`loadgen`: serve (benchmark a running server), ab (start several server configurations in turn and
benchmark each), compare (two result files), steps (engine steps), sched (scheduler cost), trace (a
server's step trace by kind of step)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from loadgen.backends import BACKENDS
from loadgen.datasets import DATASETS
from loadgen.errors import LoadgenError


def _serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:30000 (the only address contacted)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    g.add_argument("--backend", choices=BACKENDS, default="chat", help="protocol (default: chat)")
    g.add_argument("--ws-endpoint", choices=("chat", "completions"), default="chat",
                   help="which OpenAI request the ws backend sends")  # fmt: skip
    g.add_argument("--ws-connections", type=int, default=1, help="sockets the ws backend multiplexes over")
    g.add_argument(
        "--tokenizer", help="local Hugging Face tokenizer directory (default: word-count estimate)"
    )

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", help="file for sharegpt (JSON) and jsonl")
    g.add_argument(
        "--num-prompts", type=int, help="requests to send (default 1000, or no limit with --duration)"
    )
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=1024, help="also the jsonl default output length")
    g.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*ratio, len]"
    )
    g.add_argument("--gsp-num-groups", type=int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    g.add_argument("--gsp-question-len", type=int, default=128)
    g.add_argument("--gsp-output-len", type=int, default=256)
    g.add_argument("--sharegpt-output-len", type=int, help="fixed output length instead of the reply's")

    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson req/s (default inf: all at once)"
    )
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    g.add_argument("--duration", type=float, help="stop sending after this many seconds (cycles the dataset)")
    g.add_argument(
        "--warmup-requests", "--warmup", type=int, default=1, help="sent before timing (default 1)"
    )
    g.add_argument("--seed", type=int, default=1)
    g.add_argument(
        "--no-ignore-eos", action="store_true", help="let the model stop early (default: ignore_eos)"
    )
    g.add_argument("--ignore-eos", dest="no_ignore_eos", action="store_false", help="the default")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    g = p.add_argument_group("output")
    g.add_argument("--out", help="write config, per-request timings, metrics and /v1/models to this JSON")
    g.add_argument("--plot", help="write latency CDFs, throughput over time and TTFT vs input to this PNG")
    g.add_argument("--disable-tqdm", action="store_true")


def _serve(args) -> int:
    from loadgen.serve import run

    return asyncio.run(run(args))


def _ab(args) -> int:
    from loadgen.ab import run

    return run(args)


def _compare(args) -> int:
    from loadgen import report

    print(report.compare(report.load_json(args.a), report.load_json(args.b), args.a, args.b))
    return 0


def _steps(args) -> int:
    from loadgen.steps import main as steps_main

    return steps_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loadgen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server")
    _serve_args(p)
    p.set_defaults(func=_serve)
    from loadgen import ab

    p = sub.add_parser(
        "ab",
        help="start each --variant server in turn, run the same benchmark on each, print them side by side",
        description=ab.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _serve_args(p)
    ab.add_args(p)
    p.set_defaults(func=_ab)
    p = sub.add_parser("compare", help="print two results files side by side with ratios")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(func=_compare)
    try:
        from loadgen.steps import add_args as steps_args
    except ImportError:
        steps_args = None
    if steps_args:
        p = sub.add_parser("steps", help="time engine steps (prefill, decode) without HTTP")
        steps_args(p)
        p.set_defaults(func=_steps)
    from loadgen import sched_bench, step_trace

    p = sub.add_parser("sched", help="scheduler planning cost per step with a null model (CPU)")
    sched_bench.add_args(p)
    p.set_defaults(func=sched_bench.main)
    p = sub.add_parser("trace", help="a server's device time by kind of step, from CONDUIT_STEP_TRACE")
    step_trace.add_args(p)
    p.set_defaults(func=step_trace.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except LoadgenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
