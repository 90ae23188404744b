"""Server start-up and shutdown on the CPU (docs/PERF.md, "Server start-up and shutdown (CPU)").

Starts `conduit serve` on the embedded SmolLM2-135M-Instruct `--rounds` times, one after the other,
and per round times process start -> /health answering 200 (ready) and SIGTERM -> exit (stop). Prints
each round and the medians. The model must be converted already (the first `conduit serve` does it).

    python -m benchmarks.startup_cpu --rounds 5   # from the repository root
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import time
import urllib.request

from loadgen.launch import conduit_serve, free_port


def one_round() -> tuple[float, float]:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(conduit_serve(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.05)  # polling a process we do not control; there is no event to wait on
        ready = time.perf_counter() - t0
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return ready, time.perf_counter() - t1
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    runs = []
    for i in range(args.rounds):
        ready, stop = one_round()
        runs.append((ready, stop))
        print(f"round {i + 1}: ready {ready:.2f} s, stop {stop:.2f} s", flush=True)
    print(
        f"median of {args.rounds}: ready {statistics.median(r for r, _ in runs):.2f} s, "
        f"stop {statistics.median(s for _, s in runs):.2f} s"
    )


if __name__ == "__main__":
    main()
