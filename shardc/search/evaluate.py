"""The oracle of the search: assignment -> seeds -> propagation -> Plan -> simulated step time and memory."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from jax.sharding import Mesh

from annotations.errors import ShardingError
from shardc.ir.graph import Graph
from shardc.plan import Plan, build_plan
from shardc.propagate import Seed, propagate
from shardc.search.space import Assignment, Space, seeds_for
from shardc.sharding import mesh_shape
from shardc.sim import Simulator, as_topology

__all__ = ["Problem", "Score", "Evaluator", "plan_from_seeds"]


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


def plan_from_seeds(problem: Problem, mesh: Mesh, seeds: Sequence[Seed]) -> Plan:
    """Propagate the user's seeds plus `seeds` and build the plan (with program and donation recorded)."""
    from shardc.auto import _check_ties

    prop = propagate(problem.graph, mesh_shape(mesh), list(seeds))
    _check_ties(problem.graph, prop)
    plan = build_plan(problem.graph, mesh, prop, input_names=problem.input_names,
                      output_names=problem.output_names, warnings=list(problem.warnings))
    return dataclasses.replace(plan, program=problem.program, donated=tuple(problem.donated))


class Evaluator:
    """Scores assignments of one Space (memoised); keeps one Simulator for delta simulation."""

    def __init__(self, problem: Problem, mesh: Mesh, space: Space, user_seeds: Sequence[Seed]) -> None:
        self.problem, self.mesh, self.space = problem, mesh, space
        self.user_seeds = list(user_seeds)
        self.topology = as_topology(problem.topology)
        sizes = mesh_shape(mesh)
        self.sim = Simulator(problem.graph, self.topology, self.topology.map_mesh(sizes), sizes)
        self.limit = problem.memory_limit if problem.memory_limit is not None else self.topology.device.memory
        self.cache: dict[Assignment, Score] = {}
        self.evaluations = 0

    def plan(self, assignment: Assignment) -> Plan:
        return plan_from_seeds(self.problem, self.mesh, self.user_seeds + seeds_for(self.space, assignment, self.user_seeds))

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
