"""Which plan op each compiled collective was made for, against the collectives the plan lists for it.

A program lowered with `tag_ops` (`shardc.lower`) runs each plan op and its constraints under the name scope
`shardc.op<id>`; XLA copies the scope into the metadata of every collective it emits there. Grouping the
compiled collectives by that tag, against the simulation's collectives per op (the plan's reshards as the
simulator schedules them: a layout made once is reused, loop bodies counted once as in the HLO), shows,
op by op, where the program that runs differs from the plan: a reshard XLA does another way, or a
collective the plan does not list at all. Compile without XLA's collective combiners for this (a combined
all-reduce carries the metadata of one of the ops it serves).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Sequence

from annotations.errors import SourceLine
from shardc.lower import tagged_op

__all__ = ["OpCollectives", "attribute", "describe_mismatches"]


@dataclasses.dataclass(frozen=True)
class OpCollectives:
    """The collective payload bytes per kind one op has in the plan and in the compiled program (one
    execution; op None: compiled collectives no plan op's scope names)."""

    op: int | None
    primitive: str
    source: SourceLine | None
    planned: dict[str, int]
    compiled: dict[str, int]

    @property
    def agrees(self) -> bool:
        return self.planned == self.compiled


def attribute(plan: Any, compiled: Sequence[Any], simulation: Any) -> list[OpCollectives]:
    """Per op (in program order, untagged last): simulated vs compiled collective bytes by kind."""
    planned: dict[int | None, Counter] = {}
    for slot in simulation.slots:
        if slot.payload:
            planned.setdefault(slot.op, Counter()).update(slot.payload)
    got: dict[int | None, Counter] = {}
    for coll in compiled:
        got.setdefault(tagged_op(coll.op_name), Counter())[coll.kind] += coll.bytes * coll.count
    ops = sorted({k for k in planned.keys() | got.keys() if k is not None}) + (
        [None] if None in planned.keys() | got.keys() else [])
    out = []
    for k in ops:
        op = plan.graph.ops[k] if k is not None else None
        out.append(OpCollectives(k, op.primitive if op else "(no plan op)", op.source if op else None,
                                 dict(planned.get(k, {})), dict(got.get(k, {}))))
    return out


def describe_mismatches(rows: Sequence[OpCollectives], limit: int = 20) -> str:
    """A few lines per op whose compiled collectives differ from the plan's."""
    bad = [r for r in rows if not r.agrees]
    lines = []
    for r in bad[:limit]:
        where = f" at {r.source}" if r.source else ""
        lines.append(f"op {r.op} {r.primitive}{where}: planned {r.planned or '{}'}, compiled {r.compiled or '{}'}")
    if len(bad) > limit:
        lines.append(f"... and {len(bad) - limit} more")
    return "\n".join(lines)
