"""Plan -> PCG: the program's ops with a chain of parallel ops wherever a sharding changes.

Each op of the plan runs on local pieces laid out as its strategy says; where a value's sharding differs
from what a consumer needs (or an op leaves partial sums), `reshard_ops` decomposes the change into
parallel ops, one per axes group. With `fuse=False` (the default) only the primitive ops are used —
Partition, Combine, Reduce — as Unity's PCG does; the substitution engine then fuses them into
ReduceScatter/AllToAll where that pays. `fuse=True` emits the fused collectives directly.

Ops that cannot run on local pieces (gather/scatter with sharded operands, convolutions, PRNG with a
shape, reductions other than sum/max/min over sharded dims, ...) run replicated: their inputs are
gathered first and their outputs sliced after, so the PCG stays exact.

Loops and branches (`scan`, `while`, `cond`) become `Region` nodes: each body is a PCG of its own built
from the plan's layouts of the body values, taking and giving the region's values in fixed boundary
layouts (the plan's layouts of the body's parameters; a scan's stacked arrays keep dim 0 unsharded).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from annotations.errors import ShardingError
from shardc.cost.program import program_info, reads_only_padding, unread_operands, unread_repeats
from shardc.ir.build import REGION_PRIMITIVES, call_jaxpr
from shardc.pcg.graph import PCG, Compute, GraphBuilder
from shardc.pcg.ops import (AllToAll, Combine, CollectivePermute, ParallelOp, Partition, Reduce, ReduceScatter,
                            ReduceScatterDims, group_size)
from shardc.pcg.local_ops import LOCAL_CHECKS, is_local
from shardc.pcg.reshard import xla_ops
from shardc.pcg.split_index import INDEX_REDUCTIONS, split_axes, split_index_reduction
from shardc.plan import Plan, lowers_reduce_scatter
from shardc.rules.core import SELF_COMBINED
from shardc.rules.elementwise import BINARY_ELEMENTWISE, NARY_ELEMENTWISE, UNARY_ELEMENTWISE
from shardc.sharding import Sharding

__all__ = ["build_pcg", "reshard_ops", "Scope", "Walker", "LOCAL_PRIMITIVES", "HINT_PRIMITIVES", "REMATERIALIZE"]

# Primitives whose per-device application to local pieces (laid out as the op's strategy says) computes
# the local piece of the result (lowering localises shape params; see shardc.pcg.lower).
LOCAL_PRIMITIVES = frozenset(UNARY_ELEMENTWISE + BINARY_ELEMENTWISE + NARY_ELEMENTWISE) - {
    "random_seed", "random_clone", "random_fold_in", "random_gamma", "iota_2x32_shape", "platform_index",
} | frozenset({
    "dot_general", "transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "convert_element_type",
    "reduce_sum", "reduce_max", "reduce_min", "iota", "select_n", "concatenate", "slice", "pad", "rev", "split",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "argmax", "argmin", "sort", "top_k",
    "copy", "copy_p", "stop_gradient", "optimization_barrier", "name", "bitcast_convert_type",
})
# Ops whose results are their operands' values, placed: hints, jax's own constraints and moves (`reshard`,
# `device_put`, `layout_constraint`). In the PCG a result is its operand resharded to its planned layout (bound
# on local pieces, jax's would not run inside a shard_map; run replicated, they cost an all-gather the plan
# does not make: fuzz seed 900).
HINT_PRIMITIVES = frozenset({"shardc_hint", "sharding_constraint", "reshard", "device_put", "layout_constraint"})
# Cheap ops of scalars only: where their result is needed in another layout, they are made again there
# (every layout of a filled array or an iota is computed locally) instead of moved.
REMATERIALIZE = frozenset({"broadcast_in_dim", "iota"})
_LOCAL_REDUCE_OPS = ("sum", "max", "min")


def _lcp(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reshard_ops(src: Sharding, dst: Sharding, mesh: Mapping[str, int], *, fuse: bool = False,
                shape: Sequence[int] | None = None, itemsize: int = 4, reduce_scatter: bool = True,
                groups: Sequence[Sequence[str]] = ()) -> list[ParallelOp]:
    """Parallel ops taking a tensor of `shape` from `src` to `dst`.

    Without `fuse`: Unity's primitive ops, each on one axes group — Combine the dims' extra minor axes,
    Reduce the partial axes, Partition the missing ones, ordered so that a Combine/Reduce sits right
    before the Partition it could fuse with. With `fuse`: the one reshard model's collectives
    (`shardc.pcg.reshard.xla_ops`: one op per collective XLA emits for the change, `reduce_scatter`:
    whether the backend has reduce-scatters), which needs the value's `shape` and `itemsize`; `groups`: when `src`'s
    partial sums come from an op reducing several sharded dims, the axes of each (`OpStrategy.partial_groups`).
    """
    if dst.partial - src.partial:
        raise ShardingError(f"cannot reshard {src} to {dst}: partial sums cannot be created")
    if src.rank != dst.rank:
        raise ShardingError(f"cannot reshard {src} to {dst}: ranks differ")
    if not fuse:
        return _group_ops(src, dst, mesh, fuse=False)
    if shape is None:
        raise ShardingError("reshard_ops(fuse=True) needs the value's shape (the collectives depend on it)")
    return xla_ops(src, dst, shape, itemsize, mesh, lambda a, b: _group_ops(a, b, mesh, fuse=False),
                   reduce_scatter=reduce_scatter, groups=groups)


def _combining_with(ops: Sequence[ParallelOp], reduce_op: str) -> list[ParallelOp]:
    """`ops` for a tensor whose partial values combine with `reduce_op` (the reshard model's reductions are
    sums): its all-reduces take their max/min, and a reduce-scatter (sums only) is an all-reduce and a slice."""
    if reduce_op == "sum":
        return list(ops)
    out: list[ParallelOp] = []
    for op in ops:
        if isinstance(op, ReduceScatter):
            out += [Reduce(op.axes, reduce_op), Partition(op.axes, op.dim)]
        elif isinstance(op, ReduceScatterDims):
            out += [Reduce(tuple(op.axes), reduce_op), *(Partition((a,), d) for a, d in zip(op.axes, op.dims))]
        elif isinstance(op, Reduce):
            out.append(Reduce(op.axes, reduce_op))
        else:
            out.append(op)
    return out


def _group_ops(src: Sharding, dst: Sharding, mesh: Mapping[str, int], *, fuse: bool) -> list[ParallelOp]:
    """The per-axes-group decomposition (`fuse`: AllToAll, ReduceScatter and CollectivePermute directly)."""
    if dst.partial - src.partial:
        raise ShardingError(f"cannot reshard {src} to {dst}: partial sums cannot be created")
    if src.rank != dst.rank:
        raise ShardingError(f"cannot reshard {src} to {dst}: ranks differ")
    rank = src.rank
    keep = [_lcp(src.dims[d], dst.dims[d]) for d in range(rank)]
    rem = {d: src.dims[d][keep[d]:] for d in range(rank) if src.dims[d][keep[d]:]}
    add = {d: dst.dims[d][keep[d]:] for d in range(rank) if dst.dims[d][keep[d]:]}
    red = [a for a in mesh if a in src.partial - dst.partial]
    ops: list[ParallelOp] = []
    cur = src

    def emit(op: ParallelOp) -> None:
        nonlocal cur
        cur = op.apply(cur)
        ops.append(op)

    if fuse:  # a dim re-split over other axes of the same degree: collective-permute
        for d in list(rem):
            if d in add and group_size(rem[d], mesh) == group_size(add[d], mesh):
                others = {a for e, ax in enumerate(cur.dims) if e != d for a in ax} | cur.partial
                if not set(add[d]) & others and not any(set(add[d]) & set(add.get(e, ())) for e in add if e != d):
                    emit(CollectivePermute.of(d, rem.pop(d), add.pop(d)))
    # Combine/Partition pairs (all-to-all candidates): a dim's removed axes are the start of another's
    pairs = []
    for d, g in list(rem.items()):
        for e, a in add.items():
            if e != d and a[:len(g)] == g and e not in [p[1] for p in pairs]:
                pairs.append((d, e, g))
                break
    paired = {d for d, _, _ in pairs}
    for d in sorted(set(rem) - paired):
        emit(Combine(rem[d], d))
    # Reduce/Partition pairs (reduce-scatter candidates): a dim's added axes start with partial axes
    rs = []
    for e, a in add.items():
        run = []
        for ax in a:
            if ax not in red:
                break
            run.append(ax)
        if run and e not in [p[1] for p in pairs]:
            rs.append((e, tuple(run)))
    rs_axes = {a for _, g in rs for a in g}
    rest = tuple(a for a in red if a not in rs_axes)
    if rest:
        emit(Reduce(rest))
    pending = list(pairs)
    while pending:
        for i, (d, e, g) in enumerate(pending):
            if cur.dims[e] == dst.dims[e][:len(cur.dims[e])] and len(cur.dims[e]) == keep[e]:
                break
        else:
            d, e, g = pending[0]  # a cycle (dims swapping axes): gather one side first
            emit(Combine(g, d))
            pending.pop(0)
            continue
        pending.pop(i)
        if fuse:
            emit(AllToAll(g, d, e))
        else:
            emit(Combine(g, d))
            emit(Partition(g, e))
    for e, g in rs:
        if fuse:
            emit(ReduceScatter(g, e))
        else:
            emit(Reduce(g))
            emit(Partition(g, e))
    for e in range(rank):
        missing = dst.dims[e][len(cur.dims[e]):]
        if cur.dims[e] != dst.dims[e][:len(cur.dims[e])]:
            emit(Combine(cur.dims[e][keep[e]:], e))
            missing = dst.dims[e][len(cur.dims[e]):]
        if missing:
            emit(Partition(missing, e))
    if cur != dst:  # pragma: no cover - the steps above always reach dst
        raise ShardingError(f"could not decompose the reshard {src} -> {dst} (reached {cur})")
    return ops


def _is_local(op: Any, strat: Any, partial: frozenset[str], sizes: Mapping[str, int]) -> bool:
    if op.conservative:
        return False
    if op.primitive in LOCAL_CHECKS:  # indexing and convolutions: only some strategies (shardc.pcg.local_ops)
        if not is_local(op, strat):
            return False
    elif op.primitive not in LOCAL_PRIMITIVES:
        return False
    if partial and op.rule.reduce_op not in _LOCAL_REDUCE_OPS:
        return False
    if op.rule.reduce_op in SELF_COMBINED and any(  # (an argmax of pieces is no piece of the argmax)
            axes for f, axes in enumerate(strat.factor_axes) if op.rule.is_reduction(f)):
        return False
    return _layouts_agree(op.rule, strat, sizes)


def _layouts_agree(rule: Any, strat: Any, sizes: Mapping[str, int]) -> bool:
    """Does every tensor of the op carry every sharded factor it has? A dim made of factors (i, j) can
    only show j's axes if i is split completely (`OpStrategy.tensor_sharding` stops at the first factor
    that is not); where a factor's axes are dropped from some tensor, the local pieces would not line
    up and the op must run replicated."""
    for tensor in rule.tensors():
        for factors in tensor:
            whole = True
            for f in factors:
                axes = strat.factor_axes[f]
                if axes and not whole:
                    return False
                n = 1
                for a in axes:
                    n *= sizes[a]
                whole = whole and n == rule.sizes[f]
    return True


class Scope:
    """One PCG under construction — the program, or a loop/branch body — from the plan's ops."""

    def __init__(self, ctx: "Walker") -> None:
        self.ctx = ctx
        self.b = GraphBuilder(ctx.plan.mesh)
        self.vmap: dict[int, int] = {}  # graph value -> tensor
        self.memo: dict[tuple[int, Sharding], int] = {}
        self.steps: dict[tuple[int, ParallelOp], int] = {}
        self.made_by: dict[int, tuple[Compute, list[int]]] = {}
        self.zero_tensors: dict[tuple[Any, ...], int] = {}

    def value_tensor(self, v: int, const: Any = None) -> int:
        if v not in self.vmap:
            val = self.ctx.graph.values[v]
            if const is None:
                raise ShardingError(f"PCG: value {val.name} {list(val.shape)} is used before it is defined")
            self.vmap[v] = self.b.add_const(np.asarray(const, dtype=val.dtype), self.ctx.plan.shardings[v], val.name)
        return self.vmap[v]

    def input(self, v: int, layout: Sharding) -> int:
        """A PCG input for graph value `v` (shape/dtype of v) in `layout`."""
        val = self.ctx.graph.values[v]
        return self.b.add_tensor(val.shape, val.dtype, layout, val.name)

    def reshard(self, t: int, want: Sharding, cause: str, groups: Sequence[Sequence[str]] = ()) -> int:
        b = self.b
        have = b.tensors[t].sharding
        if have == want:
            return t
        if (t, want) in self.memo:
            return self.memo[(t, want)]
        if t in self.made_by:  # a broadcast of a scalar or an iota: make it again in the layout wanted
            op, args = self.made_by[t]
            tensor = b.tensors[t]
            out = b.add_tensor(tensor.shape, tensor.dtype, want, tensor.name)
            b.add_node(op, args, [out], cause=f"{op.primitive} made again as {want} ({cause})")
            self.memo[(t, want)] = out
            return out
        cur = t
        tensor = b.tensors[t]
        pops = reshard_ops(have, want, self.ctx.sizes, fuse=self.ctx.fuse, shape=tensor.shape,
                           itemsize=tensor.itemsize, reduce_scatter=self.ctx.reduce_scatter, groups=groups)
        for pop in _combining_with(pops, tensor.reduce_op):
            key = (cur, pop)
            if key not in self.steps:  # a step shared with another chain from the same tensor is made once
                self.steps[key] = b.parallel(pop, cur, cause=cause)
            cur = self.steps[key]
        self.memo[(t, want)] = cur
        return cur

    def zeros(self, like: Any, layout: Sharding) -> int:
        """Zeros shaped as tensor `like`, made in `layout` (a broadcast of a scalar: no collective)."""
        key = (like.shape, str(like.dtype), layout)
        if key not in self.zero_tensors:
            b = self.b
            scalar = b.add_const(np.zeros((), like.dtype), name="zero")
            out = b.add_tensor(like.shape, like.dtype, layout, "zeros")
            params = {"shape": tuple(like.shape), "broadcast_dimensions": (), "sharding": None}
            b.add_node(Compute.of(jax.lax.broadcast_in_dim_p, params), [scalar], [out],
                       cause="an operand XLA never reads")
            self.zero_tensors[key] = out
        return self.zero_tensors[key]

    def op(self, op: Any, eqn: Any, const_vals: Sequence[Any]) -> None:
        """One plan op: its operands resharded to what its strategy needs, the compute node, its results
        resharded to their planned layouts."""
        ctx, b = self.ctx, self.b
        graph, plan, sizes = ctx.graph, ctx.plan, ctx.sizes
        ins = [self.value_tensor(v, c) for v, c in zip(op.inputs, const_vals)]
        if op.primitive in HINT_PRIMITIVES:
            for v, t in zip(op.outputs, ins):
                self.vmap[v] = self.reshard(t, plan.shardings[v], f"{op.primitive} of {graph.values[v].name}")
            return
        strat, rule = plan.strategies[op.id], op.rule
        pieces = split_axes(op, eqn, strat, sizes, b.tensors[ins[0]].shape) \
            if op.primitive in INDEX_REDUCTIONS and not op.conservative and _layouts_agree(rule, strat, sizes) else None
        partial = strat.partial_axes(rule)
        local = pieces is not None or _is_local(op, strat, partial, sizes)
        args = []
        unread = ctx.unread(op)
        for i, (v, t, dims) in enumerate(zip(op.inputs, ins, rule.operands)):
            tensor = b.tensors[t]
            if tensor.rank == 0:
                args.append(t)
                continue
            need = strat.tensor_sharding(rule, dims, sizes) if local else Sharding(((),) * tensor.rank)
            if i in unread:  # (XLA never reads it: zeros in the layout wanted, as the jit lowering passes)
                args.append(self.zeros(tensor, need))
                continue
            cause = ctx.causes.get((v, op.id)) or f"{op.primitive} needs {graph.values[v].name} as {need}"
            args.append(self.reshard(t, need, cause))
        if pieces is not None:  # (an argmax over a split dim: by pieces, `shardc.pcg.split_index`)
            outs = [split_index_reduction(self, op, eqn, args[0], pieces)]
        else:
            outs = self._compute(op, eqn, args, strat, partial, local)
        groups = strat.partial_groups(rule) if partial and local else ()  # (XLA reduces them one dim at a time)
        for v, t in zip(op.outputs, outs):
            cause = ctx.causes.get((v, None)) or f"{graph.values[v].name} is {plan.shardings[v]}"
            self.vmap[v] = self.reshard(t, plan.shardings[v], cause, groups)

    def _compute(self, op: Any, eqn: Any, args: list[int], strat: Any, partial: frozenset[str], local: bool
                 ) -> list[int]:
        """The compute node of plan op `op` on tensors `args` (on local pieces, or `local` False: whole), its
        results in the layouts its strategy makes."""
        b, rule, sizes = self.b, op.rule, self.ctx.sizes
        outs = []
        for v, dims in zip(op.outputs, rule.results):
            val = self.ctx.graph.values[v]
            made = Sharding(strat.tensor_sharding(rule, dims, sizes).dims, partial) if local \
                else Sharding(((),) * val.rank)
            outs.append(b.add_tensor(val.shape, val.dtype, made, val.name, rule.reduce_op))
        compute = Compute.of(eqn.primitive, eqn.params, op.source)
        b.add_node(compute, args, outs)
        if op.primitive in REMATERIALIZE and all(b.tensors[a].rank == 0 and not b.tensors[a].sharding.partial
                                                 for a in args) and not partial:
            self.made_by[outs[0]] = (compute, args)
        return outs

    def outer(self, v: int | None, const: Any) -> int:
        """The tensor of a region operand: graph value `v`, or a literal made a constant here."""
        if v is None:
            return self.b.add_const(np.asarray(const), name="literal")
        return self.value_tensor(v, const)


class Walker:
    """Walks the jaxpr and the plan's ops in lockstep (the order `shardc.ir.build_graph` made ops in)."""

    def __init__(self, plan: Plan, fuse: bool, reduce_scatter: bool | None = None) -> None:
        self.plan = plan
        self.graph = plan.graph
        self.sizes = plan.mesh_sizes
        self.fuse = fuse
        self.reduce_scatter = lowers_reduce_scatter(plan.mesh) if reduce_scatter is None else reduce_scatter
        self.causes = {(r.value, r.consumer): r.cause for r in plan.reshards}
        self.i = 0  # next graph op

    def unread(self, op: Any) -> set[int]:
        """The operands of plan op `op` whose values do not matter, as XLA never reads them (`unread_operands`:
        an op folded to a constant, a dynamic_update_slice overwriting its whole operand, a scatter-add of
        zeros, a concatenate's or pad's operand no slice reads), which the plan neither reshards nor computes;
        zeros do for them, as the jit lowering passes. Not an operand XLA drops for another one of the same
        value (`max(x, x)`) or an op reading only a pad's padding: their values matter. Constants stay (they
        decide a folded op's value)."""
        graph = self.graph
        if unread_repeats(op) or reads_only_padding(graph, op):
            return set()
        constant = program_info(graph).constant
        return {i for i in unread_operands(graph, op) if not constant[op.inputs[i]]}

    def next_op(self) -> Any:
        ops = self.graph.ops
        while self.i < len(ops) and ops[self.i].primitive == "tie" and ops[self.i].region == "io":
            self.i += 1
        if self.i >= len(ops):  # pragma: no cover - the walks agree by construction
            raise AssertionError("the jaxpr has more ops than the plan")
        op = ops[self.i]
        self.i += 1
        return op

    def take(self, n: int, *kinds: str) -> list[Any]:
        """The next n graph ops, which must be region boundary ops of the given kinds."""
        out = [self.next_op() for _ in range(n)]
        for op in out:
            if op.primitive not in kinds:  # pragma: no cover - the walks agree by construction
                raise AssertionError(f"op {op.id} is {op.primitive}, expected one of {kinds}")
        return out

    def walk(self, scope: Scope, jaxpr: Any, consts: Sequence[Any], args: Sequence[tuple[int | None, Any]]
             ) -> list[tuple[int | None, Any]]:
        """Add `jaxpr`'s ops to `scope`; args/results are (graph value or None for a literal, constant
        value or None) per invar/outvar."""
        env: dict[Any, tuple[int | None, Any]] = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = (None, c)
        for var, a in zip(jaxpr.invars, args):
            env[var] = a

        def read(atom: Any) -> tuple[int | None, Any]:
            if isinstance(atom, jcore.Literal):
                return None, np.asarray(atom.val, dtype=atom.aval.dtype)
            return env[atom]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            name = eqn.primitive.name
            inner = call_jaxpr(eqn)
            if inner is not None:
                sub = inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner
                sub_consts = inner.consts if isinstance(inner, jcore.ClosedJaxpr) else []
                outs = self.walk(scope, sub, sub_consts, ins)
            elif name in REGION_PRIMITIVES:
                from shardc.pcg.regions import REGION_BUILDERS

                outs = REGION_BUILDERS[name](self, scope, eqn, ins)
            else:
                op = self.next_op()
                if op.primitive != name:  # pragma: no cover - the walks agree by construction
                    raise AssertionError(f"op {op.id} is {op.primitive} but the jaxpr walk is at {name}")
                scope.op(op, eqn, [c for _, c in ins])
                outs = [(v, None) for v in op.outputs]
            for var, o in zip(eqn.outvars, outs):
                env[var] = o
        return [read(a) for a in jaxpr.outvars]


def build_pcg(plan: Plan, closed_jaxpr: Any = None, *, fuse: bool = False, reduce_scatter: bool | None = None) -> PCG:
    """The PCG of a plan. `closed_jaxpr` is the program the plan was made from
    (`AutoFunction.compiled_info(*args).closed_jaxpr`; default: the one `shardc.auto` records on the plan,
    so `build_pcg(shardc.plan(f, *args, mesh=mesh))` works). With `fuse`, `reduce_scatter` says whether
    the collectives may include reduce-scatters (default: whether XLA emits them on the plan's backend;
    the PCG's own lowering emits them on any backend, so a PCG priced on a topology that has them
    should have them: `Topology.reduce_scatter`)."""
    if closed_jaxpr is None:
        closed_jaxpr = plan.program
        if closed_jaxpr is None:
            raise ShardingError("build_pcg needs the program the plan was made from: pass closed_jaxpr "
                                "(AutoFunction.compiled_info(*args).closed_jaxpr)")
    graph = plan.graph
    walker = Walker(plan, fuse, reduce_scatter)
    scope = Scope(walker)
    for v in graph.inputs:
        scope.vmap[v] = scope.input(v, plan.shardings[v])
    inputs = [scope.vmap[v] for v in graph.inputs]
    jaxpr = closed_jaxpr.jaxpr
    walker.walk(scope, jaxpr, closed_jaxpr.consts, [(v, None) for v in graph.inputs])
    outputs = []
    consts = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
    for v, atom in zip(graph.outputs, jaxpr.outvars):
        if v not in scope.vmap:  # a constant the program returns (a literal, or one it closes over)
            value = atom.val if isinstance(atom, jcore.Literal) else consts.get(atom)
            if value is None:
                raise ShardingError(f"PCG: output {graph.values[v].name} is made by no op of the program")
            val = graph.values[v]
            scope.vmap[v] = scope.b.add_const(np.asarray(value, dtype=val.dtype), plan.shardings[v], val.name)
        outputs.append(scope.vmap[v])
    pcg = scope.b.finish(inputs, outputs)
    if (uneven := pcg.uneven()) is not None:
        raise ShardingError(f"PCG: {uneven}: a shard_map needs equal pieces, so this plan has no PCG")
    return pcg
