"""Choosing a pipeline: stages, microbatches and schedule, each with the intra-stage strategies the search
finds for it, against the unpipelined search.

`choose_pipeline` enumerates the pipelines a step's layer stack admits on a device count (`candidates`),
and plans the step without a pipeline (the ordinary search). Every candidate is then *screened*: traced and
planned with its baselines only (`search="baselines"`: the baselines on the meshes it implies, each run
inside the stages, `shardc.search.baselines`; with `screen_budget_s`, a small search from them instead),
which costs a trace and a dozen simulations instead of a search. A candidate that only adds work to its
screened sibling with deferred weight gradients (the loop's accumulation, 1F1B's recomputation), when that
sibling's fastest baseline plan fits, is screened only if that sibling could be a finalist
(`shardc.pipeline.bound`). A candidate whose traced program has a floor (`shardc.pipeline.floor`: seconds no
plan of it simulates below) above the step time of a plan in hand that fits is neither screened nor searched:
it could not be chosen (its siblings are then bounded by it, as by a screened sibling). The `finalists`
best screened candidates get the full search (`budget_s`) unless their floor is above the best plan by then,
and the fastest plan that fits memory wins. The
screen also scores `megatron-3d` (Megatron inside each stage, the stages over the slowest level: Megatron-LM's
3-D parallelism) on every candidate. The candidates share their layer stack, tracing mesh and traced
programs (`shardc.pipeline.reuse`: a finalist's search plans the program its screen traced).

It is an outer enumeration around the search, not one joint search space.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from typing import Any, Callable, Iterator

import jax
from tqdm.auto import tqdm

from annotations import provisional_mesh
from annotations.errors import ShardingError
from shardc.gc_pause import frozen_heap, paused_gc
from shardc.pipeline.bound import bounding_sibling, fastest_baseline_fits
from shardc.pipeline.floor import floor_applies, step_floor
from shardc.pipeline.forked import ForkedScreens
from shardc.pipeline.jit import stack_of
from shardc.pipeline.reuse import SharedTraces
from shardc.search.baselines import BASELINES
from shardc.search.budget import MESH_SETUP_UNITS, full_plan_units, plan_seconds
from shardc.search.driver import NoPlanFits
from shardc.search.workers import can_fork, default_workers
from shardc.search import idle
from shardc.pipeline.value import Pipeline
from shardc.sharding import make_mesh
from shardc.waste import IdleDevicesWarning

__all__ = ["Choice", "PipelineChoice", "candidates", "choose_pipeline"]


@dataclasses.dataclass(frozen=True)
class Choice:
    """One scored plan: `name` ("unpipelined"; "screened" or "pipelined" — a candidate after the screen or
    the full search —; a baseline's name, e.g. "megatron-3d"), its pipeline (None unpipelined), mesh,
    simulated step time (s) and peak (bytes per device), and whether it fits."""

    name: str
    pipeline: Pipeline | None
    mesh: dict[str, int]
    time: float
    peak: float
    feasible: bool

    def describe(self) -> str:
        what = self.pipeline.describe() if self.pipeline is not None else "no pipeline"
        fits = "" if self.feasible else " (does not fit)"
        return f"{self.name:<12} {self.time * 1e3:9.2f} ms{fits}  peak {self.peak / 2**30:6.1f} GiB  {self.mesh}  {what}"


@dataclasses.dataclass(frozen=True)
class PipelineChoice:
    """What `choose_pipeline` scored, in order (`Choice` rows), and what it chose; `Plan.pipeline_choice`."""

    choices: tuple[Choice, ...]
    chosen: Pipeline | None

    def summary(self, top: int = 4) -> str:
        """The chosen plan against the unpipelined search and the fastest other pipelines that fit."""
        rows = self.choices
        planned = [c for c in rows if c.name in ("screened", "pipelined")]
        unpiped = next((c for c in rows if c.name == "unpipelined"), None)
        screened = sum(c.name == "screened" for c in rows)
        failed = sum(c.name.startswith("error") for c in rows)
        bounded = sum(c.name == "bounded" for c in rows)
        floored = len({c.pipeline for c in rows if c.name == "floored"} - {c.pipeline for c in planned})
        head = (f"pipelines considered: {screened + failed + bounded + floored} candidates ({screened} screened, "
                f"{sum(c.name == 'pipelined' for c in rows)} searched in full, {failed} could not be planned"
                + (f", {bounded} not screened: bounded by a faster sibling" if bounded else "")
                + (f", {floored} not screened: their floor is above a plan in hand" if floored else "") + ")")
        lines = [head]
        if unpiped is not None:
            mark = "chosen" if self.chosen is None else "      "
            lines.append(f"  {mark} " + (f"{unpiped.time * 1e3:9.2f} ms  no pipeline (the unpipelined search)"
                                         if unpiped.feasible else
                                         f"no pipeline: no plan fits ({unpiped.peak / 2**30:.1f} GiB at best)"))
        best: dict[Pipeline, Choice] = {}
        for c in planned:
            if c.feasible and (c.pipeline not in best or c.time < best[c.pipeline].time):
                best[c.pipeline] = c
        for c in sorted(best.values(), key=lambda c: c.time)[:top]:
            mark = "chosen" if c.pipeline == self.chosen else "      "
            lines.append(f"  {mark} {c.time * 1e3:9.2f} ms  {c.pipeline.describe()}")
        return "\n".join(lines)


def candidates(devices: int, layers: int, batch: int, max_stages: int = 8) -> Iterator[Pipeline]:
    """Pipelines of a `layers`-deep stack and a batch of `batch` on `devices` devices: stages dividing both,
    1 to 64 data shards (powers of two), microbatches 1, 2, 4 or 8 times the stages (each a whole number of
    rows per shard), gpipe and 1f1b, and circular with 2, 3 or 4 repeats where the layers allow; gpipe and
    circular also with the weight gradients deferred past the loop (`defer_wgrad`)."""
    for stages in range(2, max_stages + 1):
        if layers % stages or devices % stages:
            continue
        for shards in (1, 2, 4, 8, 16, 32, 64):
            if devices % (stages * shards):
                continue
            data = ("data",) if shards > 1 else ()
            for micro in (stages, 2 * stages, 4 * stages, 8 * stages):
                if micro > batch or batch % micro or (batch // micro) % shards:
                    continue
                for schedule, defer in (("gpipe", True), ("gpipe", False), ("1f1b", False)):  # (`_sibling` order)
                    yield Pipeline(stages, micro, schedule, data=data, shards=shards, defer_wgrad=defer)
                for repeats in (2, 3, 4):
                    if micro == stages and layers % (repeats * stages) == 0:
                        for defer in (True, False):
                            yield Pipeline(stages, micro, "circular", repeats=repeats, data=data, shards=shards,
                                           defer_wgrad=defer)


def _choice(name: str, plan: Any, pipeline: Pipeline | None) -> Choice:
    c = plan.cost
    return Choice(name, pipeline, dict(plan.mesh_sizes), c.step_time, c.peak_memory, c.fits)


def _baseline_choices(plan: Any, names: tuple[str, ...]) -> list[Choice]:
    """The named baselines a plan's search scored, each on its best mesh."""
    best: dict[str, Any] = {}
    for b in plan.search.baselines if plan.search is not None else ():
        if b.name in names and (b.name not in best or b.score.key < best[b.name].score.key):
            best[b.name] = b
    return [Choice(n, plan.pipeline, dict(b.mesh), b.score.time, b.score.peak, b.score.feasible)
            for n, b in best.items()]


def _quiet_candidates(fn: Callable) -> Callable:
    """`fn` with the IdleDevicesWarning of the plans it weighs silenced: a candidate's idle mesh axis is no news
    (the step that runs the chosen plan warns of its own)."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IdleDevicesWarning)
            return fn(*args, **kwargs)

    return quiet


def _with_idle_work(fn: Callable) -> Callable:
    """`fn` inside `shardc.search.idle.idle_work()`: the searches it runs may do the candidates' traces it
    queues there (`idle.current()`) while they wait for their workers."""

    @functools.wraps(fn)
    def with_queue(*args: Any, **kwargs: Any) -> Any:
        with idle.idle_work():
            return fn(*args, **kwargs)

    return with_queue


@_quiet_candidates
@_with_idle_work
def choose_pipeline(step: Callable, args: tuple, *, topology: Any, budget_s: float | None, pipeline: bool = True,
                    pipelines: list[Pipeline] | None = None, plan_for: Callable | None = None,
                    screen_budget_s: float | None = None, finalists: int = 2,
                    on_choice: Callable[[Choice], None] | None = None, prune_siblings: bool = False,
                    bound_siblings: bool = True, floors: bool = True, progress: bool | None = None,
                    **options: Any) -> tuple[Any, list[Choice]]:
    """The fastest plan that fits, over the unpipelined search and (with `pipeline=True`) the pipelines of
    `pipelines` (default: `candidates` for the step's largest layer stack): each screened by its baselines
    (or, with `screen_budget_s`, a search of that budget; with `prune_siblings`, not a candidate whose usually
    faster sibling already fit: `_sibling`; with `bound_siblings`, the default, a candidate bounded by a
    sibling only when that sibling is among the `finalists` fastest screened: `shardc.pipeline.bound`, rows
    "bounded" for the others; with `floors`, the default, not a candidate whose floor is above a plan in hand
    that fits: `shardc.pipeline.floor`, rows "floored" with the floor as their time), the `finalists` fastest
    searched with `budget_s` (with `floors`, not one whose floor is above the best plan by then). Returns the plan
    and every choice scored (also passed to `on_choice` as it is made): the unpipelined search's baselines
    ("baseline fsdp", ...) and the candidates' "megatron-3d" rows included. A progress bar counts the
    candidates on a terminal (`progress`: True/False forces it). `options` go to `shardc.plan_for`."""
    shared = None
    if plan_for is None:  # (candidates share their stack, tracing mesh and traced programs: shardc/pipeline/reuse.py)
        from shardc.auto import AutoFunction, plan_for

        shared = SharedTraces()
        # (a plain step, traced by stack_of as the candidates trace it: its stack is theirs)
        plain = not isinstance(step, AutoFunction) and not {"static_argnums", "static_argnames"} & options.keys()
    if not isinstance(finalists, int) or isinstance(finalists, bool) or finalists < 0:
        raise ShardingError(f"choose_pipeline(finalists={finalists!r}): expected an int >= 0")
    from shardc.sim import as_topology

    choices: list[Choice] = []

    def note(c: Choice) -> None:
        choices.append(c)
        if on_choice is not None:
            on_choice(c)

    topo = as_topology(topology)
    n = topo.num_devices
    if pipeline and pipelines is None:
        with provisional_mesh(True):
            stack = stack_of(step, args, make_mesh({"data": len(jax.devices()), "model": 1, "expert": 1}))
        pipelines = list(candidates(n, stack.layers, stack.batch))
        if shared is not None and plain:  # (the candidates' traces need not find it again)
            shared.stack = stack
    early = idle.current()  # (the traces the searches below may run while they wait: `_with_idle_work`)
    assert early is not None
    best: Any = None
    unfit: NoPlanFits | None = None
    bound = bound_siblings and screen_budget_s is None  # (a search's screen may beat every baseline: no bound)
    floor_of: dict[Pipeline, tuple[float | None, Any]] = {}  # traced candidate -> (floor, its traced program)
    tracing_early = pipeline and floors and shared is not None and not prune_siblings

    sizes: list[int] = []  # ops of the candidates' traced graphs

    def note_floor(p: Pipeline, program: Any, graph: Any) -> None:
        if p not in floor_of:
            floor_of[p] = (step_floor(graph, topo, n) if floors else None, program)  # (None: traced, no floor)
            sizes.append(len(graph.ops))

    def trace_now(p: Pipeline) -> None:
        """Trace candidate `p` as its screen will (the program kept in `shared`) and note its floor; its screen
        then starts from both."""

        def traced(program: Any, graph: Any) -> None:
            note_floor(p, program, graph)
            raise _TracedEarly

        try:
            with paused_gc():
                _plan(plan_for, shared, step, args, topology, n, pipeline=p, priced_only=True, on_graph=traced,
                      **_screening(screen_budget_s, options))
        except _TracedEarly:
            pass

    def trace_early(due: list[Pipeline]) -> None:
        """Queue the traces of candidates about to be screened (in their order) for the searches' waits."""
        for p in due if tracing_early else ():
            early.add(p, functools.partial(trace_now, p))

    listed = set(pipelines or ())  # (those screened whatever the others' screens say: see the loop below)
    trace_early([p for p in pipelines or () if not bound or bounding_sibling(p) not in listed])
    try:
        base = plan_for(step, *args, topology=topology, budget_s=budget_s, **options)
    except NoPlanFits as e:  # (a pipeline may fit: fewer activations per device)
        if not pipeline:
            raise
        unfit = e
        note(Choice("unpipelined", None, {}, float("inf"), e.smallest_peak, False))
    else:
        best = base
        note(_choice("unpipelined", base, None))
        for c in _baseline_choices(base, tuple(BASELINES)):  # each on its best mesh
            note(dataclasses.replace(c, name=f"baseline {c.name}"))
    if not pipeline:
        return best, choices
    screened: list[tuple[tuple, int, Pipeline, Any]] = []
    fitted: set[tuple] = set()  # sibling groups with a screened candidate that fits (`_sibling`)
    bounds: set[Pipeline] = set()  # screened candidates whose fastest baseline plan fits (shardc/pipeline/bound.py)
    bounded: dict[Pipeline, tuple[int, Pipeline]] = {}  # not screened (yet): (index, the candidate bounding it)
    floored: set[Pipeline] = set()  # candidates not screened: their floor is above a plan in hand
    lead = [best.cost.step_time if best is not None and best.cost.fits else float("inf")]  # the plan in hand

    def holds(p: Pipeline) -> float | None:
        """`p`'s floor when it bounds every plan a search can make of its program, else None."""
        f, program = floor_of.get(p, (None, None))  # (None with floors off: traced before a fork, no floor)
        return f if f is not None and floor_applies(program, options.get("remat", True)) else None

    def above_lead(p: Pipeline) -> float | None:
        """`p`'s floor when it is known, bounds every plan of its program and is above the plan in hand."""
        f = floor_of.get(p, (None,))[0]
        return holds(p) if f is not None and f > lead[0] else None

    def checker(p: Pipeline) -> Callable[[Any, Any], None] | None:
        """The graph hook of `p`'s screen: its floor (and size) noted, and `_Floored` raised when it is above
        the plan in hand (before any propagation or simulation)."""
        if shared is None:
            return None

        def check(program: Any, graph: Any) -> None:
            note_floor(p, program, graph)
            if (f := above_lead(p)) is not None:
                raise _Floored(f)

        return check
    bar = tqdm(total=len(pipelines), desc="shardc pipelines", unit="pipeline", leave=False,
               disable=None if progress is None else not progress)

    def outcome_of(p: Pipeline) -> _Outcome:
        """`p`'s screen, here or in a forked child: its rows, or why it has none."""
        try:
            with paused_gc():  # (a young collection after it instead: its garbage, not the heap it adds to)
                plan = _plan(plan_for, shared, step, args, topology, n, pipeline=p, priced_only=True,
                             on_graph=checker(p), **_screening(screen_budget_s, options))
        except ShardingError as e:  # a pipeline this step cannot take (said in the table, not fatal)
            return _Outcome("error", message=str(e).splitlines()[0][:80])
        except _Floored as e:  # no plan of it could be chosen
            return _Outcome("floored", floor=e.floor)
        return _Outcome("screened", (_choice("screened", plan, plan.pipeline),
                                     *_baseline_choices(plan, ("megatron-3d",))),
                        _key(plan), bound and fastest_baseline_fits(plan), plan=plan)

    forks = ForkedScreens(lambda p: dataclasses.replace(outcome_of(p), plan=None),
                          _fork_limit(shared, prune_siblings, topo))
    applied: set[Pipeline] = set()  # candidates whose turn has come (screened, floored, bounded or failed)
    untraced: set[Pipeline] = set()  # candidates whose trace here raised (screened here at their turn)

    def will_screen(p: Pipeline) -> bool:
        """Whether `p` is screened at its turn as far as the outcomes taken so far tell (its floor aside)."""
        q = bounding_sibling(p) if bound else None
        return q is None or q not in listed or q in applied and q not in bounds and q not in floored

    def launch(upcoming: list[tuple[int, Pipeline]], due: bool) -> bool:
        """Start the screen of the first candidate of `upcoming` (all `due` to be screened, or those that will
        be as far as known) that is not started and not floored by the plan in hand, in a free child (traced
        here first), when the candidates traced so far say a fork repays it; False when none was started."""
        for _, p in upcoming:
            if forks.running() >= forks.limit:
                return False
            if forks.started(p) or p in applied or p in untraced or not (due or will_screen(p)):
                continue
            if not sizes or not _worth_forking(max(sizes), n):  # (no traced candidate says a fork repays it)
                return False
            if p not in floor_of:
                try:
                    trace_now(p)
                except Exception:  # (its screen, at its turn here, reports it as it would have)
                    untraced.add(p)
                    continue
            if p in floor_of and above_lead(p) is None and forks.start(p):
                return True
        return False

    def screen(i: int, p: Pipeline, upcoming: list[tuple[int, Pipeline]], due: bool = False) -> None:
        """Screen `p` (the `i`-th candidate) at its turn, starting those of `upcoming` ahead while it waits."""
        bar.update(1)
        early.discard(p)
        if (f := above_lead(p)) is not None:  # (traced early: its floor settles it now)
            forks.drop(p)
            out = _Outcome("floored", floor=f)
        elif forks.started(p) or launch([(i, p)], True):
            out = forks.take(p, lambda: launch(upcoming, due))
        else:
            out = outcome_of(p)
        applied.add(p)
        if out.kind == "error":
            note(Choice(f"error: {out.message}", p, {}, float("inf"), 0.0, False))
            return
        if out.kind == "floored":
            floored.add(p)
            note(Choice("floored", p, {}, out.floor, 0.0, False))
            return
        row, *megatron = out.rows
        note(row)
        if row.feasible:
            lead[0] = min(lead[0], row.time)
        for c in megatron:
            note(c)
        screened.append((out.key, i, p, out))
        if row.feasible:
            fitted.add(_sibling(p))
        if out.bounds:
            bounds.add(p)

    try:
        with frozen_heap():  # (the unpipelined search's heap is not rescanned by each trace's collections)
            order = list(enumerate(pipelines))
            for k, (i, p) in enumerate(order):
                if prune_siblings and _sibling(p) in fitted:
                    bar.update(1)
                    continue
                q = bounding_sibling(p) if bound else None
                if q in bounds or q in floored:  # not faster than `q`: screened only if `q` could be a finalist
                    bounded[p] = (i, q)
                    applied.add(p)
                    continue
                screen(i, p, order[k + 1:])
            while bounded:  # the candidates bounded by one that could be a finalist (or the fastest screened)
                screened.sort(key=lambda x: (x[0], x[1]))
                top = {p for _, _, p, _ in screened[:max(finalists, 1)]}
                due = sorted((i, p) for p, (i, root) in bounded.items() if root in top)
                if not due:
                    break
                trace_early([p for _, p in due])
                applied.difference_update(p for _, p in due)
                for k, (i, p) in enumerate(due):
                    del bounded[p]
                    screen(i, p, due[k + 1:], True)
    finally:
        forks.close()
    bar.close()
    for i, p in sorted((i, p) for p, (i, _) in bounded.items()):
        note(Choice("bounded", p, {}, float("inf"), 0.0, False))  # (its bounding sibling is in the table)
    screened.sort(key=lambda x: (x[0], x[1]))
    best_screen = None  # the screened candidate whose plan is the best so far (priced, not made to run)
    for key, _, p, out in screened:
        if best is None or key < _key(best):
            best, best_screen = (out.plan if out.plan is not None else _Priced(out.rows[0])), p
    for _, _, p, out in screened[:finalists]:
        f = holds(p)
        if f is not None and best.cost.fits and f > best.cost.step_time:  # its search could not find the winner
            note(Choice("floored", out.rows[0].pipeline, {}, f, 0.0, False))  # (as its screen's row names it)
            continue
        plan = _plan(plan_for, shared, step, args, topology, n, budget_s=budget_s, pipeline=p, **options)
        note(_choice("pipelined", plan, plan.pipeline))
        if best is None or _key(plan) < _key(best):
            best, best_screen = plan, None
    if isinstance(best, _Priced):  # a screen run in a forked child won: its plan made here (the same plan)
        with paused_gc():
            best = _plan(plan_for, shared, step, args, topology, n, pipeline=best_screen, priced_only=True,
                         **_screening(screen_budget_s, options))
    if best_screen is not None and shared is not None and n <= len(jax.devices()):
        # a screened plan won, on this host's devices: made to run (traced under its mesh, its search's decisions)
        best = _plan(plan_for, shared, step, args, topology, n, pipeline=best_screen, resume=best,
                     **_screening(screen_budget_s, options))
    if best is None or not best.cost.fits and unfit is not None:
        raise unfit if unfit is not None else ShardingError("choose_pipeline: no candidate pipeline could be planned "
                                                            "(every one raised; see the choices passed to on_choice)")
    if dataclasses.is_dataclass(best):  # (what explain() shows of the choice)
        best = dataclasses.replace(best, pipeline_choice=PipelineChoice(tuple(choices), best.pipeline))
    return best, choices


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What `choose_pipeline` reads of one candidate's screen: `kind` "screened" (its rows — its own, then its
    megatron-3d ones —, its plan's sort key, whether it bounds its siblings, and the plan when made in this
    process), "error" (the ShardingError's first line) or "floored" (the floor above the plan in hand)."""

    kind: str
    rows: tuple[Choice, ...] = ()
    key: tuple = ()
    bounds: bool = False
    message: str = ""
    floor: float = 0.0
    plan: Any = None


class _Priced:
    """A screened plan made in a forked child, as the choice compares plans (its cost); made here if it wins."""

    def __init__(self, row: Choice) -> None:
        self.pipeline = row.pipeline
        self.cost = types.SimpleNamespace(fits=row.feasible, step_time=row.time, peak_memory=row.peak)


def _fork_limit(shared: SharedTraces | None, prune_siblings: bool, topology: Any) -> int:
    """How many screens may run at once in forked children (`shardc.pipeline.forked`): 0 (all here) for a
    caller's own `plan_for`, with `prune_siblings` (its decisions follow each screen at once) or where the
    search's workers may not fork (`shardc.search.workers.can_fork`); else the search's worker count."""
    workers = default_workers()
    return workers if shared is not None and not prune_siblings and workers > 1 and can_fork(topology) else 0


def _worth_forking(ops: int, devices: int) -> bool:
    """Whether the baselines of an `ops`-op program on one mesh of `devices` devices repay a fork."""
    per_mesh = (MESH_SETUP_UNITS + len(BASELINES) * full_plan_units(devices)) * plan_seconds(ops, devices)
    return per_mesh >= _SCREEN_FORK_WORTH_S


# A screen is forked when its baselines on one mesh take this long on the reference machine (`budget.plan_seconds`)
_SCREEN_FORK_WORTH_S = 0.2


class _TracedEarly(Exception):
    """Raised from an early trace's graph hook: the rest of the screen waits for the candidate's turn."""


class _Floored(Exception):
    """A candidate's floor is above the plan in hand (raised from its screen's graph hook)."""

    def __init__(self, floor: float) -> None:
        super().__init__(f"floor {floor:.6g} s")
        self.floor = floor


def _plan(plan_for: Callable, shared: SharedTraces | None, step: Callable, args: tuple, topology: Any, devices: int,
          priced_only: bool = False, resume: Any = None, on_graph: Callable | None = None, **options: Any) -> Any:
    """`plan_for(step, *args, topology=topology, **options)` for one candidate pipeline; with `shared`, as
    `shardc.plan_for` plans it (on all `devices` of the topology) but with what the candidates share and,
    `priced_only`, a plan to price, not to run (a screen): on this host's devices, the search's plan is not
    rebuilt from a trace of the step under the mesh it chose (the same step time and memory). `resume`: such a
    plan, rebuilt so (no search), as the plan without `priced_only` would have been. `on_graph`: AutoFunction's
    graph hook (`_on_graph`)."""
    if shared is None:
        return plan_for(step, *args, topology=topology, **options)
    from shardc.auto import AutoFunction

    fun = step.fun if isinstance(step, AutoFunction) else step
    return AutoFunction(fun, topology=topology, devices=devices, _shared=shared, _priced_only=priced_only,
                        _resume=resume, _on_graph=on_graph, **options).plan(*args)


def _screening(budget_s: float | None, options: dict) -> dict:
    """plan_for's options for a candidate's screen: its baselines only (`search="baselines"`) without a
    budget, else a search of `budget_s`."""
    if budget_s is None:
        return {**options, "search": "baselines"}
    return {**options, "budget_s": budget_s}


def _sibling(p: Pipeline) -> tuple:
    """Pipelines that differ only in what they trade memory for time: deferred weight gradients, then the
    loop's own accumulation, then 1F1B's recomputation, each usually using less memory and more time than
    the one before (`candidates` lists them in that order; `choose_pipeline(prune_siblings=True)` screens
    no later one once one fits). Usually, not always: on gpt12-wide (h100-sxm-8x8) every deferred pipeline
    was faster than its sibling, but on gpt12-xl near the memory limit the order broke both ways
    (docs/pipeline.md), so pruning is an opt-in for planning time, not the default."""
    family = "circular" if p.schedule == "circular" else "gpipe"
    return (p.stages, p.microbatches, p.repeats, p.data, p.shards, family)


def _key(plan: Any) -> tuple:
    c = plan.cost
    return (not c.fits, c.step_time, c.peak_memory)
