"""The floor of a traced program (shardc/pipeline/floor.py) and choose_pipeline's use of it: a candidate
whose floor is above a plan in hand is neither screened nor searched, and the choice is the one made
without floors."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc.ir.build import build_graph
from shardc.pipeline import Pipeline
from shardc.pipeline.choose import choose_pipeline
from shardc.pipeline.floor import may_be_bitcast, step_floor
from shardc.remat import inline_calls, inlined_layer_groups, layer_groups
from shardc.sim import as_topology

from choice_helpers import no_unpipelined_plan_fits
from test_pipeline_lowering import make_args, make_step

TOPOLOGY = "h100-sxm-8"


@pytest.fixture
def scored(monkeypatch):
    """Every step time the search's evaluators simulate, by the graph they plan."""
    from shardc.search.evaluate import Evaluator

    seen: dict[int, tuple] = {}
    real = Evaluator.score_plan

    def spy(self, plan):
        out = real(self, plan)
        seen.setdefault(id(plan.graph), (plan.graph, []))[1].append(out[0].time)
        return out

    monkeypatch.setattr(Evaluator, "score_plan", spy)
    return seen


@pytest.mark.parametrize("pipeline", [None, Pipeline(2, 4, defer_wgrad=True), Pipeline(2, 2, "1f1b"),
                                      Pipeline(2, 2, "circular", repeats=2, data=("data",), shards=2)])
def test_no_plan_the_search_scores_is_below_the_floor(scored, pipeline):
    step, args = make_step(None), make_args()
    plan = shardc.plan_for(step, *args, topology=TOPOLOGY, budget_s=0.3, pipeline=pipeline)
    topology = as_topology(TOPOLOGY)
    assert sum(len(times) for _, times in scored.values()) > 5
    for graph, times in scored.values():  # (the search's graph; the plan's, traced again under its mesh)
        assert step_floor(graph, topology, 8) <= min(times)
    floor = step_floor(plan.graph, topology, 8)
    assert floor <= plan.cost.step_time
    assert floor > 0.5 * plan.cost.step_time  # (and it bounds something: the tiny step is latency-bound)
    assert inlined_layer_groups(plan.program) == layer_groups(inline_calls(plan.program))  # (`floor_applies`)


def test_no_floor_on_measured_devices():
    step, args = make_step(None), make_args()
    plan = shardc.plan_for(step, *args, topology=TOPOLOGY, search="baselines")
    measured = dataclasses.replace(as_topology(TOPOLOGY), device=dataclasses.replace(
        as_topology(TOPOLOGY).device, measured_ops=("dot_general",)))
    assert step_floor(plan.graph, measured, 8) == 0.0


def _op(fun, *shapes):
    closed = jax.make_jaxpr(fun)(*[jnp.zeros(s) for s in shapes])
    graph = build_graph(closed, [f"x{i}" for i in range(len(shapes))], ["out"])
    (op,) = [o for o in graph.ops if o.primitive not in ("tie",)]
    return graph, op


@pytest.mark.parametrize("fun, shape, bitcast", [
    (lambda x: x.sum(0), (16, 4), False),  # 16 rows on 8 devices: at least 2 per device, summed
    (lambda x: x.sum(0), (8, 4), True),  # 8 rows split 8 ways: a unit dim, dropped
    (lambda x: x.T, (16, 16), False),  # two long dims swapped
    (lambda x: x.T, (16, 2), True),  # the short dim may be unit locally
    (lambda x: jnp.broadcast_to(x, (16, 4)), (4,), False),  # 16x the elements
    (lambda x: jnp.broadcast_to(x, (2, 4)), (4,), True),
])
def test_may_be_bitcast(fun, shape, bitcast):
    graph, op = _op(fun, shape)
    assert may_be_bitcast(graph, op, 8) is bitcast


def test_choose_pipeline_does_not_screen_or_search_what_cannot_win():
    """The tiny step is latency-bound: no pipeline beats the unpipelined plan. With floors, the candidates
    whose floor is above it are not screened (and their siblings are bounded by them); the choice is the one
    made screening them, the floors are below those screens, and the screens made anyway are the same."""
    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4, data=("data",), shards=2, defer_wgrad=True), Pipeline(2, 4, data=("data",), shards=2),
             Pipeline(4, 4, defer_wgrad=True), Pipeline(2, 2, "1f1b"), Pipeline(2, 8, "1f1b")]
    opts = dict(topology=TOPOLOGY, budget_s=0.3, pipelines=pipes, finalists=2)
    best_all, every = choose_pipeline(step, args, floors=False, **opts)
    best, rows = choose_pipeline(step, args, **opts)
    unbound = lambda p: dataclasses.replace(p, layers=None, stack="")  # noqa: E731
    of = lambda rs, name: {unbound(c.pipeline): c.time for c in rs if c.name == name}  # noqa: E731
    assert best.pipeline is None and best_all.pipeline is None
    assert best.cost.step_time == best_all.cost.step_time
    floored, screens = of(rows, "floored"), of(every, "screened")
    assert floored and of(rows, "pipelined") == {}  # not a search made: every finalist floored too
    for p, f in floored.items():
        assert f > best.cost.step_time
        if p in screens:
            assert f <= screens[p]
    for p, t in of(rows, "screened").items():
        assert t == screens[p]
    assert unbound(pipes[1]) in of(rows, "bounded")  # bounded by its floored deferred sibling
    assert "not screened: their floor is above a plan in hand" in best.pipeline_choice.summary().splitlines()[0]


def test_a_finalist_above_the_best_screen_is_not_searched(monkeypatch):
    """With no unpipelined plan in hand (it does not fit), nothing is floored until a screen fits; a finalist
    whose floor is above the best plan by then is not searched; the pipeline chosen is the one chosen without
    floors."""
    no_unpipelined_plan_fits(monkeypatch)
    step, args = make_step(None), make_args()
    # (the fastest last: the slower ones are screened while nothing faster is in hand, and the second finalist's
    # floor is above the fastest screen found after it)
    pipes = [Pipeline(2, 8, defer_wgrad=True), Pipeline(4, 8, "1f1b"), Pipeline(2, 2, data=("data",), shards=4)]
    opts = dict(topology=TOPOLOGY, budget_s=0.3, pipelines=pipes, finalists=2)
    best_all, _ = choose_pipeline(step, args, floors=False, **opts)
    best, rows = choose_pipeline(step, args, **opts)
    assert best.pipeline == best_all.pipeline and best.cost.step_time == best_all.cost.step_time
    names = [c.name for c in rows]
    assert names[-2:] == ["pipelined", "floored"] and names.count("screened") == 3  # a finalist not searched
    assert rows[-1].time > best.cost.step_time and best.pipeline == pipes[2].bind(8, best.pipeline.stack)
    assert best.pipeline_choice.summary().startswith(f"pipelines considered: {len(pipes)} candidates (3 screened, "
                                                     f"1 searched in full")
