"""The end-of-run table, the results JSON, and `loadgen compare`."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loadgen.errors import LoadgenError
from loadgen.metrics import LATENCIES, STATS, Metrics
from loadgen.records import RequestResult

W = 50

SCALARS = (  # (field, label)
    ("completed", "Successful requests"),
    ("failed", "Failed requests"),
    ("duration_s", "Benchmark duration (s)"),
    ("total_input_tokens", "Total input tokens"),
    ("total_output_tokens", "Total generated tokens"),
    ("request_throughput", "Request throughput (req/s)"),
    ("input_throughput", "Input token throughput (tok/s)"),
    ("output_throughput", "Output token throughput (tok/s)"),
    ("total_throughput", "Total token throughput (tok/s)"),
    ("concurrency", "Concurrency"),
)
LATENCY_LABELS = {"ttft": "Time to First Token", "itl": "Inter-Token Latency", "tpot": "Time per Output Token",
                  "e2e": "End-to-End Latency"}  # fmt: skip


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def table(m: Metrics, title: str = "Serving Benchmark Result", extra: dict | None = None) -> str:
    lines = [f" {title} ".center(W, "=")]
    for k, v in (extra or {}).items():
        lines.append(f"{k + ':':<38}{v:>12}")
    for key, label in SCALARS:
        lines.append(f"{label + ':':<38}{_fmt(getattr(m, key)):>12}")
    if m.retokenized_output_tokens is not None:
        lines.append(f"{'Retokenized generated tokens:':<38}{m.retokenized_output_tokens:>12}")
        lines.append(f"{'Usage/retokenized mismatches:':<38}{m.token_mismatches:>12}")
    if m.completed and m.usage_reported < m.completed:
        lines.append(f"{'Answers without usage (chunks counted):':<38}{m.completed - m.usage_reported:>12}")
    for lat in LATENCIES:
        s = getattr(m, f"{lat}_ms")
        lines.append(f" {LATENCY_LABELS[lat]} ".center(W, "-"))
        for stat in STATS:
            lines.append(f"{f'{stat.capitalize()} {lat.upper()} (ms):':<38}{getattr(s, stat):>12.2f}")
    lines.append("=" * W)
    return "\n".join(lines)


def failure_summary(results: list[RequestResult], limit: int = 3) -> list[str]:
    """The most common errors, one line each: `37 x HTTP 500: engine failed`."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            counts[r.error] = counts.get(r.error, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [f"{n} x {err}" for err, n in top]


def results_json(config: dict, server_models, started_at: float, metrics: Metrics,
                 results: list[RequestResult], gpu: dict | None = None) -> dict:  # fmt: skip
    return {
        "config": config,
        "server_models": server_models,
        "started_at": started_at,  # time.time() at the benchmark start; request times are offsets from it
        "metrics": metrics.to_json(),
        "gpu": gpu,  # per GPU, its SM clock and power under load in the run (gpu_clock.py); None: no nvidia-smi
        "requests": [r.to_json() for r in results],
    }


def strict(value):
    """`value` with every non-finite float (an infinite request rate, a ratio over zero) as None: strict
    JSON has no Infinity or NaN, and parsers other than Python's reject them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def write_json(path: str, doc: dict) -> None:
    Path(path).write_text(json.dumps(strict(doc), indent=1, allow_nan=False))


def load_json(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise LoadgenError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise LoadgenError(f"{path}: bad JSON: {e}") from None
    if not isinstance(doc, dict) or "metrics" not in doc:
        raise LoadgenError(f"{path}: not a loadgen results file (no 'metrics')")
    return doc


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Metrics of two runs side by side with the ratio B/A."""
    ma, mb = Metrics.from_json(a["metrics"]), Metrics.from_json(b["metrics"])
    rows = [(label, getattr(ma, k), getattr(mb, k)) for k, label in SCALARS]
    for lat in LATENCIES:
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {lat.upper()} (ms)", getattr(getattr(ma, f"{lat}_ms"), stat),
                         getattr(getattr(mb, f"{lat}_ms"), stat)))  # fmt: skip
    na, nb = _column_names(name_a, name_b)
    w = max(14, len(na) + 2, len(nb) + 2)
    lines = [f"{'metric':<34}{na:>{w}}{nb:>{w}}{'B/A':>9}", "-" * (43 + 2 * w)]
    for label, va, vb in rows:
        ratio = f"{vb / va:.3f}" if va else "-"
        lines.append(f"{label:<34}{_fmt(va):>{w}}{_fmt(vb):>{w}}{ratio:>9}")
    return "\n".join(lines)


def _column_names(a: str, b: str) -> tuple[str, str]:
    """Whole file names (the columns widen to fit), with as many parent folders as tell them apart."""
    pa, pb = Path(a).parts, Path(b).parts
    for k in range(1, max(len(pa), len(pb)) + 1):
        na, nb = str(Path(*pa[-k:])), str(Path(*pb[-k:]))
        if na != nb:
            return na, nb
    return a, b
