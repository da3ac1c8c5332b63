"""`shardc.cost.memdebug`: XLA's temporaries at its peak, read from its own dumps, next to the memory model's."""
import jax
import jax.numpy as jnp
import optax

import shardc
from shardc.check import _lowered
from shardc.cost.memdebug import ModelLive, peak_buffers, xla_live
from shardc.lower import compiler_options
from tests.sim.test_fidelity_vs_xla import _dropout_grad


def _plan():
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    params = {"w1": jnp.ones((128, 256)), "w2": jnp.ones((256, 128))}
    tx = optax.sgd(0.1)

    def step(p, x):
        def loss(p):
            h = jnp.tanh(shardc.split(x, 0, "data") @ shardc.split(p["w1"], 1, "model"))
            return jnp.mean((h @ p["w2"]) ** 2)

        g = jax.grad(loss)(p)
        return optax.apply_updates(p, tx.update(g, tx.init(p), p)[0])

    return shardc.auto(step, mesh=mesh, search=False).plan(params, jnp.ones((64, 128)))


def test_xla_side_accounts_for_the_temp_allocation_and_names_plan_ops():
    """The temp buffers live at XLA's peak add up to its temp allocation (heap packing aside), and those made
    for a plan op name an op of the plan."""
    plan = _plan()
    x = xla_live(_lowered(plan), compiler_options(plan))
    at = x.at(x.peak())
    total = sum(b.nbytes for b in at)
    assert 0.9 * x.temp_size <= total <= x.temp_size
    tagged = [b for b in at if b.op is not None]
    assert tagged and all(0 <= b.op < len(plan.graph.ops) for b in tagged)
    assert all(b.start <= x.peak() <= b.end for b in at)


def test_model_side_is_the_simulated_temporary_peak():
    """Read at its own peak, the model's live buffers and workspaces add up to the simulated temporaries."""
    plan = _plan()
    m = ModelLive(plan)
    assert sum(b.nbytes for b in m.at(m.peak())) == m.result.memory.temp_peak
    report = str(peak_buffers(plan))
    assert "XLA temporaries" in report and "model" in report


def test_xla_side_counts_loop_carries():
    """A while loop's values (its carry, body parameter and result) are listed as "(phi)" values in XLA's buffer
    assignment; they are temporaries like the others. jax's threefry on XLA:CPU is such a loop: its two
    words per random number stay live until the last fusion reading them (the backward pass's, for a dropout
    mask), and XLA's peak holds them."""
    f = shardc.auto(_dropout_grad, mesh=shardc.make_mesh({"data": 8}), search=False)
    plan = f.plan(jnp.ones((256, 512)), jnp.ones((512, 256)), jax.random.key(0))
    x = xla_live(_lowered(plan), compiler_options(plan))
    at = x.at(x.peak())
    words = [b for b in at if b.what.startswith("while ")]
    assert len(words) == 2 and all(b.nbytes == 512 * 512 * 4 for b in words)
    assert 0.9 * x.temp_size <= sum(b.nbytes for b in at) <= x.temp_size


def test_xla_side_is_read_when_jax_s_persistent_cache_holds_the_program(jax_persistent_cache):
    """XLA dumps only what it compiles; a program loaded from jax's persistent compilation cache (a user's, after
    a first run) is compiled afresh for the dumps."""
    plan = _plan()
    _lowered(plan).compile(compiler_options(plan))  # (fills the cache)
    assert any(jax_persistent_cache.iterdir())
    x = xla_live(_lowered(plan), compiler_options(plan))
    assert x.temp_size > 0 and x.at(x.peak())
