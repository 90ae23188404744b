from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("runtime.gpu.model_runner")

from loadgen.cli import main  # noqa: E402


def test_steps_prints_a_sane_table_on_cpu_with_a_tiny_config(capsys):
    rc = main(["steps", "--device", "cpu", "--batch-sizes", "2,4", "--context-len", "32", "--draft-tokens", "0,2",
               "--prefill-tokens", "16", "--prefill-context", "8", "--steps", "2", "--warmup-steps", "1"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("decode", "prefill"))]
    assert [r[0] for r in rows] == ["decode"] * 4 + ["prefill"]
    for r in rows:
        step_ms, tok_s = float(r[5]), float(r[6])
        mbu, mfu = float(r[7].rstrip("%")), float(r[8].rstrip("%"))
        assert step_ms > 0 and tok_s > 0
        assert 0 <= mbu < 100 and 0 < mfu < 100
    assert "copy" in out and "matmul" in out


def test_steps_times_decode_overlapped_and_waited_side_by_side(capsys):
    rc = main(["steps", "--device", "cpu", "--batch-sizes", "2", "--context-len", "16", "--prefill-tokens", "",
               "--overlap", "both", "--steps", "2", "--warmup-steps", "1"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("decode")]
    assert [r[0] for r in rows] == ["decode", "decode-s"]
    assert all(float(r[5]) > 0 for r in rows)
    assert "-s: each step waited for" in out


def test_steps_with_a_missing_model_dir_is_a_one_line_error(tmp_path, capsys):
    assert main(["steps", "--model-path", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: model directory not found")
