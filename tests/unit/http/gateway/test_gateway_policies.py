"""Each routing policy's choice, on plain worker records (no network)."""

from __future__ import annotations

import random

from runtime.http.gateway.policies import CacheAware, PowerOfTwo, Random, RoundRobin
from runtime.http.gateway.workers import Worker


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://127.0.0.1:{9000 + i}", healthy=True, load=n) for i, n in enumerate(loads)]


SYS_A = "You are a helpful assistant who answers in rhyme. " * 4
SYS_B = "You translate every question into French before answering. " * 4


def test_round_robin_cycles_over_the_candidates():
    ws = workers(0, 0, 0)
    p = RoundRobin()
    assert [p.choose(ws, "").worker for _ in range(6)] == ws + ws


def test_random_picks_every_worker_eventually():
    ws = workers(0, 0, 0)
    p = Random(random.Random(1))
    assert {p.choose(ws, "").worker for _ in range(50)} == set(ws)


def test_power_of_two_takes_the_less_loaded_of_its_two_samples():
    ws = workers(5, 0, 9)
    p = PowerOfTwo(random.Random(2))
    chosen = [p.choose(ws, "").worker for _ in range(60)]
    assert ws[2] not in chosen  # the most loaded loses every pair it is in
    assert set(chosen) == {ws[0], ws[1]}  # the middle one wins only the pair (5, 9)
    assert PowerOfTwo().choose(ws[:1], "").worker is ws[0]


def test_cache_aware_routes_a_shared_prefix_to_the_worker_that_saw_it():
    ws = workers(0, 0, 0)
    p = CacheAware(cache_threshold=0.5)
    first = p.choose(ws, SYS_A + "Q1")
    assert first.kind == "fallback"  # nothing cached anywhere: the least loaded
    first.worker.load += 1
    other = p.choose(ws, SYS_B + "Q1")
    assert other.kind == "fallback" and other.worker is not first.worker  # least loaded again
    hit = p.choose(ws, SYS_A + "Q2")
    assert hit.kind == "cache_hit" and hit.worker is first.worker  # despite its higher load
    assert p.choose(ws, SYS_B + "another question").worker is other.worker


def test_cache_aware_below_the_threshold_goes_to_the_least_loaded():
    ws = workers(3, 1, 2)
    p = CacheAware(cache_threshold=0.9)
    p.tree(ws[0]).insert("shared start, then something else entirely")
    d = p.choose(ws, "shared start, and a different long ending that is not cached")
    assert d.kind == "fallback" and d.worker is ws[1]
    assert p.tree(ws[1]).match("shared start, and a different") > 0  # the chosen worker's tree learns it


def test_cache_aware_imbalance_overrides_the_cache():
    ws = workers(10, 2, 5)
    p = CacheAware(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=1.5)
    p.tree(ws[0]).insert(SYS_A)
    d = p.choose(ws, SYS_A + "Q")
    assert d.kind == "balance" and d.worker is ws[1]  # 10 - 2 > 4 and 10 > 2 * 1.5
    assert p.tree(ws[1]).match(SYS_A + "Q") == len(SYS_A + "Q")  # the tree is updated even so
    # both thresholds must be crossed: a large relative but small absolute spread is balanced
    small = workers(3, 0, 1)
    p2 = CacheAware(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=1.5)
    p2.tree(small[0]).insert(SYS_A)
    assert p2.choose(small, SYS_A + "Q").kind == "cache_hit"


def test_cache_aware_ignores_trees_of_removed_workers():
    ws = workers(0, 0)
    p = CacheAware(cache_threshold=0.5)
    d = p.choose(ws, SYS_A)
    p.on_remove(d.worker)
    rest = [w for w in ws if w is not d.worker]
    again = p.choose(rest, SYS_A + "Q")
    assert again.worker is rest[0] and again.kind == "fallback"
