"""First-fit placement of live ranges into allocations, recomputed incrementally between similar calls.

`MemoryModel.in_outputs` models how XLA reuses output allocations for temporaries: ranges in a fixed order
(largest first), each into the first allocation (smallest first) that admits it and is free over its range.
A delta simulation changes a handful of ranges out of hundreds, so `FirstFit.place` replays the previous
placement: a range whose span meets nothing placed differently so far (`disturbed`) lands where it landed
before — every allocation holds the same ranges over its span as in the previous run, so it makes the same
choice — and so does one whose old allocation gained nothing over its span and whose earlier allocations lost
nothing there (an allocation that refused it and only gained ranges refuses it again); only the others are
placed again, against the previous run's ranges that came before them in
the order (minus those placed differently now) plus this run's new placements. The result equals placing all
ranges afresh (`FirstFit(incremental=False)`), which tests compare."""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Iterator, Sequence

from shardc.cost.busy_index import BusyIndex

__all__ = ["FirstFit", "Range"]

_REPLAY_LIMIT = 0.03  # the share of changed ranges above which a placement is made afresh
_FAR = 1 << 62  # after every position

# A range to place: (minus its bytes, its maker's post order, first position, last position, key id, the
# allocation it may use whatever its time (-1: none), the key it may begin where it ends in place (None: none)).
# Ranges are placed in tuple order (largest first); key ids are unique, so the first five fields decide it.
Range = tuple[int, int, int, int, int, int, "int | None"]


@dataclasses.dataclass
class _Run:
    """One placement: its allocations, ranges in order, where each landed (index into ranges -> allocation)
    and per allocation its ranges sorted by first position (non-overlapping except where one begins where the
    range it is written over ends)."""

    allocs: list[tuple]
    ranges: list[Range]
    index: dict[int, int]  # key id -> index into ranges
    where: dict[int, int]
    starts: list[list[int]]
    ends: list[list[int]]
    members: list[list[int]]  # range indices, in the order of `starts`


class FirstFit:
    """First-fit placement (see the module docstring), replaying the previous call's when its allocations are
    the same (`incremental`)."""

    def __init__(self, incremental: bool = True) -> None:
        self._incremental = incremental
        self._last: _Run | None = None

    def place(self, allocs: list[tuple], ranges: Sequence[Range], admits: Callable[[Range], int]) -> dict[int, int]:
        """Key id -> allocation index of each placed range. `ranges` sorted; `admits(r)`: the allocations
        that may hold range r whatever they hold (its size, its time), as a bitmask (bit j: allocation j; tried
        lowest first), a function of `allocs` and r alone (the same ranges into the same allocations are placed
        as last time)."""
        last = self._last
        ranges = list(ranges)
        if not self._incremental or last is None or last.allocs != allocs or _much_changed(last, ranges):
            self._last = self._afresh(allocs, ranges, admits)
        elif last.ranges != ranges:  # (else the same ranges land where they did)
            self._last = _state(allocs, ranges, self._replay(last, ranges, admits))
        return {ranges[i][4]: j for i, j in self._last.where.items()}

    @staticmethod
    def _afresh(allocs: list[tuple], ranges: list[Range], admits: Callable) -> _Run:
        """The run placing each range in turn: into the first allocation it may use that is free over its span
        (`BusyIndex` over the ranges' distinct positions), or that holds only the range it is written over in
        place there, ending where it begins (checked on that allocation's sorted ranges)."""
        starts: list[list[int]] = [[] for _ in allocs]
        ends: list[list[int]] = [[] for _ in allocs]
        members: list[list[int]] = [[] for _ in allocs]
        left, right = bisect.bisect_left, bisect.bisect_right
        rank = _ranks(ranges)
        busy = BusyIndex(len(rank))
        where: dict[int, int] = {}
        placed: dict[int, int] = {}  # key id -> allocation
        for i, r in enumerate(ranges):
            _, _, s, e, k, _, over = r
            ok = admits(r)
            first, last = rank[s], rank[e]
            free = ok & ~busy.busy(first, last)
            at = placed.get(over, -1) if over is not None else -1
            if at >= 0 and ok >> at & 1 and not free >> at & 1 and not free & ((1 << at) - 1):
                sj, ej = starts[at], ends[at]
                lo, hi = left(ej, s), right(sj, e)
                if hi - lo == 1 and ej[lo] == s and ranges[members[at][lo]][4] == over:  # (only `over` meets it)
                    free |= 1 << at
            if not free:
                continue
            j = (free & -free).bit_length() - 1
            pos = right(starts[j], s)
            starts[j].insert(pos, s)
            ends[j].insert(pos, e)
            members[j].insert(pos, i)
            busy.add(first, last, 1 << j)
            where[i] = j
            placed[k] = j
        return _Run(allocs, ranges, {r[4]: i for i, r in enumerate(ranges)}, where, starts, ends, members)

    @staticmethod
    def _replay(last: _Run, ranges: list[Range], admits: Callable) -> dict[int, int]:
        """Range index -> allocation, from the last run's placement (see the module docstring).

        An allocation that only gained ranges over a span admits no range there that it refused last time, and
        one that only lost ranges still admits what it held: so per allocation the spans it lost ranges over
        (`freed`, bit j) and those it gained ranges over (`filled`, bit `n + j`) are kept apart, and a range is
        placed again only if an allocation before its old one lost something over its span, or its old one
        gained something there."""
        new_keys = {r[4]: r for r in ranges}
        gone: set[int] = set()  # old ranges (indices) not where they were: dropped, or placed elsewhere now
        rank = _ranks(ranges, last.ranges)
        n = len(last.allocs)
        disturbed = BusyIndex(len(rank))  # per allocation, the spans it lost (bit j) or gained (bit n + j) ranges over
        hull = [_FAR, -1]  # (first, last) position of all disturbed spans
        low = (1 << n) - 1

        def disturb(s: int, e: int, bit: int) -> None:
            disturbed.add(rank[s], rank[e], bit)
            hull[0], hull[1] = min(hull[0], s), max(hull[1], e)

        for i, r in enumerate(last.ranges):
            if new_keys.get(r[4]) != r:
                gone.add(i)
                if i in last.where:
                    disturb(r[2], r[3], 1 << last.where[i])
        added: list[list[tuple[int, int, int]]] = [[] for _ in last.allocs]  # per allocation: (s, e, key)
        where: dict[int, int] = {}
        for i, r in enumerate(ranges):
            _, _, s, e, k, _, over = r
            old = last.index.get(k)
            if old is not None and last.ranges[old] != r:
                old = None
            was = last.where.get(old, -1) if old is not None else -1
            if old is None:  # a range the last run did not have: tried everywhere
                now = _first_free(last, _bits(admits(r)), s, e, over, _ahead(last.ranges, r), gone, added)
            else:
                # An allocation it tried last time (all it may use when it was not placed; those before where it
                # went when it was) may admit it now if it lost a range over its span; where it went, if it gained one.
                hit = disturbed.busy(rank[s], rank[e]) if s <= hull[1] and hull[0] <= e else 0
                freed = hit & low
                if was >= 0:
                    freed &= (1 << was) - 1
                    refilled = hit >> (n + was) & 1
                else:
                    refilled = 0
                if not freed and not refilled:
                    if was >= 0:
                        where[i] = was
                    continue
                ok = admits(r)
                freed &= ok
                now = _first_free(last, _bits(freed), s, e, over, old, gone, added) if freed else -1
                if now < 0 and was >= 0:
                    now = was if not refilled else _first_free(
                        last, _bits(ok >> was << was), s, e, over, old, gone, added)
            if now >= 0:
                where[i] = now
            if now == was and old is not None:
                continue
            if was >= 0:
                gone.add(old)
                disturb(s, e, 1 << was)
            if now >= 0:
                added[now].append((s, e, k))
                disturb(s, e, 1 << (n + now))
        return where


def _first_free(last: _Run, allocs: Iterator[int], s: int, e: int, over: int | None, before: int,
                gone: set[int], added: list[list[tuple[int, int, int]]]) -> int:
    """The first of `allocs` free over [s, e] now (see `_admits_now`), or -1."""
    for j in allocs:
        if _admits_now(last, j, s, e, over, before, gone, added[j]):
            return j
    return -1


def _admits_now(last: _Run, j: int, s: int, e: int, over: int | None, before: int, gone: set[int],
                added: list[tuple[int, int, int]]) -> bool:
    """Whether allocation j is free over [s, e] for a range written over `over` in place: the last run's ranges
    in it ahead of this one (index < `before`, not `gone`) and this run's `added` ones, where only `over` may
    meet it, and only ending at s."""
    for a_s, a_e, a_k in added:
        if a_s <= e and s <= a_e and (a_e != s or a_k != over):
            return False
    starts, ends, members = last.starts[j], last.ends[j], last.members[j]
    for x in range(bisect.bisect_left(ends, s), bisect.bisect_right(starts, e)):
        m = members[x]
        if m < before and m not in gone and (ends[x] != s or last.ranges[m][4] != over):
            return False
    return True


def _ahead(ranges: list[Range], r: Range) -> int:
    """How many of `ranges` (sorted) come before `r` in the placing order (which its first five fields decide)."""
    return bisect.bisect_left(ranges, r[:5], key=lambda x: x[:5])


def _bits(mask: int) -> Iterator[int]:
    """The set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _ranks(*lists: list[Range]) -> dict[int, int]:
    """Position -> its rank among the first and last positions of the ranges in `lists` (a `BusyIndex` over
    those alone answers as one over every position, in fewer levels)."""
    return {p: i for i, p in enumerate(sorted({p for rs in lists for r in rs for p in (r[2], r[3])}))}


def _much_changed(last: _Run, ranges: list[Range]) -> bool:
    """Whether more than `_REPLAY_LIMIT` of the ranges differ from the last run's (as when a search moves a
    whole group of repeated layers): replaying then costs more than placing afresh."""
    index, old = last.index, last.ranges
    limit = max(8, int(_REPLAY_LIMIT * len(ranges)))
    differ = abs(len(ranges) - len(old))
    for r in ranges:
        i = index.get(r[4])
        if i is None or old[i] != r:
            differ += 1
            if differ > limit:
                return True
    return False


def _state(allocs: list[tuple], ranges: list[Range], where: dict[int, int]) -> _Run:
    """The run a placement `where` (range index -> allocation) makes, for the next call to replay."""
    starts: list[list[int]] = [[] for _ in allocs]
    ends: list[list[int]] = [[] for _ in allocs]
    members: list[list[int]] = [[] for _ in allocs]
    for j, s, e, i in sorted((j, ranges[i][2], ranges[i][3], i) for i, j in where.items()):
        starts[j].append(s)
        ends[j].append(e)
        members[j].append(i)
    return _Run(allocs, ranges, {r[4]: i for i, r in enumerate(ranges)}, where, starts, ends, members)
