"""Helpers for parsers that consume text in pieces and must not emit half of a marker."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none): that
    much must be held back, since the next piece may complete the marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
