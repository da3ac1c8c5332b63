"""Pricing a PCG with shardc's simulator (`shardc.sim`): the cost that decides whether a rewrite pays.

A PCG is not a plan of the original program (rewrites add and remove compute ops), so it is turned into
one of its own — a `shardc.ir.Graph` with one op per PCG node and a `Plan` that gives every value the
PCG tensor's layout — and simulated as it is:

* a compute node is an op whose strategy makes exactly its tensors' layouts (one factor per dim, and
  a reduction factor over the axes its result holds partial sums on), priced by the simulator's op-cost
  estimator at the local shapes;
* a parallel node is a free identity op (`pcg_collective`: no compute, a result in a buffer of its
  own, as the collective's) that makes its input's layout while the plan wants its output's: the simulator's reshard of that one change is the op's one communication task
  (`shardc.cost.reshard`: Combine -> all-gather, Reduce -> all-reduce, ReduceScatter -> reduce-scatter,
  AllToAll -> all-to-all, CollectivePermute -> collective-permute; Partition and Replicate move
  nothing);
* a region node's bodies are inlined with the region tags and `tie` / `scan_slice` / `scan_stack`
  boundary ops the graph builder uses, so the simulator runs a scan body `length` times.

`SimCost(topology)` is a `CostFn` (seconds per step, memoised by the PCG's structural key; on a PCG of
`SCREEN_FROM_NODES` nodes or more it also screens a rewrite by its neighbourhood alone, `local_gain`);
`simulate_pcg(pcg, topology)` returns the `PCGSimulation` (the `SimResult` and which op is which node).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection, Mapping

import numpy as np

from shardc.cost.program import PCG_COLLECTIVE
from shardc.ir.build import scalar_literal
from shardc.ir.folding import small_integer_array
from shardc.ir.graph import Graph, Op
from shardc.pcg.graph import PCG, Node, Region
from shardc.pcg.local_screen import local_gain
from shardc.pcg.ops import group_size
from shardc.plan import OpStrategy, Plan
from shardc.rules.core import FactorKind, FactorRule
from shardc.sharding import Sharding

__all__ = ["SimCost", "PCGSimulation", "simulate_pcg", "pcg_plan", "DEFAULT_TOPOLOGY", "SCREEN_FROM_NODES"]

DEFAULT_TOPOLOGY = "h100-sxm-8"
SCREEN_FROM_NODES = 1000  # a full simulation of a PCG this large is ~0.2 s; its neighbourhoods' are a few ms


@dataclasses.dataclass
class _Emitter:
    """Builds the graph, the layouts and the strategies of the simulated plan."""

    mesh: Mapping[str, int]
    graph: Graph = dataclasses.field(default_factory=Graph)
    shardings: list[Sharding] = dataclasses.field(default_factory=list)
    strategies: list[OpStrategy] = dataclasses.field(default_factory=list)
    origin: dict[int, tuple[tuple[int, ...], int]] = dataclasses.field(default_factory=dict)  # op -> (path, node)

    def value(self, shape: tuple[int, ...], dtype: Any, layout: Sharding, name: str, *, const: Any = None) -> int:
        """A value of the graph; `const`: a constant's value (None: a computed one). A scalar is a literal and
        a small integer array is kept, as the graph builder keeps them (the program analysis folds what XLA folds:
        a dynamic slice at literal starts, a splat of an op's identity, literals CSE merges)."""
        if const is None:
            v = self.graph.add_value(shape, dtype, name)
        else:
            v = self.graph.add_value(shape, dtype, name, is_const=True,
                                     literal=scalar_literal(const) if not shape else None,
                                     array=small_integer_array(np.asarray(const)) if shape else None)
        self.shardings.append(layout)
        return v

    def op(self, primitive: str, ins: list[int], outs: list[int], params: Mapping[str, Any], rule: FactorRule,
           axes: tuple[tuple[str, ...], ...], region: str, where: tuple[tuple[int, ...], int] | None = None,
           source: Any = None) -> None:
        i = len(self.graph.ops)
        self.graph.add_op(Op(i, primitive, tuple(ins), tuple(outs), params, rule, region=region))
        self.strategies.append(OpStrategy(axes))
        if where is not None:
            self.origin[i] = where

    def ordered(self, axes: frozenset[str]) -> tuple[str, ...]:
        return tuple(a for a in self.mesh if a in axes)


def _dims_rule(layouts: list[Sharding], shapes: list[tuple[int, ...]], n_operands: int,
               partial: frozenset[str], emit: _Emitter) -> tuple[FactorRule, tuple[tuple[str, ...], ...]]:
    """A rule with one pass-through factor per dim of every tensor (plus one reduction factor for the
    partial axes), and the strategy that lays each tensor out as given (memoised: the candidates of a
    rewriting share most of their nodes, and a rule is an immutable value)."""
    key = (tuple(layouts), tuple(map(tuple, shapes)), n_operands, partial, tuple(emit.mesh.items()))
    hit = _RULES.get(key)
    if hit is None:
        hit = _RULES[key] = _make_dims_rule(layouts, shapes, n_operands, partial, emit)
        if len(_RULES) > 200_000:  # (a bound on what a long process keeps)
            _RULES.clear()
    return hit


_RULES: dict[tuple, tuple[FactorRule, tuple[tuple[str, ...], ...]]] = {}


def _make_dims_rule(layouts: list[Sharding], shapes: list[tuple[int, ...]], n_operands: int,
                    partial: frozenset[str], emit: _Emitter) -> tuple[FactorRule, tuple[tuple[str, ...], ...]]:
    tensors, sizes, kinds, axes = [], [], [], []
    for lay, shape in zip(layouts, shapes):
        dims = []
        for d, size in enumerate(shape):
            dims.append((len(sizes),))
            sizes.append(int(size))
            kinds.append(FactorKind.PASS_THROUGH)
            axes.append(tuple(lay.dims[d]))
        tensors.append(tuple(dims))
    if partial:
        sizes.append(max(1, group_size(emit.ordered(partial), emit.mesh)))
        kinds.append(FactorKind.REDUCTION)
        axes.append(emit.ordered(partial))
    rule = FactorRule(tuple(tensors[:n_operands]), tuple(tensors[n_operands:]), tuple(sizes), tuple(kinds))
    return rule, tuple(axes)


def _stack_rule(stacked: Sharding, shape: tuple[int, ...], length: int, *, operand: bool
                ) -> tuple[FactorRule, tuple[tuple[str, ...], ...]]:
    r = len(shape)
    inner = tuple((i + 1,) for i in range(r))
    outer = ((0,),) + inner
    sizes = (int(length),) + tuple(int(s) for s in shape)
    kinds = (FactorKind.NEED_REPLICATION,) + (FactorKind.PASS_THROUGH,) * r
    axes = ((),) + tuple(stacked.dims[1:])
    if operand:
        return FactorRule((outer,), (inner,), sizes, kinds), axes
    return FactorRule((inner,), (outer,), sizes, kinds), axes


def _emit(pcg: PCG, emit: _Emitter, args: list[int], region: str, path: tuple[int, ...]) -> list[int]:
    """Add `pcg`'s nodes with its inputs bound to values `args`; returns the values of its outputs."""
    vals: dict[int, int] = dict(zip(pcg.inputs, args))

    def val(t: int) -> int:
        if t not in vals:
            tensor = pcg.tensors[t]
            vals[t] = emit.value(tensor.shape, tensor.dtype, tensor.sharding, tensor.name or f"%{t}",
                                 const=pcg.consts.get(t))
        return vals[t]

    for n in pcg.nodes:
        if isinstance(n.op, Region) and pcg.duplicate(n):  # (the lowering runs the earlier one only)
            for t in n.outputs:
                vals[t] = val(pcg.same_values()[t])
            continue
        ins = [val(t) for t in n.inputs]
        if isinstance(n.op, Region):
            outs = _emit_region(pcg, n, emit, ins, region, path)
            for t, v in zip(n.outputs, outs):
                vals[t] = v
            continue
        outs = [val(t) for t in n.outputs]
        tin = [pcg.tensors[t] for t in n.inputs]
        tout = [pcg.tensors[t] for t in n.outputs]
        if n.is_parallel:  # makes its input's layout; the plan wants its output's: one reshard
            src = tin[0].sharding
            rule, axes = _dims_rule([src, src], [tin[0].shape, tout[0].shape], 1, src.partial, emit)
            # (its params name the parallel op: XLA's CSE merges the same collective of the same value, as
            # `PCG.collectives()` counts it once)
            emit.op(PCG_COLLECTIVE, ins, outs, {"parallel": str(n.op)}, rule, axes, region, (path, n.id))
        else:
            partial = frozenset().union(*(t.sharding.partial for t in tout)) if tout else frozenset()
            rule, axes = _dims_rule([t.sharding for t in tin + tout], [t.shape for t in tin + tout], len(tin),
                                    partial, emit)
            emit.op(n.op.primitive, ins, outs, n.op.params, rule, axes, region, (path, n.id), n.op.source)
    return [val(t) for t in pcg.outputs]


def _tie(emit: _Emitter, a: int, layout: Sharding, region: str, at: str = "", into: int | None = None) -> int:
    """A `tie` from value `a` to a new value in `layout` (or to value `into`), as the graph builder joins a
    region's values (`shardc.ir.build`: `at` "in" for an outer value entering a loop, "out" for a loop's result,
    "arg" for a branch's or a loop condition's parameter, "" for a carry across iterations or a branch's
    result), so the program analysis reads the simulated PCG's loops as it reads the plan's."""
    v = emit.graph.values[a]
    b = into if into is not None else emit.value(v.shape, v.dtype, layout, v.name)
    rule, axes = _dims_rule([emit.shardings[b]] * 2, [v.shape, v.shape], 1, frozenset(), emit)
    emit.op("tie", [a], [b], {"at": at} if at else {}, rule, axes, region)
    return b


def _emit_region(pcg: PCG, n: Node, emit: _Emitter, ins: list[int], region: str, path: tuple[int, ...]) -> list[int]:
    """A region node's bodies inlined as `shardc.ir.build` inlines a loop or a cond (the same ties, trip counts
    and branch indices), with its boundary values in the PCG's layouts."""
    op: Region = n.op
    here = f"{region}/{op.primitive}{len(emit.graph.ops)}"
    lay = [pcg.tensors[t].sharding for t in n.outputs]
    if op.primitive == "scan":
        nc, nk = op.params["num_consts"], op.params["num_carry"]
        body = op.bodies[0]
        emit.graph.region_trips[here] = int(op.trips)
        if op.params.get("reverse"):
            emit.graph.region_reversed.add(here)
        body_args = []
        for i, (a, t) in enumerate(zip(ins, body.inputs)):
            s = body.tensors[t].sharding
            if i < nc + nk:
                body_args.append(_tie(emit, a, s, here, "in"))
            else:
                v = emit.value(body.tensors[t].shape, body.tensors[t].dtype, s, body.tensors[t].name)
                rule, axes = _stack_rule(emit.shardings[a], body.tensors[t].shape, op.trips, operand=True)
                emit.op("scan_slice", [a], [v], {}, rule, axes, here)
                body_args.append(v)
        outs = _emit(body, emit, body_args, here, path + (n.id, 0))
        res = []
        for i, (o, s) in enumerate(zip(outs, lay)):
            if i < nk:
                carry = body_args[nc + i]
                _tie(emit, o, s, here, into=carry)  # the carry across iterations
                res.append(_tie(emit, carry, s, here, "out"))
            else:
                v = emit.graph.values[o]
                r = emit.value((op.trips,) + v.shape, v.dtype, s, v.name)
                rule, axes = _stack_rule(s, v.shape, op.trips, operand=False)
                emit.op("scan_stack", [o], [r], {}, rule, axes, here)
                res.append(r)
        return res
    if op.primitive == "while":
        cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
        cond, body = op.bodies
        cond_consts, body_consts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        b_consts = [_tie(emit, a, s, here, "in") for a, s in zip(body_consts, _in_layouts(body)[:bn])]
        c_consts = [_tie(emit, a, s, here, "in") for a, s in zip(cond_consts, _in_layouts(cond)[:cn])]
        b_carry, c_carry, res = [], [], []
        for a, sb, sc, s in zip(init, _in_layouts(body)[bn:], _in_layouts(cond)[cn:], lay):
            bc = _tie(emit, a, sb, here, "in")
            c_carry.append(_tie(emit, bc, sc, here, "arg"))
            res.append(_tie(emit, bc, s, here, "out"))
            b_carry.append(bc)
        _emit(cond, emit, c_consts + c_carry, here, path + (n.id, 0))
        outs = _emit(body, emit, b_consts + b_carry, here, path + (n.id, 1))
        for o, bc in zip(outs, b_carry):
            _tie(emit, o, emit.shardings[bc], here, into=bc)  # the carry across iterations
        return res
    if op.primitive == "cond":
        res: list[int] | None = None
        for b, body in enumerate(op.bodies):
            tag = f"{region}/cond{len(emit.graph.ops)}.{b}"
            emit.graph.region_reads[tag] = (ins[0],)
            args = [_tie(emit, a, s, tag, "arg") for a, s in zip(ins[1:], _in_layouts(body))]
            outs = _emit(body, emit, args, tag, path + (n.id, b))
            if res is None:
                res = [_tie(emit, o, s, tag) for o, s in zip(outs, lay)]
            else:  # the other branches write the same results
                for o, r in zip(outs, res):
                    _tie(emit, o, emit.shardings[r], tag, into=r)
        return res or []
    raise NotImplementedError(op.primitive)  # pragma: no cover


def _in_layouts(body: PCG) -> list[Sharding]:
    return [body.tensors[t].sharding for t in body.inputs]


def pcg_plan(pcg: PCG) -> tuple[Plan, dict[int, tuple[tuple[int, ...], int]]]:
    """The PCG as a plan of a graph of its own, and for each op of that graph that stands for a PCG node,
    (path of region node ids and body indices, node id)."""
    emit = _Emitter(pcg.mesh_sizes)
    ins = [emit.value(pcg.tensors[t].shape, pcg.tensors[t].dtype, pcg.tensors[t].sharding,
                      pcg.tensors[t].name or f"arg{i}") for i, t in enumerate(pcg.inputs)]
    emit.graph.inputs = list(ins)
    emit.graph.outputs = _emit(pcg, emit, ins, "", ())
    plan = Plan(emit.graph, pcg.mesh, tuple(emit.shardings), tuple(emit.strategies), (),
                tuple(() for _ in emit.shardings))
    return plan, emit.origin


@dataclasses.dataclass(frozen=True)
class PCGSimulation:
    """A simulated PCG: the simulator's result on the PCG's plan, and which op stands for which node."""

    pcg: PCG
    plan: Plan
    result: Any  # shardc.sim.SimResult
    origin: Mapping[int, tuple[tuple[int, ...], int]]

    @property
    def step_time(self) -> float:
        return self.result.step_time

    def comm_tasks(self) -> list[tuple[tuple[int, ...], int, str]]:
        """(region path, PCG node id, collective) for every collective the simulator scheduled, one per
        parallel op that moves data."""
        out = []
        for slot in self.result.slots:
            kinds = list(dict.fromkeys(t.collective for t in slot.tasks if t.collective))
            if kinds and slot.op in self.origin:
                path, node = self.origin[slot.op]
                out.extend((path, node, k) for k in kinds)
        return out


def simulate_pcg(pcg: PCG, topology: Any = DEFAULT_TOPOLOGY, *, estimator: Any = None,
                 donated: tuple[int, ...] = ()) -> PCGSimulation:
    """Simulate one step of the PCG on `topology` (a Topology, a preset name, a dict or a file);
    `donated`: indices of the PCG's inputs whose buffers the step may reuse (as `jax.jit`'s
    `donate_argnums` over the flat inputs; a plan's PCG has the plan's inputs in order)."""
    from shardc.sim import simulator_for

    plan, origin = pcg_plan(pcg)
    sim = simulator_for(plan, topology, estimator=estimator)
    return PCGSimulation(pcg, plan, sim.full(plan, tuple(donated)), origin)


class SimCost:
    """`CostFn`: the simulated step time of a PCG in seconds, on one topology (memoised per PCG key).

    `below(pcg, bound)` is the cost where it is below `bound` and a value at least `bound` otherwise: a rewrite
    that does not pay needs no memory model (it only says whether a faster PCG fits), so where the step time does
    not read it (the device charges nothing for fresh memory) the memory model runs only for PCGs faster than
    `bound`, completing the same simulation."""

    def __init__(self, topology: Any = DEFAULT_TOPOLOGY, *, estimator: Any = None, donated: tuple[int, ...] = (),
                 memory_limit: float | None = None, screen_from: int | None = SCREEN_FROM_NODES) -> None:
        from shardc.sim import as_topology
        from shardc.cost.host_ops import default_estimator

        self.topology = as_topology(topology)
        self.estimator = estimator if estimator is not None else default_estimator(self.topology.device)
        self.donated = tuple(donated)
        # memory_limit: bytes per device; a PCG whose simulated peak is above it costs infinity (never kept)
        self.memory_limit = memory_limit
        self._memo: dict[str, tuple[float, float, float]] = {}  # PCG key -> (cost, peak, comm bytes)
        self._times: dict[str, float] = {}  # PCG key -> step time, for PCGs simulated without the memory model
        self._timed: tuple[str, Any, Plan] | None = None  # (key, simulator, plan) of the last of those
        self.simulations = 0
        # screen_from: the node count from which `local_gain` prices a rewrite's neighbourhood (None: never)
        self.screen_from = screen_from
        self.local_simulations = 0
        self._local_times: dict[str, float] = {}  # neighbourhood key -> step time (`_local_step_time`)

    def __call__(self, pcg: PCG) -> float:
        return self.measures(pcg)[0]

    def below(self, pcg: PCG, bound: float) -> float:
        """The PCG's cost if it is below `bound`, else a value at least `bound` (see the class docstring)."""
        k = self._key(pcg)
        hit = self._memo.get(k)
        if hit is not None:
            return hit[0]
        time = self._times.get(k)
        if time is None and self.topology.device.fresh_memory_cost <= 0:
            from shardc.sim import simulator_for

            plan, _ = pcg_plan(pcg)
            sim = simulator_for(plan, self.topology, estimator=self.estimator)
            time = self._times[k] = sim.step_time_only(plan)
            self._timed = (k, sim, plan)
            self.simulations += 1
        if time is not None and time >= bound:
            return time
        return self._measures(pcg, k)[0]

    def local_gain(self, before: PCG, after: PCG, match_nodes: Collection[int]) -> float | None:
        """The step time a rewrite of nodes `match_nodes` of `before` into `after` saves in its neighbourhood
        (`shardc.pcg.local_screen`), for PCGs of `screen_from` nodes or more; None otherwise (price it whole)."""
        if self.screen_from is None or len(before.nodes) < self.screen_from:
            return None
        return local_gain(before, after, match_nodes, self._local_step_time)

    def _local_step_time(self, part: PCG) -> float:
        """The simulated step time of a neighbourhood cut out of a PCG, memoised per part key (a later pass and the
        lookahead cut out the same neighbourhoods again where the rewrites since left them as they were)."""
        from shardc.sim import simulator_for

        k = self._key(part)
        time = self._local_times.get(k)
        if time is None:
            plan, _ = pcg_plan(part)
            self.local_simulations += 1
            sim = simulator_for(plan, self.topology, estimator=self.estimator)
            # (where fresh memory is charged the step time reads the memory model: simulated with it)
            time = self._local_times[k] = sim.step_time_only(plan) if self.topology.device.fresh_memory_cost <= 0 \
                else sim.full(plan).step_time
        return time

    def measures(self, pcg: PCG) -> tuple[float, float, float]:
        """The PCG's cost (its simulated step, infinity over the memory limit), simulated peak memory per device
        and communication per device (bytes): simulated once per PCG key."""
        return self._measures(pcg, self._key(pcg))

    def _measures(self, pcg: PCG, k: str) -> tuple[float, float, float]:
        hit = self._memo.get(k)
        if hit is None:
            if self._timed is not None and self._timed[0] == k:  # (its timeline is made: the memory model completes it)
                _, sim, plan = self._timed
                res = sim.full(plan, self.donated)
            else:
                res = simulate_pcg(pcg, self.topology, estimator=self.estimator, donated=self.donated).result
                self.simulations += 1
            self._timed = None
            cost = res.step_time
            if self.memory_limit is not None and res.peak_memory > self.memory_limit:
                cost = float("inf")
            hit = self._memo[k] = (cost, float(res.peak_memory), float(sum(res.comm_bytes.values())))
        return hit

    @staticmethod
    def _key(pcg: PCG) -> str:
        return pcg.key() + repr([(pcg.tensors[t].shape, str(pcg.tensors[t].dtype)) for t in pcg.inputs])

    def __repr__(self) -> str:
        return f"SimCost({self.topology.name})"
