"""The prefill worker's exports: with a per-token pool, each prefill chunk's positions leave as soon as
the chunk is launched (a cached prefix with the first one) and the last chunk is final; with a pool of
compressed windows or per-request state, the whole prompt leaves once, with the first token."""

from __future__ import annotations

import torch

from runtime.disaggregation.config import DisaggConfig
from runtime.disaggregation.worker import PrefillSide
from runtime.gpu.kv_pool import MHAKVPool
from runtime.mailbox.messages import Disagg, SamplingParams, SeqStart, StepPlan


class Runner:
    def __init__(self, pool) -> None:  # noqa: ANN001
        self.kv_pool = pool
        self.calls: list[tuple[int, int, int]] = []

    def export_request(self, row: int, end: int, start: int = 0) -> dict:
        self.calls.append((row, start, end))
        return {"slot.k.0": torch.zeros(end - start, 1, 1)}


class StatefulPool(MHAKVPool):
    def row_state(self, row: int) -> dict:
        return {"start": torch.zeros(1)}


def plan(step: int, prefix: int, extend: int, sample: bool, added: list[SeqStart] = ()) -> StepPlan:
    ids = list(range(extend))
    return StepPlan(step, list(added), [], [3], [prefix], [extend], [False], ids, ids, [sample])


def run(pool, prefix: int = 0) -> tuple[Runner, list]:  # noqa: ANN001
    runner = Runner(pool)
    side = PrefillSide(DisaggConfig(mode="prefill"), runner, None, torch.device("cpu"))
    start = SeqStart(3, SamplingParams(), [1] * 40, list(range(prefix)), [], transfer=Disagg(9, "h:1"))
    exports = [side.after_launch(plan(0, prefix, 16 - prefix, False, [start]))]
    exports.append(side.after_launch(plan(1, 16, 16, False)))
    exports.append(side.after_launch(plan(2, 32, 8, True)))
    exports.append(side.after_launch(plan(3, 40, 1, True)))  # a decode step: nothing more to send
    return runner, exports


def test_a_per_token_pool_streams_each_prefill_chunk():
    runner, exports = run(MHAKVPool(1, 64, 1, 1, torch.float32, "cpu"), prefix=4)
    assert runner.calls == [(3, 0, 16), (3, 16, 32), (3, 32, 40)]  # the cached 4 go with the first chunk
    assert [[(e.start, e.final, e.target.room) for e in x] for x in exports] == [
        [(0, False, 9)],
        [(16, False, 9)],
        [(32, True, 9)],
        [],
    ]


def test_a_pool_with_per_request_state_sends_the_prompt_once():
    runner, exports = run(StatefulPool(1, 64, 1, 1, torch.float32, "cpu"))
    assert runner.calls == [(3, 0, 40)]
    assert [[(e.start, e.final) for e in x] for x in exports] == [[], [], [(0, True)], []]
