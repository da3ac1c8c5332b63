"""Each rule family of the issue fires on a real plan under the simulator's cost, and the rewritten PCG
computes the same numbers with the collectives it names. (Reduce->Partition, Combine->Partition,
Combine across elementwise ops/dots/reshapes, dot re-association and launch-count fusion are in
test_pcg_rewrite.py; slicing early in test_pcg_simcost.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc import replicate, split
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg, optimize
from shardc.pcg.library import library_rules
from shardc.pcg.simcost import SimCost


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def optimized(f, mesh, *args):
    """Optimized with the hand-written library (the generated one holds equivalent rules by other names)."""
    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr)
    sim = SimCost("h100-sxm-8")
    res = optimize(pcg, library_rules(), cost_fn=sim)
    assert res.cost == sim(res.pcg) < sim(pcg)
    fn = lower_pcg(res.pcg)
    out = fn(*args)
    for a, b in zip(out, jax.tree.leaves(f(*args)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert hlo_collectives(fn.lower(*args).compile().as_text()) == res.pcg.collectives()
    return pcg, res


def test_partition_combine_identities(mesh):
    def f(x):
        return split(replicate(split(replicate(x), 0, "model")), 1, "model")

    pcg, res = optimized(f, mesh, jnp.arange(64.0 * 64).reshape(64, 64))
    assert [n.op.kind for n in pcg.parallel_nodes()] == ["combine", "partition", "combine", "partition"]
    assert [s.rule for s in res.steps] == ["partition_combine", "combine_partition"]
    assert not res.pcg.parallel_nodes()


@pytest.mark.parametrize("move, rule", [
    (lambda a: a.T, "reduce_transpose"),
    (lambda a: a.reshape(-1), "reduce_merge"),
    (lambda a: -a, "reduce_neg"),
])
def test_reduce_moved_across_linear_ops_then_merged(mesh, move, rule):
    def f(x, w1, w2, v1, v2):
        x = split(x, 0, "data")
        a = jax.nn.relu(x @ split(w1, 1, "model")) @ w2  # row-parallel: partial sums over model
        b = jnp.tanh(x @ split(v1, 1, "model")) @ v2
        return move(a) + move(b)

    k = jax.random.split(jax.random.key(0), 5)
    args = (jax.random.normal(k[0], (16, 64)),) + tuple(jax.random.normal(k[i], (64, 64)) / 8 for i in range(1, 5))
    pcg, res = optimized(f, mesh, *args)
    # moving each Reduce past the op does not pay by itself; with Reduce(x) + Reduce(y) = Reduce(x + y) it does
    names = [s.rule for s in res.steps]
    assert names.count(rule) == 2 and names.index("reduce_add") == 2, res
    assert pcg.collectives()["all-reduce"] == 2 and res.pcg.collectives()["all-reduce"] == 1


def test_fused_matmul_split_back(mesh):
    def f(x, w, v):
        y = split(x, 0, "data") @ jnp.concatenate([w, v], 1)
        return y[:, :w.shape[1]], y[:, w.shape[1]:]

    k = jax.random.split(jax.random.key(1), 3)
    args = (jax.random.normal(k[0], (256, 512)), jax.random.normal(k[1], (512, 512)) / 16,
            jax.random.normal(k[2], (512, 512)) / 16)
    pcg, res = optimized(f, mesh, *args)
    # two dots with the weights apart instead of concatenating them every step
    assert [s.rule for s in res.steps] == ["fuse_dots~rev"]
    prims = [n.op.primitive for n in res.pcg.nodes]
    assert prims.count("dot_general") == 2 and "concatenate" not in prims
