"""The worker's side of overlap with speculation: a row planned before its verify step's counts reached
the host (`StepPlan.assume_accepted`: prefix lengths and fresh slots for the worst case, every draft
accepted) is moved back by the drafts that step rejected, on the device in the decode and verify graphs
(their padded static-buffer path, run eagerly on the CPU) and by `settle` on the eager path, and emits
exactly plain greedy decoding's tokens. Three rows whose verify step keeps all, one and none of their
drafts, then a verify step and a plain step planned ahead, one after the other (tests/gpu/
test_speculative_cuda.py runs the same on CUDA with captured graphs)."""

from __future__ import annotations

import random

import msgspec
import pytest

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import save_tiny_llama
from runtime.gpu.testing.plans import GREEDY, PlanBuilder
from runtime.mailbox.messages import SeqStart, StepPlan

K, ROWS, LEN = 3, [1, 2, 3], 64


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    return str(path)


def _runner(path: str, device: str, **spec) -> ModelRunner:
    cfg = RunnerConfig(path, device=device, dtype="float32", num_kv_slots=1024, max_reqs=4, max_model_len=LEN,
                       cpu_threads=1, **spec)  # fmt: skip
    return ModelRunner(cfg)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 128) for _ in range(8 + i)] for i in range(len(ROWS))]


def _tokens(out) -> dict[int, list[int]]:  # noqa: ANN001 - a StepOutput
    got, i = {}, 0
    for row, c in zip(out.rows, out.counts or [1] * len(out.rows), strict=True):
        got[row], i = out.tokens[i : i + c], i + c
    return got


def _ahead(plan: StepPlan) -> StepPlan:
    return msgspec.structs.replace(plan, assume_accepted=[True] * len(plan.rows))


def _continuations(path: str, device: str, prompts: list[list[int]], n: int) -> dict[int, list[int]]:
    """Plain greedy decoding's first `n` tokens of each prompt."""
    runner, pb = _runner(path, device), PlanBuilder()
    added = [SeqStart(r, GREEDY, p, [], []) for r, p in zip(ROWS, prompts, strict=True)]
    lens = [len(p) for p in prompts]
    out = runner.execute(pb.plan(ROWS, [0] * 3, lens, sum(prompts, []), added=added))
    cont = {r: t for r, t in _tokens(out).items()}
    for step in range(1, n):
        out = runner.execute(pb.plan(ROWS, [x + step - 1 for x in lens], [1] * 3, [], use_last=[True] * 3))
        for r, t in _tokens(out).items():
            cont[r] += t
    return cont


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_rows_planned_ahead_of_their_verify_step_emit_plain_decodings_tokens(path, graphs):
    assert_rows_planned_ahead_emit_plain_tokens(path, "cpu", graphs)


def assert_rows_planned_ahead_emit_plain_tokens(path: str, device: str, graphs: bool) -> None:
    """The module docstring's steps; `graphs`: through the decode and verify graphs (on CUDA, the
    runner's captured ones; on the CPU their static-buffer path), else eagerly."""
    prompts = _prompts()
    cont = _continuations(path, device, prompts, 16)
    runner = _runner(path, device, speculative_algorithm="ngram", speculative_num_draft_tokens=K)
    if device == "cpu" and graphs:
        runner.graphs = runner.make_graphs(4, capture=False)
    elif not graphs:
        runner.graphs = None
    pb = PlanBuilder()
    added = [SeqStart(r, GREEDY, p, [], []) for r, p in zip(ROWS, prompts, strict=True)]
    lens = [len(p) for p in prompts]
    runner.execute(pb.plan(ROWS, [0] * 3, lens, sum(prompts, []), added=added))
    # drafts the verify step keeps all of, one of, none of
    true = {r: cont[r][1 : K + 1] for r in ROWS}
    drafts = {1: true[1], 2: [true[2][0]] + [t ^ 1 for t in true[2][1:]], 3: [t ^ 1 for t in true[3]]}
    for r, d in drafts.items():
        runner.tables.fed[r, 1:] = runner.tables.fed.new_tensor(d)
    verify = pb.plan(ROWS, lens, [K + 1] * 3, [], use_last=[True] * 3, draft_lens=[K] * 3)
    got = _tokens(runner.execute(verify))
    assert [len(got[r]) for r in ROWS] == [K + 1, 2, 1]
    # planned before those counts: the worst case, every draft accepted, with its own fresh slots
    worst = [n + K + 1 for n in lens]
    step = pb.plan(ROWS, worst, [2 + 1] * 3, [], use_last=[True] * 3, draft_lens=[2] * 3)
    step = _ahead(step)
    assert runner._graph_path(step) == ("verify" if graphs else None)
    out = _tokens(runner.execute(step))
    # the next plain step, planned before that step's counts (the earlier counts now known)
    known = [n + len(got[r]) for n, r in zip(lens, ROWS, strict=True)]
    plain = _ahead(pb.plan(ROWS, [n + 2 + 1 for n in known], [1] * 3, [], use_last=[True] * 3))
    assert runner._graph_path(plain) == ("decode" if graphs else None)
    last = _tokens(runner.execute(plain))
    for r in ROWS:
        emitted = got[r] + out[r] + last[r]
        assert emitted == cont[r][1 : 1 + len(emitted)], r
