"""`@shardc.auto(pipeline=True)`: the pipeline (or none) is chosen on the devices the step runs on, and the
step runs exactly the chosen plan — rebuilt from the choice's decisions, not searched again — computing what
jax.jit computes."""
import jax
import numpy as np
import pytest

import shardc
import shardc.pipeline.choose as choose
import shardc.search.integrate as integrate
from shardc.pipeline import Pipeline

from test_pipeline_lowering import make_args, make_step, rel, train

CANDIDATES = [Pipeline(2, 4, data=("data",), shards=4), Pipeline(4, 4, "1f1b")]


@pytest.fixture
def searches(monkeypatch):
    """The candidates above, and a count of the searches run. (Every candidate screened and searched: no
    floor, tests/pipeline/test_pipeline_floor.py tests those; here the tiny step's floors would leave no
    pipeline to run.)"""
    monkeypatch.setattr(choose, "candidates", lambda *a, **k: iter(CANDIDATES))
    monkeypatch.setattr(choose, "step_floor", lambda *a, **k: 0.0)
    calls = []
    real = integrate.search_plan

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(integrate, "search_plan", counted)
    return calls


@pytest.mark.parametrize("prefer", ["pipelined", "fastest"])
def test_auto_runs_the_plan_it_chose(searches, monkeypatch, prefer):
    """`prefer="pipelined"` makes the choice rank pipelines first (the tiny step runs fastest unpipelined), so a
    pipelined plan is what the step must run; "fastest" is the choice as it is."""
    if prefer == "pipelined":
        key = choose._key
        monkeypatch.setattr(choose, "_key", lambda plan: (plan.pipeline is None,) + key(plan))
    step, args = make_step(None), make_args()
    f = shardc.auto(step, pipeline=True, topology="h100-sxm-8", budget_s=0.5)
    got_p, got_l = train(f, args)
    chosen_after = len(searches)
    # the unpipelined search, each candidate's screen, the finalists: nothing searched again to run the choice
    assert chosen_after == 1 + len(CANDIDATES) + 2
    plan = f.plan(*args)
    assert len(searches) == chosen_after
    choice = plan.pipeline_choice
    assert choice is not None and choice.chosen == plan.pipeline
    if prefer == "pipelined":
        assert plan.pipeline is not None and plan.mesh_sizes["stage"] == plan.pipeline.stages
    planned = [c for c in choice.choices if c.name in ("unpipelined", "screened", "pipelined")
               and c.pipeline == plan.pipeline]
    assert plan.cost.step_time == min(c.time for c in planned)  # the chosen plan, priced as the choice priced it
    assert choice.summary().splitlines()[0] in plan.explain()
    want_p, want_l = train(jax.jit(step), args)
    assert np.allclose(want_l, got_l, rtol=1e-5, atol=0)
    for w, g in zip(jax.tree.leaves(want_p), jax.tree.leaves(got_p)):
        assert rel(w, g) <= 1e-5


def test_pipeline_true_errors():
    step, args = make_step(None), make_args()
    mesh = shardc.make_mesh({"stage": 2, "data": 4})
    with pytest.raises(shardc.ShardingError, match="leave mesh= out"):
        shardc.auto(step, mesh=mesh, pipeline=True)
    with pytest.raises(shardc.ShardingError, match="needs the search"):
        shardc.auto(step, pipeline=True, search=False)
    with pytest.raises(shardc.ShardingError, match="plan_for"):  # priced for 64 devices, run on 8
        shardc.auto(step, pipeline=True, topology="h100-sxm-8x8").plan(*args)
    p, s, x, y = args
    with pytest.raises(shardc.ShardingError, match="keyword arguments"):
        shardc.auto(step, pipeline=True, topology="h100-sxm-8").plan(p, s, x, y=y)
