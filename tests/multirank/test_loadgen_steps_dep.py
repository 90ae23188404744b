"""`loadgen steps --dp-size 2 --ep-size 2` on a tiny DeepSeek-V3 config (dummy weights, two CPU ranks over
gloo): every rank runs the same steps, rank 0 prints per-GPU rows with the step's all-to-all time."""

from __future__ import annotations

import subprocess
import sys

from runtime.gpu.testing import tiny_deepseek_v3_config


def test_dep_steps_report_per_gpu_rows_with_all_to_all_time(tmp_path):
    tiny_deepseek_v3_config().save_pretrained(tmp_path)
    cmd = [sys.executable, "-m", "loadgen", "steps", "--model-path", str(tmp_path), "--device", "cpu",
           "--batch-sizes", "2", "--context-len", "8", "--prefill-tokens", "16", "--steps", "2",
           "--dp-size", "2", "--ep-size", "2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("DP=2 EP=2: every figure is per GPU") for line in lines), out.stdout
    rows = [line.split() for line in lines if line.startswith(("decode ", "prefill "))]
    assert [r[0] for r in rows] == ["decode", "prefill"]
    assert all(float(r[-1]) > 0 for r in rows)  # the a2a ms column: the exchanges ran and were timed
