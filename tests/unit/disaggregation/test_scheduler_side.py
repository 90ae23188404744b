"""The scheduler's side of disaggregation on a real planner and allocator: a decode request gets a row
and page-aligned slots for its prompt, only while the pool has room; one that ends before its KV came
gives every page back uncached; one whose KV came continues from its prompt's slots with the prefill's
token as its first output (the next step feeds it at the prompt's length and samples)."""

from __future__ import annotations

import pytest

from runtime.actors.scheduler.batch_planner import BatchPlanner
from runtime.actors.scheduler.kv_allocator import PageAllocator
from runtime.actors.scheduler.radix_cache import RadixCache
from runtime.actors.scheduler.request import Req
from runtime.disaggregation.scheduler import DecodeReservations
from runtime.mailbox.messages import Disagg, SamplingParams


def planner(slots: int, page_size: int) -> BatchPlanner:
    alloc = PageAllocator(slots, page_size)
    return BatchPlanner(alloc, RadixCache(alloc), max_reqs=4, token_budget=64, max_model_len=256)


def req(rid: str, room: int, n: int) -> Req:
    r = Req(rid, list(range(10, 10 + n)), SamplingParams(temperature=0), frozenset(), max_new_tokens=8)
    r.transfer = Disagg(room)
    return r


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_reserved_prompt_continues_from_its_slots_with_the_prefill_token(page_size):
    p = planner(128, page_size)
    res = DecodeReservations()
    r = req("a", 7, 10)
    res.add(r)
    (msg,) = res.reserve(p)
    assert (msg.room, msg.rid, msg.row) == (7, "a", r.row) and r.row > 0
    assert msg.slots == r.slots and len(set(msg.slots)) == 10 and 0 not in msg.slots
    assert all(s % page_size == i % page_size for i, s in enumerate(msg.slots))  # position-aligned pages
    assert p.allocator.used_pages == -(-10 // page_size)
    assert p.plan(0) is None  # nothing to run while the KV travels

    assert res.take(7) is r
    r.output_ids.append(99)  # the prefill's first token
    p.admit_prefilled(r)
    step = p.plan(1).plan
    (start,) = step.added
    assert (start.row, start.prefix_slots, start.output_ids) == (r.row, msg.slots, [99])
    assert (step.rows, step.prefix_lens, step.extend_lens, step.input_ids) == ([r.row], [10], [1], [99])
    assert step.sample == [True] and step.use_last == [False]
    assert r.slots[:10] == msg.slots and len(r.slots) == 11
    assert p.plan(2).plan.use_last == [True]  # then it decodes as any request


def test_a_request_that_ends_before_its_kv_came_gives_its_pages_back_uncached():
    p = planner(64, 4)
    res = DecodeReservations()
    a, b = req("a", 1, 30), req("b", 2, 30)
    res.add(a)
    res.add(b)
    assert [m.room for m in res.reserve(p)] == [1]  # the second does not fit yet: it waits, in order
    assert len(res) == 2 and res.holds(b)
    assert not res.drop(b, p)  # waiting: nothing was reserved, nothing to tell the worker
    row = a.row
    assert res.drop(a, p)
    assert p.allocator.used_pages == 0 and p.cache.evictable_pages == 0  # freed, not cached
    assert p.take_released() == [row] and a.row == 0
    assert len(res) == 0


def test_reservations_wait_for_room_and_take_the_rows_released_since_the_last_plan():
    p = planner(64, 4)
    res = DecodeReservations()
    first = req("a", 1, 40)
    res.add(first)
    (m1,) = res.reserve(p)
    second = req("b", 2, 40)
    res.add(second)
    assert res.reserve(p) == []  # 40 + 40 tokens > the pool's 60: it waits
    assert res.drop(first, p)  # the first leaves; its row is released
    (m2,) = res.reserve(p)
    assert m2.room == 2 and m1.row in m2.released  # the worker forgets the old row before the import
    assert p.released_rows == []
