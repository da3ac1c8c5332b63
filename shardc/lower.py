"""Plan -> jax: the traced program re-evaluated with sharding constraints, under jax.jit.

The jaxpr is evaluated eqn by eqn inside `jax.jit`, call-like eqns (jit, custom_jvp/vjp calls, remat)
inlined exactly as the graph builder inlined them, so each primitive application meets the plan's op
for it. The plan is enforced op by op, so that what XLA compiles is what the plan (and the simulator)
says:

* an operand the op needs in another layout is constrained to that layout just before the op (the
  plan's reshard; XLA emits the collective for it);
* each result is constrained to the layout the op's strategy produces (with partial sums this is where
  XLA emits the all-reduce), then to the value's planned sharding if that differs;
* hints become constraints to the plan's (now fully decided) sharding of the hinted value.

Inputs and outputs get the plan's shardings through `in_shardings`/`out_shardings` on the Auto mesh.
With `tag_ops`, each op's constraints and the op itself run under the name scope `shardc.op<id>`, so every
collective XLA emits names the plan op it was made for in its metadata (`op_tag`; `shardc.check` uses it
to attribute compiled collectives to the plan's reshards).
Loop and branch bodies (scan/while/cond) are bound unchanged: inside them only hints constrain
(lowering through the hint primitive's own rule on the mesh they were traced under).
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Sequence

import jax
from jax._src import source_info_util
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from annotations.primitive import hint_p
from shardc.ir.build import CALL_PRIMITIVES, REGION_PRIMITIVES
from shardc.plan import Plan, require_devices
from shardc.rules.core import FactorKind
from shardc.sharding import Sharding

__all__ = ["plan_function", "is_decision_op", "DECISION_PRIMITIVES", "jit_plan", "in_out_shardings", "op_tag",
           "tagged_op"]

DECISION_PRIMITIVES = frozenset({
    "dot_general", "conv_general_dilated", "gather", "scatter", "scatter-add", "scatter_add",
    "scatter_mul", "scatter_min", "scatter_max", "dynamic_slice", "dynamic_update_slice",
})


def is_decision_op(primitive: str, rule: Any) -> bool:
    """Ops whose output layout the plan decides: contractions, indexing, reductions."""
    if primitive in DECISION_PRIMITIVES:
        return True
    return any(k is FactorKind.REDUCTION for k in rule.kinds)


_TAG = re.compile(r"shardc\.op(\d+)(?:/|$)")


def op_tag(op_id: int) -> str:
    """The name scope of plan op `op_id` in a program lowered with `tag_ops`."""
    return f"shardc.op{op_id}"


def tagged_op(op_name: str) -> int | None:
    """The plan op a compiled instruction's metadata op_name names (the innermost tag), or None."""
    found = _TAG.findall(op_name)
    return int(found[-1]) if found else None


def _constrain(x: Any, sharding: NamedSharding) -> Any:
    return jax.lax.with_sharding_constraint(x, sharding)


def _call_jaxpr(eqn: Any) -> Any:
    key = CALL_PRIMITIVES.get(eqn.primitive.name)
    return eqn.params.get(key) if key else None


def _in_region(region: str, prefix: str) -> bool:
    return region == prefix or region.startswith(prefix + "/")


def plan_function(plan: Plan, closed_jaxpr: Any, tag_ops: bool = False) -> Callable[..., list[Any]]:
    """A function of the flat inputs that computes the program with the plan's constraints."""
    graph = plan.graph
    mesh = plan.mesh
    sizes = plan.mesh_sizes
    needs: dict[int, dict[int, Sharding]] = {}
    for r in plan.reshards:
        if r.consumer is not None:
            needs.setdefault(r.consumer, {})[r.value] = r.dst.without_partial()

    def named(s: Sharding) -> NamedSharding:
        return s.named(mesh)

    def made_dims(op_id: int) -> list[Sharding]:
        op = graph.ops[op_id]
        strat = plan.strategies[op_id]
        return [strat.tensor_sharding(op.rule, dims, sizes) for dims in op.rule.results]

    def bind(eqn: Any, invals: list[Any], op_id: int | None = None) -> list[Any]:
        params = eqn.primitive.get_bind_params(eqn.params)
        names = eqn.source_info.name_stack
        if tag_ops and op_id is not None:
            names = names.extend(op_tag(op_id))
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=names), eqn.ctx.manager:
            ans = eqn.primitive.bind(*invals, **params)
        return list(ans) if eqn.primitive.multiple_results else [ans]

    def apply_op(op: Any, eqn: Any, invals: list[Any]) -> list[Any]:
        """One plan op: its operands constrained to the layouts it needs, the op, its results constrained to
        the layout its strategy makes and then to their planned layouts."""
        need = needs.get(op.id)
        if need:
            invals = [_constrain(x, named(need[v])) if v in need else x for x, v in zip(invals, op.inputs)]
        if eqn.primitive is hint_p:
            return [_constrain(invals[0], named(plan.shardings[op.outputs[0]]))]
        outs = bind(eqn, invals, op.id)
        made = made_dims(op.id)
        for i, (var, vid) in enumerate(zip(eqn.outvars, op.outputs)):
            if isinstance(var, jcore.DropVar) or not hasattr(outs[i], "shape") \
                    or len(made[i].dims) != len(outs[i].shape):
                continue
            outs[i] = _constrain(outs[i], named(made[i]))
            if made[i] != plan.shardings[vid]:
                outs[i] = _constrain(outs[i], named(plan.shardings[vid]))
        return outs

    def run(*args: Any) -> list[Any]:
        next_op = [0]

        def walk(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], region: str) -> list[Any]:
            env: dict[Any, Any] = {}

            def read(v: Any) -> Any:
                return v.val if isinstance(v, jcore.Literal) else env[v]

            for var, c in zip(jaxpr.constvars, consts):
                env[var] = c
            for var, a in zip(jaxpr.invars, args):
                env[var] = a
            for eqn in jaxpr.eqns:
                invals = [read(v) for v in eqn.invars]
                name = eqn.primitive.name
                sub = _call_jaxpr(eqn)
                if sub is not None:
                    inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                    outs = walk(inner, sub.consts if isinstance(sub, jcore.ClosedJaxpr) else (), invals, region)
                elif name in REGION_PRIMITIVES:
                    for b in range(len(eqn.params["branches"]) if name == "cond" else 1):
                        prefix = f"{region}/{name}{next_op[0]}" + (f".{b}" if name == "cond" else "")
                        while next_op[0] < len(graph.ops) and _in_region(graph.ops[next_op[0]].region, prefix):
                            next_op[0] += 1
                    outs = bind(eqn, invals)
                else:
                    op = graph.ops[next_op[0]]
                    next_op[0] += 1
                    if op.primitive != name:  # the walk lost step with the graph: constrain nothing more
                        raise AssertionError(f"lowering met {name} where the plan has op {op.id} ({op.primitive})")
                    with jax.named_scope(op_tag(op.id)) if tag_ops else contextlib.nullcontext():
                        outs = apply_op(op, eqn, invals)
                for var, val in zip(eqn.outvars, outs):
                    env[var] = val
            return [read(v) for v in jaxpr.outvars]

        return walk(closed_jaxpr.jaxpr, closed_jaxpr.consts, args, "")

    return run


def in_out_shardings(plan: Plan) -> tuple[list[NamedSharding], list[NamedSharding]]:
    mesh = plan.mesh
    ins = [plan.shardings[v].named(mesh) for v in plan.graph.inputs]
    outs = [plan.shardings[v].named(mesh) for v in plan.graph.outputs]
    return ins, outs


# XLA CPU's scatter expander (with algsimp after it) miscompiles a scatter-add into a dim sharded over
# the mesh whose result is added to a resharded value — wrong numbers, silently; pure JAX too (pinned by
# tests/fuzz/test_fuzz_regressions.py::test_xla_cpu_scatter_add_into_a_sharded_dim). XLA CPU runs
# scatters natively without that pass, so shardc compiles without it on CPU.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "scatter_expander"}


def compiler_options(plan: Plan) -> dict[str, str] | None:
    """XLA options for the plan's platform (workarounds for known miscompilations)."""
    platform = next(iter(plan.mesh.devices.flat)).platform
    return dict(CPU_COMPILER_OPTIONS) if platform == "cpu" else None


def jit_plan(plan: Plan, closed_jaxpr: Any, donate: Sequence[int] = (), tag_ops: bool = False) -> Any:
    """`jax.jit` of the planned program over flat inputs, with the plan's in/out shardings."""
    require_devices(plan)  # a plan made for more devices than this host has can only be simulated
    ins, outs = in_out_shardings(plan)
    return jax.jit(plan_function(plan, closed_jaxpr, tag_ops), in_shardings=ins, out_shardings=outs,
                   donate_argnums=tuple(donate), compiler_options=compiler_options(plan))
