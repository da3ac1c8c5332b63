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
ranges afresh (`FirstFit(incremental=False)`), which tests compare.

A replay costs O(ranges) cheap steps (a merge of the two sorted range lists by identity, then a look at each
range's span against the few disturbed spans) plus the work of placing again the few that need it; the
previous run's per-allocation lists, its placement and the bytes it places per position (`usage`) are updated
in place for what moved, not rebuilt."""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Sequence

import numpy as np

from shardc.cost.busy_index import BusyIndex

__all__ = ["FirstFit", "Range"]

_REPLAY_LIMIT = 0.03  # the share of changed ranges above which a placement is made afresh
_FAR = 1 << 62  # after every position
_FEW_SPANS = 24  # disturbed spans kept in a list (scanned) before a replay indexes them in a BusyIndex

# A range to place: (minus its bytes, its maker's post order, first position, last position, key id, the
# allocation it may use whatever its time (-1: none), the key it may begin where it ends in place (None: none)).
# Ranges are placed in tuple order (largest first); key ids are unique, so the first five fields decide it.
Range = tuple[int, int, int, int, int, int, "int | None"]


@dataclasses.dataclass
class _Run:
    """One placement: its allocations, ranges in order, where each landed (key id -> allocation) and per
    allocation its ranges sorted by first position (non-overlapping except where one begins where the range it
    is written over ends), with their first and last positions; `top`: no range of the run (or of the runs it
    was replayed from) ends after it."""

    allocs: list[tuple]
    ranges: list[Range]
    where: dict[int, int]
    starts: list[list[int]]
    ends: list[list[int]]
    members: list[list[Range]]
    top: int


class _Disturbed:
    """The spans over which allocations lost (bit j) or gained (bit n + j) ranges in a replay: a list scanned
    while it is short, a `BusyIndex` over positions 0..`top` once it is not; `hull` bounds them all."""

    __slots__ = ("spans", "index", "top", "lo", "hi")

    def __init__(self, top: int) -> None:
        self.spans: list[tuple[int, int, int]] = []
        self.index: BusyIndex | None = None
        self.top = top
        self.lo, self.hi = _FAR, -1

    def add(self, s: int, e: int, bit: int) -> None:
        """Allocations `bit` changed over [s, e]."""
        if s < self.lo:
            self.lo = s
        if e > self.hi:
            self.hi = e
        if self.index is not None:
            self.index.add(s, e, bit)
            return
        self.spans.append((s, e, bit))
        if len(self.spans) > _FEW_SPANS:
            self.index = BusyIndex(self.top + 1)
            for a, b, m in self.spans:
                self.index.add(a, b, m)

    def at(self, s: int, e: int) -> int:
        """The bits of the spans meeting [s, e]."""
        if e < self.lo or s > self.hi:
            return 0
        if self.index is not None:
            return self.index.busy(s, e)
        out = 0
        for a, b, m in self.spans:
            if a <= e and s <= b:
                out |= m
        return out


class FirstFit:
    """First-fit placement (see the module docstring), replaying the previous call's when its allocations are
    the same (`incremental`)."""

    def __init__(self, incremental: bool = True) -> None:
        self._incremental = incremental
        self._last: _Run | None = None
        self._diff: np.ndarray = np.zeros(0, np.int64)  # bytes placed, as differences over positions

    def place(self, allocs: list[tuple], ranges: Sequence[Range], admits: Callable[[Range], int]) -> dict[int, int]:
        """Key id -> allocation index of each placed range (the placement's own dict: read it, do not change
        it; the next call updates it). `ranges` sorted; `admits(r)`: the allocations that may hold range r
        whatever they hold (its size, its time), as a bitmask (bit j: allocation j; tried lowest first), a
        function of `allocs` and r alone (the same ranges into the same allocations are placed as last time)."""
        last = self._last
        ranges = list(ranges)
        if not self._incremental or last is None or last.allocs != allocs:
            self._set_afresh(allocs, ranges, admits)
            return self._last.where
        fresh, gone = _align(ranges, last.ranges)
        if not fresh and not gone:  # the same ranges land where they did
            return last.where
        if max(len(fresh), len(gone)) > max(8, int(_REPLAY_LIMIT * len(ranges))):
            # (as when a search moves a whole group of repeated layers: replaying then costs more than placing)
            self._set_afresh(allocs, ranges, admits)
        else:
            out, into = self._replay(last, ranges, fresh, gone, admits)
            self._apply(last, ranges, out, into)
        return self._last.where

    def usage(self, length: int) -> np.ndarray:
        """Bytes of the ranges the last call placed, per position 0..`length` - 1."""
        if len(self._diff) < length:
            self._diff = np.concatenate([self._diff, np.zeros(length - len(self._diff), np.int64)])
        return np.cumsum(self._diff[:length])

    def _set_afresh(self, allocs: list[tuple], ranges: list[Range], admits: Callable) -> None:
        """Place `ranges` afresh; the bytes placed per position too."""
        run = self._last = self._afresh(allocs, ranges, admits)
        diff = np.zeros(max(run.top + 2, len(self._diff)), np.int64)
        got = [r for r in ranges if r[4] in run.where]
        sizes = np.array([-r[0] for r in got], np.int64)
        np.add.at(diff, np.array([r[2] for r in got], np.int64), sizes)  # (a range adds its bytes from its
        np.add.at(diff, np.array([r[3] + 1 for r in got], np.int64), -sizes)  # first position to its last)
        self._diff = diff

    @staticmethod
    def _afresh(allocs: list[tuple], ranges: list[Range], admits: Callable) -> _Run:
        """The run placing each range in turn: into the first allocation it may use that is free over its span
        (`BusyIndex` over the ranges' distinct positions), or that holds only the range it is written over in
        place there, ending where it begins (checked on that allocation's sorted ranges)."""
        starts: list[list[int]] = [[] for _ in allocs]
        ends: list[list[int]] = [[] for _ in allocs]
        members: list[list[Range]] = [[] for _ in allocs]
        left, right = bisect.bisect_left, bisect.bisect_right
        rank = _ranks(ranges)
        busy = BusyIndex(len(rank))
        where: dict[int, int] = {}  # key id -> allocation
        for r in ranges:
            _, _, s, e, k, _, over = r
            ok = admits(r)
            first, last = rank[s], rank[e]
            free = ok & ~busy.busy(first, last)
            at = where.get(over, -1) if over is not None else -1
            if at >= 0 and ok >> at & 1 and not free >> at & 1 and not free & ((1 << at) - 1):
                sj, ej = starts[at], ends[at]
                lo, hi = left(ej, s), right(sj, e)
                if hi - lo == 1 and ej[lo] == s and members[at][lo][4] == over:  # (only `over` meets it)
                    free |= 1 << at
            if not free:
                continue
            j = (free & -free).bit_length() - 1
            pos = right(starts[j], s)
            starts[j].insert(pos, s)
            ends[j].insert(pos, e)
            members[j].insert(pos, r)
            busy.add(first, last, 1 << j)
            where[k] = j
        top = max((r[3] for r in ranges), default=0)
        return _Run(allocs, ranges, where, starts, ends, members, top)

    @staticmethod
    def _replay(last: _Run, ranges: list[Range], fresh: list[int], dropped: list[Range], admits: Callable
                ) -> tuple[list[Range], list[tuple[Range, int]]]:
        """The ranges that leave the allocation they had in `last` (dropped, changed or moved) and the
        (range, allocation) placements this run makes that `last` did not: the last run's placement with
        those applied is this run's (see the module docstring). `fresh`: the indices of `ranges` that `last`
        does not have (new or changed); `dropped`: the last run's ranges that `ranges` does not have.

        An allocation that only gained ranges over a span admits no range there that it refused last time, and
        one that only lost ranges still admits what it held: so per allocation the spans it lost ranges over
        (`freed`, bit j) and those it gained ranges over (`filled`, bit `n + j`) are kept apart, and a range is
        placed again only if an allocation before its old one lost something over its span, or its old one
        gained something there."""
        old_where = last.where
        top = max([last.top] + [ranges[i][3] for i in fresh])
        n = len(last.allocs)
        disturbed = _Disturbed(top)
        low = (1 << n) - 1
        gone: set[int] = set()  # keys of the last run's ranges not where they were: dropped, or placed elsewhere now
        out: list[Range] = []
        for r in dropped:
            gone.add(r[4])
            was = old_where.get(r[4], -1)
            if was >= 0:
                out.append(r)
                disturbed.add(r[2], r[3], 1 << was)
        added: list[list[tuple[int, int, int]]] = [[] for _ in last.allocs]  # per allocation: (s, e, key)
        into: list[tuple[Range, int]] = []
        fresh_at = set(fresh)
        for i, r in enumerate(ranges):
            _, _, s, e, k, _, over = r
            if i in fresh_at:  # a range the last run did not have: tried everywhere
                was = -1
                now = _first_free(last, admits(r), s, e, over, r, gone, added)
            else:
                # An allocation it tried last time (all it may use when it was not placed; those before where it
                # went when it was) may admit it now if it lost a range over its span; where it went, if it gained one.
                hit = disturbed.at(s, e)
                if not hit:
                    continue
                was = old_where.get(k, -1)
                freed = hit & low
                if was >= 0:
                    freed &= (1 << was) - 1
                    refilled = hit >> (n + was) & 1
                else:
                    refilled = 0
                if not freed and not refilled:
                    continue
                ok = admits(r)
                freed &= ok
                now = _first_free(last, freed, s, e, over, r, gone, added) if freed else -1
                if now < 0 and was >= 0:
                    now = was if not refilled else _first_free(
                        last, ok >> was << was, s, e, over, r, gone, added)
                if now == was:
                    continue
            if was >= 0:
                gone.add(k)
                out.append(r)
                disturbed.add(s, e, 1 << was)
            if now >= 0:
                added[now].append((s, e, k))
                into.append((r, now))
                disturbed.add(s, e, 1 << (n + now))
        return out, into

    def _apply(self, run: _Run, ranges: list[Range], out: list[Range], into: list[tuple[Range, int]]) -> None:
        """Make `run` the placement of `ranges`: take the ranges of `out` out of the allocations they had,
        put those of `into` into theirs, and count their bytes out of and into `usage`."""
        where, diff = run.where, self._diff
        top = max([run.top] + [r[3] for r, _ in into])
        if len(diff) < top + 2:
            diff = self._diff = np.concatenate([diff, np.zeros(top + 2 - len(diff), np.int64)])
        for r in out:
            j = where.pop(r[4])
            starts, members = run.starts[j], run.members[j]
            x = bisect.bisect_left(starts, r[2])
            while members[x] is not r and members[x] != r:
                x += 1
            del starts[x], run.ends[j][x], members[x]
            diff[r[2]] += r[0]
            diff[r[3] + 1] -= r[0]
        for r, j in into:
            x = bisect.bisect_right(run.starts[j], r[2])
            run.starts[j].insert(x, r[2])
            run.ends[j].insert(x, r[3])
            run.members[j].insert(x, r)
            where[r[4]] = j
            diff[r[2]] -= r[0]
            diff[r[3] + 1] += r[0]
        run.ranges, run.top = ranges, top


def _align(new: list[Range], old: list[Range]) -> tuple[list[int], list[Range]]:
    """The indices of the ranges of `new` that `old` does not have, and the ranges of `old` that `new` does not
    have (both sorted: one merge, comparing by identity first — a kept range is the same tuple)."""
    fresh: list[int] = []
    gone: list[Range] = []
    i = j = 0
    n, m = len(new), len(old)
    while i < n and j < m:
        a, b = new[i], old[j]
        if a is b or a == b:
            i += 1
            j += 1
        elif a[:5] == b[:5]:  # (one key, changed past its first five fields: no compare of the rest)
            fresh.append(i)
            gone.append(b)
            i += 1
            j += 1
        elif a < b:
            fresh.append(i)
            i += 1
        else:
            gone.append(b)
            j += 1
    fresh.extend(range(i, n))
    gone.extend(old[j:])
    return fresh, gone


def _first_free(last: _Run, mask: int, s: int, e: int, over: int | None, r: Range, gone: set[int],
                added: list[list[tuple[int, int, int]]]) -> int:
    """The first allocation of `mask` (lowest bit first) free over [s, e] for range `r`, written over `over` in
    place, or -1: where neither this run's `added` ranges nor the last run's ranges ahead of `r` in the order
    (and not `gone`) meet it, except `over`, ending at s."""
    left, right = bisect.bisect_left, bisect.bisect_right
    while mask:
        low = mask & -mask
        mask ^= low
        j = low.bit_length() - 1
        clash = False
        for a_s, a_e, a_k in added[j]:
            if a_s <= e and s <= a_e and (a_e != s or a_k != over):
                clash = True
                break
        if clash:
            continue
        starts, ends, members = last.starts[j], last.ends[j], last.members[j]
        for x in range(left(ends, s), right(starts, e)):
            m = members[x]
            # (a last-run range of r's key is r itself, not ahead of it, or a changed one, gone: no tuple compare
            # of two ranges equal in their first five fields is made)
            if m[4] not in gone and m < r and (ends[x] != s or m[4] != over):
                break
        else:
            return j
    return -1


def _ranks(ranges: list[Range]) -> dict[int, int]:
    """Position -> its rank among the first and last positions of `ranges` (a `BusyIndex` over those alone
    answers as one over every position, in fewer levels)."""
    return {p: i for i, p in enumerate(sorted({p for r in ranges for p in (r[2], r[3])}))}
