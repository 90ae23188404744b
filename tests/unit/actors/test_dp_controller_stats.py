"""The DP controller reports the ranks' stats as one: every counter summed, healthy only if every rank
is, and the fields that are not counters (an error, speculation's and Engram's counters) taken from a
rank that has them; a new EngineStats field of any of those kinds must not break the sum."""

from __future__ import annotations

from runtime.actors.dp_controller import DpController
from runtime.mailbox.messages import EngineStats, EngramCounters


def test_stats_of_every_rank_sum_and_non_counters_pass_through():
    ctl = DpController(2)
    engram = EngramCounters(lookups=3, rows=12)
    ctl.stats = [
        EngineStats(running=1, waiting=2, kv_pages_used=3, kv_pages_total=10, steps=5, plan_s=0.5, dp_rank=0),
        EngineStats(running=4, waiting=0, kv_pages_used=1, kv_pages_total=10, steps=7, plan_s=0.25,
                    healthy=False, error="rank 1 died", engram=engram, dp_rank=1),
    ]  # fmt: skip
    total = ctl._total()
    assert (total.running, total.waiting, total.kv_pages_used, total.kv_pages_total) == (5, 2, 4, 20)
    assert (total.steps, total.plan_s) == (12, 0.75)
    assert not total.healthy and total.error == "rank 1 died"
    assert total.engram == engram and total.spec is None and total.dp_rank == 0
