"""The radix prefix cache: a token-keyed radix tree over KV pages, reused across requests and turns.

As in SGLang's RadixCache: a child is keyed by its first page of tokens; a partial match splits the
node so locks cover exactly the matched prefix; lock counts run along the path to the root (a locked
node and its ancestors are never evicted); eviction pops least-recently-used unlocked leaves from a heap
built over the maintained set of evictable leaves; inserting a sequence whose prefix is already cached
frees the request's duplicate pages. Every node holds whole pages.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from runtime.actors.scheduler.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from runtime.actors.scheduler.kv_allocator import PageAllocator
    from runtime.actors.scheduler.request import Req

_clock = itertools.count()


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: Node | None, key: list[int], value: list[int]) -> None:
        self.children: dict = {}
        self.parent = parent
        self.key = key  # the tokens this edge adds
        self.value = value  # their KV slots
        self.lock_ref = 0
        self.last_access = next(_clock)


class RadixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator) -> None:
        super().__init__(allocator)
        self.page_size = allocator.page_size
        self._reset()

    def _reset(self) -> None:
        self.root = Node(None, [], [])
        self.root.lock_ref = 1
        self.evictable_leaves: set[Node] = set()
        self._evictable = 0  # tokens in unlocked nodes
        self._protected = 0  # tokens in locked nodes

    # ------------------------------------------------------------------ keys

    def _child_key(self, tokens: list[int]) -> object:
        return tokens[0] if self.page_size == 1 else tuple(tokens[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i - i % self.page_size

    # ------------------------------------------------------------------ the tree

    def _walk(self, key: list[int]) -> tuple[Node, list[int]]:
        """Follow `key` down the tree, splitting on a partial match; returns the deepest node and the slots."""
        node, slots = self.root, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = next(_clock)
            n = self._match_len(child.key, key)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            slots.extend(child.value)
            node, key = child, key[n:]
        return node, slots

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after k tokens; returns the new upper part (which keeps node's locks)."""
        upper = Node(node.parent, node.key[:k], node.value[:k])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.children = {self._child_key(node.key[k:]): node}
        node.parent.children[self._child_key(upper.key)] = upper
        node.parent = upper
        node.key, node.value = node.key[k:], node.value[k:]
        return upper

    def _update_leaf(self, node: Node) -> None:
        if node is not self.root and not node.children and node.lock_ref == 0:
            self.evictable_leaves.add(node)
        else:
            self.evictable_leaves.discard(node)

    def insert(self, key: list[int], slots: list[int]) -> int:
        """Add `key` -> `slots`; returns how many leading tokens were already cached (their slots in
        `slots` are duplicates the caller must free)."""
        node, cached = self._walk(key)
        matched = len(cached)
        if matched < len(key):
            leaf = Node(node, key[matched:], slots[matched:])
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += len(leaf.key)
            self._update_leaf(leaf)
            self._update_leaf(node)
        return matched

    # ------------------------------------------------------------------ PrefixCache interface

    def match(self, req: Req) -> tuple[list[int], object | None]:
        seq = req.seq_ids
        usable = (len(seq) - 1) // self.page_size * self.page_size  # the last token must be computed
        node, slots = self._walk(seq[:usable])
        return slots, node

    def lock(self, handle: object | None) -> None:
        node = handle
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            self._update_leaf(node)
            node = node.parent

    def unlock(self, handle: object | None) -> None:
        node = handle
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            self._update_leaf(node)
            node = node.parent

    def release(self, req: Req, *, keep: bool) -> None:
        ps = self.page_size
        known = min(req.kv_len, len(req.seq_ids)) if keep else req.cached_len
        aligned = max(known // ps * ps, req.cached_len)
        own = (aligned - req.cached_len) // ps  # request pages covering [cached_len, aligned)
        if aligned > req.cached_len:
            matched = self.insert(req.seq_ids[:aligned], req.slots[:aligned])
            dup = (max(matched, req.cached_len) - req.cached_len) // ps
            self.allocator.free(req.pages[:dup])
        self.allocator.free(req.pages[own:])
        req.pages = []
        self.unlock(req.cache_node)
        req.cache_node = None

    def evict(self, num_pages: int) -> int:
        heap = [(n.last_access, id(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            if leaf not in self.evictable_leaves:
                continue
            pages = leaf.value[:: self.page_size]
            self.allocator.free([s // self.page_size for s in pages])
            freed += len(pages)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            self.evictable_leaves.discard(leaf)
            self._update_leaf(parent)
            if parent in self.evictable_leaves:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> bool:
        if self._protected:
            return False
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self.allocator.free([s // self.page_size for s in node.value[:: self.page_size]])
            stack.extend(node.children.values())
        self._reset()
        return True

    @property
    def evictable_pages(self) -> int:
        return self._evictable // self.page_size

    @property
    def evictable_tokens(self) -> int:
        return self._evictable

    @property
    def protected_tokens(self) -> int:
        return self._protected
