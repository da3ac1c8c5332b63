"""Choosing a pipeline: the enumeration of pipelines a stack admits, and the choice of the fastest plan
that fits among the unpipelined search, pipelined searches and their megatron-3d baselines."""
import pytest

import shardc
from shardc.pipeline import Pipeline
from shardc.pipeline.choose import candidates, choose_pipeline

from choice_helpers import no_unpipelined_plan_fits
from test_pipeline_lowering import make_args, make_step


def test_candidates():
    got = list(candidates(64, 12, 8))
    assert got  # 12 layers on 64 devices: 2 or 4 stages (3 and 6 do not divide 64; 8 does not divide 12)
    assert {p.stages for p in got} == {2, 4}
    for p in got:
        assert 12 % (p.stages * p.repeats) == 0 and 8 % p.microbatches == 0
        assert (8 // p.microbatches) % p.shards == 0 and 64 % (p.stages * p.shards) == 0
    assert Pipeline(4, 4, "1f1b", data=("data",), shards=2) in got
    assert Pipeline(4, 8, data=("data",), shards=8) not in got  # a microbatch of 1 row does not split 8 ways
    assert Pipeline(2, 2, data=("data",), shards=4) in got
    assert Pipeline(2, 2, "circular", repeats=2) in got
    assert {p.repeats for p in got if p.schedule == "circular" and p.stages == 4} == {3}  # 12 % 8, 12 % 16
    assert Pipeline(2, 4, data=("data",), shards=2, defer_wgrad=True) in got
    assert not any(p.defer_wgrad and p.schedule == "1f1b" for p in got)


def test_choose_pipeline_keeps_the_fastest_that_fits():
    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4, data=("data",), shards=4), Pipeline(4, 4, "1f1b")]
    seen = []
    best, choices = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=1.0, pipelines=pipes, finalists=1,
                                    on_choice=seen.append, floors=False)  # (every candidate screened)
    assert seen == choices
    names = [c.name for c in choices]
    assert names.count("unpipelined") == 1 and names.count("screened") == 2 and names.count("pipelined") == 1
    assert "megatron-3d" in names and "baseline fsdp" in names
    # the finalist is the fastest screened candidate
    screened = min((c for c in choices if c.name == "screened"), key=lambda c: (not c.feasible, c.time))
    assert next(c for c in choices if c.name == "pipelined").pipeline == screened.pipeline
    planned = [c for c in choices if c.name in ("unpipelined", "screened", "pipelined")]
    fastest = min(planned, key=lambda c: (not c.feasible, c.time))
    assert best.cost.step_time == fastest.time
    assert (best.pipeline is None) == (fastest.pipeline is None)
    for c in choices:
        if c.name in ("screened", "pipelined"):
            assert c.mesh["stage"] == c.pipeline.stages and list(c.mesh)[0] == "stage"
    only, rows = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=1.0, pipeline=False)
    assert only.pipeline is None and [c.name for c in rows if not c.name.startswith("baseline ")] == ["unpipelined"]


def test_choose_pipeline_finds_the_brute_force_optimum():
    """Stages x microbatches x data shards x schedule on a tiny stack, each searched in full (the brute
    force), against choose_pipeline's screen + 2 finalists: the same fastest pipeline and step time, and the
    same overall choice (here the unpipelined plan: the tiny step is latency-bound)."""
    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 2), Pipeline(2, 8), Pipeline(4, 4), Pipeline(4, 8, "1f1b"),
             Pipeline(2, 4, data=("data",), shards=2)]
    key = lambda pl: (not pl.cost.fits, pl.cost.step_time)  # noqa: E731
    brute = [shardc.plan_for(step, *args, topology="h100-sxm-8", budget_s=0.5, pipeline=p) for p in pipes]
    fastest = min(brute, key=key)
    assert len({pl.cost.step_time for pl in brute}) == len(brute)  # a strict order: one optimum
    unpiped = shardc.plan_for(step, *args, topology="h100-sxm-8", budget_s=0.5)
    best, choices = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipelines=pipes, finalists=2,
                                    floors=False)
    piped = min((c for c in choices if c.name in ("screened", "pipelined")), key=lambda c: (not c.feasible, c.time))
    assert piped.time == fastest.cost.step_time and piped.pipeline == fastest.pipeline
    overall = min([fastest, unpiped], key=key)
    assert best.cost.step_time == overall.cost.step_time and best.pipeline == overall.pipeline


def test_siblings_trading_memory_for_time_are_screened_only_until_one_fits(monkeypatch):
    """Deferred weight gradients, the loop's accumulation, 1F1B: the same pipeline with (usually) less memory
    and more time each. With prune_siblings, once one fits its siblings are not screened; plan_for(pipeline=True)
    is choose_pipeline's choice."""
    step, args = make_step(None), make_args()
    group = [Pipeline(2, 4, defer_wgrad=True), Pipeline(2, 4), Pipeline(2, 4, "1f1b")]
    other = Pipeline(4, 4)
    _, pruned = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipelines=group + [other],
                                finalists=0, prune_siblings=True, floors=False)
    screened = [(c.pipeline.stages, c.pipeline.schedule, c.pipeline.defer_wgrad)
                for c in pruned if c.name == "screened"]
    assert screened == [(2, "gpipe", True), (4, "gpipe", False)]
    _, every = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipelines=group, finalists=0,
                               floors=False)
    times = [c.time for c in every if c.name == "screened"]
    assert len(times) == 3 and times[0] <= times[1] <= times[2]  # here each sibling is slower than the one before

    import shardc.pipeline.choose as choose
    monkeypatch.setattr(choose, "candidates", lambda *a, **k: iter([group[0], other]))
    best = shardc.plan_for(step, *args, topology="h100-sxm-8", pipeline=True, budget_s=0.5, prune_siblings=True,
                           floors=False)
    fastest = min((c for c in pruned if c.name in ("unpipelined", "screened")), key=lambda c: (not c.feasible, c.time))
    assert best.cost.step_time <= fastest.time
    summary = best.pipeline_choice.summary()  # what explain() shows: the choice against what it beat
    assert summary.startswith("pipelines considered: 2 candidates (2 screened, 2 searched in full, 0 could not")
    assert summary.splitlines()[0] in best.explain()
    chosen = [line for line in summary.splitlines() if line.startswith("  chosen")]
    assert len(chosen) == 1 and ("no pipeline" in chosen[0]) == (best.pipeline is None)


def test_a_pipeline_is_chosen_when_no_unpipelined_plan_fits():
    """(gpt48 on h100-sxm-8x8 without rematerialization: the unpipelined search finds no plan that fits, a
    1F1B pipeline does.) The failed search is a row, not the end of the choice; with nothing that fits at all,
    the unpipelined search's NoPlanFits is raised."""
    import types

    from shardc.search.driver import NoPlanFits

    def fake_plan_for(step, *args, topology, budget_s=None, pipeline=None, **options):
        if pipeline is None or pipeline.schedule == "gpipe":
            raise NoPlanFits(200 * 2**30, 80 * 2**30)
        cost = types.SimpleNamespace(step_time=1.0, peak_memory=60 * 2**30, fits=True)
        return types.SimpleNamespace(cost=cost, mesh_sizes={"stage": 2}, pipeline=pipeline, search=None)

    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4), Pipeline(2, 4, "1f1b")]
    best, rows = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipelines=pipes,
                                 plan_for=fake_plan_for, finalists=1)
    assert best.pipeline.schedule == "1f1b"
    assert rows[0].name == "unpipelined" and not rows[0].feasible and rows[0].peak == 200 * 2**30
    with pytest.raises(NoPlanFits):
        choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipelines=pipes[:1], plan_for=fake_plan_for)
    with pytest.raises(NoPlanFits):  # and without pipelines, as before
        choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipeline=False, plan_for=fake_plan_for)


def test_bounded_siblings_are_screened_only_when_they_could_be_finalists():
    """A sibling that only adds work to its sibling with deferred weight gradients (the loop's accumulation,
    1F1B's recomputation) is not screened unless that sibling is among the finalists; the choice, the finalists and their
    step times are those of screening every candidate, and the bound's premise holds on what was screened."""
    import dataclasses

    from shardc.pipeline.bound import bounding_sibling

    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4, data=("data",), shards=2, defer_wgrad=True), Pipeline(2, 4, data=("data",), shards=2),
             Pipeline(2, 4, "1f1b", data=("data",), shards=2),
             Pipeline(4, 4, defer_wgrad=True), Pipeline(4, 4), Pipeline(4, 4, "1f1b")]
    opts = dict(topology="h100-sxm-8", budget_s=0.5, pipelines=pipes, finalists=1, floors=False)
    best_all, every = choose_pipeline(step, args, bound_siblings=False, **opts)
    best, rows = choose_pipeline(step, args, **opts)
    unbound = lambda p: dataclasses.replace(p, layers=None, stack="")  # noqa: E731
    of = lambda rs, name: {unbound(c.pipeline): c.time for c in rs if c.name == name}  # noqa: E731
    assert best.cost.step_time == best_all.cost.step_time and best.pipeline == best_all.pipeline
    assert of(rows, "pipelined") == of(every, "pipelined")  # the same finalist, searched to the same plan
    screened, times, skipped = of(rows, "screened"), of(every, "screened"), of(rows, "bounded")
    assert skipped and len(screened) + len(skipped) == len(pipes)  # some not screened; every one in the table
    assert all(screened[p] == times[p] for p in screened)  # the same screens
    for p in skipped:  # bounded by its screened sibling with deferred weight gradients, which is no finalist
        root = bounding_sibling(p)
        assert root in screened and root not in of(rows, "pipelined") and times[p] >= times[root]
    for p, t in times.items():  # the premise, on every sibling pair screened
        q = bounding_sibling(p)
        if q in times:
            assert t >= times[q]
    summary = best.pipeline_choice.summary()
    assert f"{len(skipped)} not screened: bounded by a faster sibling" in summary.splitlines()[0]


def test_candidates_share_the_stack_the_tracing_mesh_and_the_programs(monkeypatch):
    """The layer stack is found once, later candidates trace on the mesh the first one's trace ended on, and a
    finalist's search plans the program its screen traced: one trace per candidate, none for the finalists,
    and the same plans as shardc.plan_for makes of each candidate alone."""
    import shardc.pipeline.choose as choose
    from shardc.pipeline.reuse import SharedTraces

    made: list[SharedTraces] = []

    class Counting(SharedTraces):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(choose, "SharedTraces", Counting)
    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4, data=("data",), shards=2), Pipeline(4, 4, "1f1b")]
    _, rows = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipelines=pipes, finalists=2,
                              floors=False)
    shared, = made
    assert shared.stack is not None and shared.stack.layers == 8
    assert shared.reused >= 2  # each finalist's trace (and each retrace under the mesh its search chose)
    assert len(shared.programs) == shared.traced
    alone = {p: shardc.plan_for(step, *args, topology="h100-sxm-8", budget_s=0.5, pipeline=p) for p in pipes}
    for c in rows:
        if c.name == "pipelined":
            p = next(q for q in pipes if c.pipeline == q.bind(8, c.pipeline.stack))
            assert c.time == alone[p].cost.step_time and c.mesh == dict(alone[p].mesh_sizes)


def test_screens_are_priced_without_a_retrace_and_a_screened_winner_is_planned_to_run(monkeypatch):
    """On this host's devices a screen's plan is not rebuilt from a trace under the mesh its search chose (it
    is priced, not run): the screens score what shardc.plan_for(search="baselines") scores, and a screened
    plan that wins is planned again as plan_for plans it (the same plan, traced under its mesh)."""
    real = no_unpipelined_plan_fits(monkeypatch)  # (so that a screened plan wins)
    import shardc.pipeline.choose as choose

    made, plan = [], choose._plan
    monkeypatch.setattr(choose, "_plan", lambda *a, priced_only=False, **k: made.append(priced_only) or plan(
        *a, priced_only=priced_only, **k))
    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4, data=("data",), shards=4), Pipeline(4, 4, "1f1b")]
    best, rows = choose_pipeline(step, args, topology="h100-sxm-8", budget_s=0.5, pipelines=pipes, finalists=0,
                                 floors=False)
    assert made == [True, True, False]  # two screens, priced; the winner made to run (without a search)
    alone = [real(step, *args, topology="h100-sxm-8", pipeline=p, search="baselines") for p in pipes]
    screened = {c.pipeline: c for c in rows if c.name == "screened"}
    for pl in alone:
        c = screened[pl.pipeline]
        assert (c.time, c.peak, c.mesh) == (pl.cost.step_time, pl.cost.peak_memory, dict(pl.mesh_sizes))
    fastest = min(alone, key=lambda pl: (not pl.cost.fits, pl.cost.step_time))
    assert best.pipeline == fastest.pipeline and best.cost.step_time == fastest.cost.step_time
    assert dict(best.mesh_sizes) == dict(fastest.mesh_sizes) and best.strategies == fastest.strategies
    assert len(best.graph.ops) == len(fastest.graph.ops) and best.pipeline_choice is not None


def test_candidates_traced_while_the_searches_wait_change_nothing(monkeypatch):
    """With forked search workers, the candidates' traces run while the unpipelined search and the screens wait
    for them (shardc.search.idle); every row of the choice is what it is without that."""
    import dataclasses

    import shardc.search.driver as driver
    import shardc.search.idle as idle

    monkeypatch.setattr(driver, "_FORK_WORTH_S", 0.0)
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "2")
    step, args = make_step(None), make_args()
    opts = dict(topology="h100-sxm-8x8", budget_s=0.3, finalists=1)
    early, real = [], idle.IdleQueue.run_one  # (the candidates traced while a search waited)

    def run_one(queue):
        early.extend(list(queue._tasks)[:1])
        return real(queue)

    monkeypatch.setattr(idle.IdleQueue, "run_one", run_one)
    best, rows = choose_pipeline(step, args, **opts)
    assert early  # (some traced while a search waited)
    with monkeypatch.context() as m:
        m.setattr(idle, "pending", lambda: False)
        m.setattr(idle, "run_while", lambda waiting: None)
        best_after, rows_after = choose_pipeline(step, args, **opts)
    assert [(c.name, c.time, c.peak, c.mesh, c.pipeline) for c in rows] == \
           [(c.name, c.time, c.peak, c.mesh, c.pipeline) for c in rows_after]
    assert (best.pipeline, best.cost.step_time) == (best_after.pipeline, best_after.cost.step_time)
    unbound = lambda p: dataclasses.replace(p, layers=None, stack="")  # noqa: E731
    assert set(early) <= {unbound(c.pipeline) for c in rows if c.name in ("screened", "floored")}
