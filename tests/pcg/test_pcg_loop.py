"""The substitution engine in the planning loop (`shardc.auto(pcg=True)`, shardc/pcg/choice.py): the plan's
PCG rewritten with proved rules runs when the simulator says it is faster — its compiled collectives are
the PCG's and its results those of jax.jit(step) — and plan.explain() lists the rewrites."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardc
from shardc import ShardingError, split
from shardc.pcg import build_pcg, hlo_collectives, simulate_pcg
from shardc.pcg.choice import choose_pcg
from shardc.sim import simulate

TOPO = "h100-sxm-8"


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4}, jax.devices()[:8])


def two_branch(x, w1, w2):
    """Two Megatron row-parallel matmuls whose partial sums meet in an add: the plan reduce-scatters each
    (the output is split over model); proved rules merge the two into one after the add and fuse the dots."""
    x = split(x, 0, "data")
    x = split(x, 1, "model")
    w1, w2 = split(w1, 0, "model"), split(w2, 0, "model")
    y = x @ w1 + jnp.tanh(x) @ w2
    return split(jnp.tanh(y), 1, "model")


@pytest.fixture(scope="module")
def args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (256, 512)), jax.random.normal(k[1], (512, 512)) / 20,
            jax.random.normal(k[2], (512, 512)) / 20)


def test_rewritten_pcg_runs_with_its_collectives_and_jit_numbers(mesh, args):
    af = shardc.auto(two_branch, mesh=mesh, search=False, pcg=True, topology=TOPO)
    plan = af.plan(*args)
    ch = plan.pcg
    assert ch.chosen and ch.steps
    # the unrewritten PCG is priced as the plan is; the gain comes from the rewrites
    assert ch.pcg_time == pytest.approx(ch.plan_time, rel=0.01)
    assert ch.time < ch.plan_time and ch.time == pytest.approx(simulate_pcg(ch.pcg, TOPO).step_time)
    assert all(s.cost_before > 0 for s in ch.steps) and ch.steps[-1].cost_after == ch.time
    c = af.compiled_info(*args)
    hlo = hlo_collectives(c.jitted.lower(*args).compile().as_text())
    assert hlo == ch.pcg.collectives() and hlo != build_pcg(plan, fuse=True, reduce_scatter=True).collectives()
    np.testing.assert_allclose(af(*args), jax.jit(two_branch)(*args), rtol=1e-5, atol=1e-5)
    text = plan.explain()
    assert "PCG rewrites" in text and "the rewritten PCG runs" in text
    assert ch.steps[0].rule in text and "test_pcg_loop.py:" in text  # rule name and the user's source line


def test_pcg_off_by_default_and_checked(mesh, args):
    plan = shardc.auto(two_branch, mesh=mesh, search=False, topology=TOPO).plan(*args)
    assert plan.pcg is None and "PCG rewrites" not in plan.explain()
    with pytest.raises(ShardingError, match="pcg="):
        shardc.auto(two_branch, mesh=mesh, pcg="yes")


def test_rewrite_over_the_memory_limit_is_not_kept(mesh, args):
    """The rewritten PCG competes under the memory limit: a limit below every rewrite's peak keeps none."""
    plan = shardc.auto(two_branch, mesh=mesh, search=False, topology=TOPO).plan(*args)
    free = choose_pcg(plan, plan.program, TOPO)
    assert free.chosen
    tight = choose_pcg(plan, plan.program, TOPO, memory_limit=min(free.peak, simulate(plan, TOPO).peak_memory) - 1)
    assert not tight.chosen and not tight.steps and "no rewrite paid" in tight.summary()


def test_searched_train_step_with_pcg_equals_jit(mesh):
    """pcg=True on a searched plan of a train step (search, then rewriting): whichever wins runs, with
    jax.jit's numbers over two steps (carried state keeps its layout)."""

    def mlp(p, x):
        h = jnp.tanh(x @ p["w1"])
        return h @ p["w2"] + jnp.tanh(x) @ p["w3"]

    tx = optax.sgd(0.05)

    def step(p, opt, x, y):
        loss, g = jax.value_and_grad(lambda q: jnp.mean((mlp(q, x) - y) ** 2))(p)
        u, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, u), opt, loss

    k = jax.random.split(jax.random.key(1), 5)
    p = {"w1": jax.random.normal(k[0], (64, 128)) / 8, "w2": jax.random.normal(k[1], (128, 64)) / 8,
         "w3": jax.random.normal(k[2], (64, 64)) / 8}
    x, y = jax.random.normal(k[3], (32, 64)), jax.random.normal(k[4], (32, 64))
    opt = tx.init(p)
    af = shardc.auto(step, mesh=mesh, topology=TOPO, pcg=True, budget_s=1.0)
    plan = af.plan(p, opt, x, y)
    assert plan.pcg is not None and plan.pcg.time <= plan.pcg.pcg_time
    a, ref = (p, opt), (p, opt)
    for _ in range(2):
        *a, la = af(*a, x, y)
        *ref, lr = jax.jit(step)(*ref, x, y)
        np.testing.assert_allclose(la, lr, rtol=1e-5)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(ref)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_each_searched_mesh_competes_with_its_rewritten_pcg(args, monkeypatch):
    """With the mesh left to the search, every searched mesh's best plan competes with its rewritten PCG
    ("search+pcg" rows of the report): the fastest of all wins and runs. A rewriting made to pay 10x on the
    mesh that loses without it moves the choice there."""
    import shardc.pcg.choice as choice_mod
    import shardc.search.integrate as integrate

    # meshes where the plans communicate (on data=8 the step needs no collective: nothing to rewrite)
    monkeypatch.setattr(integrate, "mesh_candidates", lambda *a, **k: [{"data": 4, "model": 2}, {"data": 2, "model": 4}])
    af = shardc.auto(two_branch, pcg=True, topology=TOPO, budget_s=1.0)
    plan = af.plan(*args)
    report = plan.search
    rewritten = [c for c in report.baselines if c.name == "search+pcg"]
    assert rewritten and {tuple(c.mesh.items()) for c in rewritten} <= {tuple(m.items()) for m in report.meshes}
    assert all(report.chosen.score.key <= c.score.key for c in report.baselines)
    if report.chosen.name == "search+pcg":
        assert plan.pcg.chosen and plan.pcg.time == report.chosen.score.time
    # the plan's time the rewriting weighed is the search's score of it (not simulated again): a fresh simulation's
    assert plan.pcg is not None and plan.pcg.plan_time == simulate(plan, TOPO, donated=plan.donated).step_time
    plain = shardc.auto(two_branch, topology=TOPO, budget_s=1.0).plan(*args)
    loser = next(c.mesh for c in rewritten if c.mesh != dict(plain.mesh_sizes))

    real = choice_mod.choose_pcg
    calls = []

    def boosted(plan, *a, **k):
        calls.append(dict(plan.mesh_sizes))
        ch = real(plan, *a, **k)
        if dict(plan.mesh_sizes) == loser and ch.chosen:
            ch = dataclasses.replace(ch, time=ch.time / 10)
        return ch

    monkeypatch.setattr(choice_mod, "choose_pcg", boosted)
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "1")  # (a mesh is rewritten where it is searched: counted here)
    af = shardc.auto(two_branch, pcg=True, topology=TOPO, budget_s=1.0)
    plan = af.plan(*args)
    assert plan.search.chosen.name == "search+pcg" and dict(plan.mesh_sizes) == loser and plan.pcg.chosen
    assert sorted(map(str, calls)) == sorted(map(str, report.meshes))  # once per mesh: not again to run it
    c = af.compiled_info(*args)
    assert hlo_collectives(c.jitted.lower(*args).compile().as_text()) == plan.pcg.pcg.collectives()
    np.testing.assert_allclose(af(*args), jax.jit(two_branch)(*args), rtol=1e-5, atol=1e-5)
    assert "search+pcg" in plan.explain()


def test_a_plan_the_search_rewrote_is_not_rewritten_again(monkeypatch):
    """A 1-layer GPT train step whose hints' plan is also the search's best on its mesh, and wins (the search
    gains nothing over it): the rewriting that plan got as the mesh's best is the chosen plan's, not made again
    by `shardc.auto` (the 12-layer GPT planned with pcg=True rewrote its plan twice: 149 s, now 2 rewritings of 3)."""
    import shardc.pcg.choice as choice_mod
    from bench.gpt import make_train_step, setup
    from shardc.distributed import plan_digest

    real, digests = choice_mod.choose_pcg, []

    def counted(plan, *a, **k):  # (few simulations: no rewrite pays, and the test stays short)
        digests.append(plan_digest(plan))
        return real(plan, *a, **{**k, "max_evaluations": 4})

    monkeypatch.setattr(choice_mod, "choose_pcg", counted)
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "1")  # (a mesh is rewritten where it is searched: counted here)
    model, tx, params, opt, ids = setup(layers=1, batch=8, seq=16)
    plan = shardc.plan_for(make_train_step(model, tx), params, opt, ids, topology=TOPO, pcg=True, budget_s=1)
    assert plan.search.chosen.name in ("hints", "fsdp", "megatron", "data parallel")  # (not a searched plan)
    assert plan_digest(plan) in digests and plan.pcg is not None
    assert len(digests) == len(set(digests)), "a plan was rewritten twice"


def test_pcg_rewriting_of_a_plan_for_more_devices_than_the_host(monkeypatch, args):
    """`plan_for` on 64 GPUs (a mesh shape without devices) with pcg=True: the rewritten plans are told apart by
    their digests, which took the mesh's devices (a ValueError from the gpt48 zoo row on h100-sxm-8x8)."""
    import shardc.pcg.choice as choice_mod
    from shardc.distributed import plan_digest

    real = choice_mod.choose_pcg
    monkeypatch.setattr(choice_mod, "choose_pcg", lambda plan, *a, **k: real(plan, *a, **{**k, "max_evaluations": 4}))
    plan = shardc.plan_for(two_branch, *args, topology="h100-sxm-8x8", pcg=True, budget_s=0.5)
    assert math.prod(plan.mesh_sizes.values()) == 64 and len(plan_digest(plan)) == 32
    assert plan.pcg is not None  # (its rewriting, made by the search or for the plan chosen)


def test_a_chosen_pcg_runs_under_a_set_mesh_of_explicit_axes():
    """Flax's NNX examples call their train step under `jax.set_mesh` of a mesh with Explicit axes; a chosen PCG's
    `shard_map` lowering is traced there too and runs on its own mesh, as the plan's lowering does. Before, JAX
    refused the call (the context mesh must be the shard_map's): `shardc.auto(pcg=True)` on flax's Gemma example."""
    from jax.sharding import AxisType

    from shardc.pcg import lower_pcg
    from tests.pcg.test_pcg_simcost import two_layers, two_layers_args

    args = two_layers_args()
    pcg = build_pcg(shardc.plan(two_layers, *args, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=False))
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:8])
    with jax.set_mesh(explicit):
        (got,) = lower_pcg(pcg)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(two_layers(*args)), rtol=1e-4, atol=1e-3)
