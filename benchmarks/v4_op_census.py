"""Which lines of the DeepSeek-V4 model issue the ops of a decode step, and how many: the kernel count a
CUDA graph of the step replays, each a few microseconds however small (docs/PERF.md: about 1,900 device
ops a step of the 8-layer V4-Flash cut, the FP4 experts aside the largest cost left). Runs on the CPU:
the tiny V4 checkpoint of the parity tests (sliding, CSA, HCA, CSA; hash then learned routing), four
rows, one batched decode step after the decode scenario's others (`v4_decode_scenario`); a kernel op of
the registry counts once where the model calls it (its reference's own ops are not counted: on CUDA it
is one Triton or TileLang launch), every other aten op that makes a kernel (views and metadata aside)
once at the model line that issued it.
    python -m benchmarks.v4_op_census [--top 40]"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from runtime.config import RunnerConfig
from runtime.gpu.kernels import registry
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import V4_TINY_CONFIGS, save_tiny_deepseek_v4, v4_decode_scenario

_NO_KERNEL = {
    "view", "_unsafe_view", "slice", "select", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "reshape", "lift_fresh",
    "_reshape_alias", "view_as", "unflatten", "flatten", "diagonal", "narrow", "sym_size", "sym_stride",
    "is_same_size", "_local_scalar_dense", "empty", "empty_like", "empty_strided", "new_empty", "size", "dim",
}  # fmt: skip
_ROOT = str(Path(__file__).resolve().parent.parent / "runtime" / "gpu")


def _site() -> str:
    """The innermost frame in the model code (models/, layers/, the backend) below the caller."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_ROOT) and "/kernels/" not in path and "/testing/" not in path:
            return f"{path[len(_ROOT) + 1 :]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class Census(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.on, self.inside = False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self.on and not self.inside:
            name = func.overloadpacket.__name__
            if name not in _NO_KERNEL:
                self.counts[(name, _site())] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, op_name: str, fn):  # noqa: ANN001, ANN201
        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if self.on and not self.inside:
                self.counts[(f"op {op_name}", _site())] += 1
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1

        return counted


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    census = Census()
    get = registry.Op.get
    registry.Op.get = lambda self, device: census.wrap(self.name, get(self, device))
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_deepseek_v4(Path(tmp), seed=7, **V4_TINY_CONFIGS["v4"])
        cfg = RunnerConfig(tmp, num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1)
        runner = ModelRunner(cfg)
        runner.attn.batched_decode = True
        forward, calls = runner.forward_logits, []

        def last_counted(plan):  # noqa: ANN001, ANN202
            calls.append(1)
            census.on = len(calls) == 29  # the scenario's last step: a decode of all four rows
            try:
                return forward(plan)
            finally:
                census.on = False

        runner.forward_logits = last_counted
        with census:
            v4_decode_scenario(runner)
    assert len(calls) == 29, len(calls)
    layers = collections.Counter(t for t in runner.model.config.layer_types)
    by_site: collections.Counter[str] = collections.Counter()
    for (_, site), n in census.counts.items():
        by_site[site] += n
    total = sum(census.counts.values())
    print(f"{total} kernel ops in one decode step of 4 rows; layers {dict(layers)}")
    print("\nby model line:")
    for site, n in by_site.most_common(args.top):
        ops = collections.Counter({k[0]: v for k, v in census.counts.items() if k[1] == site})
        print(f"{n:5d}  {site}   {', '.join(f'{o} x{c}' for o, c in ops.most_common(6))}")


if __name__ == "__main__":
    main()
