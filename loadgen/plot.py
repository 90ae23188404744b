"""`--plot out.png`: latency CDFs, output throughput and in-flight requests over time, TTFT vs input."""

from __future__ import annotations

import numpy as np

from loadgen.records import RequestResult


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    x = np.sort(np.asarray(values_ms))
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{label} (n={len(x)})")


def output_rate(results: list[RequestResult], bins: int = 60) -> tuple[np.ndarray, np.ndarray, float]:
    """Output tokens per second over time: each request's tokens are spread over its content chunks."""
    times, weights = [], []
    for r in results:
        if not r.success or r.output_chunks == 0:
            continue
        chunk_t = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
        times.extend(chunk_t)
        weights.extend([r.output_tokens / len(chunk_t)] * len(chunk_t))
    if not times:
        return np.zeros(0), np.zeros(0), 1.0
    end = max(times)
    width = max(end / bins, 1e-3)
    edges = np.arange(0.0, end + width, width)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1] + width / 2, counts / width, width


def plot(results: list[RequestResult], path: str, title: str = "loadgen") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0][0]
    _cdf(ax, [r.ttft_s * 1e3 for r in ok], "TTFT")
    _cdf(ax, [g * 1e3 for r in ok for g in r.itl_s], "ITL")
    _cdf(ax, [r.e2e_s * 1e3 for r in ok], "E2E")
    ax.set_xscale("log")
    ax.set(xlabel="latency (ms, log scale)", ylabel="fraction of requests / gaps ≤ x", title="Latency CDFs")
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[0][1]
    t, rate, width = output_rate(ok)
    ax.plot(t, rate, label=f"output tokens/s ({width:.2f} s bins)")
    ax.set(
        xlabel="time since start (s)", ylabel="output throughput (tok/s)", title="Output throughput over time"
    )
    ax.grid(True, alpha=0.3)

    ax = axes[1][0]
    ax.scatter(
        [r.input_tokens for r in ok], [r.ttft_s * 1e3 for r in ok], s=8, alpha=0.6, label="completed request"
    )
    ax.set(xlabel="input length (tokens)", ylabel="TTFT (ms)", title="TTFT vs input length")
    ax.grid(True, alpha=0.3)

    ax = axes[1][1]
    if results:
        events = sorted([(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results])
        ts = [e[0] for e in events]
        inflight = np.cumsum([e[1] for e in events])
        ax.step(ts, inflight, where="post", label="requests in flight")
    failed = [r for r in results if not r.success]
    if failed:
        ax.plot(
            [r.start_s for r in failed], [0] * len(failed), "rx", label=f"failed request (n={len(failed)})"
        )
    ax.set(xlabel="time since start (s)", ylabel="requests in flight", title="Concurrency over time")
    ax.grid(True, alpha=0.3)

    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
