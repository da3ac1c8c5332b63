"""Rules on two axes groups (`op@B`, `reduce@AB`): proved on device grids (shardc/pcg/grid.py), wrong ones
refuted, and each library rule of the family firing on a real plan's PCG under the simulator, the rewritten
PCG computing the same numbers with exactly the collectives it names."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc import replicate, split
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg, optimize
from shardc.pcg.lang import RuleSyntaxError, parse_rule
from shardc.pcg.library import library_rules
from shardc.pcg.simcost import SimCost
from shardc.pcg.verify import verify_rule


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


@pytest.mark.parametrize("text", [
    "ok: partition[d]@B(reduce@AB(x)) => reduce(reduce_scatter[d]@B(x))",
    "ok: partition[e]@B(partition[d](combine[e]@B(reduce(x)))) => reduce_scatter[d](x) if d != e",
    "ok: partition[e](reduce@B(x)) => reduce@B(partition[e](x))",
    "ok: partition[e](partition[d]@B(reduce@AB(x))) => reduce_scatter[d]@B(reduce_scatter[e](x)) if d != e",
])
def test_two_group_rules_are_proved(text):
    (rule,) = parse_rule(text)
    assert rule.two_groups and verify_rule(rule, use_cache=False, use_record=False).proved


@pytest.mark.parametrize("text", [
    "bad: partition[d]@B(reduce@AB(x)) => reduce@B(reduce_scatter[d](x))",  # the groups swapped
    "bad: partition[e]@B(partition[d](combine[e]@B(reduce(x)))) => reduce_scatter[d](x)",  # d == e too
    "bad: partition[d]@B(partition[d](x)) => partition[d](partition[d]@B(x))",  # slices of one dim do not commute
    "bad: reduce@B(reduce(x)) => reduce(x)",
])
def test_wrong_two_group_rules_are_refuted(text):
    (rule,) = parse_rule(text)
    v = verify_rule(rule, use_cache=False, use_record=False)
    assert not v.proved and v.counterexample


def test_two_group_syntax():
    (r,) = parse_rule("r: partition[d]@B(reduce@AB(x)) => reduce@A(reduce_scatter[d]@B(x))")
    assert r.text == "partition[d]@B(reduce@AB(x)) => reduce(reduce_scatter[d]@B(x))"  # @A is the default
    assert parse_rule(r.name + ": " + r.text)[0].text == r.text
    for bad in ("r: partition[d]@AB(x) => partition[d]@AB(x)",  # only reduce acts on both groups
                "r: partition[d]@B(x) => partition[d]@B(x)",  # the left side binds one group
                "r: add@B(x, y) => add(x, y)"):  # groups are for parallel ops
        with pytest.raises(RuleSyntaxError):
            parse_rule(bad)


def _optimized(f, mesh, *args):
    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)
    sim = SimCost("h100-sxm-8")
    res = optimize(pcg, library_rules(), cost_fn=sim)
    assert res.cost == sim(res.pcg) < sim(pcg)
    fn = lower_pcg(res.pcg)
    for a, b in zip(fn(*args), jax.tree.leaves(f(*args)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert hlo_collectives(fn.lower(*args).compile().as_text()) == res.pcg.collectives()
    return pcg, res


def test_all_reduce_gather_and_slices_become_one_reduce_scatter(mesh):
    def f(x, w):  # partial sums over data, stored replicated, read split over (data, model)
        y = replicate(split(x, 1, "data") @ split(w, 1, "model"))
        return split(split(jnp.sin(y), 0, "data"), 1, "model")

    k = jax.random.split(jax.random.key(0), 2)
    pcg, res = _optimized(f, mesh, jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 64)))
    assert pcg.collectives() == collections.Counter({"all-reduce": 1, "all-gather": 1})
    assert [s.rule for s in res.steps] == ["reduce_gather_slice"]
    assert res.pcg.collectives() == collections.Counter({"reduce-scatter": 1})


def test_all_reduce_over_both_groups_then_slice(mesh):
    def f(x):  # sums over a dim split over (data, model), read split over model
        s = jnp.sum(split(x, 0, ("data", "model")) * 2.0, axis=0)
        return split(jnp.sin(replicate(s)), 0, "model")

    pcg, res = _optimized(f, mesh, jax.random.normal(jax.random.key(1), (16, 256)))
    assert [str(n.op) for n in pcg.nodes if n.is_parallel] == ["reduce[data+model]", "partition[0,model]"]
    assert "reduce_split_scatter" in [s.rule for s in res.steps]
    assert res.pcg.collectives() == collections.Counter({"reduce-scatter": 1, "all-reduce": 1})


def test_slice_over_one_group_before_an_all_reduce_over_the_other(mesh):
    def f(x):
        s = jnp.sum(split(x, 0, "data") * 2.0, axis=0)
        return split(jnp.sin(replicate(s)), 0, "model")

    pcg, res = _optimized(f, mesh, jax.random.normal(jax.random.key(2), (16, 4096)))
    assert [s.rule for s in res.steps] == ["reduce_slice_other"]
    (ar,) = res.pcg.communication()
    (before,) = pcg.communication()
    assert ar.collective == before.collective == "all-reduce" and ar.in_bytes * 4 == before.in_bytes


def test_all_reduce_over_both_groups_then_slices_over_each_become_two_reduce_scatters(mesh):
    def f(x):  # weight-gradient-like: summed over a dim split over (data, model), read split [model, data]
        s = jnp.sum(split(x, 0, ("data", "model")) * 2.0, axis=0)
        return split(split(jnp.sin(replicate(s)), 0, "model"), 1, "data")

    pcg, res = _optimized(f, mesh, jax.random.normal(jax.random.key(3), (16, 64, 256)))
    assert [str(n.op) for n in pcg.nodes if n.is_parallel] == ["reduce[data+model]", "partition[0,model]",
                                                                "partition[1,data]"]
    assert "reduce_split_scatter2" in [s.rule for s in res.steps]
    assert res.pcg.collectives() == collections.Counter({"reduce-scatter": 2})


def test_a_simulation_budget_goes_first_to_rewrites_that_remove_collectives(mesh):
    """Each pass simulates the rewrites of rules that leave fewer collectives first, and a budget running out
    mid-pass keeps the best rewrite that paid: with two simulations (the PCG's own and one more) the
    reduce-scatter is found, though four candidates (all-to-alls split, a slice moved) come first in rule
    order."""
    def f(x, w, v):
        y = replicate(split(x, 1, "data") @ split(w, 1, "model"))
        z = split(jnp.tanh(split(v, 0, "model")), 1, "model")
        u = jnp.exp(split(jnp.sin(split(v, 1, "model")), 0, "model"))
        return split(split(jnp.sin(y), 0, "data"), 1, "model"), z, u

    k = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 64)), jax.random.normal(k[2], (64, 64)))
    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)
    assert [s.rule for s in optimize(pcg, max_evaluations=2).steps] == ["reduce_gather_slice"]
    assert "reduce_gather_slice" in [s.rule for s in optimize(pcg).steps]
