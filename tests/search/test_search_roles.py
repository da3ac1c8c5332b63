"""Role mixes: one baseline's choices for the parameters, another's for the optimizer state (ZeRO-1/2 is
data parallel's parameters with FSDP's moments), tried by the search as whole plans."""
import jax
import jax.numpy as jnp
import optax

from shardc.search.baselines import parameter_inputs, role_mixes, baseline_seeds, state_inputs
from shardc.search.driver import _mesh_of, search_plan
from shardc.search.evaluate import plan_from_seeds
from search_models import mlp_forward, problem_of

TX = optax.adam(1e-3)


def _args(b=256, d=512, f=2048):
    x = jnp.ones((b, d)) * 0.01
    params = {"w1": jnp.ones((d, f)) * 0.01, "w2": jnp.ones((f, d)) * 0.01}
    return params, TX.init(params), x


def _step(params, opt_state, x):
    loss, grads = jax.value_and_grad(lambda p: mlp_forward(x, p["w1"], p["w2"]).mean())(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def test_parameters_are_the_carried_inputs_the_loss_depends_on():
    pb = problem_of(_step, _args())
    g = pb.graph
    params = parameter_inputs(g)
    shapes = sorted(g.values[v].shape for v in params)
    assert shapes == [(512, 2048), (2048, 512)]  # w1, w2: not Adam's moments nor its step count
    rest = set(state_inputs(g)) - set(params)
    assert len(rest) == 5  # mu and nu of w1 and w2, and the count


def test_zero1_mix_replicates_parameters_and_shards_moments():
    pb = problem_of(_step, _args(b=8192))  # many tokens: gradients, not activations, should move
    g, sizes = pb.graph, {"data": 8}
    sets = {n: baseline_seeds(n, g, sizes) for n in ("data-parallel", "fsdp")}
    mixes = dict(role_mixes(g, sets))
    seeds = mixes["data-parallel parameters + fsdp state"]
    plan = plan_from_seeds(pb, _mesh_of(sizes), seeds)
    for v in parameter_inputs(g):
        assert plan.shardings[v].dims == ((), ()), plan.shardings[v]
    moments = [v for v in set(state_inputs(g)) - set(parameter_inputs(g)) if g.values[v].rank == 2]
    assert moments and all(any(plan.shardings[v].dims) for v in moments)
    big = [r for r in plan.reshards if g.values[r.value].shape in ((512, 2048), (2048, 512))]
    # gradients reduced into shards (a reduce-scatter; XLA:CPU all-reduces and slices), updated weights gathered
    assert any(r.src.partial and r.dst.axes() and r.kind in ("reduce-scatter", "all-reduce") for r in big)
    assert any(r.kind == "all-gather" and not r.dst.axes() for r in big)


def test_search_tries_role_mixes_and_keeps_the_best():
    pb = problem_of(_step, _args())
    plan, rep = search_plan(pb, [{"data": 8}], budget_s=None, max_steps=30, method="mcmc", progress=False)
    best_baseline = min(c.score.time for c in rep.baselines if c.score.feasible)
    assert rep.chosen.score.time <= best_baseline
    # the mix is a candidate: the result is at least as good as ZeRO-1 on this mesh
    g = pb.graph
    sets = {n: baseline_seeds(n, g, {"data": 8}) for n in ("data-parallel", "fsdp")}
    zero1 = plan_from_seeds(pb, _mesh_of({"data": 8}), dict(role_mixes(g, sets))["data-parallel parameters + fsdp state"])
    from shardc.sim import simulate
    assert rep.chosen.score.time <= simulate(zero1, "h100-sxm-8").step_time + 1e-12


def test_carried_state_keeps_its_layout_whatever_the_seeds():
    """Seeds on the inputs alone (parameters replicated, moments sharded) let propagation lay the updated
    parameters out like the moments; the plan still returns them as they came, with the all-gather that
    costs, so step 2 starts where step 1 did and the simulator sees that collective."""
    from shardc.search.baselines import consistent_carry
    pb = problem_of(_step, _args(b=8192))
    g, sizes = pb.graph, {"data": 8}
    params = set(parameter_inputs(g))
    seeds = ([s for s in baseline_seeds("data-parallel", g, sizes) if s.value not in set(state_inputs(g)) - params]
             + [s for s in baseline_seeds("fsdp", g, sizes) if s.value in set(state_inputs(g)) - params])
    plan = plan_from_seeds(pb, _mesh_of(sizes), seeds)
    assert consistent_carry(g, plan)
    gathers = [r for r in plan.reshards if r.kind == "all-gather" and g.values[r.value].shape in ((512, 2048), (2048, 512))]
    assert len(gathers) == 2


def test_fsdp_gathers_the_weights_and_keeps_the_batch_layout_without_hints():
    """FSDP (ZeRO-3) computes data parallel with the state stored sharded: on a program without hints the
    state's seeds come after the batch's (priority 2), so every matmul with a weight reads its activations split on
    the batch and gets its weight gathered; before, the weights' splits were propagated into the activations
    (moe-auto's FSDP row: 67.5 ms -> 40.6 ms on h100-sxm-8)."""
    from shardc.search.baselines import STORAGE_PRIORITY, baseline_plan

    pb = problem_of(_step, _args(b=512, d=1024, f=1024))
    g = pb.graph
    seeds = baseline_seeds("fsdp", g, {"data": 8})
    state = set(state_inputs(g))
    assert {s.priority for s in seeds if s.value in state} == {STORAGE_PRIORITY}
    plan = baseline_plan("fsdp", pb, _mesh_of({"data": 8}))
    forward = [op for op in g.ops if op.primitive == "dot_general" and op.inputs[1] in state]
    assert len(forward) == 3  # the two forward matmuls and one backward (dy @ w2^T)
    for op in forward:
        assert plan.shardings[op.inputs[0]].dims[0] == ("data",), plan.shardings[op.inputs[0]]
        assert plan.strategies[op.id].factor_axes[0] == ("data",)
    assert any(r.kind == "all-gather" and r.value in state for r in plan.reshards)


def test_role_mixes_follow_the_given_order_and_skip_a_baselines_own_seeds():
    """The driver passes the baselines fastest first, so that a small plan budget scores the mixes of the best
    ones; a mix whose seeds are a baseline's own (data parallel's parameters with a copy of data parallel's
    state) is that baseline, already scored."""
    g = problem_of(_step, _args()).graph
    sizes = {"data": 8}
    sets = {n: baseline_seeds(n, g, sizes) for n in ("data-parallel", "fsdp")}
    forward = [label for label, _ in role_mixes(g, sets)]
    backward = [label for label, _ in role_mixes(g, dict(reversed(list(sets.items()))))]
    assert forward == ["data-parallel parameters + fsdp state", "fsdp parameters + data-parallel state"]
    assert backward == list(reversed(forward))
    twin = dict(sets, copy=list(sets["data-parallel"]))
    labels = [label for label, _ in role_mixes(g, twin)]
    assert "data-parallel parameters + copy state" not in labels and "copy parameters + data-parallel state" \
        not in labels
    assert len(labels) == len(set(tuple(sorted((s.value, s.dims, s.priority) for s in seeds))
                                  for _, seeds in role_mixes(g, twin)))
