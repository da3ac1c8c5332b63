"""Collectives an op makes by itself, whatever the plan's reshards around it: a rule table keyed by primitive.

Most communication comes from changes of layout (reshards, `shardc.cost.reshard`). A few primitives
communicate as part of what they compute: the pipeline's stage shift (`shardc.pipeline.shift`) is one
collective-permute of the rows that leave each device when its dim is split. Their rules say which
collectives, from the layouts the op's strategy needs on its operands; the simulator runs them as the op's
own tasks (on the link streams) and `shardc.check` counts them like any other.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from shardc.cost.collectives import Collective
from shardc.sharding import Sharding

__all__ = ["OP_COLLECTIVES", "register_op_collectives", "op_collectives"]

# (op, operand layouts, operand shapes, operand itemsizes, mesh sizes) -> the op's collectives
OpCollectivesRule = Callable[[Any, Sequence[Sharding], Sequence[tuple[int, ...]], Sequence[int], Mapping[str, int]],
                             tuple[Collective, ...]]
OP_COLLECTIVES: dict[str, OpCollectivesRule] = {}


def register_op_collectives(*names: str) -> Callable[[OpCollectivesRule], OpCollectivesRule]:
    def deco(fn: OpCollectivesRule) -> OpCollectivesRule:
        for n in names:
            OP_COLLECTIVES[n] = fn
        return fn

    return deco


def op_collectives(op: Any, ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int],
                   mesh: Mapping[str, int]) -> tuple[Collective, ...]:
    """The collectives `op` makes with its operands laid out as `ins` (none for most primitives)."""
    rule = OP_COLLECTIVES.get(op.primitive)
    return rule(op, ins, shapes, itemsizes, mesh) if rule is not None else ()
