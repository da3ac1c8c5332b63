"""Collectives an op makes by itself, whatever the plan's reshards around it: a rule table keyed by primitive.

Most communication comes from changes of layout (reshards, `shardc.cost.reshard`). A few primitives
communicate as part of what they compute: the pipeline's stage shift (`shardc.pipeline.shift`) is one
collective-permute of the rows that leave each device when its dim is split; an argmax/argmin over a split
dim reduces each piece, then all-gathers the candidates (`_arg_reduce`); a gather or scatter whose operand is
split on a dim it indexes with slices of one row regroups its indices, updates, result or operand by the
operand's device groups and collective-permutes those whose grouping differs (`shardc.cost.gather_groups`).
Their rules say which collectives (`OwnCollectives`: before the op computes, after it, or instead of it),
from the layouts the op's strategy needs on its operands; the simulator runs them as the op's own tasks (on
the link streams) and `shardc.check` counts them like any other.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shardc.cost.collectives import Collective
from shardc.sharding import Sharding

__all__ = ["NONE", "OP_COLLECTIVES", "OperandPermute", "OwnCollectives", "register_op_collectives", "op_collectives"]


@dataclasses.dataclass(frozen=True, slots=True)
class OperandPermute:
    """What a collective-permute of one operand is to XLA: operand `operand` (as the op reads it) sent from
    device `src` to `dst` for each of `pairs` (devices in mesh order). Two ops of one computation that permute
    the same operand instruction with the same pairs read one collective-permute (the partitioner reshards an
    instruction to one layout once; CSE merges the rest): a gather and its gradient's scatter-add regrouping
    the same indices."""

    operand: int
    pairs: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class OwnCollectives:
    """The collectives one op makes by itself: `before` it computes (on its operands), `after` (on its local
    results); `instead`: the op is nothing but its `before` collectives (the stage shift computes nothing);
    `shared`: per collective of `before`, the operand permute it is when another op may share it (None: the
    op's own; empty: none is shared)."""

    before: tuple[Collective, ...] = ()
    after: tuple[Collective, ...] = ()
    instead: bool = False
    shared: tuple[OperandPermute | None, ...] = ()

    @property
    def all(self) -> tuple[Collective, ...]:
        return self.before + self.after


NONE = OwnCollectives()

# (op, operand layouts, operand shapes, operand itemsizes, mesh sizes, per operand the dims along which it is a
# broadcast) -> the op's collectives
OpCollectivesRule = Callable[[Any, Sequence[Sharding], Sequence[tuple[int, ...]], Sequence[int], Mapping[str, int],
                              Sequence[frozenset[int]]], OwnCollectives]
OP_COLLECTIVES: dict[str, OpCollectivesRule] = {}


def register_op_collectives(*names: str) -> Callable[[OpCollectivesRule], OpCollectivesRule]:
    def deco(fn: OpCollectivesRule) -> OpCollectivesRule:
        for n in names:
            OP_COLLECTIVES[n] = fn
        return fn

    return deco


def op_collectives(op: Any, ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int],
                   mesh: Mapping[str, int], bcast: Sequence[frozenset[int]] = ()) -> OwnCollectives:
    """The collectives `op` makes with its operands laid out as `ins` (none for most primitives). `bcast`: per
    operand, the dims along which it is a broadcast (XLA's partitioner copies rather than moves it there)."""
    rule = OP_COLLECTIVES.get(op.primitive)
    if rule is None:
        return NONE
    bcast = tuple(bcast) + (frozenset(),) * (len(ins) - len(bcast))
    return rule(op, ins, shapes, itemsizes, mesh, bcast)


@register_op_collectives("argmax", "argmin")
def _arg_reduce(op: Any, ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int],
                mesh: Mapping[str, int], bcast: Sequence[frozenset[int]]) -> OwnCollectives:
    """An argmax/argmin over a dim split over mesh axes (its rule's reduction factor, `SELF_COMBINED`): XLA's
    partitioner reduces each device's piece, then all-gathers each shard's candidate value and its global
    index over those axes (two all-gathers of the local result times the group) and reduces them again."""
    (axis,) = op.params["axes"]
    axes = tuple(a for a in ins[0].dims[axis] if mesh[a] > 1) if axis < len(ins[0].dims) else ()
    if not axes:  # (an axis of size 1 splits nothing: XLA's sharding does not name it)
        return NONE
    group = math.prod(mesh[a] for a in axes)
    local = ins[0].local_shape(shapes[0], mesh)
    n = math.prod(local) // local[axis] * group
    index = np.dtype(op.params.get("index_dtype", np.int32)).itemsize
    return OwnCollectives(after=(Collective("all-gather", axes, n * itemsizes[0]),
                                 Collective("all-gather", axes, n * index)))
