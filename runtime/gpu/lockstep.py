"""One round of the lockstep that data-parallel ranks with expert parallelism run before each step
(`GpuWorkerActor._lockstep`): every MoE layer's exchange needs every rank, so the ranks agree, with one
max over the gloo group on the host, whether any has a plan (or is stopping), on the most tokens any has,
and on one shape for the step: all replay decode graphs, or all verify graphs, at the bucket of the
largest batch, or all run eagerly. A rank with no rows joins with an idle step sized alike.

The graph kinds agree through a max of (kind, -kind) over the ranks with rows: a graph step needs the
largest and the smallest kind to be the same graph kind (runtime/gpu/cuda_graph.py says why the sizes
must match)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from runtime.gpu import distributed
from runtime.gpu.cuda_graph import StepGraph
from runtime.mailbox.messages import StepPlan

_NO_KIND = -(max(StepGraph) + 1)  # an idle rank's -kind: below every real one


class LockstepRunner(Protocol):
    def graph_shape(self, plan: StepPlan | None) -> tuple[StepGraph, int]: ...
    def set_step_shape(self, most_tokens: int, graph: StepGraph, rows: int) -> None: ...
    def idle_step(self) -> None: ...


@dataclass(frozen=True)
class Round:
    state: int  # 0: every rank idle; 1: step; 2: some rank stops (all leave)
    most_tokens: int
    graph: StepGraph  # DECODE / VERIFY: every rank with rows replays it; EAGER otherwise
    rows: int  # the largest batch of any rank


def agree(runner: LockstepRunner, plan: StepPlan | None, stopping: bool) -> Round:
    """This rank's view of the next step, agreed with every other rank's."""
    kind, rows = runner.graph_shape(plan)
    flag = 2 if stopping else int(plan is not None)
    tokens = sum(plan.extend_lens) if plan is not None else 0
    neg = _NO_KIND if kind == StepGraph.IDLE else -kind
    state, most, hi, neg_lo, rows = distributed.agree_max(flag, tokens, kind, neg, rows)
    graph = StepGraph(hi) if hi == -neg_lo and hi in (StepGraph.DECODE, StepGraph.VERIFY) else StepGraph.EAGER
    return Round(state, most, graph, rows)


def prepare(runner: LockstepRunner, plan: StepPlan | None, agreed: Round) -> None:
    """Size this rank's step as agreed; a rank without rows runs its idle step here (its plan, if any,
    still goes through the runner for its row changes)."""
    runner.set_step_shape(agreed.most_tokens, agreed.graph, agreed.rows)
    if plan is None or not plan.rows:
        runner.idle_step()
