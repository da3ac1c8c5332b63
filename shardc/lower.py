"""Plan -> jax: the traced program re-evaluated with sharding constraints, under jax.jit.

The jaxpr is evaluated eqn by eqn inside `jax.jit`, call-like eqns (jit, custom_jvp/vjp calls, remat)
inlined exactly as the graph builder inlined them, so each primitive application meets the plan's op
for it. The plan is enforced op by op, so that what XLA compiles is what the plan (and the simulator)
says:

* an operand the op needs in another layout is constrained to that layout just before the op (the
  plan's reshard; XLA emits the collective for it);
* each result is constrained to the layout the op's strategy produces (with partial sums this is where
  XLA emits the all-reduce), then to the value's planned sharding if that differs;
* hints and `with_sharding_constraint`s become constraints to the plan's (now fully decided) sharding of
  the value, on the plan's mesh (the step may have been traced under another one).

Inputs and outputs get the plan's shardings through `in_shardings`/`out_shardings` on the Auto mesh.
With `tag_ops`, each op's constraints and the op itself run under the name scope `shardc.op<id>`, so every
collective XLA emits names the plan op it was made for in its metadata (`op_tag`; `shardc.check` uses it
to attribute compiled collectives to the plan's reshards).
Loop and branch bodies (scan/while/cond) are re-traced by the same walk (`shardc.lower_regions`). An op
that CSE merges into an identical earlier one (`shardc.cost.program.merged`) is not bound again, and each
reshard step of one traced value is made once: the simulator counts them so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable, Iterator, Sequence

import jax
from jax._src import source_info_util
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from annotations.primitive import hint_p
from shardc.ir.build import REGION_PRIMITIVES, call_jaxpr
from shardc.ir.jaxpr_env import JaxprEnv, open_jaxpr
from shardc.cost.program import (BOUND_THROUGH, SCATTERS, folds_to_constant, pad_of, program_info, reads_only_padding,
                                  unread_repeats)
from shardc.cost.windows import window_unread
from shardc.cost.reshard_path import reshard_steps
from shardc.plan import Plan, lowers_reduce_scatter, planned_apart, require_devices
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


_TAG = re.compile(r"shardc\.op(\d+)(?![\w.])")  # also inside transforms: "jvp(shardc.op42)/..."


def op_tag(op_id: int) -> str:
    """The name scope of plan op `op_id` in a program lowered with `tag_ops`."""
    return f"shardc.op{op_id}"


def tagged_op(op_name: str) -> int | None:
    """The plan op a compiled instruction's metadata op_name names (the innermost tag), or None."""
    found = _TAG.findall(op_name)
    return int(found[-1]) if found else None


def _constant_like(x: Any) -> Any:
    """Zeros shaped as `x`, a compile-time constant: the operand of an op XLA folds to a constant whatever it
    reads (an argmax over dims of size 1), passed so (its constant operands, an out-of-bounds gather's
    indices, stay as they are: they decide the constant). Bound on the traced operand, XLA partitions the op as
    the operand is laid out before it folds it, and a result split over two mesh axes was all-gathered and
    sliced back (the plan has no collective there: the op reads nothing, `unread_operands`)."""
    if not hasattr(x, "shape"):
        return x
    return jax.numpy.zeros(x.shape, x.dtype)


def _constrain(x: Any, sharding: NamedSharding) -> Any:
    return jax.lax.with_sharding_constraint(x, sharding)


@dataclasses.dataclass
class _Trace:
    """What the walk keeps per trace being built (the program, each re-traced loop or branch body)."""

    bound: dict[int, Any] = dataclasses.field(default_factory=dict)  # graph value -> its traced value
    # each reshard made so far, (id of the traced source, layout) -> (source, result): XLA reshards one
    # instruction to one layout once; a later consumer reuses it
    made: dict[tuple[int, Sharding], tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    padding: dict[int, Any] = dataclasses.field(default_factory=dict)  # a pad's result -> its padding value


class Lowering:
    """The walk that re-evaluates a traced program op by op with the plan's constraints (one per lowering:
    `next_op` is the plan op the walk meets next, in the graph builder's order)."""

    def __init__(self, plan: Plan, tag_ops: bool = False) -> None:
        self.plan, self.graph, self.tag_ops = plan, plan.graph, tag_ops
        self.sizes = plan.mesh_sizes
        self.reduce_scatter = lowers_reduce_scatter(plan.mesh)
        self.needs: dict[int, dict[int, Sharding]] = {}  # op -> operand index -> the layout it needs
        for r in plan.constrained:
            if r.consumer is not None:
                self.needs.setdefault(r.consumer, {})[r.operand] = r.dst.without_partial()
        self.next_op = 0
        self.info = program_info(self.graph)
        self._traces: list[_Trace] = [_Trace()]  # the program's, then each re-traced loop or branch body's

    @contextlib.contextmanager
    def new_trace(self) -> Iterator[None]:
        """A body traced apart from the program (its values are not the enclosing trace's)."""
        self._traces.append(_Trace())
        try:
            yield
        finally:
            self._traces.pop()

    # -- constraints ---------------------------------------------------------------------------------
    def named(self, s: Sharding) -> NamedSharding:
        return s.named(self.plan.mesh)

    def as_planned(self, x: Any, vid: int) -> Any:
        """`x` constrained to value `vid`'s planned sharding."""
        return _constrain(x, self.named(self.plan.shardings[vid]))

    def reshard(self, x: Any, vid: int, src: Sharding, dst: Sharding) -> Any:
        """`x` (value `vid`, laid out as `src`) constrained to `dst` through the layouts of the one reshard
        model (`reshard_steps`: intermediate layouts where XLA would rematerialize the whole value). Each
        step is made once per traced value and layout and reused by later consumers, as the simulator
        counts it (XLA would share only a path's first step: each constraint is an instruction of its own)."""
        if src != dst:
            val = self.graph.values[vid]
            made = self._traces[-1].made
            for layout, _ in reshard_steps(src, dst, val.shape, val.dtype.itemsize, self.sizes, self.reduce_scatter):
                layout = layout.without_partial()
                hit = made.get((id(x), layout))
                if hit is None:
                    hit = made[(id(x), layout)] = (x, _constrain(x, self.named(layout)))
                x = hit[1]
        return x

    def as_needed(self, x: Any, op_id: int, vid: int) -> Any:
        """`x` (value `vid`, the operand of one-operand op `op_id`) constrained to the layout the op needs it
        in (its planned one if no reshard)."""
        need = self.needs.get(op_id, {}).get(0)
        if need is None and self.info.constant[vid]:
            # the plan lists no reshard of a compile-time constant: made whole, it is sliced to what the op
            # needs (through its planned layout, XLA would move it as data)
            return _constrain(x, self.named(self.needed_dims(op_id, 0)))
        x = self.reshard(x, vid, self.plan.shardings[vid], need) if need is not None else x
        return _constrain(x, self.named(need if need is not None else self.plan.shardings[vid]))

    def operand_side(self, x: Any, op: Any) -> Any:
        """`x` (the operand of a one-operand op) taken to the layout `op` needs it in."""
        return self.as_needed(x, op.id, op.inputs[0])

    def result_side(self, x: Any, op: Any) -> Any:
        """`x` (in the layout a one-result op's strategy makes) taken to its result's planned layout."""
        made, vid = self.made_dims(op.id)[0], op.outputs[0]
        x = _constrain(x, self.named(made))
        return self.as_planned(self.reshard(x, vid, made, self.plan.shardings[vid]), vid)

    def take(self, *primitives: str) -> Any:
        """The next plan op, which must be one of `primitives` (the walk and the graph builder agree)."""
        op = self.graph.ops[self.next_op]
        if op.primitive not in primitives:
            raise AssertionError(f"lowering expected {'/'.join(primitives)} where the plan has op {op.id} "
                                 f"({op.primitive})")
        self.next_op += 1
        return op

    def scope(self, op_id: int) -> Any:
        return jax.named_scope(op_tag(op_id)) if self.tag_ops else contextlib.nullcontext()

    # -- ops -----------------------------------------------------------------------------------------
    def needed_dims(self, op_id: int, i: int) -> Sharding:
        """The layout op `op_id`'s strategy needs its operand `i` in."""
        op = self.graph.ops[op_id]
        return self.plan.strategies[op_id].tensor_sharding(op.rule, op.rule.operands[i], self.sizes)

    def whole(self, x: Any) -> Any:
        """`x` constrained to be whole on every device."""
        return _constrain(x, self.named(Sharding(((),) * len(x.shape))))

    def made_dims(self, op_id: int) -> list[Sharding]:
        op = self.graph.ops[op_id]
        strat = self.plan.strategies[op_id]
        return [strat.tensor_sharding(op.rule, dims, self.sizes) for dims in op.rule.results]

    def bind(self, eqn: Any, invals: Sequence[Any], op_id: int | None = None, **replace: Any) -> list[Any]:
        params = {**eqn.primitive.get_bind_params(eqn.params), **replace}
        names = eqn.source_info.name_stack
        if self.tag_ops and op_id is not None:
            names = names.extend(op_tag(op_id))
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=names), eqn.ctx.manager:
            ans = eqn.primitive.bind(*invals, **params)
        return list(ans) if eqn.primitive.multiple_results else [ans]

    def apply_op(self, op: Any, eqn: Any, invals: list[Any]) -> list[Any]:
        """One plan op: its operands constrained to the layouts it needs, the op, its results constrained to
        the layout its strategy makes and then to their planned layouts."""
        need = self.needs.get(op.id)
        if need:
            invals = [self.reshard(x, v, self.plan.shardings[v], need[i]) if i in need else x
                      for i, (x, v) in enumerate(zip(invals, op.inputs))]
        invals = self.repeats_as_read(op, invals)
        read = invals  # (the operands in the layouts the op reads them in, constants as they were made)
        invals = self.constants_as_needed(op, invals)
        if folds_to_constant(self.graph, op):  # (its result is a constant whatever it reads: see below)
            invals = [x if self.info.constant[v] else _constant_like(x) for x, v in zip(invals, op.inputs)]
        if op.primitive == "pad" and len(invals) > 1:
            self._traces[-1].padding[op.outputs[0]] = invals[1]
        invals = self.padding_only(op, invals)
        invals = self.unread_as_zeros(op, invals)
        if eqn.primitive is hint_p or op.primitive == "sharding_constraint":
            # a hint or jax's own constraint (maybe on the mesh the step was traced under, e.g. Flax's on
            # partitioned parameters): the plan's decided sharding of the value, on the plan's mesh. A
            # compile-time constant stays whole (XLA would slice it by device and all-gather it for a
            # consumer needing it whole; its consumers slice it, `constants_as_needed`).
            if self.info.constant[op.outputs[0]] and hasattr(invals[0], "shape") and invals[0].shape:
                return [self.whole(invals[0])]
            return [self.as_planned(invals[0], op.outputs[0])]
        through = op.id in self.info.through and op.primitive not in BOUND_THROUGH
        outs = self.passed_through(op, read, invals) if through else self.bind(eqn, invals, op.id)
        made = self.made_dims(op.id)
        for i, (var, vid) in enumerate(zip(eqn.outvars, op.outputs)):
            if isinstance(var, jcore.DropVar) or not hasattr(outs[i], "shape") \
                    or len(made[i].dims) != len(outs[i].shape):
                continue
            if self.info.constant[vid]:  # whole on every device; its consumers slice it (`constants_as_needed`)
                outs[i] = self.whole(outs[i])
                continue
            outs[i] = _constrain(outs[i], self.named(made[i]))
            if made[i] != self.plan.shardings[vid]:
                outs[i] = self.reshard(outs[i], vid, made[i], self.plan.shardings[vid])
        return outs

    def repeats_as_read(self, op: Any, invals: list[Any]) -> list[Any]:
        """`invals`, with each operand XLA's simplifier drops because it repeats another (`unread_repeats`:
        `where(p, x, x)` is x, `max(x, x)` is x) replaced by the operand it repeats, as the op reads that one.
        The plan reshards only the operand kept; left as traced, a dropped repeat is another instruction than the
        kept one's reshard, so XLA does not fold the op before partitioning and moves the repeat (and a select's
        predicate) to the op's layout itself: collectives the plan does not list."""
        dropped = unread_repeats(op)
        if not dropped:
            return invals
        kept = next(i for i in range(len(invals)) if i not in dropped)
        return [invals[kept] if i in dropped and op.inputs[i] == op.inputs[kept] else x for i, x in enumerate(invals)]

    def passed_through(self, op: Any, read: list[Any], invals: list[Any]) -> list[Any]:
        """The results of an op XLA's simplifier replaces by its operands (`passes_through`: result k is operand
        k), without binding it. Bound, the op would be partitioned before the simplifier runs, so a constant
        result (the zeros iota a sort along a dim of size 1 sorts for its gradient), sliced to the op's layout
        and then made whole as constants are (`apply_op`), would be all-gathered. A constant result is its
        operand as made (`read`: whole), any other the operand in the layout the op reads it in."""
        constant = self.info.constant
        return [r if constant[v] else x for r, x, v in zip(read, invals, op.outputs)]

    def padding_only(self, op: Any, invals: list[Any]) -> list[Any]:
        """`invals`, with the operand of an op that reads nothing but the padding of the pad making it
        (`reads_only_padding`: the plan reads nothing there) replaced by a broadcast of that padding value.
        Left the pad's result, XLA's partitioner (which runs before the simplifier that folds such a slice
        on CPU) moves it to the layout the op's result is constrained to (a whole constant: an all-gather
        the plan does not list); a broadcast it makes in any layout."""
        if not invals or not reads_only_padding(self.graph, op):
            return invals
        pad = pad_of(self.graph, op.inputs[0])  # (maybe through a sort along a dim of size 1)
        value = self._traces[-1].padding.get(pad.outputs[0])
        x = invals[0]
        if value is None or not hasattr(x, "shape"):  # (a pad of another trace: left as it is)
            return invals
        return [jax.lax.broadcast_in_dim(jax.numpy.asarray(value, x.dtype), x.shape, ()), *invals[1:]]

    def unread_as_zeros(self, op: Any, invals: list[Any]) -> list[Any]:
        """`invals`, with each operand of a concatenate or pad that no slice of its result reads (`window_unread`:
        the plan neither reshards nor computes it) replaced by zeros of its shape. XLA's simplifier moves such
        slices past the op only when nothing lies between them after partitioning; with a collective between
        (a reshard the plan makes of the op's result), it would read the operand and move it to the op's
        layout. Zeros it makes in any layout without moving data, and the slices read none of them."""
        unread = window_unread(self.graph, op)
        if not unread:
            return invals
        return [jax.numpy.zeros(x.shape, x.dtype) if i in unread and hasattr(x, "shape") else x
                for i, x in enumerate(invals)]

    def constants_as_needed(self, op: Any, invals: list[Any]) -> list[Any]:
        """`invals` with each compile-time constant operand of a non-constant op constrained to the layout
        the op's strategy needs: the plan lists no reshard of a constant, so XLA computes it whole on every
        device (`apply_op` constrains constant results replicated) and each consumer slices it for free (a
        constant computed split would be all-gathered for a consumer needing it whole). Left in its planned
        layout, it would steer XLA's partitioner (a scatter whose constant indices are split over an axis
        computes partial sums there and permutes them back)."""
        if op.is_hint or op.primitive in ("tie", "sharding_constraint") \
                or all(self.info.constant[v] for v in op.outputs):
            return invals
        constant = self.info.constant
        out = list(invals)
        for i, (v, dims) in enumerate(zip(op.inputs, op.rule.operands)):
            x = out[i]
            if not constant[v] or not hasattr(x, "shape") or len(x.shape) != len(dims) or not x.shape \
                    or i in self.needs.get(op.id, {}):
                continue
            out[i] = _constrain(x, self.named(self.needed_dims(op.id, i)))
        return out

    def merged(self, op: Any) -> list[Any] | None:
        """The outputs of the op CSE merges `op` into (`shardc.cost.program`), when it was bound in this trace
        and they are planned alike: the duplicate is not bound again (bound, each copy would be constrained
        apart and XLA would reshard each for its consumers)."""
        if not self.info.duplicate[op.id]:
            return None
        bound = self._traces[-1].bound
        canon = [self.info.canon[v] for v in op.outputs]
        if planned_apart(self.plan, op, self.info.canon) or not all(c in bound for c in canon):
            return None
        return [bound[c] for c in canon]

    def walk(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], region: str) -> list[Any]:
        """Evaluate `jaxpr` (inlining calls, lowering loop and branch bodies with their plan) from op
        `next_op` on; returns its outputs."""
        from shardc.lower_regions import lower_region

        env = JaxprEnv(jaxpr, consts, args)
        for eqn in jaxpr.eqns:
            invals = env.reads(eqn.invars)
            name = eqn.primitive.name
            sub = call_jaxpr(eqn)
            if sub is not None:
                outs = self.walk(*open_jaxpr(sub), invals, region)
            elif name in REGION_PRIMITIVES:
                outs = lower_region(self, eqn, invals, region)
            else:
                op = self.take(name)
                outs = None if eqn.effects else self.merged(op)
                if outs is None:
                    with self.scope(op.id):
                        outs = self.apply_op(op, eqn, invals)
                    self._traces[-1].bound.update(zip(op.outputs, outs))
            env.write(eqn.outvars, outs)
        return env.reads(jaxpr.outvars)


def plan_function(plan: Plan, closed_jaxpr: Any, tag_ops: bool = False) -> Callable[..., list[Any]]:
    """A function of the flat inputs that computes the program with the plan's constraints."""

    def run(*args: Any) -> list[Any]:
        # under the plan's (Auto) mesh, also when called under a `jax.set_mesh` of Explicit axes
        with jax.sharding.use_abstract_mesh(plan.mesh.abstract_mesh):
            return Lowering(plan, tag_ops).walk(closed_jaxpr.jaxpr, closed_jaxpr.consts, args, "")

    return run


def in_out_shardings(plan: Plan) -> tuple[list[NamedSharding], list[NamedSharding]]:
    mesh = plan.mesh
    ins = [plan.shardings[v].named(mesh) for v in plan.graph.inputs]
    outs = [plan.shardings[v].named(mesh) for v in plan.graph.outputs]
    return ins, outs


# XLA CPU's scatter expander (with algsimp after it) miscompiles a scatter-add into a dim sharded over
# the mesh whose result is added to a resharded value — wrong numbers, silently; pure JAX too (pinned by
# tests/fuzz/test_fuzz_regressions.py::test_xla_cpu_scatter_add_into_a_sharded_dim). XLA CPU runs
# scatters natively without that pass, so shardc compiles without it on CPU where a scatter is split — only
# there: the native path miscompiles other programs (a sort's gradient scatter with a min's in one step: wrong
# gradients, pure JAX on one device too; fuzz seed 125015, `test_xla_cpu_native_scatter_is_only_used_when_split`).
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "scatter_expander"}


def compiler_options(plan: Plan) -> dict[str, str] | None:
    """XLA options for the plan's platform (workarounds for known miscompilations)."""
    platform = next(iter(plan.mesh.devices.flat)).platform
    return dict(CPU_COMPILER_OPTIONS) if platform == "cpu" and _splits_a_scatter(plan) else None


def _splits_a_scatter(plan: Plan) -> bool:
    """Whether a scatter of the plan has its operand or result split over the mesh (where XLA CPU's scatter
    expander miscompiles: see CPU_COMPILER_OPTIONS)."""
    return any(op.primitive in SCATTERS and any(plan.shardings[v].axes() for v in (*op.inputs[:1], *op.outputs))
               for op in plan.graph.ops)


def jit_plan(plan: Plan, closed_jaxpr: Any, donate: Sequence[int] = (), tag_ops: bool = False) -> Any:
    """`jax.jit` of the planned program over flat inputs, with the plan's in/out shardings."""
    require_devices(plan)  # a plan made for more devices than this host has can only be simulated
    ins, outs = in_out_shardings(plan)
    return jax.jit(plan_function(plan, closed_jaxpr, tag_ops), in_shardings=ins, out_shardings=outs,
                   donate_argnums=tuple(donate), compiler_options=compiler_options(plan))
