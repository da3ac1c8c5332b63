"""A sharding hint names its operand and makes no buffer of its own; an op reading the hinted value reads the
operand's buffer. The simulator priced such reads as free (read from registers, as a fused producer would be):
a hinted program simulated faster than the same program unhinted at the same layouts."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import shardc
from annotations import split
from shardc.sim import simulate


def _step(hinted: bool):
    def step(x, w):
        h = jnp.tanh(x @ w)  # materialised: the second matmul reads it
        if hinted:
            h = split(h, 0, "data")  # the layout propagation gives it anyway
        return jnp.sum(h @ w.T)
    return step


def test_a_hint_does_not_make_its_readers_cheaper():
    mesh = shardc.make_mesh({"data": 8})
    x = jax.random.normal(jax.random.key(0), (1024, 512))
    w = jax.random.normal(jax.random.key(1), (512, 512))
    times = {}
    for hinted in (False, True):
        af = shardc.auto(_step(hinted), mesh=mesh, in_shardings=(P("data", None), P(None, None)))
        plan = af.plan(x, w)
        result = simulate(plan, "h100-sxm-8")
        dots = [sl for sl in result.slots if plan.graph.ops[sl.op].primitive == "dot_general"]
        times[hinted] = sorted(sl.compute_ps for sl in dots)
        assert len(dots) == 2
    assert times[True] == times[False], times
