"""The oracle of the search: assignment -> seeds -> propagation -> Plan -> simulated step time and memory."""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any, Sequence

from jax.sharding import Mesh

from annotations.errors import ShardingError
from shardc.ir.graph import Graph
from shardc.plan import Plan, PlanBuilder, build_plan, topology_pricer
from shardc.propagate import Propagation, Seed, propagate
from shardc.search.space import Assignment, Space, seeds_for
from shardc.sharding import mesh_shape
from shardc.sim import Simulator, as_topology
from shardc.ties import check_ties

__all__ = ["LAYOUT_COSTS", "Problem", "Score", "Evaluator", "plan_from_seeds"]


@dataclasses.dataclass
class Problem:
    """What is planned: a graph, the user's seeds (a function of the mesh), names, donation, topology."""

    graph: Graph
    user_seeds: Any  # Callable[[Mesh], list[Seed]]
    topology: Any
    input_names: Sequence[str] = ()
    output_names: Sequence[str] = ()
    warnings: Sequence[str] = ()
    donated: tuple[int, ...] = ()
    program: Any = None
    memory_limit: float | None = None  # bytes per device; default: the topology's device memory
    pipeline: Any = None  # the bound shardc.pipeline.Pipeline of a pipelined program (baselines run per stage)
    pcg: bool = False  # each searched mesh's best plan also competes with its PCG rewritten (shardc.pcg.choice)

    def seeds_on(self, mesh: Any) -> list[Seed]:
        """The user's seeds on `mesh` (ShardingError when the hints do not fit it)."""
        return list(self.user_seeds(mesh)) if callable(self.user_seeds) else list(self.user_seeds or ())


@dataclasses.dataclass(frozen=True)
class Score:
    """Simulated step time (s), peak bytes per device, communication bytes; feasible = fits memory."""

    time: float
    peak: float
    comm: float
    feasible: bool

    @property
    def key(self) -> tuple:
        """Order: feasible plans by time, then infeasible ones by peak memory."""
        return (0, self.time, self.peak) if self.feasible else (1, self.peak, self.time)


INVALID = Score(math.inf, math.inf, math.inf, False)


def _worklist(graph: Graph, phase_of: Sequence[int]) -> tuple:
    """The worklist of `_Propagator.run_to_fixed_point`, precomputed once per graph: per value the ops it
    queues (its users and producer) and every op it is a tensor of; per phase the ops allowed, and the ops
    first queued (as a list and as a mask)."""
    return graph.analysis("worklist", lambda: _compute_worklist(graph, phase_of))


def _compute_worklist(graph: Graph, phase_of: Sequence[int]) -> tuple:
    n = len(graph.ops)
    queues = [list(graph.users[v]) + ([graph.values[v].producer] if graph.values[v].producer is not None else [])
              for v in range(len(graph.values))]
    ops_of: list[list[int]] = [[] for _ in graph.values]
    for op in graph.ops:
        for v in dict.fromkeys(op.inputs + op.outputs):
            ops_of[v].append(op.id)
    allowed = {ph: bytes(q <= ph for q in phase_of) for ph in (0, 1, 2)}
    first = {(ph, new): [i for i in range(n) if (phase_of[i] == ph if new else phase_of[i] <= ph)]
             for ph in (0, 1, 2) for new in (False, True)}
    first_mask = {}
    for k, ops in first.items():
        mask = bytearray(n)
        for i in ops:
            mask[i] = 1
        first_mask[k] = bytes(mask)
    return queues, ops_of, allowed, first, first_mask


class UserPropagation:
    """Propagation of the user's seeds done once; `run(extra)` continues from it with the search's seeds
    (priority 1), giving exactly what `propagate(graph, mesh, user + extra)` gives."""

    def __init__(self, graph: Graph, mesh: dict[str, int], user_seeds: Sequence[Seed]) -> None:
        from shardc.propagate import _Propagator

        assert all(s.priority == 0 for s in user_seeds)
        self.p = p = _Propagator(graph, mesh)
        for s in user_seeds:
            p.apply_seed(s)
        for phase in (0, 1, 2):
            p.run_to_fixed_point(phase, only_new=phase > 0)
        self.base = (p.axes, p.closed, p.origin, p.visits)
        self._queues, self._ops_of, self._allowed, self._first, self._first_mask = _worklist(graph, p.phase_of)

    def run(self, extra: Sequence[Seed]) -> Propagation:
        p = self.p
        p.fork(*self.base)  # copy-on-write: only the values this run writes are copied (p.touched)
        # dirty[op]: one of its tensors changed since its last visit. A clean op is at its fixed point, so
        # its visit would change nothing and is skipped (the queue order is the one propagate() uses).
        self.dirty = dirty = bytearray(len(p.g.ops))
        for level in sorted({s.priority for s in extra}):
            for s in extra:
                if s.priority == level:
                    p.apply_seed(s)
                    for o in self._ops_of[s.value]:
                        dirty[o] = 1
            for phase in (0, 1, 2):
                self._run(phase, only_new=phase > 0)
        return Propagation(p.axes, p.closed, p.origin, p.visits)

    def _run(self, max_phase: int, only_new: bool) -> None:
        """`_Propagator.run_to_fixed_point`, skipping clean ops: the initial queue (program order) first,
        then the ops queued meanwhile, in the order they were queued."""
        p = self.p
        ops, queues, ops_of, dirty = p.g.ops, self._queues, self._ops_of, self.dirty
        allowed = self._allowed[max_phase]
        queued = bytearray(self._first_mask[(max_phase, only_new)])
        tail: deque[int] = deque()

        def step(oid: int) -> None:
            queued[oid] = 0
            if not dirty[oid]:
                return
            dirty[oid] = 0
            for v in p.visit(ops[oid]):
                for o in ops_of[v]:
                    dirty[o] = 1
                for n in queues[v]:
                    if allowed[n] and not queued[n]:
                        queued[n] = 1
                        tail.append(n)

        for oid in self._first[(max_phase, only_new)]:
            if dirty[oid]:
                step(oid)
            else:
                queued[oid] = 0
        while tail:
            step(tail.popleft())


# What an op's layout choice weighs its reshards by (`plan_from_seeds`): seconds on the topology, bytes sent, or
# seconds of the collectives alone (without XLA:CPU's relayout copies, `topology_pricer(copies=False)`).
LAYOUT_COSTS = ("time", "bytes", "collectives")


def plan_from_seeds(problem: Problem, mesh: Mesh, seeds: Sequence[Seed], *,
                    base: UserPropagation | None = None, layout_cost: str = "time") -> Plan:
    """Propagate `seeds` (the user's and the search's; with `base`, only the search's, continuing from the
    user's propagation) and build the plan (with program and donation recorded). `layout_cost`: what each op's
    layout choice weighs its reshards by — "time", seconds on the problem's topology; "bytes" sent, as
    `search=False` does without a topology; or "collectives", the seconds without XLA:CPU's relayout copies
    (`SearchReport.layout_cost` says which the chosen plan used)."""
    if layout_cost not in LAYOUT_COSTS:
        raise ShardingError(f"layout_cost={layout_cost!r}: expected one of {LAYOUT_COSTS}")

    prop = base.run(list(seeds)) if base is not None else propagate(problem.graph, mesh_shape(mesh), list(seeds))
    check_ties(problem.graph, prop)
    plan = build_plan(problem.graph, mesh, prop, input_names=problem.input_names,
                      output_names=problem.output_names, warnings=list(problem.warnings),
                      price=None if problem.topology is None or layout_cost == "bytes" else
                      topology_pricer(as_topology(problem.topology), mesh_shape(mesh),
                                      copies=layout_cost != "collectives"))
    return dataclasses.replace(plan, program=problem.program, donated=tuple(problem.donated))


def _shared_base(graph: Graph, sizes: dict[str, int], user_seeds: Sequence[Seed]) -> tuple[UserPropagation, dict]:
    """The user's propagation and the plan memos (per reshard pricer's key) for these axis sizes, shared by the
    meshes that only order the same axes differently (propagation and plans depend on the sizes and on which
    topology levels each axis spans, not on the order). Kept on the graph."""
    cache: dict = graph.analysis("search_bases", dict)
    try:
        key = (tuple(sorted(sizes.items())), tuple(user_seeds))
        hash(key)
    except TypeError:  # an unhashable cause: not shared
        return UserPropagation(graph, sizes, user_seeds), {}
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (UserPropagation(graph, sizes, user_seeds), {})
    return hit


class Evaluator:
    """Scores assignments of one Space (memoised); keeps one Simulator for delta simulation."""

    def __init__(self, problem: Problem, mesh: Mesh, space: Space, user_seeds: Sequence[Seed]) -> None:
        self.problem, self.mesh, self.space = problem, mesh, space
        self.user_seeds = list(user_seeds)
        self.topology = as_topology(problem.topology)
        sizes = mesh_shape(mesh)
        mapping = self.topology.map_mesh(sizes)
        # (the graph's own ProgramInfo for every plan: one per plan's per-device shapes costs ~3x the search time;
        # the chosen plan is simulated with them, `shardc.cost.device_shapes`)
        self.sim = Simulator(problem.graph, self.topology, mapping, sizes, device_shapes=False)
        self.price = topology_pricer(self.topology, sizes, mapping)
        self.limit = problem.memory_limit if problem.memory_limit is not None else self.topology.device.memory
        self.cache: dict[Assignment, Score] = {}
        self._base: UserPropagation | None = None
        self._builder: PlanBuilder | None = None
        self._touched: set[int] | None = None  # values the last built propagation wrote (beyond the base)
        self.evaluations = 0

    def plan(self, assignment: Assignment) -> Plan:
        return self.plan_with(seeds_for(self.space, assignment, self.user_seeds))

    def user_propagation(self) -> UserPropagation:
        """The propagation of the user's seeds every plan of this evaluator continues from (shared by the
        meshes with the same axis sizes); `run([])` of it is `propagate(graph, mesh, user_seeds)`."""
        if self._base is None:
            self._base = _shared_base(self.problem.graph, mesh_shape(self.mesh), self.user_seeds)[0]
        return self._base

    def plan_with(self, extra: Sequence[Seed]) -> Plan:
        """The plan of the user's seeds plus `extra` (priority >= 1)."""
    
        pr = self.problem
        if self._builder is None:
            self._base, memos = _shared_base(pr.graph, mesh_shape(self.mesh), self.user_seeds)
            self._builder = PlanBuilder(pr.graph, self.mesh, input_names=pr.input_names,
                                        output_names=pr.output_names, warnings=list(pr.warnings),
                                        memo=memos.setdefault(self.price.key, {}), price=self.price)
        prop = self._base.run(list(extra))
        check_ties(pr.graph, prop)
        # Incremental: only values this or the last propagation wrote can differ from the last build's.
        touched = set(self._base.p.touched)
        plan = self._builder.build(prop, None if self._touched is None else touched | self._touched)
        self._touched = touched
        return dataclasses.replace(plan, program=pr.program, donated=tuple(pr.donated))

    def score_plan(self, plan: Plan) -> tuple[Score, Any]:
        self.evaluations += 1
        r = self.sim.delta(plan, tuple(self.problem.donated))
        peak = float(r.peak_memory)
        return Score(float(r.step_time), peak, float(sum(r.comm_bytes.values())), peak <= self.limit), r

    def score(self, assignment: Assignment) -> Score:
        s = self.cache.get(assignment)
        if s is None:
            try:
                s = self.score_plan(self.plan(assignment))[0]
            except ShardingError:
                s = INVALID
            self.cache[assignment] = s
        return s
