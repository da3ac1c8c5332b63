"""The search's cheap evaluations (continued propagation, incremental plan building, delta simulation)
give exactly what a from-scratch evaluation gives; plans for more devices than the host are simulated
but refuse to run."""
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardc
from bench.gpt import make_train_step
from annotations.errors import ShardingError
from search_models import graph_of
from shardc.plan import PlanBuilder, abstract_mesh, build_plan, require_devices, topology_pricer
from shardc.propagate import Cause, Seed, propagate
from shardc.lower import jit_plan
from shardc.search.baselines import BASELINES, baseline_seeds
from shardc.search.driver import _mesh_of, search_plan
from shardc.search.evaluate import Evaluator, Problem
from shardc.search.space import build_space, seeds_for
from shardc.sim import Simulator, as_topology


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(d, name=n)(h).reshape(b, s, 2, d // 2) for n in "qkv")
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        x = x + nn.Dense(d, name="o")(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d))
        return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x))))


class _LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(32, 16)(ids)
        for _ in range(2):
            x = _Block()(x)
        return nn.Dense(32)(x)


def _train_step_graph():
    model, tx = _LM(), optax.adam(1e-3)
    ids = jnp.zeros((8, 9), jnp.int32)
    params = model.init(jax.random.key(0), ids[:, :-1])["params"]
    opt = tx.init(params)

    step = make_train_step(model, tx)  # next-token cross-entropy, optax update

    flat = jax.tree_util.tree_leaves((params, opt, ids))
    return graph_of(lambda *xs: jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure((params, opt, ids)), xs))), flat)


def _timeline(r):
    return (r.makespan_ps, r.starts, r.ends, r.binds, r.payload, r.xla_payload, r.wire, r.flops, r.xla_flops,
            r.memory)


def _same_plan(a, b):
    assert a.shardings == b.shardings
    assert a.strategies == b.strategies
    assert a.origins == b.origins
    assert a.reshards == b.reshards


@pytest.mark.parametrize("sizes", [{"data": 2, "model": 4}, {"data": 2, "model": 2, "expert": 2}])
def test_incremental_evaluation_equals_full_evaluation(sizes):
    g, closed, names, outs = _train_step_graph()
    ids = g.inputs[-1]
    user = [Seed(ids, (("data",), None), Cause("hint", "batch"))]
    problem = Problem(g, user, "h100-sxm-8", names, outs, (), (), closed)
    mesh = _mesh_of(sizes)
    space = build_space(g, sizes, user)
    assert len(space.groups) >= 4
    ev = Evaluator(problem, mesh, space, user)
    topo = as_topology("h100-sxm-8")
    rng = random.Random(0)
    a = space.neutral()
    steps = [baseline_seeds(n, g, sizes, user) for n in BASELINES]
    steps = [s for s in steps if s is not None]
    for _ in range(14):  # random one- and two-decision moves, then the baselines' big jumps
        for _ in range(rng.choice((1, 1, 2))):
            gi = rng.randrange(len(space.groups))
            a = a[:gi] + (rng.randrange(space.groups[gi].size),) + a[gi + 1:]
        steps.insert(rng.randrange(len(steps) + 1), seeds_for(space, a, user))
    for _ in range(6):  # back to earlier states, as MCMC does after a rejected proposal (memoised slots)
        steps.insert(rng.randrange(len(steps) + 1), rng.choice(steps))
    checked = 0
    for extra in steps:
        try:
            full_prop = propagate(g, sizes, user + list(extra))
        except ShardingError:
            with pytest.raises(ShardingError):
                ev.plan_with(extra)
            continue
        inc = ev.plan_with(extra)
        full = build_plan(g, mesh, full_prop, input_names=names, output_names=outs,
                          price=topology_pricer(topo, sizes))  # (the search weighs op layouts on its topology)
        _same_plan(inc, full)
        r_inc = ev.score_plan(inc)[1]
        r_full = Simulator(g, topo, topo.map_mesh(sizes), sizes, device_shapes=False).full(full)  # (as the search's)
        assert r_inc.step_time == r_full.step_time
        assert r_inc.peak_memory == r_full.peak_memory
        assert r_inc.comm_bytes == r_full.comm_bytes
        assert _timeline(r_inc) == _timeline(r_full)
        checked += 1
    assert checked >= 14


def test_plan_builder_rebuild_from_any_state():
    """Building B after A incrementally equals building B from scratch, whatever A was."""
    g, *_ = _train_step_graph()
    sizes = {"data": 2, "model": 4}
    mesh = _mesh_of(sizes)
    space = build_space(g, sizes, [])
    rng = random.Random(1)
    props = []
    for _ in range(4):
        a = tuple(rng.randrange(grp.size) for grp in space.groups)
        props.append(propagate(g, sizes, seeds_for(space, a)))
    pb = PlanBuilder(g, mesh)
    for p in props + props[::-1]:
        _same_plan(pb.build(p, changed=range(len(g.values))), build_plan(g, mesh, p))


def test_plan_for_more_devices_than_the_host():
    g, closed, names, outs = _train_step_graph()
    problem = Problem(g, [], "h100-sxm-8x2", names, outs, (), (), closed)
    plan, report = search_plan(problem, [{"data": 4, "model": 4}], budget_s=None, max_steps=5, progress=False)
    assert isinstance(plan.mesh, jax.sharding.AbstractMesh) and plan.mesh_sizes == {"data": 4, "model": 4}
    assert shardc.simulate(plan, "h100-sxm-8x2").step_time > 0
    assert "data" in plan.explain()
    with pytest.raises(ShardingError, match="this plan is for 16 devices"):
        require_devices(plan)
    with pytest.raises(ShardingError, match="this plan is for 16 devices"):
        jit_plan(plan, closed)
    require_devices(build_plan(g, _mesh_of({"data": 8}), propagate(g, {"data": 8}, [])))  # real devices: fine
    assert abstract_mesh({"a": 2, "b": 8}).shape == {"a": 2, "b": 8}


def test_plan_for_a_topology_larger_than_the_host_and_running_it_is_an_error():
    from search_models import mlp_args, mlp_forward

    args = mlp_args(64, 32, 64)
    plan = shardc.plan_for(mlp_forward, *args, topology="h100-sxm-8x2", budget_s=2)
    assert isinstance(plan.mesh, jax.sharding.AbstractMesh) and plan.mesh.size == 16
    assert plan.search is not None and plan.cost is not None
    f = shardc.auto(mlp_forward, search=True, topology="h100-sxm-8x2", devices=16, budget_s=2)
    with pytest.raises(ShardingError, match="this plan is for 16 devices .* but this process has 8"):
        f(*args)
    with pytest.raises(ShardingError, match="needs a positive int and search=True"):
        shardc.auto(mlp_forward, devices=16, search=False)


def test_meshes_ordering_the_same_axes_differently_share_propagation_exactly():
    g, closed, names, outs = _train_step_graph()
    problem = Problem(g, [], "h100-sxm-8", names, outs, (), (), closed)
    topo = as_topology("h100-sxm-8")
    evs = []
    for sizes in ({"data": 2, "model": 4}, {"model": 4, "data": 2}):
        mesh = _mesh_of(sizes)
        evs.append((sizes, mesh, Evaluator(problem, mesh, build_space(g, sizes, []), [])))
    assert evs[0][2]._base is None
    rng = random.Random(2)
    for k in range(6):
        sizes, mesh, ev = evs[k % 2]
        a = tuple(rng.randrange(grp.size) for grp in ev.space.groups)
        extra = seeds_for(ev.space, a)
        inc = ev.plan_with(extra)
        full = build_plan(g, mesh, propagate(g, sizes, extra), input_names=names, output_names=outs,
                          price=topology_pricer(topo, sizes))
        _same_plan(inc, full)
        assert list(inc.mesh_sizes) == list(sizes)
        assert _timeline(ev.score_plan(inc)[1]) == _timeline(
            Simulator(g, topo, topo.map_mesh(sizes), sizes, device_shapes=False).full(full))  # (as the search's)
    assert evs[0][2]._base is evs[1][2]._base  # one propagation of the user's hints for both orders
