"""The search driver: for each candidate mesh, score the baselines, run DP and/or MCMC from them, and keep
the fastest plan that fits in memory. Also plan save/load (JSON)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
import warnings
from typing import Any, Mapping, Sequence

import jax

from annotations.errors import ShardingError
from shardc.distributed import plan_digest
from shardc.gc_pause import paused_gc
from shardc.plan import Plan, abstract_mesh
from shardc.propagate import Seed
from shardc.report import format_bytes
from shardc.search.baselines import BASELINES
from shardc.search.budget import MESH_SETUP_UNITS, Budget, full_plan_units, plan_seconds
from shardc.search.compare import GroupNote
from shardc.search.evaluate import Problem, Score, plan_from_seeds
from shardc.search.mesh_work import Considered, MeshWork
from shardc.search.space import SEARCH_CAUSE, Assignment, Space, project_plan
from shardc.search.workers import Job, MeshPool, WorkerLost, can_fork, default_workers
from shardc.sharding import make_mesh

__all__ = ["SearchReport", "search_plan", "save_plan", "load_plan", "graph_key", "NoPlanFits"]


class NoPlanFits(ShardingError):
    """No plan the search found fits in device memory; `smallest_peak` and `limit` are bytes per device."""

    def __init__(self, smallest_peak: float, limit: float, note: str = "") -> None:
        self.smallest_peak, self.limit = smallest_peak, limit
        super().__init__(f"no plan fits in device memory: the smallest simulated peak found is "
                         f"{format_bytes(smallest_peak)} per device (limit {format_bytes(limit)}){note}; use more "
                         f"devices, a smaller batch, or donate the state")


# A searched plan replaces the fastest of the user's hints and the baselines only when it simulates faster by more
# than this fraction: below it the simulator's error decides (on XLA:CPU a searched Flax Gemma plan with 17 more
# all-to-alls simulated 0.24% faster than the hints' plan and ran 5% slower; docs/search.md).
SEARCH_MARGIN = 0.01


SEARCHED = ("search", "search+pcg")  # candidates the search built (the others: the hints and the baselines)


def _beats(name: str, score: Score, best_name: str, best: Score) -> bool:
    """Whether candidate `name` scoring `score` replaces the best so far (`best_name`, `best`): a plan the
    search built must gain `SEARCH_MARGIN` over the hints and baselines, not over another searched plan (a
    searched plan against a rewritten one: the faster)."""
    if name in SEARCHED and best_name not in SEARCHED and score.feasible and best.feasible:
        return score.time < best.time * (1 - SEARCH_MARGIN)
    return score.key < best.key


@dataclasses.dataclass
class Candidate:
    name: str
    mesh: dict[str, int]
    score: Score


@dataclasses.dataclass
class SearchReport:
    """What the search tried and why the chosen plan won (shown by `plan.explain()`)."""

    chosen: Candidate
    baselines: list[Candidate]
    meshes: list[dict[str, int]]
    evaluations: int
    seconds: float
    method: str
    seeds: tuple[Seed, ...] = ()
    plan_budget: int | None = None  # the deterministic allowance of simulated plans (None: unbounded)
    capped: bool = False  # the wall-clock cap stopped the search first: a rerun may choose differently
    candidate_meshes: int = 0  # meshes scored + those the budget left unscored (`meshes` lists those scored)
    user_hinted: bool = True  # whether the program had hints (in-program or metadata) on its first mesh
    topology: str = ""  # what the plans were priced on, and why (set by @shardc.auto)
    groups: tuple[GroupNote, ...] = ()  # the chosen plan's heaviest decision groups and what they beat
    layout_cost: str = "time"  # what the chosen plan's ops weighed reshards by (`plan_from_seeds`)
    searched: Candidate | None = None  # the fastest searched plan, also when it did not win (`SEARCH_MARGIN`)

    def summary(self) -> str:
        per_name: dict[str, Candidate] = {}
        for c in self.baselines:  # each baseline on its best mesh
            if c.name not in per_name or c.score.key < per_name[c.name].score.key:
                per_name[c.name] = c
        rows = [self.chosen] + sorted((c for c in per_name.values() if c is not self.chosen), key=lambda c: c.score.key)
        of = f" of {self.candidate_meshes}" if self.candidate_meshes > len(self.meshes) else ""
        lines = [f"strategy search ({self.method}): {self.evaluations} simulated plans over {len(self.meshes)}{of} "
                 f"mesh shape(s) in {self.seconds:.1f} s"
                 + (f" (budget {self.plan_budget} plans)" if self.plan_budget is not None else "")]
        if of:
            lines.append(f"  the plan budget scored the baselines on {len(self.meshes)} of the {self.candidate_meshes} "
                         f"candidate meshes (in the order of docs/search.md); raise budget_s to score more")
        if self.capped:
            lines.append("  stopped by the time cap (time_cap_s) before its plan budget was spent: a rerun may choose "
                         "another plan (without time_cap_s the same seed gives the same plan)")
        w = max(len(c.name) for c in rows)
        for c in rows:
            mesh = ",".join(f"{a}={n}" for a, n in c.mesh.items())
            s = c.score
            t = f"{s.time * 1e3:.3f} ms" if math.isfinite(s.time) else "n/a"
            fit = "" if s.feasible else "  (does not fit memory)"
            lines.append(f"  {c.name.ljust(w)}  mesh({mesh})  time {t}  peak {format_bytes(s.peak)}  "
                         f"comm {format_bytes(s.comm)}{fit}")
        best_base = min((c for c in self.baselines if c.score.feasible), key=lambda c: c.score.time, default=None)
        if best_base is not None and self.chosen.name == "search" and best_base.score.time <= self.chosen.score.time:
            lines.append(f"  chosen: the searched plan, as fast as the best baseline ({best_base.name})")
        elif best_base is not None and self.chosen.name == "search":
            lines.append(f"  chosen: the searched plan, {best_base.score.time / self.chosen.score.time:.2f}x the speed of "
                         f"the best baseline ({best_base.name})")
        elif best_base is not None and self.chosen.name == "search+pcg":
            lines.append(f"  chosen: the searched plan with its PCG rewritten by proved rules, "
                         f"{best_base.score.time / self.chosen.score.time:.2f}x the speed of the best baseline "
                         f"({best_base.name})")
        elif self.chosen.name not in ("search", "search+pcg"):
            what = ("the hints baseline: the program has no hints, so this is plain propagation (every tensor "
                    "replicated)" if self.chosen.name == "hints" and not self.user_hinted
                    else _HINTS_PLANNED.get(self.chosen.name, f"the {self.chosen.name} baseline"))
            s = self.searched
            if s is not None and s.score.feasible and s.score.time < self.chosen.score.time:
                lines.append(f"  chosen: {what}; the search's fastest plan simulated "
                             f"{1 - s.score.time / self.chosen.score.time:.2%} faster ({s.score.time * 1e3:.3f} ms), "
                             f"under the {SEARCH_MARGIN:.0%} a searched plan must gain to replace the hints and "
                             f"baselines (the simulator's error is larger there)")
            else:
                lines.append(f"  chosen: {what} (the search found nothing faster"
                             + (" on the meshes it searched)" if of else ")"))
        return "\n".join(lines)


def _mesh_of(sizes: Mapping[str, int]):
    """A mesh of this host's devices, or a mesh shape without devices when it needs more than the host has
    (the plan can then be simulated and inspected, not run)."""
    n = math.prod(sizes.values())
    if n > len(jax.devices()):
        return abstract_mesh(sizes)
    return make_mesh(dict(sizes), jax.devices()[:n])


def project(space: Space, plan: Plan) -> Assignment:
    """The point of the space that reproduces `plan` (a baseline): see `space.project_plan`."""
    return project_plan(space, plan)


def _search_plan(problem: Problem, meshes: Sequence[Mapping[str, int]], *, method: Any = True,
                budget_s: float | None = 30.0, seed: int = 0, max_steps: int = 2000, progress: bool | None = None, max_meshes: int = 2,
                baselines: Sequence[str] = tuple(BASELINES), time_cap: bool | float | None = None,
                workers: int | None = None) -> tuple[Plan, SearchReport]:
    """Search every mesh in `meshes` and return the best plan (fits memory, lowest simulated step time)
    with its report. `method`: True (DP then MCMC), "dp", "mcmc", "baselines" (no search: the fastest
    baseline, e.g. to screen many programs cheaply). The baselines are scored on the meshes
    in order (on every mesh when the budget allows, at least `max_meshes`); the search then runs on the
    `max_meshes` meshes whose best baseline is fastest.

    `budget_s` becomes a number of simulated plans (`shardc.search.budget`), so the result is the same on
    every run for a seed, however busy the machine. `time_cap` (off by default) also stops the search on
    the clock: at `budget_s` when True, at `time_cap` seconds when a number (flagged in the report: a
    rerun may differ). With budget_s=None, `max_steps` alone bounds MCMC and every mesh is scored.

    `workers`: processes that score the meshes (`shardc.search.workers`; None: `default_workers()` when the
    work repays a fork); the result is the same with any number."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    n_devices = math.prod(dict(meshes[0]).values()) if meshes else 1
    budget = Budget.for_search(budget_s, problem.graph, n_devices, cap=time_cap)
    work = MeshWork(problem, baselines, method, n_devices)
    jobs: dict[int, Job | ShardingError] = {}

    def job(i: int) -> Job | ShardingError:
        """Mesh `i`, made, with the user's seeds on it (or why the hints do not fit it)."""
        if i not in jobs:
            sizes = dict(meshes[i])
            mesh = _mesh_of(sizes)
            try:
                user = problem.seeds_on(mesh)
                jobs[i] = (i, sizes, mesh, user)
            except ShardingError as e:
                jobs[i] = e
        return jobs[i]

    pool = MeshPool(work)
    bar = tqdm(desc="shardc search", unit="plan", disable=(None if progress is None else not progress), leave=False)
    try:
        return _search(problem, meshes, pool, job, budget, t0, bar, method=method, seed=seed, max_steps=max_steps,
                       max_meshes=max_meshes, workers=_worker_limit(workers, problem, meshes, budget),
                       forced=workers is not None)
    except WorkerLost as e:
        pool.close()
        warnings.warn(f"shardc: {e}\nsearching again in this process alone (the same plan, more slowly)",
                      RuntimeWarning, stacklevel=3)
        return _search_plan(problem, meshes, method=method, budget_s=budget_s, seed=seed, max_steps=max_steps,
                            progress=progress, max_meshes=max_meshes, baselines=baselines, time_cap=time_cap,
                            workers=1)
    finally:
        bar.close()
        pool.close()


# Forked workers score the meshes when the baselines of the meshes after the first take this long: as estimated
# from the program's size (`budget.plan_seconds`, the reference machine) before the first, else as the first took.
_FORK_WORTH_S = 0.5


def _worker_limit(workers: int | None, problem: Problem, meshes: Sequence[Mapping[str, int]], budget: Budget) -> int:
    """How many processes may score the meshes (`workers`, or `default_workers()`): 1 with a wall-clock cap
    (what it stops must not depend on how the work was split) or when a child may not run this problem's
    simulation (`can_fork`)."""
    if len(meshes) < 2 or budget.cap_s is not None or (workers is not None and workers <= 1):
        return 1
    if not can_fork(problem.topology):
        return 1
    return default_workers() if workers is None else workers


def _phase_one_estimate(problem: Problem, meshes: Sequence[Mapping[str, int]], baselines: int) -> float:
    """Seconds the reference machine takes to score the baselines of every mesh after the first."""
    n = math.prod(dict(meshes[0]).values())
    return (len(meshes) - 1) * (MESH_SETUP_UNITS + baselines * full_plan_units(n)) * plan_seconds(
        len(problem.graph.ops), n)


def _search(problem: Problem, meshes: Sequence[Mapping[str, int]], pool: MeshPool, job: Any, budget: Budget,
            t0: float, bar: Any, *, method: Any, seed: int, max_steps: int, max_meshes: int, workers: int,
            forced: bool) -> tuple[Plan, SearchReport]:
    """`_search_plan`'s decisions, over the mesh work of `pool` (see there). The meshes are spread over
    `workers` processes at once when `forced` or when the program's size says their baselines repay a fork
    (`_FORK_WORTH_S`), else after the first mesh if it took that long times the meshes left: the seconds
    decide only who does the work, never what is decided."""
    method_name = {True: "dp+mcmc", "dp": "dp", "mcmc": "mcmc", "baselines": "baselines only"}.get(method, str(method))
    best: tuple[Score, Candidate, Considered, int, int, Plan | None] | None = None
    cands: list[Candidate] = []
    smallest_peak = math.inf
    searched: Candidate | None = None
    rewritten: dict[bytes, Any] = {}  # plan digest -> the PCG choice made for that plan

    def consider(rec: Considered, index: int, plan: Plan | None = None, name: str | None = None,
                 score: Score | None = None) -> None:
        """Weigh a plan mesh `index`'s work made (`plan`: a rewritten one made here instead). (Its handle is
        kept with the process holding it now: a mesh searched elsewhere than it was scored keeps its baselines'
        plans where they were made.)"""
        nonlocal best, smallest_peak, searched
        name, score = name or rec.name, score or rec.score
        smallest_peak = min(smallest_peak, score.peak)
        c = Candidate(name, dict(rec.sizes), score)
        if name != "search":
            cands.append(c)
        elif searched is None or score.key < searched.score.key:
            searched = c
        if best is None or _beats(name, score, best[1].name, best[0]):
            best = (score, c, rec, index, pool.process_of(index), plan)

    # Phase 1: every baseline on every mesh (while the budget allows, at least max_meshes).
    states: list[tuple[tuple, int, int, float]] = []  # best key, order, mesh index, memory limit
    tried: list[dict[str, int]] = []
    scored: list[int] = []  # the meshes whose work counts
    first_s = 0.0  # seconds the first of them took
    not_started = 0  # meshes the budget left unscored
    hinted = False  # any user hint on a mesh scored
    hint_error: str | None = None  # why the first mesh that rejected the hints did
    if workers > 1 and (forced or _phase_one_estimate(problem, meshes, len(pool.work.baselines)) >= _FORK_WORTH_S):
        pool.spread([r for r in map(job, range(len(meshes))) if not isinstance(r, ShardingError)], workers)
    for i in range(len(meshes)):
        if budget.plans is not None and len(states) >= max_meshes and (3 * budget.spent >= 2 * budget.plans
                                                                       or budget.out_of_time()):
            not_started = len(meshes) - i
            break  # 2/3 of the budget is spent on baselines: search the meshes scored so far (at least max_meshes)
        j = job(i)
        if isinstance(j, ShardingError):
            hint_error = hint_error or f"on {dict(meshes[i])}: {j}"
            continue  # the hints do not fit this mesh
        _, sizes, _, user = j
        if workers > 1 and scored and not pool.spread_done:  # (from the second mesh scored on)
            rest = [r for r in map(job, range(i, len(meshes))) if not isinstance(r, ShardingError)]
            if first_s * len(rest) >= _FORK_WORTH_S:
                pool.spread(rest, workers, here_first=False)
        tried.append(sizes)
        hinted = hinted or bool(user)
        t = time.perf_counter()
        res = pool.scored(j)
        if not scored:
            first_s = time.perf_counter() - t
        scored.append(i)
        for units in res.charges:
            budget.charge(units)
        bar.update(res.progress)
        for rec in res.considered:
            consider(rec, i)
        states.append((res.top, len(states), i, res.limit))
    pool.stop_scoring()
    # Phase 2: search the most promising meshes (by their best baseline), each with an equal share of what is
    # left of the budget, decided before any of them runs (so they may run at once: shardc.search.workers).
    states.sort(key=lambda st: (st[0], st[1]))
    states = states[:max_meshes] if method != "baselines" else []  # ("baselines": the best of phase 1)
    share = budget.left / len(states) if states else 0.0  # plans for each mesh
    searches = pool.search([st[2] for st in states], job, share, budget, seed, max_steps)
    for (_, _, i, _), res in zip(states, searches):
        bar.update(res.progress)
        for units in res.charges:
            budget.charge(units)
        budget.capped = budget.capped or res.capped
        for rec in res.considered:
            consider(rec, i)
        if res.final is not None:
            rec = res.final
            plan = None
            if problem.pcg and rec.score.feasible:  # this mesh's best, its PCG rewritten (`MeshWork.search`)
                plan = pool.call(i, "plan", rec.plan_id)
                if plan.pcg is not None:
                    rewritten[plan_digest(plan)] = plan.pcg
                else:
                    plan = None
            consider(rec, i, plan)
            if plan is not None and plan.pcg is not None and plan.pcg.chosen:
                ch = plan.pcg
                consider(rec, i, plan, "search+pcg", Score(ch.time, ch.peak, ch.comm, True))
    limit = states[0][3] if states else math.inf
    if best is None:
        raise ShardingError(f"strategy search: no mesh of {[dict(m) for m in meshes]} accepts the program's hints"
                            + (f" ({hint_error})" if hint_error is not None else ""))
    score, chosen, rec, index, process, plan = best
    if not score.feasible:
        raise NoPlanFits(smallest_peak, limit)
    if plan is None:
        plan = pool.call_on(process, "plan", rec.plan_id)
    if plan.pcg is None and rewritten:  # a baseline or the hints with a searched plan's layouts: its rewriting
        plan = dataclasses.replace(plan, pcg=rewritten.get(plan_digest(plan)))
    groups = () if method == "baselines" else \
        pool.call(index, "groups", index, rec.point, dataclasses.replace(plan, pcg=None), score.time)  # (the layouts)
    report = SearchReport(chosen, cands, tried, pool.evaluations(scored), time.perf_counter() - t0, method_name,
                          rec.extra, budget.plans, budget.capped, len(tried) + not_started, hinted, groups=groups,
                          layout_cost=rec.layout_cost, searched=searched)
    return dataclasses.replace(plan, search=report), report


HINTS_BY_BYTES = "hints (bytes)"  # the candidate that is exactly the search=False plan
# What each candidate of the user's hints planned with another op-layout pricing is (`MeshWork.score`), for the
# summary.
_HINTS_PLANNED = {
    HINTS_BY_BYTES: "the hints as search=False plans them (each op's layout chosen by the bytes it sends)",
    "hints (collectives)": "the hints with each op's layout chosen by its collectives' time, without XLA:CPU's "
                           "relayout copies",
}


@functools.wraps(_search_plan)
def search_plan(*args: Any, **options: Any) -> tuple[Plan, SearchReport]:
    with paused_gc():  # the search allocates much over a large live heap: see paused_gc
        return _search_plan(*args, **options)


# -- save / load ----------------------------------------------------------------------------------------
def graph_key(graph: Any) -> str:
    """A fingerprint of the traced program (primitives, shapes, dtypes, wiring)."""
    h = hashlib.sha256()
    for v in graph.values:
        h.update(f"{v.shape}{v.dtype};".encode())
    for op in graph.ops:
        h.update(f"{op.primitive}{op.inputs}{op.outputs};".encode())
    return h.hexdigest()[:20]


def hints_key(seeds: Sequence[Seed]) -> str:
    """A fingerprint of the user's hints as seeds (in-program hints and Flax metadata, on one mesh): the
    program's fingerprint does not see a hint's axes."""
    h = hashlib.sha256()
    for s in sorted(seeds, key=lambda s: (s.value, repr(s.dims), s.priority)):
        h.update(f"{s.value}{s.dims}{s.priority};".encode())
    return h.hexdigest()[:20]


def save_plan(plan: Plan, path: str, topology: str | None = None, hints: Sequence[Seed] | None = None) -> None:
    """Write the decisions behind a searched plan (mesh + search seeds, the topology it was searched for
    and, when given, the fingerprint of the user's hints on its mesh) as JSON, atomically. A file keeps one
    plan per traced program and hints (a step called with several batch shapes is several programs; arguments
    placed in other layouts are other hints): this plan is added to those already in `path`, replacing one for
    the same program and hints."""
    report = getattr(plan, "search", None)
    seeds = report.seeds if report is not None else ()
    entry = {"graph": graph_key(plan.graph), "mesh": plan.mesh_sizes, "topology": topology,
             "hints": None if hints is None else hints_key(hints),
             "layout_cost": getattr(report, "layout_cost", "time"),
             "seeds": [{"value": s.value, "dims": [None if d is None else list(d) for d in s.dims],
                        "cause": s.cause.description, "priority": s.priority} for s in seeds]}
    try:
        plans = _saved_plans(path) if os.path.exists(path) else {}
    except ShardingError:
        plans = {}  # not a plan file: replaced
    plans[f"{entry['graph']}/{entry['hints']}"] = entry  # one plan per program and hints
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"version": 2, "plans": plans}, f, indent=1)
    os.replace(tmp, path)  # a run stopped while saving leaves the old file or none, never half of one


def _saved_plans(path: str) -> dict[str, dict]:
    """The plans in a plan file, by program and hints fingerprints (version 1 files hold one)."""
    try:
        with open(path) as f:
            data = json.load(f)
        plans = data["plans"] if data.get("version") == 2 else {f"{data['graph']}/{data.get('hints')}": data}
        for entry in plans.values():
            entry["mesh"], entry["seeds"]  # noqa: B018 (a plan has both)
        return plans
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ShardingError(f"{path} is not a plan file shardc saved ({type(e).__name__}: {e}); delete it to "
                            f"search again") from None


def load_plan(path: str, problem: Problem, *, mesh: Mapping[str, int] | None = None,
              topology: str | None = None, missing_ok: bool = False) -> Plan | None:
    """Rebuild the plan saved for this program and its hints — and, when given, the same mesh (axis order
    included) and topology; otherwise a ShardingError saying what differs (`missing_ok`: None when the file
    has no plan for this program and hints, which the caller then searches and adds)."""
    from shardc.propagate import Cause

    program = graph_key(problem.graph)
    plans = [e for e in _saved_plans(path).values() if e["graph"] == program]
    if not plans:
        if missing_ok:
            return None
        raise ShardingError(f"the plans saved in {path} were made for a different program (this one's graph "
                            f"fingerprint: {program}); delete it to search again")
    error: ShardingError | None = None
    for data in plans:
        if mesh is not None and list(data["mesh"].items()) != list(mesh.items()):
            raise ShardingError(f"saved plan {path} was made for mesh {data['mesh']}, this call's mesh is "
                                f"{dict(mesh)}; pass that mesh, or delete the file to search again")
        if topology is not None and data.get("topology") not in (None, topology):
            raise ShardingError(f"saved plan {path} was searched for topology {data['topology']!r}, this call plans "
                                f"for {topology!r}; delete the file to search again")
        on = _mesh_of(data["mesh"])
        try:
            user = problem.seeds_on(on)
        except ShardingError as e:
            if data.get("hints") is None:
                raise
            error = ShardingError(f"saved plan {path} was made for other hints: on its mesh {data['mesh']} this "
                                  f"program's hints fail ({e}); delete the file to search again")
            continue
        if data.get("hints") not in (None, hints_key(user)):
            error = ShardingError(f"saved plan {path} was made for other hints (a hint, the Flax partitioning "
                                  f"metadata or an argument's placement differs); delete it to search again")
            continue
        mesh = on
        break
    else:
        if missing_ok:
            return None
        raise error
    extra = [Seed(s["value"], tuple(None if d is None else tuple(d) for d in s["dims"]),
                  Cause(SEARCH_CAUSE.kind, s.get("cause", SEARCH_CAUSE.description)), int(s.get("priority", 1)))
             for s in data["seeds"]]
    return plan_from_seeds(problem, mesh, user + extra, layout_cost=data.get("layout_cost", "time"))
