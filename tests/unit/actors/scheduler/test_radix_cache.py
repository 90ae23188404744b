from runtime.actors.scheduler.kv_allocator import PageAllocator
from runtime.actors.scheduler.radix_cache import RadixCache
from runtime.actors.scheduler.request import Req
from runtime.mailbox.messages import SamplingParams


def make_req(ids: list[int]) -> Req:
    return Req("r", list(ids), SamplingParams(), frozenset(), 16)


def admit(cache: RadixCache, alloc: PageAllocator, ids: list[int]) -> Req:
    """What the planner does: match, lock, then allocate the rest of the sequence."""
    req = make_req(ids)
    slots, node = cache.match(req)
    cache.lock(node)
    req.cache_node, req.cached_len, req.slots = node, len(slots), list(slots)
    ps = alloc.page_size
    n_pages = -(-(len(ids) - len(slots)) // ps)
    req.pages = alloc.alloc(n_pages)
    req.slots += [req.pages[i // ps] * ps + i % ps for i in range(len(ids) - len(slots))]
    return req


def test_second_request_reuses_the_first_requests_prefix_and_frees_duplicates():
    alloc = PageAllocator(1024, page_size=1)
    cache = RadixCache(alloc)
    a = admit(cache, alloc, list(range(100)))
    cache.release(a, keep=True)
    assert cache.evictable_tokens == 100 and alloc.used_pages == 100
    b = admit(cache, alloc, list(range(90)) + [999] * 20)
    assert b.cached_len == 90
    assert b.slots[:90] == a.slots[:90]
    assert cache.protected_tokens == 90 and cache.evictable_tokens == 10  # split at 90
    cache.release(b, keep=True)
    assert cache.protected_tokens == 0
    assert alloc.used_pages == 100 + 20  # b's own 20 tokens were cached, nothing duplicated


def test_match_never_covers_the_last_token():
    alloc = PageAllocator(256)
    cache = RadixCache(alloc)
    cache.release(admit(cache, alloc, [1, 2, 3, 4]), keep=True)
    again = admit(cache, alloc, [1, 2, 3, 4])
    assert again.cached_len == 3


def test_duplicate_insert_frees_the_requests_own_pages():
    alloc = PageAllocator(256)
    cache = RadixCache(alloc)
    a = admit(cache, alloc, [5, 6, 7, 8, 9])
    b = admit(cache, alloc, [5, 6, 7, 8, 9])  # admitted before a finished: no sharing yet
    cache.release(a, keep=True)
    used = alloc.used_pages
    cache.release(b, keep=True)
    assert alloc.used_pages == used - 5


def test_locked_prefix_is_not_evicted_and_lru_leaf_goes_first():
    alloc = PageAllocator(64)
    cache = RadixCache(alloc)
    old = admit(cache, alloc, [1] * 10)
    cache.release(old, keep=True)
    new = admit(cache, alloc, [2] * 10)
    cache.release(new, keep=True)
    user = admit(cache, alloc, [2] * 10 + [3])  # locks the whole [2]*10 sequence
    assert cache.evict(100) == 10  # only the unlocked [1]*10 leaf can go
    assert cache.protected_tokens == 10
    cache.release(user, keep=False)
    assert cache.evict(100) == 10
    assert alloc.used_pages == 0


def test_page_size_16_keeps_only_whole_pages():
    alloc = PageAllocator(64 * 16, page_size=16)
    cache = RadixCache(alloc)
    a = admit(cache, alloc, list(range(40)))  # 3 pages, the last one partial
    cache.release(a, keep=True)
    assert cache.evictable_tokens == 32
    assert alloc.used_pages == 2
    b = admit(cache, alloc, list(range(40)))
    assert b.cached_len == 32
    cache.release(b, keep=True)
    assert cache.flush() and alloc.used_pages == 0
