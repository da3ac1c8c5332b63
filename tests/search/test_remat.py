"""Rematerialization as a decision of the search (shardc/remat.py, shardc/search/remat_choice.py)."""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import shardc
from shardc.remat import (inline_calls, inlined_layer_groups, layer_groups, rematerialize, uses_own_remat,
                          without_own_remat)
from shardc.search.driver import NoPlanFits


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(256)(x))
        return x + nn.Dense(128)(jnp.sin(h) * h)


class Net(nn.Module):
    layers: int = 16
    own_remat: bool = False

    @nn.compact
    def __call__(self, x):
        x = shardc.split(x, 0, "data")
        block = nn.remat(Layer) if self.own_remat else Layer
        for _ in range(self.layers):
            x = block()(x)
        return x


def _problem(batch=4096, layers=16, own_remat=False):
    net = Net(layers, own_remat)
    x = jax.random.normal(jax.random.key(1), (batch, 128))
    params = net.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(0.1)

    def step(p, o, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(net.apply({"params": p}, x) ** 2))(p)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, loss

    return step, (params, tx.init(params), x)


@pytest.fixture(scope="module")
def traced():
    step, args = _problem(batch=4096, layers=6)
    mesh = shardc.make_mesh({"data": 8})
    with jax.set_mesh(mesh):
        closed = inline_calls(jax.make_jaxpr(step)(*args))
    return closed, jax.tree.leaves(args), mesh


def test_layers_are_the_repeated_modules(traced):
    closed, _, _ = traced
    groups = layer_groups(closed)
    assert list(groups) == ["Layer_*"] and [l.path for l in groups["Layer_*"]] == [f"Layer_{i}" for i in range(6)]


@pytest.mark.parametrize("jit_loss, layers", [(False, 6), (True, 6), (True, 1)])
def test_inlined_layer_groups_are_those_of_the_inlined_program(jit_loss, layers):
    """(choose_pipeline's floor asks whether the search could rematerialize a program without inlining it.)"""
    step, args = _problem(batch=64, layers=layers)
    if jit_loss:  # the layers inside a call: their name stacks are the call's, then their own
        step = jax.jit(step)
    closed = jax.make_jaxpr(step)(*args)
    want = layer_groups(inline_calls(closed))
    assert bool(want) == (layers > 1)
    assert inlined_layer_groups(closed) == want


@pytest.mark.parametrize("policy", ["dots", "dots_no_batch", "nothing"])
def test_the_rewrite_is_the_same_math_with_more_work(traced, policy):
    closed, args, mesh = traced
    program = rematerialize(closed, {"Layer_*": policy})
    with jax.set_mesh(mesh):
        want = jax.jit(jcore.jaxpr_as_fun(closed)).lower(*args).compile()
        got = jax.jit(jcore.jaxpr_as_fun(program)).lower(*args).compile()
        for a, b in zip(want(*args), got(*args)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    # the recomputation is there (XLA did not merge it back); recomputing whole layers frees their activations
    assert got.cost_analysis()["flops"] > want.cost_analysis()["flops"]
    if policy == "nothing":
        assert got.memory_analysis().temp_size_in_bytes < 0.6 * want.memory_analysis().temp_size_in_bytes


def test_a_layer_that_keeps_nothing_recomputes_its_matmuls_and_one_that_keeps_dots_does_not(traced):
    """Only what the backward pass reads is recomputed: of each layer's two matmuls, the first (its output
    feeds tanh, whose result the backward pass needs); the second's output is read by nothing there."""
    closed, _, _ = traced
    dots = lambda c: sum(e.primitive.name == "dot_general" for e in c.jaxpr.eqns)
    assert dots(rematerialize(closed, {"Layer_*": "dots"})) == dots(closed)
    assert dots(rematerialize(closed, {"Layer_*": "nothing"})) == dots(closed) + 6


def test_the_search_rematerializes_when_nothing_else_fits():
    step, args = _problem()
    mesh = shardc.make_mesh({"data": 8})
    f = shardc.auto(step, mesh=mesh, memory_limit=12 * 2**20)
    plan = f.plan(*args)
    assert plan.remat is not None and plan.remat.policies == {"Layer_*": "nothing"}
    assert plan.remat.base_time is None and plan.cost.peak_memory <= 12 * 2**20
    assert "rematerialization" in plan.explain() and "Layer_* (16 layers): nothing" in plan.explain()
    report = shardc.check(plan)  # XLA's memory analysis of what runs confirms the predicted peak
    assert report.row("peak memory bytes").ok, str(report)
    assert report.row("peak memory bytes").compiled <= 12 * 2**20 * 1.1
    for a, b in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_remat_off_or_a_limit_too_small_says_the_smallest_peak():
    step, args = _problem()
    mesh = shardc.make_mesh({"data": 8})
    with pytest.raises(NoPlanFits, match="smallest simulated peak") as off:
        shardc.auto(step, mesh=mesh, memory_limit=12 * 2**20, remat=False).plan(*args)
    assert "remat" not in str(off.value)
    with pytest.raises(NoPlanFits, match="with remat policy 'nothing'"):
        shardc.auto(step, mesh=mesh, memory_limit=4 * 2**20).plan(*args)


def test_without_memory_pressure_the_program_runs_as_traced():
    step, args = _problem(batch=512, layers=4)
    plan = shardc.auto(step, mesh=shardc.make_mesh({"data": 8})).plan(*args)
    assert plan.remat is None


def test_the_users_own_remat_is_kept():
    step, args = _problem(batch=512, layers=4, own_remat=True)
    closed = jax.make_jaxpr(step)(*args)
    assert uses_own_remat(closed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NoPlanFits):
            shardc.auto(step, mesh=shardc.make_mesh({"data": 8}), memory_limit=2**20).plan(*args)


def test_without_its_own_remat_a_program_is_the_one_written_without_it():
    """The remat calls inlined and each recomputation merged into the forward op it repeats: the same eqns as
    the program traced without `nn.remat`, and the same values."""
    step, args = _problem(batch=64, layers=3, own_remat=True)
    plain_step, plain_args = _problem(batch=64, layers=3)
    own = jax.make_jaxpr(step)(*args)
    plain = inline_calls(jax.make_jaxpr(plain_step)(*plain_args))
    removed = without_own_remat(own)
    assert uses_own_remat(own) and not uses_own_remat(removed)
    assert len(inline_calls(own).jaxpr.eqns) > len(removed.jaxpr.eqns) == len(plain.jaxpr.eqns)
    flat = jax.tree.leaves(args)
    for a, b in zip(jcore.jaxpr_as_fun(removed)(*flat), jcore.jaxpr_as_fun(own)(*flat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert without_own_remat(plain) is plain


def test_remat_replace_lets_the_search_decide_in_place_of_the_users_remat():
    step, args = _problem(batch=512, layers=4, own_remat=True)
    mesh = shardc.make_mesh({"data": 8})
    f = shardc.auto(step, mesh=mesh, remat="replace")
    plan = f.plan(*args)
    assert not uses_own_remat(plan.program) and "remat='replace'" in plan.explain()
    for a, b in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # under a limit nothing meets, the search tried its own policies on the user's layers (remat=True: none)
    with pytest.raises(NoPlanFits, match=r"with remat policy '\w+' on CheckpointLayer_\*"):
        shardc.auto(step, mesh=mesh, memory_limit=2**20, remat="replace").plan(*args)


def test_remat_option_is_checked():
    with pytest.raises(shardc.ShardingError, match="remat="):
        shardc.auto(lambda x: x, remat="yes")
    with pytest.raises(shardc.ShardingError, match="memory_limit="):
        shardc.auto(lambda x: x, memory_limit=-1)


class AttentionBlock(nn.Module):
    """An attention layer as Flax writes it (per-head projections `bsd,dhk->bshk` and back), its activations
    split along the sequence."""

    @nn.compact
    def __call__(self, x):
        x = shardc.split(x, 1, "data")
        x = x + nn.MultiHeadDotProductAttention(num_heads=8, use_bias=False, deterministic=True)(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))


class AttentionNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = AttentionBlock()(x)
        return x


def test_the_memory_of_a_recomputing_attention_model_is_what_xla_allocates():
    """The backward pass of `bshk` projections makes XLA:CPU's dot decomposition copy the head gradients into
    the order its matmul reads ([hk, bs] for the weight gradient; [bs, hk] from the transposed attention
    output): the simulator counts those copies (it was 10.6% under without them)."""
    net = AttentionNet()
    x = jax.random.normal(jax.random.key(1), (8, 64, 128))
    params = net.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(0.1)

    def step(p, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(net.apply({"params": p}, x) ** 2))(p)
        return optax.apply_updates(p, tx.update(g, tx.init(p), p)[0]), loss

    mesh = shardc.make_mesh({"data": 8})
    args = (params, x)
    with jax.set_mesh(mesh):
        closed = inline_calls(jax.make_jaxpr(step)(*args))
    program = rematerialize(closed, {"AttentionBlock_*": "dots"})
    flat = jax.tree.leaves(args)
    f = shardc.auto(jcore.jaxpr_as_fun(program), mesh=mesh, search=False, donate_argnums=tuple(range(len(flat) - 1)))
    row = shardc.check(f, *flat).row("peak memory bytes")
    assert row.ok, f"predicted {row.predicted:,.0f} bytes, XLA {row.compiled:,.0f} ({100 * row.error:.1f}% off)"
