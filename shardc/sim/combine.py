"""XLA's all-reduce combiner, as the simulator sees it.

XLA merges all-reduces over the same devices into one tuple-shaped all-reduce (AllReduceCombiner: on
GPU up to 30 MiB and 256 operands by default, on CPU without a byte limit) within one computation (the
all-reduces of a loop body merge among themselves). Two all-reduces merge only when neither's input
depends on the other's result. The gradient all-reduces of data parallelism are
independent of each other and merge into a few large ones at the end of the backward pass — which keeps
every gradient alive until then; the activation all-reduces of tensor parallelism feed the next layer
and stay apart.

`Combiner` finds the groups in program order, by dataflow over the program graph: each value's set of
descendants is a bitmask (computed once per graph), a group accumulates its members' descendants, and
an all-reduce joins the open group of its mesh axes and region unless its value is among them. The memory
model uses the groups (members' inputs live until the merged all-reduce, which runs after the member
scheduled last; results start there); the timeline keeps one task per all-reduce.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

from shardc.cost.program import descendants
from shardc.sim.tasks import Slot

__all__ = ["Group", "Combiner"]


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    members: tuple[tuple[int, int], ...]  # (slot, index into slot.ars), in program order
    axes: tuple[str, ...]
    bytes: int


class Combiner:
    def __init__(self, graph: Any, canon: Sequence[int], key_list: Sequence[Any]) -> None:
        self.key_list = key_list
        self.desc = descendants(graph, canon)  # canonical value -> bitmask of the values computed from it

    def groups(self, slots: Sequence[Slot], ar_slots: Iterable[int], max_bytes: float, max_count: int) -> list[Group]:
        """Groups of two or more all-reduces XLA merges (`ar_slots`: the slots holding candidates, in order)."""
        out: list[Group] = []
        open_: dict[tuple, list] = {}  # (axes, region) -> [members, bytes, descendants of members]
        desc, key_list = self.desc, self.key_list

        def close(at: tuple) -> None:
            members, nbytes, _ = open_.pop(at)
            if len(members) > 1:
                out.append(Group(tuple(members), at[0], nbytes))

        for si in ar_slots:
            for ei, e in enumerate(slots[si].ars):
                c = key_list[e.src][0]
                at = (e.axes, e.region)
                g = open_.get(at)
                if g is not None and ((g[2] >> c) & 1 or len(g[0]) >= max_count or g[1] + e.bytes > max_bytes):
                    close(at)
                    g = None
                if g is None:
                    g = open_[at] = [[], 0, 0]
                g[0].append((si, ei))
                g[1] += e.bytes
                g[2] |= desc[c]
        for at in list(open_):
            close(at)
        out.sort(key=lambda g: g.members[0])
        return out

    @staticmethod
    def lifetimes(slots: Sequence[Slot], groups: Sequence[Group], order: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Key id -> (not before, not after) slot bounds the merging imposes on buffers: members' inputs
        live until the merged all-reduce, their results start there. `order`: each slot's position in the
        schedule (the merged all-reduce runs after the member scheduled last)."""
        out: dict[int, tuple[int, int]] = {}
        for g in groups:
            a = max((s for s, _ in g.members), key=order.__getitem__)
            for s, e in g.members:
                entry = slots[s].ars[e]
                out[entry.src] = (-1, a)
                out[entry.dst] = (a, -1)
        return out
