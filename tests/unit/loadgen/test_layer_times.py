from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from loadgen.layer_times import main  # noqa: E402
from runtime.gpu.testing import save_tiny_deepseek_v4  # noqa: E402


def test_layer_times_reports_every_layer_of_a_prefill_and_a_decode_step(tmp_path, capsys):
    """A tiny V4 (sliding, CSA and HCA layers) on the CPU: the prefill chunk on a cached context and
    the decode step (request by request, then batched) each list one time per decoder layer, named by its
    kind, and the rest of the step."""
    save_tiny_deepseek_v4(tmp_path)
    main(["--model-path", str(tmp_path), "--device", "cpu", "--prefill-context", "32", "--prefill-tokens", "16",
          "--decode-batch", "3", "--decode-context", "16", "--decode-steps", "2"])  # fmt: skip
    out = capsys.readouterr().out
    prefill, per_row, batched = out.split("decode batch 3")
    assert prefill.startswith("prefill 16 new tokens on a 32-token context")
    assert per_row.startswith(" at context 17, request by request") and batched.startswith(
        " at context 19, batched"
    )
    for part in (prefill, per_row, batched):
        layer_lines = [line for line in part.splitlines() if line.strip().startswith("layer")]
        assert len(layer_lines) >= 3 and all(float(line.split()[-2]) > 0 for line in layer_lines)
        assert "rest of the step" in part
    assert "CSA" in out and "HCA" in out
