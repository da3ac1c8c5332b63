"""A sharding hint names its operand and makes no buffer of its own; an op reading the hinted value reads the
operand's buffer. The simulator priced such reads as free (read from registers, as a fused producer would be):
a hinted program simulated faster than the same program unhinted at the same layouts."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardc
from annotations import replicate, split
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


def _matmul_step(looped: bool, trips: int):
    """h <- tanh(h @ w + x): `trips` times in a scan (w enters the loop unchanged, h is its carry), or once."""
    def step(w, xs, h0):
        def body(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jnp.sum(h)
        return jax.lax.scan(body, h0, xs) if looped else body(h0, xs[0])
    return step


def test_an_op_in_a_loop_reads_what_enters_the_loop_from_memory():
    """What enters a loop, and its carry, are buffers of the loop's state (a while loop's operands); an op in the
    body reads them from memory. The simulator priced them as read from registers (as a fused producer would
    be): an in-loop matmul per trip 3.8x cheaper than the same matmul outside the loop on an H100 (a full-size
    LSTM's), and a plan of that LSTM 3.16 ms of compute cheaper than its own PCG, where a Combine node (a
    buffer) reads the weight first."""
    mesh = shardc.make_mesh({"data": 8})
    d, b, trips = 1024, 64, 6
    w = jax.random.normal(jax.random.key(1), (d, d))
    xs, h0 = jnp.ones((trips, b, d)), jnp.zeros((b, d))
    per_trip = {}
    for looped in (False, True):
        af = shardc.auto(_matmul_step(looped, trips), mesh=mesh, in_shardings=(P(), P(None, "data"), P("data")))
        plan = af.plan(w, xs, h0)
        result = simulate(plan, "h100-sxm-8")
        dots = [sl for sl in result.slots if plan.graph.ops[sl.op].primitive == "dot_general"]
        assert len(dots) == 1 and bool(plan.graph.ops[dots[0].op].region) == looped
        per_trip[looped] = dots[0].compute_ps / (trips if looped else 1)
    assert per_trip[True] == pytest.approx(per_trip[False], rel=1e-6), per_trip



def _scaled_step(gathered: bool):
    """`u * 2` of a (1024, 1024) value split over `data`: an input (a buffer), or `sin(x)` gathered whole by a hint
    (the multiply then reads its part of the gathered buffer)."""
    def step(x):
        if not gathered:
            return x * 2.0
        u = jnp.sin(x)  # (fused into its readers where no collective stands between)
        return replicate(u) * 2.0
    return step


def test_an_op_reading_what_a_collective_gathered_reads_it_from_memory():
    """An all-gather's result is a buffer: the multiply reading (its part of) it reads it from memory, as it reads an
    input. The simulator priced the read as free wherever the value's producer fuses into its readers
    (`sin` here): a split of an all-gathered gradient in a full-size LSTM's backward scan was priced at nothing,
    and the plan 5 ms faster than its own PCG, which reads the gathered buffer (`shardc.pcg.simcost`)."""
    mesh = shardc.make_mesh({"data": 8})
    x = jax.random.normal(jax.random.key(0), (1024, 1024))
    times = {}
    for gathered in (False, True):
        af = shardc.auto(_scaled_step(gathered), mesh=mesh, search=False, in_shardings=(P("data", None),))
        plan = af.plan(x)
        result = simulate(plan, "h100-sxm-8")
        muls = [sl for sl in result.slots if plan.graph.ops[sl.op].primitive == "mul"]
        assert len(muls) == 1
        times[gathered] = muls[0].compute_ps
        assert (result.payload.get("all-gather", 0) > 0) == gathered
    assert times[True] == times[False], times
