"""The series-parallel DP: exact on series-parallel decision graphs (against brute force), both on explicit
pairwise costs and with the simulator as oracle on a program with a parallel branch (4 devices)."""
import random

import jax
import jax.numpy as jnp

from shardc.search.dp import brute_force, decision_graph, solve_pairwise, sp_dp
from shardc.search.evaluate import Evaluator
from shardc.search.space import build_space
from shardc.sharding import make_mesh
from search_models import problem_of


def _random_costs(n, edges, k, rng):
    domains = [list(range(k)) for _ in range(n)]
    unary = [{x: rng.uniform(0, 10) for x in range(k)} for _ in range(n)]
    pair = {e: {(x, y): rng.uniform(0, 10) for x in range(k) for y in range(k)} for e in edges}
    return domains, unary, pair


def _value(x, unary, pair):
    return sum(unary[v][x[v]] for v in range(len(unary))) + sum(t[(x[a], x[b])] for (a, b), t in pair.items())


def test_pairwise_elimination_is_exact_on_series_parallel_graphs():
    rng = random.Random(0)
    graphs = {
        "chain": [(0, 1), (1, 2), (2, 3), (3, 4)],
        "diamond": [(0, 1), (0, 2), (1, 3), (2, 3)],
        "residual": [(0, 1), (1, 2), (0, 2), (2, 3), (3, 4), (2, 4)],  # two skip connections
        "nested": [(0, 1), (1, 2), (2, 5), (0, 3), (3, 4), (4, 5), (1, 4)][:6] + [(0, 5)],
        "forest": [(0, 1), (2, 3)],
    }
    for name, edges in graphs.items():
        n = 1 + max(max(e) for e in edges)
        for trial in range(5):
            domains, unary, pair = _random_costs(n, edges, 3, rng)
            x, exact = solve_pairwise(domains, unary, pair)
            _, best = brute_force(domains, unary, pair)
            assert exact, name
            assert abs(_value([x[v] for v in range(n)], unary, pair) - best) < 1e-9, (name, trial)


def test_a_non_series_parallel_graph_is_flagged_approximate():
    rng = random.Random(1)
    k4 = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    domains, unary, pair = _random_costs(4, k4, 3, rng)
    x, exact = solve_pairwise(domains, unary, pair)
    assert not exact and sorted(x) == [0, 1, 2, 3]
    assert _value([x[v] for v in range(4)], unary, pair) >= brute_force(domains, unary, pair)[1] - 1e-9


def _branchy(x, w1, wa, wb, w4):
    h = jnp.tanh(x @ w1)
    return jnp.tanh((jnp.tanh(h @ wa) + jnp.tanh(h[:, :512] @ wb)) @ w4)


def test_sp_dp_finds_the_brute_force_optimum_of_a_program_with_a_parallel_branch():
    args = (jnp.ones((512, 256)), jnp.ones((256, 1024)), jnp.ones((1024, 512)), jnp.ones((512, 512)) * 0.5,
            jnp.ones((512, 128)))
    pb = problem_of(_branchy, args)
    mesh = make_mesh({"data": 4}, jax.devices()[:4])
    space = build_space(pb.graph, dict(mesh.shape), inputs=False)
    ev = Evaluator(pb, mesh, space, [])
    assert len(space.groups) == 4
    edges = decision_graph(space)
    # dot(w1) feeds both branches, the branches meet at the add, the add feeds dot(w4)
    w1, wa, wb, w4 = (next(i for i, g in enumerate(space.groups) if pb.graph.ops[g.members[0]].inputs[1] == v)
                      for v in pb.graph.inputs[1:])
    assert {(w1, wa), (w1, wb), (wa, wb), (wa, w4), (wb, w4)} <= {(min(e), max(e)) for e in edges} | \
        {(max(e), min(e)) for e in edges}
    best = min(space.all_assignments(), key=lambda a: (ev.score(a).time, a))
    assert len(edges) == 5  # series-parallel: the DP's model is exact
    a, s = sp_dp(ev, space.neutral(), polish=False)
    assert s.time == ev.score(best).time, (a, best)
