"""Collectives an op makes by itself, whatever the plan's reshards around it: a rule table keyed by primitive.

Most communication comes from changes of layout (reshards, `shardc.cost.reshard`). A few primitives
communicate as part of what they compute: the pipeline's stage shift (`shardc.pipeline.shift`) is one
collective-permute of the rows that leave each device when its dim is split; an argmax/argmin over a split
dim reduces each piece, then all-gathers the candidates (`_arg_reduce`). Their rules say which
collectives, from the layouts the op's strategy needs on its operands; the simulator runs them as the op's
own tasks (on the link streams) and `shardc.check` counts them like any other.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shardc.cost.collectives import Collective
from shardc.sharding import Sharding

__all__ = ["OP_COLLECTIVES", "AFTER_COMPUTE", "register_op_collectives", "op_collectives"]

# (op, operand layouts, operand shapes, operand itemsizes, mesh sizes) -> the op's collectives
OpCollectivesRule = Callable[[Any, Sequence[Sharding], Sequence[tuple[int, ...]], Sequence[int], Mapping[str, int]],
                             tuple[Collective, ...]]
OP_COLLECTIVES: dict[str, OpCollectivesRule] = {}
# Primitives that compute on their local pieces first and communicate the partial results after (argmax);
# the others are their collectives and nothing more (the stage shift).
AFTER_COMPUTE: set[str] = set()


def register_op_collectives(*names: str, after_compute: bool = False
                            ) -> Callable[[OpCollectivesRule], OpCollectivesRule]:
    def deco(fn: OpCollectivesRule) -> OpCollectivesRule:
        for n in names:
            OP_COLLECTIVES[n] = fn
            if after_compute:
                AFTER_COMPUTE.add(n)
        return fn

    return deco


def op_collectives(op: Any, ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int],
                   mesh: Mapping[str, int]) -> tuple[Collective, ...]:
    """The collectives `op` makes with its operands laid out as `ins` (none for most primitives)."""
    rule = OP_COLLECTIVES.get(op.primitive)
    return rule(op, ins, shapes, itemsizes, mesh) if rule is not None else ()


@register_op_collectives("argmax", "argmin", after_compute=True)
def _arg_reduce(op: Any, ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int],
                mesh: Mapping[str, int]) -> tuple[Collective, ...]:
    """An argmax/argmin over a dim split over mesh axes (its rule's reduction factor, `SELF_COMBINED`): XLA's
    partitioner reduces each device's piece, then all-gathers each shard's candidate value and its global
    index over those axes (two all-gathers of the local result times the group) and reduces them again."""
    (axis,) = op.params["axes"]
    axes = tuple(a for a in ins[0].dims[axis] if mesh[a] > 1) if axis < len(ins[0].dims) else ()
    if not axes:  # (an axis of size 1 splits nothing: XLA's sharding does not name it)
        return ()
    group = math.prod(mesh[a] for a in axes)
    local = ins[0].local_shape(shapes[0], mesh)
    n = math.prod(local) // local[axis] * group
    index = np.dtype(op.params.get("index_dtype", np.int32)).itemsize
    return Collective("all-gather", axes, n * itemsizes[0]), Collective("all-gather", axes, n * index)
