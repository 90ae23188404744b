"""How far a DeepSeek-V4 prefix hit is from a cold run, by replay length, on the tiny random configs of
the V4 tests (float32, CPU): `python -m loadgen.v4_replay`. The figures in docs/deepseek_v4.md.

Per config and replay length R, over prefixes of H = 16..96 tokens (page 8) and a few seeds: the max
abs logit difference at the prompt positions past the hit (same inputs in both runs), how often the
first greedy token and the whole 8-token greedy continuation agree, and whether the cached entries
stayed bit-identical. R = the window is the default bound; R = layers * (window - 1) covers the
window's receptive field; R = H is exact mode."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import V4_TINY_CONFIGS, save_tiny_deepseek_v4, v4_hit_vs_cold

CONFIGS = V4_TINY_CONFIGS
PREFIXES = (16, 24, 40, 48, 64, 96)


def report(name: str, overrides: dict, seeds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_deepseek_v4(Path(tmp), seed=5, **overrides)
        runner = ModelRunner(
            RunnerConfig(tmp, num_kv_slots=2048, max_reqs=4, max_model_len=128, cpu_threads=1)
        )
    cfg = runner.config
    window, field = cfg.sliding_window, cfg.num_hidden_layers * (cfg.sliding_window - 1)
    for label, replay in (("window", window), ("2 x window", 2 * window), ("field", field), ("exact", None)):
        runs = [
            v4_hit_vs_cold(runner, h, min(h, replay or h), seed) for h in PREFIXES for seed in range(seeds)
        ]
        diffs = torch.tensor([r.prompt_max_diff for r in runs])
        first = sum(r.hit_tokens[0] == r.cold_tokens[0] for r in runs)
        same = sum(r.hit_tokens == r.cold_tokens for r in runs)
        print(
            f"{name:9s} R={label:10s} ({replay or 'H'}) hits={len(runs)} logit diff max {diffs.max():.2e} "
            f"median {diffs.median():.2e}  first token same {first}/{len(runs)}  "
            f"8-token continuation same {same}/{len(runs)}  cache untouched {all(r.cache_untouched for r in runs)}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=4)
    args = p.parse_args(argv)
    for name, overrides in CONFIGS.items():
        report(name, overrides, args.seeds)


if __name__ == "__main__":
    main()
