"""On small spaces (<= 8 decision ops, 4 devices) MCMC and DP find the optimum brute force finds."""
import jax

from shardc.search.dp import chain_dp
from shardc.search.evaluate import Evaluator
from shardc.search.mcmc import mcmc
from shardc.search.space import build_space
from shardc.sharding import make_mesh
from search_models import mlp_args, mlp_forward, problem_of


def _setup():
    pb = problem_of(mlp_forward, mlp_args())
    mesh = make_mesh({"data": 2, "model": 2}, jax.devices()[:4])
    space = build_space(pb.graph, dict(mesh.shape), inputs=False)
    assert 1 <= sum(len(g.members) for g in space.groups) <= 8
    return Evaluator(pb, mesh, space, [])


def _brute(ev):
    return min(ev.space.all_assignments(), key=lambda a: (ev.score(a).key, a))


def test_mcmc_finds_the_brute_force_optimum():
    ev = _setup()
    best = _brute(ev)
    a, s, stats = mcmc(ev, [ev.space.neutral()], seed=3, max_steps=1500)
    assert s.key == ev.score(best).key, (a, best, stats)


def test_dp_is_exact_on_a_two_decision_chain():
    ev = _setup()
    assert len(ev.space.groups) == 2
    best = _brute(ev)
    a, s = chain_dp(ev, ev.space.neutral())
    assert s.time <= ev.score(best).time * (1 + 1e-9)


def test_search_beats_replicated():
    ev = _setup()
    a, s, _ = mcmc(ev, [ev.space.neutral()], seed=0, max_steps=300)
    assert s.time < ev.score(ev.space.neutral()).time


def test_dp_then_mcmc_find_the_optimum_of_a_three_layer_chain():
    import jax.numpy as jnp

    def f(x, w1, w2, w3):
        return jnp.tanh(jnp.tanh(jnp.tanh(x @ w1) @ w2) @ w3)

    pb = problem_of(f, (jnp.ones((512, 256)), jnp.ones((256, 1024)), jnp.ones((1024, 256)), jnp.ones((256, 512))))
    mesh = make_mesh({"data": 2, "model": 2}, jax.devices()[:4])
    ev = Evaluator(pb, mesh, build_space(pb.graph, dict(mesh.shape), inputs=False), [])
    assert len(ev.space.groups) == 3
    best = ev.score(_brute(ev))
    start, _ = chain_dp(ev, ev.space.neutral())
    a, s, _ = mcmc(ev, [start], seed=1, max_steps=800)
    assert s.key == best.key
