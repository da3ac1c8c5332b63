"""Plan: a sharding for every value, a strategy for every op, and the reshards between them.

`build_plan` turns a propagation result into a Plan: each op takes its factors' axes from its results
(reduction factors from its largest operand), which fixes the layout it needs on each operand; where a
value's sharding differs from what a consumer needs, or an op leaves partial sums, a Reshard is recorded
with its cause and the collectives XLA emits for it — from `shardc.cost.reshard_path.reshard_steps`, the
one reshard model the simulator, the lowering and `shardc.check` use too.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from annotations.errors import ShardingError, SourceLine
from shardc.cost.collectives import Collective, collectives_time
from shardc.cost.host_ops import default_estimator, relayout_seconds
from shardc.cost.dropped import candidates, dead_ops, plan_drops
from shardc.cost.program import (broadcast_dims, enters_a_constant, gather_relayouts, merged, read_values,
                                 unread_operands)
from shardc.cost.reshard_path import reshard_steps, sent_bytes
from shardc.cost.wire import wire_itemsize
from shardc.ir.graph import Graph, Op
from shardc.propagate import Cause, Propagation, _pass_through_op, project_dim
from shardc.rules.core import SELF_COMBINED, FactorKind, FactorRule
from shardc.sharding import Sharding, mesh_shape

__all__ = ["OpStrategy", "Reshard", "Plan", "PlanBuilder", "build_plan", "abstract_mesh", "is_abstract", "planned_apart",
           "require_devices", "reshard_cost", "ReshardCost", "op_reshard_specs", "lowers_reduce_scatter",
           "lowers_backend",
           "ReshardPricer", "topology_pricer"]

Axes = tuple[str, ...]


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
    """A mesh shape without devices (all axes Auto): plans, propagation and simulation need only the axis
    sizes, so a plan can be made for more devices than this host has; only running it needs devices."""
    names = tuple(sizes)
    return AbstractMesh(tuple(int(sizes[a]) for a in names), names, axis_types=(AxisType.Auto,) * len(names))


def is_abstract(mesh: Any) -> bool:
    """True for a mesh without devices (`abstract_mesh`)."""
    return isinstance(mesh, AbstractMesh)


def require_devices(plan: "Plan") -> None:
    """A ShardingError unless `plan`'s mesh is made of real devices (it can be lowered and run)."""
    if not is_abstract(plan.mesh):
        return
    sizes = plan.mesh_sizes
    n = math.prod(sizes.values())
    mesh = ",".join(f"{a}={k}" for a, k in sizes.items())
    raise ShardingError(
        f"this plan is for {n} devices (mesh {mesh}) but this process has {len(jax.devices())} "
        f"({jax.default_backend()}); a plan made for a larger topology can be simulated and inspected "
        f"(plan.explain(), shardc.simulate(plan, topology), save_plan) but not run here: run it on {n} "
        f"devices, or plan for this host's devices")


@dataclasses.dataclass(frozen=True, slots=True)
class OpStrategy:
    """Mesh axes assigned to each factor of an op."""

    factor_axes: tuple[Axes, ...]

    def tensor_sharding(self, rule: FactorRule, dims: Sequence[Sequence[int]], mesh: Mapping[str, int]) -> Sharding:
        out: list[Axes] = []
        for factors in dims:
            axes: list[str] = []
            for f in factors:
                fa = self.factor_axes[f]
                axes.extend(fa)
                n = 1
                for a in fa:
                    n *= mesh[a]
                if n != rule.sizes[f]:
                    break
            out.append(tuple(axes))
        return Sharding(tuple(out))

    def partial_axes(self, rule: FactorRule) -> frozenset[str]:
        """The axes the results hold partial values over: those of the sharded reduction factors (none for an
        op that combines its shards itself, `SELF_COMBINED`)."""
        if rule.reduce_op in SELF_COMBINED:
            return frozenset()
        return frozenset(a for f, axes in enumerate(self.factor_axes) if rule.kinds[f] is FactorKind.REDUCTION for a in axes)

    def partial_groups(self, rule: FactorRule) -> tuple[Axes, ...]:
        """The axes of each sharded reduction factor, last factor first: XLA's partitioner reduces the
        partial sums of a reduction or contraction over several sharded dims with one all-reduce per dim,
        the last dim's first (a reduce_sum of f32[4,4] over [x, y] is an all-reduce over y, then one over x)."""
        if rule.reduce_op in SELF_COMBINED:
            return ()
        return tuple(tuple(axes) for f, axes in reversed(list(enumerate(self.factor_axes)))
                     if axes and rule.kinds[f] is FactorKind.REDUCTION)


@dataclasses.dataclass(frozen=True, slots=True)
class Reshard:
    """A change of sharding on one value: before op `consumer` (its operand `operand`), or after the op that
    makes it (partial sums, another layout).
    `collectives` are what XLA emits for it; `kind` names them ("all-to-all+collective-permute"; "slice"
    when the change is a free local slice); `bytes` is their payload per device (as `shardc.check` reads it
    from the compiled program)."""

    value: int
    src: Sharding
    dst: Sharding
    kind: str
    bytes: int
    cause: str
    source: SourceLine | None
    consumer: int | None = None
    collectives: tuple[Collective, ...] = ()
    operand: int | None = None  # which operand of `consumer` (an op may read one value twice, in two layouts)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A sharding per value, a strategy per op, the reshards, on one mesh."""

    graph: Graph
    mesh: Mesh  # or a jax AbstractMesh (`abstract_mesh`): a plan for more devices than this host has
    shardings: tuple[Sharding, ...]
    strategies: tuple[OpStrategy, ...]
    reshards: tuple[Reshard, ...]
    origins: tuple[tuple[Cause | None, ...], ...]
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # Reshards the lowering constrains that XLA then removes (`split_unrun`): of operands its simplifier drops
    # as one buffer with another, and of ops only they read. Not run, not counted; the lowering and the
    # simulator read the layouts they need (`constrained`).
    unrun: tuple[Reshard, ...] = ()
    # Set by @shardc.auto: the traced program and donated flat inputs (so shardc.check can compile the
    # plan), and the simulated cost when a topology was given (shardc.simulate's SimResult).
    program: Any = None
    donated: tuple[int, ...] = ()
    cost: Any = None
    search: Any = None  # set by the strategy search: its SearchReport (baselines beside the chosen plan)
    remat: Any = None  # set by the search when it rematerializes repeated layers: its RematChoice
    loops: Any = None  # with pcg=True, when a scan had matmuls to move out of it: the LoopChoice
    pipeline: Any = None  # a shardc.pipeline.Pipeline (bound to its layer stack) when the step is pipelined
    pcg: Any = None  # with shardc.auto(pcg=True): the PCG rewriting's PCGChoice (shardc.pcg.choice)
    pipeline_choice: Any = None  # set by choose_pipeline: the PipelineChoice (every plan it scored)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return mesh_shape(self.mesh)

    def sharding_of(self, vid: int) -> Sharding:
        return self.shardings[vid]

    def input_shardings(self) -> list[Sharding]:
        return [self.shardings[v] for v in self.graph.inputs]

    def output_shardings(self) -> list[Sharding]:
        return [self.shardings[v] for v in self.graph.outputs]

    def local_bytes(self, vid: int) -> int:
        v = self.graph.values[vid]
        n = int(v.dtype.itemsize) if v.dtype is not None else 4
        return n * math.prod(self.shardings[vid].local_shape(v.shape, self.mesh_sizes))

    @property
    def constrained(self) -> tuple[Reshard, ...]:
        """Every reshard the lowering constrains: those that run, then those XLA removes (`unrun`)."""
        return self.reshards + self.unrun if self.unrun else self.reshards

    def total_reshard_bytes(self) -> int:
        return sum(r.bytes for r in self.reshards)

    def explain(self, *, max_rows: int = 60, width: int = 120) -> str:
        from shardc.report import explain

        return explain(self, max_rows=max_rows, width=width)

    def fingerprint(self) -> str:
        """A stable hash of the plan (mesh, shardings), equal on every process of a multi-host job."""
        import hashlib

        h = hashlib.sha256()
        h.update(repr(list(self.mesh_sizes.items())).encode())  # in mesh order: it lays devices out
        for s in self.shardings:
            h.update(str(s).encode())
        return h.hexdigest()[:16]


@dataclasses.dataclass(frozen=True, slots=True)
class ReshardCost:
    """What one change of sharding costs: XLA's collectives, their kinds by name, their payload bytes per
    device, and the bytes each device sends for them (ring algorithms; what op layouts are chosen by)."""

    collectives: tuple[Collective, ...]
    kind: str
    payload: int
    sent: int
    # XLA:CPU's copies around its all-gathers of non-major dims, each (local buffer shape, permutation, item
    # size) (`shardc.cost.program.gather_relayouts`): priced on CPU topologies only (`topology_pricer`)
    relayouts: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] = ()


def lowers_reduce_scatter(mesh: Any) -> bool:
    """Whether XLA emits reduce-scatters on this mesh's backend (XLA:CPU all-reduces, then slices). A mesh
    without devices (`abstract_mesh`) is planned for accelerators, which have them."""
    return lowers_backend(mesh) != "cpu"


def lowers_backend(mesh: Any) -> str:
    """The platform of this mesh's devices ("cpu", "gpu", "tpu"), whose backend rules apply to the collectives
    XLA emits (`reduce_scatter`, `shardc.cost.wire`); "" for a mesh without devices (planned for accelerators)."""
    if is_abstract(mesh):
        return ""
    return next(iter(mesh.devices.flat)).platform


# What a reshard costs when an op's layout is chosen: seconds on a topology (`topology_pricer`), or, without
# one, the bytes each device sends.
ReshardPricer = Callable[[ReshardCost], float]


_DTYPE_OF_ITEMSIZE = {1: "int8", 2: "bfloat16", 4: "float32", 8: "float64"}  # (a relayout's time is its bytes')


def topology_pricer(topology: Any, mesh: Any, mapping: Any = None, copies: bool = True) -> ReshardPricer:
    """Seconds of a reshard's collectives, one after another, on `topology` with the mesh laid out by `mapping`
    (default: `topology.map_mesh` of the mesh's axes in order) — the simulator's collective formulas, so a
    collective's fixed cost counts as well as its bytes (many small collectives cost more than one big one);
    on XLA:CPU also the copies around all-gathers of non-major dims (`ReshardCost.relayouts`) unless
    `copies=False`."""
    sizes = dict(mesh_shape(mesh)) if not isinstance(mesh, Mapping) else dict(mesh)
    mapping = topology.map_mesh(sizes) if mapping is None else mapping

    estimator = default_estimator(topology.device) if topology.backend == "cpu" and copies else None

    @functools.lru_cache(maxsize=1 << 14)
    def seconds(colls: tuple[Collective, ...]) -> float:
        return collectives_time(colls, topology, mapping, sizes)

    @functools.lru_cache(maxsize=1 << 14)
    def copy_seconds(relayouts: tuple) -> float:
        return sum(relayout_seconds(estimator, shape, _DTYPE_OF_ITEMSIZE.get(n, "float32"), perm)
                   for shape, perm, n in relayouts)

    def price(cost: ReshardCost) -> float:
        if not cost.collectives:
            return 0.0
        if estimator is None or not cost.relayouts:
            return seconds(cost.collectives)
        return seconds(cost.collectives) + copy_seconds(cost.relayouts)

    # (what plan memos are shared by: the same link levels, each axis on the same ones, whatever the axis order;
    # the formulas read nothing else of the topology but, on XLA:CPU, the device the copies are priced on)
    price.key = (topology.levels, tuple(sorted(mapping.axes)),  # type: ignore[attr-defined]
                 None if estimator is None else repr(topology.device))
    return price


@functools.lru_cache(maxsize=1 << 16)
def _reshard_cost(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int,
                  mesh_items: tuple[tuple[str, int], ...], reduce_scatter: bool,
                  groups: tuple[Axes, ...], bcast: frozenset[int]) -> ReshardCost:
    mesh = dict(mesh_items)
    steps = reshard_steps(src, dst, shape, itemsize, mesh, reduce_scatter, groups, bcast)
    colls = tuple(c for _, step in steps for c in step)
    if colls:
        kind = "+".join(dict.fromkeys(c.kind for c in colls))
    else:
        kind = "none" if src.without_partial() == dst.without_partial() else "slice"
    relayouts: list = []
    before = src
    for layout, step in steps:
        if any(c.kind == "all-gather" for c in step):
            relayouts += [(*copy, itemsize) for copy in gather_relayouts(
                before.dims, layout.dims, before.local_shape(shape, mesh), layout.local_shape(shape, mesh))]
        before = layout
    return ReshardCost(colls, kind, sum(c.bytes for c in colls), sum(sent_bytes(c, mesh) for c in colls),
                       tuple(relayouts))


def reshard_cost(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, mesh: Mapping[str, int],
                 reduce_scatter: bool = True, groups: Sequence[Axes] = (),
                 bcast: frozenset[int] = frozenset()) -> ReshardCost:
    """The collectives XLA emits to take a value of `shape` from `src` to `dst` (memoised); `groups`: how
    the op that made `src` reduces its partial sums (`OpStrategy.partial_groups`); `bcast`: the dims along
    which the value is a broadcast (`shardc.cost.program.broadcast_dims`)."""
    return _reshard_cost(src, dst, tuple(shape), int(itemsize), tuple(mesh.items()), reduce_scatter, tuple(groups),
                         frozenset(bcast))


def _greedy_strategy(op: Op, axes_of, tensors: Sequence[tuple[int, Any]], mesh: Mapping[str, int]) -> OpStrategy:
    """Factor axes taken from `tensors` ((value, dims) in priority order), each axis used by one factor
    only: the layout of the first tensor is kept and later ones give way where they disagree."""
    rule = op.rule
    nf = rule.num_factors
    group = rule.components  # an axis shards one factor per group (one iteration space)
    chosen: list[Axes | None] = [None] * nf
    taken: dict[int, set[str]] = {}
    for v, dims in tensors:
        for d, factors in enumerate(dims):
            if not factors:
                continue
            proj, _complete = project_dim(axes_of(v)[d], factors, rule.sizes, mesh)
            for f in factors:
                here = taken.setdefault(group[f], set())
                if chosen[f] is None and f in proj and proj[f] and not (here & set(proj[f])) \
                        and rule.kinds[f] not in (FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION):
                    chosen[f] = proj[f]
                    here.update(proj[f])
    used: dict[int, set[str]] = {}
    out: list[Axes] = []
    for f in range(nf):
        axes = chosen[f] or ()
        if rule.kinds[f] in (FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION):
            axes = ()
        here = used.setdefault(group[f], set())
        keep = []
        for a in axes:
            if a in here:
                break
            keep.append(a)
        here.update(keep)
        out.append(tuple(keep))
    return OpStrategy(expressible(rule, out, mesh))


def expressible(rule: FactorRule, factor_axes: Sequence[Axes], mesh: Mapping[str, int]) -> tuple[Axes, ...]:
    """`factor_axes` with the axes dropped that no tensor of the op can show: in a dim made of several
    factors (a reshape's merged dim), a factor can be split only if every factor before it is split
    whole. Example: (b, s, 3*d) reshaped to (b, s, 3, h, hd) with h split over `model` — the merged dim's
    local piece would not be a tile of it (3 is whole), so XLA gathers h there; the op computes with h
    whole instead, and the plan lists that gather as a reshard of its operand."""
    axes = [tuple(a) for a in factor_axes]
    changed = True
    while changed:
        changed = False
        for dims in rule.operands + rule.results:
            for factors in dims:
                whole = True
                for f in factors:
                    if not whole and axes[f]:
                        axes[f] = ()
                        changed = True
                    if math.prod(mesh[a] for a in axes[f]) != rule.sizes[f]:
                        whole = False
    return tuple(axes)


def _degree(strat: OpStrategy, mesh: Mapping[str, int]) -> int:
    """Devices the op's work is divided over."""
    return math.prod(mesh[a] for axes in strat.factor_axes for a in axes)


def _strategy(op: Op, graph: Graph, shardings: Sequence[Sharding], nbytes, mesh: Mapping[str, int],
              reduce_scatter: bool = True, price: ReshardPricer | None = None, backend: str = "",
              shares: Sequence[int] = ()) -> tuple[OpStrategy, list[ReshardSpec] | None]:
    """The op's factor axes, and its reshards when choosing it computed them (else None): of the layouts that keep one of its tensors as it is (the others giving way,
    largest first), the one whose reshards cost least (`price`: seconds on the plan's topology; without
    one, bytes sent) among those dividing the work over the most devices; ties go to fewer bytes, then to
    keeping the largest tensor (results first among equals), as propagation's conflict resolution does.
    An operand's reshard counts for its share only (`shares[i]`, `operand_shares`): ops of one class that
    read the same value choose alike, and XLA makes the reshard once for all of them (attention's q, k and
    v projections of one input: a gather of the input each would pay three times).

    Keeping the largest tensor is usually cheapest, but not always: GShard's dispatch einsum
    GSEC,GSM->EGCM has a result (split on E) larger than either operand (split on G), yet computing it
    split on G and moving the result (one all-to-all) is far cheaper than gathering the tokens."""
    rule = op.rule
    tensors = [(v, dims, 0) for v, dims in zip(op.outputs, rule.results)]
    tensors += [(v, dims, 1) for v, dims in zip(op.inputs, rule.operands)]
    tensors.sort(key=lambda t: (-nbytes[t[0]], t[2]))
    order = [(v, dims) for v, dims, _ in tensors]

    def axes_of(v: int):
        return shardings[v].dims

    if op.is_hint:  # a constraint: its value in the layout it pins; the lowering reshards the operand to it
        return _greedy_strategy(op, axes_of, [(op.outputs[0], rule.results[0])], mesh), None
    default = _greedy_strategy(op, axes_of, order, mesh)
    sharded = [i for i, (v, _) in enumerate(order) if i > 0 and shardings[v].dims and any(shardings[v].dims)]
    if not sharded or not (op.primitive in _COSTED_PRIMITIVES or _elementwise(op)):
        return default, None

    def share(spec: ReshardSpec) -> int:
        return shares[spec[1]] if spec[0] and spec[1] < len(shares) else 1

    def key(strat: OpStrategy, specs: list[ReshardSpec]) -> tuple:
        sent = sum(spec[4].sent / share(spec) for spec in specs)
        return (-_degree(strat, mesh), sent if price is None else sum(price(spec[4]) / share(spec) for spec in specs),
                sent)

    best_specs = op_reshard_specs(op, graph, default, shardings, mesh, reduce_scatter, backend)
    best, best_key = default, key(default, best_specs)
    for i in sharded:
        strat = _greedy_strategy(op, axes_of, [order[i]] + order[:i] + order[i + 1:], mesh)
        if strat == best:
            continue
        specs = op_reshard_specs(op, graph, strat, shardings, mesh, reduce_scatter, backend)
        k = key(strat, specs)
        if k < best_key:
            best, best_key, best_specs = strat, k, specs
    return best, best_specs


def _elementwise(op: Op) -> bool:
    """An n-ary elementwise op (every factor pass-through, in every tensor; not a tie, whose layouts the
    step's carried state decides): its layout is chosen by cost too. Keeping the largest tensor's layout is
    right when one is largest, but among equals it keeps the result's, and where two operands agree with
    each other against it (an `add_any` of two cotangents whose sum a consumer wants elsewhere), resharding
    the one result costs half of resharding both operands."""
    return len(op.inputs) > 1 and op.primitive != "tie" and _pass_through_op(op.rule)


# Ops whose layout is chosen by cost (above): those whose tensors have different shapes, where which one
# keeps its layout matters, and elementwise ops with several operands (`_elementwise`).
_COSTED_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter", "scatter-add",
                                "scatter_add", "reduce_sum", "reduce_max", "reduce_min", "transpose",
                                "reshape", "broadcast_in_dim", "concatenate", "dynamic_slice",
                                "dynamic_update_slice"})


ReshardSpec = tuple[bool, int, Sharding, Sharding, ReshardCost]  # (on an operand?, tensor index, src, dst, cost)


def op_reshard_specs(op: Op, graph: Graph, strat: OpStrategy, shardings: Sequence[Sharding],
                     mesh: Mapping[str, int], reduce_scatter: bool = True, backend: str = "") -> list[ReshardSpec]:
    """The reshards `strat` needs: (on an operand?, tensor index, src, dst, cost), their bytes as `backend`'s
    collectives carry them (`wire_itemsize`). An operand that only needs a free slice is listed (its layout
    changes); a result that only needs one is not (the slice is the consumer's business)."""
    rule = op.rule
    specs: list[ReshardSpec] = []
    unread = unread_operands(graph, op)
    constant = merged(graph).constant  # (XLA folds them: any layout is free)
    bcast = broadcast_dims(graph)  # (as when every reshard before keeps them; the simulator follows the plan's)
    param = op.primitive == "tie" and op.params.get("at") in ("out", "arg")
    for i, (v, dims) in enumerate(zip(op.inputs, rule.operands)):
        val = graph.values[v]
        if (val.is_const and val.rank == 0) or i in unread or constant[v]:
            continue
        need = strat.tensor_sharding(rule, dims, mesh)
        have = shardings[v]
        if need != have:
            cost = reshard_cost(have, need, val.shape, wire_itemsize(val.dtype, backend), mesh, reduce_scatter,
                                bcast=frozenset() if param else bcast[v])
            if cost.kind != "none":
                specs.append((True, i, have, need, cost))
    partial, groups = strat.partial_axes(rule), strat.partial_groups(rule)
    for i, (v, dims) in enumerate(zip(op.outputs, rule.results)):
        val = graph.values[v]
        if constant[v] or enters_a_constant(op, constant):  # folded by XLA: made in the layout wanted
            continue
        made = strat.tensor_sharding(rule, dims, mesh)
        made = Sharding(made.dims, partial)
        want = shardings[v]
        if made != want:
            cost = reshard_cost(made, want, val.shape, wire_itemsize(val.dtype, backend), mesh, reduce_scatter,
                                groups, bcast[v])
            if cost.kind not in ("none", "slice"):
                specs.append((False, i, made, want, cost))
    return specs


def _plan_classes(graph: Graph) -> list[int]:
    """Per op: the class of ops whose strategy and reshards are the same at the same tensor shardings
    (rule, io tie or not, parameter tie or not, tensor shapes/dtypes/broadcast dims, constant operands);
    computed once per graph."""
    return graph.analysis("plan_classes", lambda: _compute_plan_classes(graph))


def _compute_plan_classes(graph: Graph) -> list[int]:
    classes: dict[tuple, int] = {}
    out: list[int] = []
    bcast, constant = broadcast_dims(graph), merged(graph).constant
    for op in graph.ops:
        vals = [graph.values[v] for v in op.inputs + op.outputs]
        tie = op.primitive == "tie"
        key = (op.rule, tie and op.region == "io", tie and op.params.get("at") in ("out", "arg"),
               tuple((v.shape, v.dtype, v.nbytes, bcast[v.id]) for v in vals),
               tuple((graph.values[v].is_const and graph.values[v].rank == 0, constant[v]) for v in op.inputs))
        out.append(classes.setdefault(key, len(classes)))
    return out


def operand_shares(graph: Graph) -> list[tuple[int, ...]]:
    """Per op, per operand: how many ops of its plan class read that value as the same operand (itself
    included), computed once per graph. Such ops choose their layouts alike, so a reshard of the value one
    of them needs, the others need too and reuse."""
    return graph.analysis("operand_shares", lambda: _compute_operand_shares(graph))


def _compute_operand_shares(graph: Graph) -> list[tuple[int, ...]]:
    classes = _plan_classes(graph)
    readers: dict[tuple[int, int, int], int] = {}  # (value, operand index, class) -> readers
    for op in graph.ops:
        for i, v in enumerate(op.inputs):
            k = (v, i, classes[op.id])
            readers[k] = readers.get(k, 0) + 1
    return [tuple(readers[(v, i, classes[op.id])] for i, v in enumerate(op.inputs)) for op in graph.ops]


def planned_apart(plan: "Plan", op: Op, canon: Sequence[int]) -> bool:
    """Whether `op`, which CSE merges into an earlier identical op (`canon`: value -> the value kept), has a
    result planned in another layout than that op's (a program output keeps its own: `PlanBuilder`): the
    lowering binds it again with its own strategy and reshards, and the simulator prices it so."""
    return any(plan.shardings[v] != plan.shardings[canon[v]] for v in op.outputs)


def reshard_needs(reshards: Sequence[Reshard]) -> dict[tuple[int, int], Sharding]:
    """(consumer op, operand index) -> the layout the consumer reads it in, from reshards (as lowered)."""
    return {(r.consumer, r.operand): r.dst.without_partial() for r in reshards if r.consumer is not None}


def split_unrun(graph: Graph, shardings: Sequence[Sharding], strategies: Sequence[OpStrategy],
                reshards: Sequence[Reshard], sizes: Mapping[str, int]
                ) -> tuple[tuple[Reshard, ...], tuple[Reshard, ...]]:
    """(the reshards that run, those XLA removes): a reshard of an operand XLA's simplifier drops as one buffer
    with another in this plan, or of an op only such operands read, does not run (`shardc.cost.dropped`); nor
    does the reshard of a result to its planned layout when the compiled program reads that result nowhere
    (`read_values`: a sort's permutation whose gradient is not taken)."""
    read, canon = read_values(graph), merged(graph).canon
    drops = plan_drops(graph, shardings, strategies, reshard_needs(reshards), sizes) if candidates(graph) else {}
    dead = dead_ops(graph, drops) if drops else frozenset()
    run: list[Reshard] = []
    unrun: list[Reshard] = []
    for r in reshards:
        op = r.consumer if r.consumer is not None else graph.values[r.value].producer
        gone = op in dead or (r.consumer is not None and r.operand in drops.get(r.consumer, ())) \
            or r.consumer is None and not read[canon[r.value]]
        (unrun if gone else run).append(r)
    return tuple(run), tuple(unrun)


def _describe_origin(origins: Sequence[Cause | None]) -> str:
    causes = [str(c) for c in dict.fromkeys(c for c in origins if c is not None)]
    return f" (from {'; '.join(causes)})" if causes else ""


def build_plan(graph: Graph, mesh: Mesh, prop: Propagation, *, input_names: Sequence[str] = (),
               output_names: Sequence[str] = (), warnings: Sequence[str] = (),
               price: ReshardPricer | None = None) -> Plan:
    """The plan of a propagation result (strategies and reshards of every op); `price` prices the reshards
    an op's layout choice weighs (`topology_pricer`; default: bytes sent)."""
    return PlanBuilder(graph, mesh, input_names=input_names, output_names=output_names,
                       warnings=warnings, price=price).build(prop)


_Entry = tuple[OpStrategy, tuple[ReshardSpec, ...]]


def _carried_axes(prop: Propagation, inp: int, out: int) -> tuple[Axes, ...]:
    """The layout of a carried input's next value: the input's, except on dims a hint or seed closed on the
    output alone (there the user asked for that layout of the result; both closed and different is an
    error raised before planning)."""
    a, b = prop.axes[inp], prop.axes[out]
    merged = tuple(tuple(b[d]) if prop.closed[out][d] and not prop.closed[inp][d] else tuple(a[d])
                   for d in range(len(a)))
    flat = [x for dim in merged for x in dim]
    return merged if len(flat) == len(set(flat)) else tuple(tuple(x) for x in b)


class PlanBuilder:
    """Builds plans of one graph on one mesh, incrementally.

    `build(prop)` plans every op; `build(prop, changed=values)` — with `values` a superset of the values
    whose axes or origins differ from the previous build's propagation — replans only the ops that read or
    make them and reuses the rest (unchanged shardings and strategies are the same objects, which the
    simulator's delta relies on). Both give the plan `build_plan` gives. Each op's strategy and reshards
    depend only on its rule, its tensors' shapes and shardings and the mesh, so they are memoised across
    structurally identical ops (the layers of a model) and across builds."""

    def __init__(self, graph: Graph, mesh: Mesh, *, input_names: Sequence[str] = (),
                 output_names: Sequence[str] = (), warnings: Sequence[str] = (),
                 memo: dict | None = None, price: ReshardPricer | None = None) -> None:
        """`memo`: a memo shared with other builders of this graph, axis sizes and pricer (any axis order when
        the pricer does not depend on it); `price`: what an op's layout choice weighs its reshards by
        (`topology_pricer`; default: bytes sent)."""
        self.graph, self.mesh = graph, mesh
        self.price = price
        self.sizes = mesh_shape(mesh)
        self.reduce_scatter = lowers_reduce_scatter(mesh)
        self.backend = lowers_backend(mesh)
        self.names = (tuple(input_names), tuple(output_names), tuple(warnings))
        self.nbytes = [v.nbytes for v in graph.values]
        self._memo: dict[tuple, _Entry] = memo if memo is not None else {}
        self._sources: dict[int, SourceLine | None] = {}
        self._class = _plan_classes(graph)
        self._shares = operand_shares(graph)
        self._users: list[list[int]] | None = None
        self.shardings: list[Sharding] = []
        self.origins: list[tuple[Cause | None, ...]] = []
        self.axes: list[tuple[Axes, ...]] = []
        self.strategies: list[OpStrategy] = []
        self.reshards: list[tuple[Reshard, ...]] = []
        # Carried train-step state: the next value of an input (an output tied to it) is laid out as the
        # input is, whatever propagation gave it, so step 2 starts where step 1 did; the op that makes it
        # in another layout records the reshard (e.g. ZeRO's all-gather of the updated parameters).
        self._next = graph.carried()  # input -> its next value
        self._carry = {out: inp for inp, out in self._next.items()}
        # Values XLA's CSE merges are one value: one layout, the first's (`shardc.cost.program.merged`; the
        # lowering binds the op once). Outputs keep their own: they leave in the layout the caller gets.
        outputs = set(graph.outputs)
        self._same = {v: c for v, c in enumerate(merged(graph).canon) if c != v and v not in outputs}
        self._dups: dict[int, list[int]] = {}
        for v, c in self._same.items():
            self._dups.setdefault(c, []).append(v)

    def build(self, prop: Propagation, changed: Any = None) -> Plan:
        graph = self.graph
        if changed is None or not self.strategies:
            self.axes = [tuple(a) for a in prop.axes]
            for out, inp in self._carry.items():
                self.axes[out] = _carried_axes(prop, inp, out)
            for v, c in self._same.items():
                self.axes[v] = self.axes[c]
            self.shardings = [Sharding(a) for a in self.axes]
            self.origins = [tuple(o) for o in prop.origin]
            self.strategies, self.reshards = [], []
            for op in graph.ops:
                strat, rs = self._op(op)
                self.strategies.append(strat)
                self.reshards.append(rs)
        else:
            if self._users is None:  # value -> every op that reads or makes it
                self._users = [[] for _ in graph.values]
                for op in graph.ops:
                    for v in dict.fromkeys(op.inputs + op.outputs):
                        self._users[v].append(op.id)
            ops: set[int] = set()
            changed = set(changed)
            changed.update(self._next[v] for v in list(changed) if v in self._next)
            changed.update(d for v in list(changed) for d in self._dups.get(v, ()))
            for v in sorted(changed):  # (a value CSE merges into another comes after it)
                if v in self._same:
                    axes = self.axes[self._same[v]]
                elif v in self._carry:
                    axes = _carried_axes(prop, self._carry[v], v)
                else:
                    axes = tuple(prop.axes[v])
                origin = tuple(prop.origin[v])
                if axes != self.axes[v]:
                    self.axes[v] = axes
                    self.shardings[v] = Sharding(axes)
                elif origin == self.origins[v]:
                    continue
                self.origins[v] = origin
                ops.update(self._users[v])
            for i in ops:
                strat, rs = self._op(graph.ops[i])
                if strat != self.strategies[i]:
                    self.strategies[i] = strat
                self.reshards[i] = rs
        run, unrun = split_unrun(graph, self.shardings, self.strategies, [r for rs in self.reshards for r in rs],
                                 self.sizes)
        return Plan(graph, self.mesh, tuple(self.shardings), tuple(self.strategies), run, tuple(self.origins),
                    *self.names, unrun=unrun)

    def _op(self, op: Op) -> tuple[OpStrategy, tuple[Reshard, ...]]:
        tensors = op.inputs + op.outputs
        key = (self._class[op.id], tuple([self.axes[v] for v in tensors]), self._shares[op.id])
        entry = self._memo.get(key)
        if entry is None:
            entry = self._memo[key] = self._entry(op)
        strat, specs = entry
        if not specs:
            return strat, ()
        return strat, tuple(self._reshard(op, strat, *spec) for spec in specs)

    def _entry(self, op: Op) -> _Entry:
        """An op's strategy and its reshards (`ReshardSpec`s)."""
        strat, specs = _strategy(op, self.graph, self.shardings, self.nbytes, self.sizes, self.reduce_scatter,
                                 self.price, self.backend, self._shares[op.id])
        if op.primitive == "tie" and op.region == "io":
            return strat, ()
        if specs is None:
            specs = op_reshard_specs(op, self.graph, strat, self.shardings, self.sizes, self.reduce_scatter,
                                     self.backend)
        return strat, tuple(specs)

    def _reshard(self, op: Op, strat: OpStrategy, operand: bool, i: int, src: Sharding, dst: Sharding,
                 cost: ReshardCost) -> Reshard:
        # (the memo is shared across meshes ordering the same axes differently: the collectives' axes are
        # listed in this mesh's order)
        val = self.graph.values[op.inputs[i] if operand else op.outputs[i]]
        groups = () if operand else strat.partial_groups(op.rule)
        bcast = frozenset() if operand and op.primitive == "tie" and op.params.get("at") in ("out", "arg") \
            else broadcast_dims(self.graph)[val.id]
        cost = reshard_cost(src, dst, val.shape, wire_itemsize(val.dtype, self.backend), self.sizes,
                            self.reduce_scatter, groups, bcast)
        if op.id not in self._sources:
            self._sources[op.id] = op.source
        source = self._sources[op.id]
        if operand:
            v = op.inputs[i]
            val = self.graph.values[v]
            cause = (f"{op.primitive} needs {val.name} {list(val.shape)} as {dst}, it is {src}"
                     f"{_describe_origin(self.origins[v])}")
            return Reshard(v, src, dst, cost.kind, cost.payload, cause, source, op.id, cost.collectives, i)
        v = op.outputs[i]
        val = self.graph.values[v]
        partial = src.partial
        what = (f"partial {op.rule.reduce_op}s over {','.join(sorted(partial))} from {op.primitive}"
                if partial else f"{op.primitive} makes {src}")
        return Reshard(v, src, dst, cost.kind, cost.payload, f"{what}; {val.name} {list(val.shape)} is {dst}", source,
                       None, cost.collectives)
