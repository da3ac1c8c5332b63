"""The search's work on one candidate mesh: score the baselines there (phase 1) and search from them (phase 2).

`MeshWork` keeps, per mesh, its evaluator, the baselines' plans and choices, and every plan it made (by a
small integer handle), and hands back only what the driver decides with: scores, the seeds and search
points that rebuild a plan, and the plan-budget units spent. The driver (`shardc.search.driver`) decides
which meshes are scored, which are searched and with how many plans; it may give meshes to `MeshWork`s in
other processes (`shardc.search.workers`), which is why the results are plain values and handles.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from annotations.errors import ShardingError
from shardc.plan import Plan
from shardc.propagate import Seed
from shardc.search.baselines import (COMPUTE_OF, baseline_seeds, consistent_carry, role_mixes, state_inputs,
                                     storage_mixes)
from shardc.search.budget import MESH_SETUP_UNITS, Budget, full_plan_units
from shardc.search.compare import GroupNote, compare_groups
from shardc.search.dp import sp_dp
from shardc.search.evaluate import INVALID, Evaluator, Problem, Score, plan_from_seeds
from shardc.search.mcmc import mcmc
from shardc.search.polish import polish
from shardc.search.space import (Assignment, build_space, mixing_domains, plan_choices, project_plan, seeds_for,
                                 with_input_layouts)
from shardc.sim import as_topology

__all__ = ["Considered", "MeshScored", "MeshSearched", "MeshWork"]


@dataclasses.dataclass(frozen=True)
class Considered:
    """A plan the driver weighs: its candidate name, mesh, score, the search seeds and point that rebuild it,
    the op-layout pricing it was planned with, and its handle in the `MeshWork` that made it."""

    name: str
    sizes: Mapping[str, int]
    score: Score
    extra: tuple[Seed, ...]
    point: Assignment | None
    layout_cost: str
    plan_id: int


@dataclasses.dataclass
class MeshScored:
    """Phase 1 on one mesh: the plans weighed in order, the plan-budget units spent (each charge, in order, so
    the budget adds them up as the search alone does), progress-bar steps, the best score's key and the mesh's
    memory limit."""

    index: int
    considered: list[Considered]
    charges: list[float]
    progress: int
    top: tuple
    limit: float


@dataclasses.dataclass
class MeshSearched:
    """Phase 2 on one mesh: the plans weighed in order, the mesh's best plan (`final`, None when it does not
    plan), the units spent, progress-bar steps, and whether the wall-clock cap stopped MCMC."""

    considered: list[Considered]
    final: Considered | None
    charges: list[float]
    progress: int
    capped: bool


@dataclasses.dataclass
class _MeshState:
    sizes: dict[str, int]
    user: list[Seed]
    ev: Evaluator
    starts: list[Assignment]
    mixes: list[Assignment]
    seed_sets: dict[str, list[Seed]]
    seed_scores: dict[str, Score]
    plans: dict[str, Plan]
    base_choices: dict[str, Assignment]


class MeshWork:
    """Phase 1 and phase 2 of the search on the meshes given to it, for one problem."""

    def __init__(self, problem: Problem, baselines: Sequence[str], method: Any, n_devices: int) -> None:
        self.problem, self.baselines, self.method, self.n_devices = problem, tuple(baselines), method, n_devices
        self._states: dict[int, _MeshState] = {}
        self._plans: list[Plan] = []

    def keep(self, plan: Plan) -> int:
        """A handle of `plan` (`plan(handle)` gives it back)."""
        self._plans.append(plan)
        return len(self._plans) - 1

    def plan(self, plan_id: int) -> Plan:
        return self._plans[plan_id]

    def evaluations(self, indices: Sequence[int]) -> int:
        """Simulated plans of the meshes `indices` (those of them this MeshWork scored)."""
        return sum(self._states[i].ev.evaluations for i in indices if i in self._states)

    def score(self, index: int, sizes: Mapping[str, int], mesh: Any, user: Sequence[Seed]) -> MeshScored:
        """Phase 1: every baseline (and the user's hints by other op-layout pricings) on mesh `sizes`."""
        problem, graph, n_devices = self.problem, self.problem.graph, self.n_devices
        sizes, user = dict(sizes), list(user)
        out = MeshScored(index, [], [MESH_SETUP_UNITS], 0, INVALID.key, math.inf)

        def consider(name: str, plan: Plan, score: Score, extra: Sequence[Seed], point: Assignment | None = None,
                     layout_cost: str = "time") -> None:
            out.considered.append(Considered(name, sizes, score, tuple(extra), point, layout_cost, self.keep(plan)))
            out.top = min(out.top, score.key)

        # Without search moves ("baselines") the space serves only a baseline computed as another one computes
        # (COMPUTE_OF): built when one is, as it costs much of a pipelined program's baselines-only screen.
        space = None if self.method == "baselines" else build_space(graph, sizes, user)
        ev = Evaluator(problem, mesh, space, user)
        out.limit = ev.limit
        st = self._states[index] = _MeshState(sizes, user, ev, [] if space is None else [space.neutral()], [], {},
                                              {}, {}, {})
        of_name: dict[str, Plan] = {}  # each baseline's plan, for their choices when the space is built late
        scored: dict[tuple, tuple[Plan, Score]] = {}  # baselines that seed alike plan alike: scored once
        state = state_inputs(graph)
        for name in self.baselines:
            try:
                extra = baseline_seeds(name, graph, sizes, user, problem.pipeline)
                if extra is None:
                    continue
                if name in COMPUTE_OF:  # its storage, another baseline's compute: one incremental evaluation
                    if COMPUTE_OF[name] not in of_name:
                        continue
                    if space is None:
                        space = ev.space = build_space(graph, sizes, user)
                        st.base_choices.update((n, plan_choices(space, pl)) for n, pl in of_name.items())
                    point = with_input_layouts(space, st.base_choices[COMPUTE_OF[name]], extra, state)
                    plan = ev.plan(point)
                    score = ev.cache[point] = ev.score_plan(plan)[0]
                    out.progress += 1
                    out.charges.append(1)
                    consider(name, plan, score, tuple(seeds_for(space, point, user)), point)
                    st.plans[name] = of_name[name] = plan
                    st.starts.append(point)
                    st.mixes.append(plan_choices(space, plan))
                    st.base_choices[name] = st.mixes[-1]
                    continue
                key = tuple((s.value, s.dims, s.priority) for s in extra)
                if key in scored:
                    plan, score = scored[key]
                    consider(name, plan, score, extra)
                    of_name[name] = plan
                    if space is not None:
                        st.base_choices[name] = plan_choices(space, plan)
                    continue
                plan = ev.plan_with(extra)
                score = ev.score_plan(plan)[0]
                scored[key] = (plan, score)
            except ShardingError:
                continue
            out.progress += 1
            out.charges.append(full_plan_units(n_devices))
            consider(name, plan, score, extra)
            st.seed_sets[name] = list(extra)
            st.seed_scores[name] = score
            st.plans[name] = of_name[name] = plan
            if space is not None:
                st.starts.append(project_plan(space, plan))
                st.mixes.append(plan_choices(space, plan))
                st.base_choices[name] = st.mixes[-1]
        if "hints" in st.plans and problem.topology is not None:
            for layout_cost in _other_layout_costs(problem):
                other = _hints_by(layout_cost, problem, ev, st.plans["hints"])
                if other is not None:
                    out.progress += 1
                    out.charges.append(full_plan_units(n_devices))
                    consider(f"hints ({layout_cost})", *other, (), None, layout_cost)
        return out

    def search(self, index: int, share: float, budget: Budget, seed: int, max_steps: int) -> MeshSearched:
        """Phase 2 on a scored mesh with `share` plans: role and storage mixes of the baselines, the other
        starts polished, DP (when it fits in half the share), MCMC; the mesh's best plan last."""
        problem, n_devices, method = self.problem, self.n_devices, self.method
        st = self._states[index]
        ev, sizes, user, starts, mixes = st.ev, st.sizes, st.user, st.starts, st.mixes
        out = MeshSearched([], None, [], 0, False)

        def searched(plan: Plan, score: Score, extra: Sequence[Seed], point: Assignment | None = None) -> Considered:
            return Considered("search", sizes, score, tuple(extra), point, "time", self.keep(plan))

        def consider(plan: Plan, score: Score, extra: Sequence[Seed], point: Assignment | None = None) -> None:
            out.considered.append(searched(plan, score, extra, point))

        def step(*_: Any) -> None:
            out.progress += 1

        used0 = ev.evaluations
        # the mixes of the fastest baselines first (the budget may allow only a few)
        ranked = dict(sorted(st.seed_sets.items(), key=lambda kv: st.seed_scores[kv[0]].key))
        roles = role_mixes(problem.graph, ranked)
        if math.isfinite(share):  # role mixes get at most a quarter of the share
            roles = roles[:int(share / 4 / full_plan_units(n_devices))]
        # one baseline's storage of the state with another's compute (the FSDP of the second: storage_mixes)
        storage = storage_mixes(problem.graph, st.plans)
        if math.isfinite(share):  # at most a quarter of the share too
            storage = storage[:int(share / 4)]
        state = set(state_inputs(problem.graph))
        for a, b in storage:
            point = tuple(sa if grp.kind == "input" and grp.members[0] in state else sb
                          for grp, sa, sb in zip(ev.space.groups, st.base_choices[a], st.base_choices[b]))
            if point in ev.cache:
                continue
            try:
                plan = ev.plan(point)
                score = ev.cache[point] = ev.score_plan(plan)[0]
            except ShardingError:
                ev.cache[point] = INVALID
                continue
            step()
            if not consistent_carry(problem.graph, plan):
                continue
            consider(plan, score, seeds_for(ev.space, point, user), point)
            starts.append(point)
            mixes.append(plan_choices(ev.space, plan))
        for _, seeds in roles:
            try:
                plan = ev.plan_with(seeds)
                if not consistent_carry(problem.graph, plan):
                    continue  # the next step would start from another layout: not a steady-state plan
                score = ev.score_plan(plan)[0]
            except ShardingError:
                continue
            step()
            out.charges.append(full_plan_units(n_devices) - 1)  # (the evaluation itself is charged below)
            consider(plan, score, seeds)
            starts.append(project_plan(ev.space, plan))
            mixes.append(plan_choices(ev.space, plan))
        base = min(starts, key=lambda s: (ev.score(s).key, s))
        doms = mixing_domains(ev.space, mixes + [base])  # the DP mixes the baselines per kind of layer
        # each other start polished by single-group moves (a slower baseline may be one move from the best
        # plan): at most a quarter of the share, split evenly between the starts, the fastest first
        others = sorted({s for s in starts if s != base}, key=lambda s: (ev.score(s).key, s))
        for s in others:
            if not math.isfinite(share) or budget.out_of_time():
                break
            starts.append(polish(ev, s, doms, max_evals=int(share / 4 / len(others)), on_eval=step))
        base = min(starts, key=lambda s: (ev.score(s).key, s))
        dp_evals = sum(len(d) - 1 for d in doms) + 10  # its unary pass
        skip_dp = method is True and dp_evals > share / 2  # (DP+MCMC skips a DP that cannot finish in half its share)
        if method in (True, "dp") and not skip_dp and not budget.out_of_time():
            cap = 400 if method is True else 4000
            dp_max = int(min(cap, share / 2 if method is True else share))
            a, _ = sp_dp(ev, base, max_evals=dp_max, deadline=budget.deadline, on_eval=step, domains=doms)
            budget.out_of_time()
            starts.append(a)
        if method in (True, "mcmc") and not budget.out_of_time():
            steps = int(min(max_steps, share - (ev.evaluations - used0)))
            a, _, mc = mcmc(ev, starts, seed=seed, max_steps=max(steps, 1), deadline=budget.deadline, on_step=step,
                            prefer=doms)
            if mc.stopped == "time cap":
                out.capped = True
            starts.append(a)
        out.charges.append(ev.evaluations - used0)
        a = min(starts, key=lambda s: (ev.score(s).key, s))
        extra = tuple(seeds_for(ev.space, a, user))
        try:
            plan = ev.plan(a)
            score = ev.score_plan(plan)[0]
        except ShardingError:
            return out
        if problem.pcg and score.feasible:  # this mesh's best, its PCG rewritten with proved rules (here: the
            plan = with_pcg(problem, plan, score.time)  # meshes' rewritings run at once where searched at once)
        out.final = searched(plan, score, extra, a)
        return out

    def groups(self, index: int, point: Assignment | None, plan: Plan, time: float) -> tuple[GroupNote, ...]:
        """What each heavy decision group of the chosen plan (simulated `time`) beat on its mesh."""
        st = self._states[index]
        return compare_groups(st.ev, point if point is not None else project_plan(st.ev.space, plan), plan, time,
                              st.base_choices)


def with_pcg(problem: Problem, plan: Plan, time: float | None = None) -> Plan:
    """`plan` with the choice of its PCG rewritten by proved rules (`shardc.pcg.choice.choose_pcg`, under the
    problem's simulator and memory limit; `plan.pcg.chosen` when the rewritten PCG is faster); the plan as it
    is when the rewriting cannot build its PCG (a ShardingError: the plan competes as it is). `time`: the plan's
    simulated step as the search scored it (not simulated again)."""
    from shardc.pcg import choice

    try:
        return dataclasses.replace(plan, pcg=choice.choose_pcg(plan, problem.program, problem.topology,
                                                               donated=problem.donated,
                                                               memory_limit=problem.memory_limit, plan_time=time))
    except ShardingError:
        return plan


def _other_layout_costs(problem: Problem) -> tuple[str, ...]:
    """The op-layout pricings the user's hints are also planned with (`_hints_by`): bytes, as `search=False`
    does; on XLA:CPU also the collectives' seconds without the relayout copies (elsewhere that is "time")."""
    return ("bytes", "collectives") if as_topology(problem.topology).backend == "cpu" else ("bytes",)


def _hints_by(layout_cost: str, problem: Problem, ev: Evaluator, hints: Plan) -> tuple[Plan, Score] | None:
    """The user's hints planned with each op's layout weighed by `layout_cost` (`plan_from_seeds`) instead of
    the seconds of its reshards on the topology, when that gives other op layouts than the "hints" baseline:
    scored, so the search never returns a plan simulated slower than these. The per-op choice is greedy and
    the step's simulation sometimes prefers another pricing's: "bytes" is what `search=False` plans (never
    slower than not searching); "collectives" leaves out XLA:CPU's copies around all-gathers of non-major
    dims, which an op pays alone in the pricer where the step shares them (docs/search.md). None when it
    plans the same."""
    try:  # (the user's seeds alone: their propagation is the one the evaluator continues from)
        plan = plan_from_seeds(problem, ev.mesh, [], base=ev.user_propagation(), layout_cost=layout_cost)
    except ShardingError:
        return None
    if plan.strategies == hints.strategies and plan.shardings == hints.shardings:
        return None
    return plan, ev.score_plan(plan)[0]
