"""`loadgen trace FILE`: where a server's device time went, from the scheduler's step trace
(`CONDUIT_STEP_TRACE=FILE conduit serve ...`, one JSON line per step). Steps are grouped by what they
held: decode-only steps by batch size, steps with prefill tokens by chunk size. The gaps between
consecutive steps are device idle time (overlap scheduling should keep it near zero)."""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from loadgen.errors import LoadgenError


@dataclass
class Group:
    steps: int = 0
    device_s: float = 0.0
    decode_rows: int = 0
    prefill_tokens: int = 0


def kind(step: dict) -> str:
    """A step's group: `decode B<=n` or `prefill <=n tokens` (n a power of two), `empty` for none."""
    if step["prefill_tokens"]:
        return f"prefill <={1 << (step['prefill_tokens'] - 1).bit_length()} tokens"
    if step["decode"]:
        return f"decode B<={1 << (step['decode'] - 1).bit_length()}"
    return "empty"


def summarize(steps: list[dict]) -> tuple[dict[str, Group], float]:
    """Groups by kind, and the device idle time between consecutive steps."""
    groups: dict[str, Group] = defaultdict(Group)
    for s in steps:
        g = groups[kind(s)]
        g.steps += 1
        g.device_s += s["gpu_end"] - s["gpu_start"]
        g.decode_rows += s["decode"]
        g.prefill_tokens += s["prefill_tokens"]
    idle = sum(max(0.0, b["gpu_start"] - a["gpu_end"]) for a, b in itertools.pairwise(steps))
    return dict(groups), idle


def load(path: Path) -> list[dict]:
    try:
        steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise LoadgenError(f"cannot read the step trace {path}: {e}") from e
    if not steps:
        raise LoadgenError(f"{path} holds no steps")
    return sorted(steps, key=lambda s: s["gpu_start"])


def report(groups: dict[str, Group], idle: float) -> str:
    total = sum(g.device_s for g in groups.values())
    lines = [
        f"{'steps':<24}{'count':>8}{'device s':>11}{'share':>8}{'mean ms':>10}{'decode rows':>13}{'prefill':>10}"
    ]
    for name, g in sorted(groups.items(), key=lambda kv: -kv[1].device_s):
        lines.append(
            f"{name:<24}{g.steps:>8}{g.device_s:>11.2f}{100 * g.device_s / max(total, 1e-9):>7.1f}%"
            f"{1e3 * g.device_s / g.steps:>10.2f}{g.decode_rows:>13}{g.prefill_tokens:>10}"
        )
    lines.append(f"device busy {total:.2f} s, idle between steps {idle:.3f} s")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, help="the file CONDUIT_STEP_TRACE named")


def main(args: argparse.Namespace) -> int:
    print(report(*summarize(load(args.path))))
    return 0
