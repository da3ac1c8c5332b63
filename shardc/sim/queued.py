"""Which of a plan's reshards XLA:CPU's breadth-first schedule queues as instructions an op waits for.

An all-gather along a dim that is not the most major one reads a copy of its operand in the gathered order
(`shardc.cost.program.gather_relayouts`). When other ops read the value too, its producer writes it row-major for
them and the copy is an instruction of its own: the op reading the gathered value then waits for three
instructions (copy, all-gather, copy back), each queued when the one before it runs, and runs after what became
ready meanwhile (a convolution's weight gradient before its input gradient). Such a reshard changes the schedule,
so it is part of the plan's signature (`shardc.cost.device_shapes.info_for`), whose `ProgramInfo` orders the ops
with the reshard's instructions as queued units (`program._add_chain_units`).

Likewise a reshard that slices a value another op made locally and then runs a collective on the slice: the slice
is an instruction among the value's users (a dynamic-slice fusion), the collective is queued when it runs, and the
op reading the collective's result runs after what became ready with the value (two instructions, not three).
"""
from __future__ import annotations

from typing import Any, Sequence

from shardc.cost.device_shapes import queued_item
from shardc.cost.memory import gather_copy, local_slice

__all__ = ["QUEUED_RESHARDS", "queued_reshards"]

QUEUED_RESHARDS = True  # (switch: plans' queued reshards order the schedule of their per-device ProgramInfo)


def queued_reshards(slots: Sequence[Any], builder: Any) -> frozenset:
    """The signature items (`queued_item`) of the reshards in `slots` (built by `builder`) whose collective the
    schedule queues after an instruction of their own (`_gather_copies`, `_sliced_collectives`)."""
    return _gather_copies(slots, builder) | _sliced_collectives(slots, builder)


def _gather_copies(slots: Sequence[Any], builder: Any) -> frozenset:
    """The reshards that begin with a copy of their operand into an all-gather's order which is an instruction of its
    own: the value is materialised by a live op, not cheap work fusion recomputes (`ProgramInfo.cheap`), and read
    in that layout by other tasks than such copies, so its producer writes it row-major and cannot take the copy in."""
    flags, keys, graph, info = builder.is_value_key, builder.key_list, builder.graph, builder.info
    copies: list[tuple[int, int]] = []  # (op, key) of each copy
    plain: set[int] = set()  # keys read otherwise
    for slot in slots:
        for i, t in enumerate(slot.tasks):
            if gather_copy(slot, i, flags):
                copies.append((slot.op, t.deps[0]))
            else:
                plain.update(d for d in t.deps if flags[d])
    out = set()
    for op, d in copies:
        c = keys[d][0]
        p = graph.values[c].producer
        if d in plain and p is not None and info.live[p] and c not in info.cheap:
            out.add(queued_item(op, c))
    return frozenset(out)


def _sliced_collectives(slots: Sequence[Any], builder: Any) -> frozenset:
    """The operands' reshards that begin with a local slice of a value another slot made (a layout of a value a
    live op materialises, not cheap work fusion recomputes) read by a collective: the slice is an instruction of
    its own (a dynamic-slice fusion: a collective takes no fusion in), one of the value's users, and the collective
    is queued when it runs, so the op reading the collective's result runs after what became ready meanwhile (a
    multiply reading the value through a slice fused into it, later in program order)."""
    flags, keys, graph, info = builder.is_value_key, builder.key_list, builder.graph, builder.info
    out = set()
    for slot in slots:
        made: set[int] = set()  # keys the slot's earlier tasks made
        sliced: dict[int, int] = {}  # a local slice's result -> the canonical value it slices
        for i, t in enumerate(slot.tasks[:slot.at]):
            if local_slice(slot, i, flags) and not made.intersection(t.deps):
                c = keys[t.deps[0]][0]
                p = graph.values[c].producer
                if p is not None and info.live[p] and c not in info.cheap:
                    sliced.update((k, c) for k in t.outs)
            elif t.collective and (c := next((sliced[d] for d in t.deps if d in sliced), None)) is not None:
                out.add(queued_item(slot.op, c, 2))
            made.update(t.outs)
    return frozenset(out)
