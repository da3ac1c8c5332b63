"""The budget: `budget_s` becomes a number of simulated plans, so the plan does not depend on how fast or how
busy the machine is; a wall-clock cap only when asked for (time_cap / time_cap_s), and it says so."""
import time
import warnings

import jax
import pytest

import shardc
from shardc.search.budget import Budget, SearchTimeCapWarning, plans_for
from shardc.search.driver import search_plan
from shardc.search.evaluate import Evaluator
from search_models import mlp_args, mlp_forward, problem_of

MESHES = [{"data": 4}, {"data": 2, "model": 2}]


def _step(x, w1, w2):
    l, g = jax.value_and_grad(lambda w1, w2: mlp_forward(x, w1, w2).mean(), argnums=(0, 1))(w1, w2)
    return w1 - g[0], w2 - g[1], l


def _slowed(monkeypatch, seconds: float) -> None:
    """Every evaluation takes `seconds` longer (a busy machine)."""
    real = Evaluator.score_plan

    def slow(self, plan):
        time.sleep(seconds)
        return real(self, plan)

    monkeypatch.setattr(Evaluator, "score_plan", slow)


def test_plan_budget_grows_with_seconds_and_shrinks_with_program_size():
    assert plans_for(6.0, 6000, 8) > plans_for(6.0, 6000, 64) > 20
    assert plans_for(12.0, 6000, 8) >= 2 * plans_for(6.0, 6000, 8) - 1
    assert plans_for(6.0, 300, 8) > 5 * plans_for(6.0, 6000, 8)
    assert plans_for(0.001, 6000, 8) == 20  # a floor, so tiny budgets still search


def test_a_slower_machine_gives_the_same_plan(monkeypatch):
    pb = problem_of(_step, mlp_args())
    fast, rep_fast = search_plan(pb, MESHES, budget_s=2.0, seed=3, progress=False)
    _slowed(monkeypatch, 0.01)
    t = time.perf_counter()
    # no cap by default (one process: the sleeps then add up)
    slow, rep_slow = search_plan(pb, MESHES, budget_s=2.0, seed=3, progress=False, workers=1)
    assert time.perf_counter() - t > rep_slow.evaluations * 0.01  # it really was slower
    assert rep_fast.plan_budget == rep_slow.plan_budget
    assert rep_fast.evaluations == rep_slow.evaluations  # the same work, not the same seconds
    assert fast.fingerprint() == slow.fingerprint() and fast.mesh_sizes == slow.mesh_sizes
    assert not rep_fast.capped and not rep_slow.capped


def test_the_time_cap_stops_a_far_slower_search_and_flags_it(monkeypatch):
    pb = problem_of(_step, mlp_args())
    _slowed(monkeypatch, 0.05)
    plan, rep = search_plan(pb, MESHES, budget_s=0.3, seed=0, progress=False, time_cap=True)
    # the cap stops the search phase (fewer plans simulated than the budget allows); the baselines of the
    # first meshes are still scored. (No wall-clock bound: it failed on a busy machine, 3.6 s against 3.0.)
    assert rep.capped and rep.evaluations < rep.plan_budget
    assert "time cap" in rep.summary()
    feasible = [c.score.time for c in rep.baselines if c.score.feasible]
    assert rep.chosen.score.time <= min(feasible)  # still never worse than a baseline it scored


def test_auto_warns_when_the_cap_decided(monkeypatch):
    x, w1, w2 = mlp_args()
    _slowed(monkeypatch, 0.05)
    f = shardc.auto(lambda x, w1, w2: mlp_forward(x, w1, w2), mesh=shardc.make_mesh({"data": 4, "model": 2}),
                    budget_s=0.2, time_cap_s=0.2, seed=11)
    with pytest.warns(SearchTimeCapWarning, match="time_cap_s=0.2 s.*may differ from another run's"):
        f.plan(x, w1, w2)
    assert "stopped by the time cap" in f.plan(x, w1, w2).explain()


def test_auto_has_no_time_cap_by_default(monkeypatch):
    """@shardc.auto's search slowed far past its budget's seconds does the same work and plans the same."""
    import shardc.search.integrate as integrate

    x, w1, w2 = mlp_args()
    mesh = shardc.make_mesh({"data": 4, "model": 2})
    runs = []
    for delay in (0.0, 0.05):
        monkeypatch.setattr(integrate, "_PLAN_CACHE", {})  # plan again, not from this process's plan cache
        if delay:
            _slowed(monkeypatch, delay)
        f = shardc.auto(lambda x, w1, w2: mlp_forward(x, w1, w2), mesh=mesh, budget_s=0.2, seed=11)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SearchTimeCapWarning)
            t = time.perf_counter()
            plan = f.plan(x, w1, w2)
            runs.append((plan, time.perf_counter() - t))
    (quick, _), (slow, seconds) = runs
    assert seconds > 3 * 0.2  # far past budget_s (the old default cap: budget_s)
    assert not slow.search.capped and slow.search.evaluations == quick.search.evaluations
    assert slow.fingerprint() == quick.fingerprint()


def test_budget_none_is_unbounded_and_uncapped():
    b = Budget.for_search(None, None, 8)
    assert b.plans is None and b.cap_s is None and b.left == float("inf") and not b.out_of_time()


def test_the_report_counts_every_scored_plan_and_says_which_meshes_went_unscored(monkeypatch):
    """Every simulated plan is counted (also the baselines on meshes the search did not go on to search),
    and a budget too small for every candidate mesh says how many it scored."""
    calls = []
    real = Evaluator.score_plan
    monkeypatch.setattr(Evaluator, "score_plan", lambda self, plan: (calls.append(1), real(self, plan))[1])
    pb = problem_of(_step, mlp_args())
    meshes = [{"data": 8}, {"data": 4, "model": 2}, {"data": 2, "model": 4}, {"model": 8}, {"model": 4, "data": 2},
              {"model": 2, "data": 4}]
    _, rep = search_plan(pb, meshes, budget_s=0.01, seed=0, progress=False, max_meshes=1)
    assert rep.evaluations >= len(calls)
    assert len(rep.meshes) < len(meshes) and rep.candidate_meshes == len(meshes)
    assert f"over {len(rep.meshes)} of {len(meshes)} mesh shape(s)" in rep.summary()
    assert "raise budget_s" in rep.summary()


def test_baselines_that_seed_alike_are_scored_once(monkeypatch):
    import shardc.search.mesh_work as mesh_work

    real_seeds = mesh_work.baseline_seeds
    monkeypatch.setattr(mesh_work, "baseline_seeds",  # FSDP made to seed what data parallelism seeds
                        lambda name, *a: real_seeds("data-parallel" if name == "fsdp" else name, *a))
    pb = problem_of(_step, mlp_args())
    runs = {}
    for names in (("data-parallel",), ("data-parallel", "fsdp")):
        _, rep = search_plan(pb, [{"data": 8}], budget_s=None, max_steps=5, seed=0, progress=False, baselines=names)
        runs[names] = rep
    one, two = runs[("data-parallel",)], runs[("data-parallel", "fsdp")]
    assert two.evaluations == one.evaluations
    scores = {c.name: c.score for c in two.baselines}
    assert scores["fsdp"] == scores["data-parallel"]


def test_the_budget_has_no_clock_unless_asked():
    from shardc.search.integrate import default_budget

    pb = problem_of(_step, mlp_args())
    b = Budget.for_search(default_budget(64), pb.graph, 64)
    assert b.plans == plans_for(default_budget(64), len(pb.graph.ops), 64) and b.cap_s is None
    assert Budget.for_search(6.0, pb.graph, 8, cap=False).cap_s is None
    assert Budget.for_search(6.0, pb.graph, 8, cap=True).cap_s == 6.0
    assert Budget.for_search(6.0, pb.graph, 8, cap=2.5).cap_s == 2.5


def test_a_program_without_hints_is_not_said_to_have_them():
    import dataclasses

    pb = problem_of(_step, mlp_args())  # no hints
    _, rep = search_plan(pb, [{"data": 8}], budget_s=0.01, seed=0, progress=False)
    assert not rep.user_hinted
    hints = next(c for c in rep.baselines if c.name == "hints")
    text = dataclasses.replace(rep, chosen=hints).summary()
    assert "the program has no hints, so this is plain propagation" in text

    from shardc.propagate import Cause, Seed

    hint = Seed(0, (("data",), None), Cause("hint", "split(x, 0, 'data')"), 0)  # the batch, as a user's hint
    _, rep = search_plan(problem_of(_step, mlp_args(), seeds=[hint]), [{"data": 8}], budget_s=0.01, seed=0,
                         progress=False)
    assert rep.user_hinted
    hints = next(c for c in rep.baselines if c.name == "hints")
    assert "no hints" not in dataclasses.replace(rep, chosen=hints).summary()
