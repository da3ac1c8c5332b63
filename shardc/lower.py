"""Plan -> jax: the traced program re-evaluated with sharding constraints, under jax.jit.

The top-level jaxpr is evaluated eqn by eqn inside `jax.jit`. Every hint becomes a
`with_sharding_constraint` to the plan's sharding of the hinted value (its open dims now decided), and
so does every output of a *decision op* (dot_general, conv, gather/scatter, reductions — ops whose
layout is a choice rather than a consequence). Inputs and outputs get the plan's shardings through
`in_shardings`/`out_shardings` on the Auto mesh; XLA's partitioner inserts the collectives. Nested
jaxprs (scan bodies, jit calls) are bound as they are; hints inside them lower through the hint
primitive's own rule, on the mesh they were traced under.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax._src import source_info_util
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from annotations.primitive import hint_p
from shardc.plan import Plan
from shardc.rules.core import FactorKind

__all__ = ["plan_function", "is_decision_op", "DECISION_PRIMITIVES"]

DECISION_PRIMITIVES = frozenset({
    "dot_general", "conv_general_dilated", "gather", "scatter", "scatter-add", "scatter_add",
    "scatter_mul", "scatter_min", "scatter_max", "dynamic_slice", "dynamic_update_slice",
})


def is_decision_op(primitive: str, rule: Any) -> bool:
    """Ops whose output layout the plan decides: contractions, indexing, reductions."""
    if primitive in DECISION_PRIMITIVES:
        return True
    return any(k is FactorKind.REDUCTION for k in rule.kinds)


def _constrain(x: Any, sharding: NamedSharding) -> Any:
    return jax.lax.with_sharding_constraint(x, sharding)


def plan_function(plan: Plan, closed_jaxpr: Any) -> Callable[..., list[Any]]:
    """A function of the flat inputs that computes the program with the plan's constraints."""
    graph = plan.graph
    mesh = plan.mesh
    jaxpr = closed_jaxpr.jaxpr
    consts = closed_jaxpr.consts
    top = graph.top_level
    # Ops created for each top-level eqn: the graph builder made them in order, so the op producing a
    # top-level outvar identifies whether that eqn was a decision.
    decision_values: set[int] = set()
    for op in graph.ops:
        if op.region == "" and (op.is_hint or is_decision_op(op.primitive, op.rule)):
            decision_values.update(op.outputs)

    def sharding_of(vid: int) -> NamedSharding:
        return plan.shardings[vid].named(mesh)

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for var, c in zip(jaxpr.constvars, consts):
            env[var] = c
        for var, a in zip(jaxpr.invars, args):
            env[var] = a
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive is hint_p:
                outs = [_constrain(invals[0], sharding_of(top[eqn.outvars[0]]))]
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                with source_info_util.user_context(eqn.source_info.traceback,
                                                   name_stack=eqn.source_info.name_stack), eqn.ctx.manager:
                    ans = eqn.primitive.bind(*invals, **params)
                outs = list(ans) if eqn.primitive.multiple_results else [ans]
                for i, var in enumerate(eqn.outvars):
                    vid = top.get(var)
                    if vid is not None and vid in decision_values and not isinstance(var, jcore.DropVar):
                        outs[i] = _constrain(outs[i], sharding_of(vid))
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]

    return run


def in_out_shardings(plan: Plan) -> tuple[list[NamedSharding], list[NamedSharding]]:
    mesh = plan.mesh
    ins = [plan.shardings[v].named(mesh) for v in plan.graph.inputs]
    outs = [plan.shardings[v].named(mesh) for v in plan.graph.outputs]
    return ins, outs


def jit_plan(plan: Plan, closed_jaxpr: Any, donate: Sequence[int] = ()) -> Any:
    """`jax.jit` of the planned program over flat inputs, with the plan's in/out shardings."""
    ins, outs = in_out_shardings(plan)
    return jax.jit(plan_function(plan, closed_jaxpr), in_shardings=ins, out_shardings=outs,
                   donate_argnums=tuple(donate))
