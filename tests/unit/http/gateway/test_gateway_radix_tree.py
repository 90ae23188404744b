"""The gateway's approximate radix tree: prefix matches, splits, and LRU eviction under its size bound."""

from __future__ import annotations

import random

from runtime.http.gateway.radix_tree import RadixTree


def stored(tree: RadixTree) -> set[str]:
    """Every text the tree spells from the root to a leaf."""
    out, stack = set(), [(tree.root, "")]
    while stack:
        node, prefix = stack.pop()
        if not node.children and node is not tree.root:
            out.add(prefix)
        stack.extend((c, prefix + c.key) for c in node.children.values())
    return out


def test_match_is_the_longest_stored_prefix_in_characters():
    t = RadixTree(1000)
    assert t.match("anything") == 0
    t.insert("You are a pirate.\n\nHello")
    assert t.match("You are a pirate.\n\nWho are you?") == len("You are a pirate.\n\n")
    assert t.match("You are a pirate.\n\nHello there") == len("You are a pirate.\n\nHello")
    assert t.match("You are a") == len("You are a")  # a prefix inside an edge
    assert t.match("Yo!") == 2
    assert t.match("") == 0


def test_insert_splits_edges_and_counts_each_character_once():
    t = RadixTree(1000)
    t.insert("abcdef")
    t.insert("abcxyz")
    t.insert("abcdef")  # again: nothing new
    t.insert("ab")  # inside an edge: a split, no new characters
    assert stored(t) == {"abcdef", "abcxyz"}
    assert t.chars == len("abc") + len("def") + len("xyz")
    assert t.match("abcdxx") == 4 and t.match("abcxyzz") == 6


def test_eviction_keeps_the_size_bound_and_drops_least_recently_used_leaves():
    t = RadixTree(max_chars=30)
    t.insert("system A: q1")  # 12 chars
    t.insert("system A: q2")  # + 1 (shares "system A: q")
    t.insert("system B: q1")  # + 5 ("B: q1" after "system ")
    assert t.chars == 18
    t.insert("system A: q1")  # used again: now the most recent
    t.insert("other text 1234")  # + 15 = 33 > 30: evict the LRU leaf "...A: q2" (32), then "...B: q1"
    assert t.chars == 27
    assert stored(t) == {"system A: q1", "other text 1234"}
    assert t.match("system A: q1") == len("system A: q1")
    assert t.match("system B: q1") == len("system ")


def test_an_evicted_chain_becomes_a_leaf_and_goes_in_its_turn():
    t = RadixTree(max_chars=12)
    t.insert("aaaa1111")
    t.insert("aaaa2222")  # "aaaa" inner, two leaves: 12 chars
    t.insert("zz")  # 14: evict "1111" (oldest), then 10 <= 12
    assert stored(t) == {"aaaa2222", "zz"}
    t.insert("zzzzzzzz")  # 16: evict "2222"; "aaaa" is a leaf now
    assert stored(t) == {"aaaa", "zzzzzzzz"} and t.chars == 12
    t.insert("y")  # 13: the bare "aaaa" is the least recently used leaf
    assert stored(t) == {"zzzzzzzz", "y"} and t.chars == 9


def test_random_inserts_stay_bounded_and_recent_texts_stay_matched():
    rng = random.Random(0)
    t = RadixTree(max_chars=2000)
    groups = ["".join(rng.choice("abcdef") for _ in range(100)) for _ in range(30)]
    recent = []
    for i in range(3000):
        text = rng.choice(groups) + "".join(rng.choice("xyz") for _ in range(20))
        t.insert(text)
        recent = (recent + [text])[-5:]
        assert t.chars <= 2000
        if i % 97 == 0:
            for r in recent:  # 5 x 120 chars always fit: the most recent are never evicted
                assert t.match(r) == len(r)
    assert len(t._leaves) <= 4 * t.nodes + 1024  # stale heap entries are compacted
