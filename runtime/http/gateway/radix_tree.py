"""An approximate radix tree of request text for one worker: what that worker has probably cached.

The keys are characters of the request text, not tokens (the gateway has no tokenizer, as
sglang-router's tree). `match(text)` is the length of the longest stored prefix of `text` and changes
nothing; `insert(text)` stores `text` and marks its path as used now. The tree holds at most
`max_chars` characters: an insert that goes past that evicts the least recently used leaves until it
fits again (a heap over leaves, stale entries skipped when popped), so memory stays bounded and the
oldest conversations are forgotten first.

    tree = RadixTree(max_chars=1 << 20)
    tree.insert("You are a pirate.\\n\\nHello")
    tree.match("You are a pirate.\\n\\nWho are you?")   # -> 19, the shared "You are a pirate.\\n\\n"
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("key", "children", "parent", "stamp")

    def __init__(self, key: str, parent: _Node | None, stamp: int) -> None:
        self.key = key  # the edge label from the parent
        self.children: dict[str, _Node] = {}  # by the first character of the child's key
        self.parent = parent  # None once evicted (and for the root)
        self.stamp = stamp  # logical time of the last insert through this node


def _common_len(key: str, text: str, pos: int) -> int:
    """Length of the common prefix of `key` and `text[pos:]` (binary search on C-level compares)."""
    n = min(len(key), len(text) - pos)
    if text.startswith(key[:n], pos):
        return n
    lo, hi = 0, n  # key[:lo] matches, key[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(key[:mid], pos):
            lo = mid
        else:
            hi = mid
    return lo


class RadixTree:
    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be >= 1")
        self.max_chars = max_chars
        self.root = _Node("", None, 0)
        self.chars = 0  # characters stored: the sum of the edge labels
        self.nodes = 0  # nodes besides the root
        self._clock = 0
        self._seq = itertools.count()  # tie-break for equal stamps in the heap
        self._leaves: list[tuple[int, int, _Node]] = []  # (stamp, seq, leaf); may hold stale entries

    def match(self, text: str) -> int:
        """Characters of `text` found as a stored prefix."""
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            n = _common_len(child.key, text, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Store `text`, mark its path as most recently used, then evict down to `max_chars`."""
        self._clock += 1
        now = self._clock
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(text[pos:], node, now)
                node.children[text[pos]] = leaf
                self.chars += len(leaf.key)
                self.nodes += 1
                node = leaf
                break
            n = _common_len(child.key, text, pos)
            if n < len(child.key):  # split the edge: `mid` takes the common part
                mid = _Node(child.key[:n], node, now)
                node.children[text[pos]] = mid
                child.key = child.key[n:]
                child.parent = mid
                mid.children[child.key[0]] = child
                self.nodes += 1
                child = mid
            child.stamp = now
            pos += n
            node = child
        if node is not self.root and not node.children:
            self._push(node)
        self._evict()

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._leaves, (leaf.stamp, next(self._seq), leaf))
        if len(self._leaves) > 4 * self.nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop the stale entries: one fresh entry per current leaf."""
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append((node.stamp, next(self._seq), node))
        heapq.heapify(leaves)
        self._leaves = leaves

    def _evict(self) -> None:
        while self.chars > self.max_chars and self._leaves:
            stamp, _, leaf = heapq.heappop(self._leaves)
            if leaf.parent is None or leaf.children or leaf.stamp != stamp:
                continue  # stale: evicted already, grew children, or used again since
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None
            self.chars -= len(leaf.key)
            self.nodes -= 1
            if parent is not self.root and not parent.children:
                self._push(parent)  # a chain left behind still matches what it spells
