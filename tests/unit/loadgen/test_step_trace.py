"""`loadgen trace`: a step trace grouped by kind of step, idle gaps, and errors for unreadable files."""

from __future__ import annotations

import json

import pytest

from loadgen.cli import main
from loadgen.step_trace import kind, summarize


def step(i: int, start: float, end: float, decode: int, prefill: int) -> dict:
    return {"step": i, "rows": decode + (prefill > 0), "decode": decode, "prefill_tokens": prefill,
            "gpu_start": start, "gpu_end": end}  # fmt: skip


def test_groups_by_batch_and_chunk_size_and_counts_idle_gaps():
    steps = [step(0, 0.0, 0.4, 0, 16384), step(1, 0.4, 0.8, 16, 16000), step(2, 0.8, 0.814, 256, 0),
             step(3, 0.824, 0.838, 250, 0), step(4, 0.838, 0.842, 1, 0)]  # fmt: skip
    assert [kind(s) for s in steps] == [
        "prefill <=16384 tokens", "prefill <=16384 tokens", "decode B<=256", "decode B<=256", "decode B<=1"
    ]  # fmt: skip
    groups, idle = summarize(steps)
    assert groups["prefill <=16384 tokens"].steps == 2
    assert groups["prefill <=16384 tokens"].prefill_tokens == 32384
    assert groups["prefill <=16384 tokens"].decode_rows == 16
    assert groups["decode B<=256"].decode_rows == 506
    assert groups["decode B<=256"].device_s == pytest.approx(0.028)
    assert idle == pytest.approx(0.010)


def test_cli_prints_the_table_and_rejects_an_empty_file(tmp_path, capsys):
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(step(i, i * 0.01, i * 0.01 + 0.009, 8, 0)) for i in range(3)))
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "decode B<=8" in out and "idle between steps 0.002 s" in out  # two gaps of 1 ms
    path.write_text("")
    assert main(["trace", str(path)]) == 2
    assert "holds no steps" in capsys.readouterr().err
