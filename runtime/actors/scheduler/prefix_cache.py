"""The prefix-cache interface the scheduler talks to, and the trivial cache (`--disable-radix-cache`).

Page ownership: a request owns the pages it allocated (`Req.pages`, covering slots[cached_len:]); pages
of a matched prefix belong to the cache and are locked while the request uses them. When a request ends,
`release` hands its pages to the cache (or frees them) and unlocks its prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.actors.scheduler.kv_allocator import PageAllocator
    from runtime.actors.scheduler.request import Req


class PrefixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator

    def match(self, req: Req) -> tuple[list[int], object | None]:
        """KV slots of the longest cached, page-aligned prefix of the request's tokens, and a handle to
        lock. Never the whole sequence: the last token must be computed to produce logits."""
        return [], None

    def lock(self, handle: object | None) -> None:
        pass

    def unlock(self, handle: object | None) -> None:
        pass

    def release(self, req: Req, *, keep: bool) -> None:
        """The request leaves its row. `keep`: its computed KV may be cached (finished or retracted)."""
        self.allocator.free(req.pages)
        req.pages = []
        self.unlock(req.cache_node)
        req.cache_node = None

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages of unlocked cached KV; returns how many were freed."""
        return 0

    def flush(self) -> bool:
        return True

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0

    @property
    def protected_tokens(self) -> int:
        return 0
