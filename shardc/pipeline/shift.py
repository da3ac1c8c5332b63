"""`stage_shift`: move a pipeline's activation buffer one stage along its stage dim.

In value it is `jnp.roll(x, offset, axis)`. It is a primitive of its own ("shardc_stage_shift") because
what it costs depends on the plan: with the stage dim split over the stage mesh axis, XLA's partitioner
makes the roll one collective-permute of each device's shard (GSPMD §3.3), and nothing else; unsplit, it
is a local copy. Written as `jnp.roll` the planner would see a concatenate of slices (permutation factors,
planned unsharded) and gather the buffer.

Rules:

* factor rule (`shardc.rules`): every dim passes through (the result is laid out as the operand);
* collectives (`shardc.cost.op_collectives`): one collective-permute of the rows that leave each device;
* jvp / transpose: linear (the transpose shifts back); batching: the dim moves with the batch dim;
* lowering: `jnp.roll`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from shardc.cost.collectives import Collective
from shardc.cost.op_collectives import NONE, OwnCollectives, register_op_collectives
from shardc.rules.core import FactorKind, FactorRule, register_rule

__all__ = ["stage_shift", "stage_shift_p", "SHIFT_PRIMITIVE"]

SHIFT_PRIMITIVE = "shardc_stage_shift"
stage_shift_p = Primitive(SHIFT_PRIMITIVE)


def stage_shift(x: jax.Array, offset: int = 1, axis: int = 0) -> jax.Array:
    """`jnp.roll(x, offset, axis)` as the pipeline's stage-to-stage transfer."""
    axis = axis % x.ndim
    return stage_shift_p.bind(x, offset=int(offset), axis=int(axis))


def _roll(x: jax.Array, *, offset: int, axis: int) -> jax.Array:
    return jnp.roll(x, offset, axis=axis)


stage_shift_p.def_abstract_eval(lambda x, *, offset, axis: x)
stage_shift_p.def_impl(_roll)
mlir.register_lowering(stage_shift_p, mlir.lower_fun(_roll, multiple_results=False))
ad.deflinear2(stage_shift_p, lambda ct, x, *, offset, axis: [stage_shift_p.bind(ct, offset=-offset, axis=axis)])


def _batch(vals, dims, *, offset: int, axis: int):
    (x,), (d,) = vals, dims
    if d is None:
        return stage_shift_p.bind(x, offset=offset, axis=axis), None
    return stage_shift_p.bind(x, offset=offset, axis=axis + (1 if d <= axis else 0)), d


batching.primitive_batchers[stage_shift_p] = _batch


def _rule(ins, outs, params) -> FactorRule:
    """Every dim passes through: the shifted result has the operand's layout."""
    (shape,) = ins
    dims = tuple((i,) for i in range(len(shape)))
    return FactorRule((dims,), (dims,), tuple(int(s) for s in shape), (FactorKind.PASS_THROUGH,) * len(shape))


register_rule(SHIFT_PRIMITIVE, _rule)


@register_op_collectives(SHIFT_PRIMITIVE)
def _collectives(op, ins, shapes, itemsizes, mesh, bcast) -> OwnCollectives:
    """With the shifted dim split over mesh axes, each device sends the rows that leave its shard to the next
    one: one collective-permute over those axes (XLA's partitioner makes exactly this of a roll)."""
    axis, offset = op.params["axis"], abs(op.params["offset"])
    axes = tuple(ins[0].dims[axis]) if axis < len(ins[0].dims) else ()
    if not axes or offset == 0:
        return NONE
    local = ins[0].local_shape(shapes[0], mesh)
    rows = local[axis]
    moved = min(offset, rows)
    moving = Collective("collective-permute", axes, itemsizes[0] * math.prod(local) * moved // rows)
    return OwnCollectives(before=(moving,), instead=True)
