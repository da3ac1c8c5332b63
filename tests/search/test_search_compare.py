"""What each decision group beat (shown by plan.explain()): the simulated difference of switching one group of
the chosen plan to a baseline's choice."""
import jax
import pytest

import shardc
from search_models import mlp_args, mlp_forward, problem_of
from shardc.search.baselines import baseline_plan
from shardc.search.compare import compare_groups
from shardc.search.evaluate import Evaluator, plan_from_seeds
from shardc.search.space import build_space, plan_choices, project_plan, seeds_for


def test_group_comparisons_are_the_simulated_difference():
    """Each 'faster than X's choice' is the simulated time of the chosen plan with that group switched to X's
    choice, minus the chosen plan's: recomputed here from scratch."""
    def step(x, w1, w2):
        l, g = jax.value_and_grad(lambda w1, w2: mlp_forward(x, w1, w2).mean(), argnums=(0, 1))(w1, w2)
        return w1 - g[0], w2 - g[1], l

    pb = problem_of(step, mlp_args(256, 128, 512), topology="cpu-host")
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    space = build_space(pb.graph, dict(mesh.shape))
    plans = {n: baseline_plan(n, pb, mesh) for n in ("megatron", "fsdp", "data-parallel")}
    choices = {n: plan_choices(space, p) for n, p in plans.items()}
    chosen = plans["megatron"]
    point = project_plan(space, chosen)
    ev = Evaluator(pb, mesh, space, [])
    time = shardc.simulate(chosen, "cpu-host").step_time
    notes = compare_groups(ev, point, chosen, time, choices)
    assert notes and any(n.beats for n in notes)
    for note in notes:
        gi = next(i for i, g in enumerate(space.groups) if g.members == note.members)
        assert "megatron" in note.same_as or plan_choices(space, chosen)[gi] == 0
        for who, dt in note.beats:
            alt = point[:gi] + (choices[who.split("/")[0]][gi],) + point[gi + 1:]
            again = plan_from_seeds(pb, mesh, seeds_for(space, alt))
            assert dt == pytest.approx(shardc.simulate(again, "cpu-host").step_time - time, rel=1e-9, abs=1e-12)
