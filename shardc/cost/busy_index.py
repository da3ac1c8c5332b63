"""Which of a set of allocations hold something over a range of positions: a segment tree over positions whose
nodes carry bitmasks of allocations (bit j: allocation j), for first-fit placement of live ranges
(`MemoryModel.in_outputs`). Ranges are only ever added, so a node's `cover` (allocations busy over its whole
span) and `below` (busy anywhere in it) only gain bits; a query ORs the `below` of the nodes tiling the range
with the `cover` of their ancestors, an insertion sets `cover` on the tiling nodes and `below` on them and their
ancestors. Both cost O(log positions) Python steps, where scanning allocation by allocation costs one bisection
per allocation tried."""
from __future__ import annotations

__all__ = ["BusyIndex"]


class BusyIndex:
    """Bitmasks of the allocations busy at positions 0 .. `positions` - 1 (inclusive ranges)."""

    __slots__ = ("_size", "_cover", "_below")

    def __init__(self, positions: int) -> None:
        self._size = 1 << max(positions - 1, 1).bit_length()
        self._cover = [0] * (2 * self._size)
        self._below = [0] * (2 * self._size)

    def busy(self, first: int, last: int) -> int:
        """The allocations busy at any position of [first, last]."""
        cover, below, size = self._cover, self._below, self._size
        out = 0
        a, b = (first + size) >> 1, (last + size) >> 1
        while a != b:  # (the ancestors of both ends, up to where they meet ...
            out |= cover[a] | cover[b]
            a >>= 1
            b >>= 1
        while a:  # ... and above)
            out |= cover[a]
            a >>= 1
        lo, hi = first + size, last + size + 1
        while lo < hi:
            if lo & 1:
                out |= below[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                out |= below[hi]
            lo >>= 1
            hi >>= 1
        return out

    def add(self, first: int, last: int, bit: int) -> None:
        """Mark the allocations of `bit` busy over [first, last]."""
        cover, below, size = self._cover, self._below, self._size
        lo, hi = first + size, last + size + 1
        while lo < hi:
            if lo & 1:
                cover[lo] |= bit
                below[lo] |= bit
                lo += 1
            if hi & 1:
                hi -= 1
                cover[hi] |= bit
                below[hi] |= bit
            lo >>= 1
            hi >>= 1
        a, b = (first + size) >> 1, (last + size) >> 1
        while a != b:
            below[a] |= bit
            below[b] |= bit
            a >>= 1
            b >>= 1
        while a:
            below[a] |= bit
            a >>= 1
