"""Server start-up and shutdown on the CPU (docs/PERF.md, "Server start-up and shutdown (CPU)").

Starts `conduit serve` on the embedded SmolLM2-135M-Instruct `--rounds` times, one after the other,
and per round times process start -> /health answering 200 (ready) and SIGTERM -> exit (stop), with
the launcher the tests and `loadgen ab` use. Prints
each round and the medians. The model must be converted already (the first `conduit serve` does it).

    python -m benchmarks.startup_cpu --rounds 5   # from the repository root
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from loadgen.launch import conduit_serve, free_port, launch


def one_round(log_dir: Path) -> tuple[float, float]:
    """(seconds to a healthy server, seconds from SIGTERM to its exit); `launch` polls /health every
    0.2 s, so `ready` may read up to 0.2 s late."""
    port = free_port()
    t0 = time.perf_counter()
    with launch(conduit_serve(port), port, log_dir / f"server-{port}.log"):
        ready = time.perf_counter() - t0
        t1 = time.perf_counter()
    return ready, time.perf_counter() - t1  # leaving `launch` sends SIGTERM and waits for the exit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    runs = []
    log_dir = Path(tempfile.mkdtemp(prefix="startup-"))
    for i in range(args.rounds):
        ready, stop = one_round(log_dir)
        runs.append((ready, stop))
        print(f"round {i + 1}: ready {ready:.2f} s, stop {stop:.2f} s", flush=True)
    print(
        f"median of {args.rounds}: ready {statistics.median(r for r, _ in runs):.2f} s, "
        f"stop {statistics.median(s for _, s in runs):.2f} s"
    )


if __name__ == "__main__":
    main()
