"""Indexing and convolution ops on local pieces in the PCG (shardc/pcg/local_ops.py): a vocab-split
embedding gathers the rows each device holds, a data-parallel embedding gradient scatters into partial
sums, a batch-split convolution runs per device; the PCG's lowering equals jax.jit, and the PCG moves
what the plan moves."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardc
from shardc import split
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg, simulate_pcg
from shardc.pcg.graph import Compute
from shardc.sim import as_topology, simulate


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4}, jax.devices()[:8])


def _run(af, args):
    c = af.compiled_info(*args)
    flat = jax.tree.leaves(args)
    return c, flat


def _node_layouts(pcg, primitive):
    return [[pcg.tensors[t].sharding for t in n.inputs] for n in pcg.nodes
            if isinstance(n.op, Compute) and n.op.primitive == primitive]


def test_vocab_split_embedding_gathers_locally(mesh):
    """Embedding table split over its vocab dim: each device gathers the rows it holds (masked) and the
    result holds partial sums; the table is never all-gathered."""

    def f(table, ids):
        table = split(table, 0, "model")
        ids = split(ids, 0, "data")
        return jnp.tanh(jnp.take(table, ids, axis=0)).sum(-1)

    table = jax.random.normal(jax.random.key(0), (64, 16))
    ids = jax.random.randint(jax.random.key(1), (8, 6), 0, 64)
    af = shardc.auto(f, mesh=mesh, search=False)
    c, flat = _run(af, (table, ids))
    pcg = build_pcg(c.plan, c.closed_jaxpr)
    (table_layout, _), = _node_layouts(pcg, "gather")
    assert table_layout.dims[0] == ("model",)  # gathered from the local piece of the table
    assert not any(n.is_parallel and str(n.op).startswith("combine") and pcg.tensors[n.inputs[0]].shape == (64, 16)
                   for n in pcg.nodes)
    g = lower_pcg(pcg)
    np.testing.assert_allclose(g(*flat)[0], jax.jit(f)(table, ids), rtol=1e-5, atol=1e-5)
    assert hlo_collectives(g.lower(*flat).compile().as_text()) == pcg.collectives()


def test_embedding_train_step_and_conv_same_numbers(mesh):
    """A data-parallel train step of an embedding + conv + max-pool + dense model (scatter-add of the
    embedding gradient into partial sums, batch-split convolution and pooling): the PCG's lowering equals jax.jit(step), and
    the PCG simulates within 2% of its plan (the same collectives)."""

    class M(nn.Module):
        @nn.compact
        def __call__(self, ids):
            ids = split(ids, 0, "data")
            x = nn.Embed(32, 8)(ids)  # [b, l, 8]
            x = nn.relu(nn.Conv(8, (3,), padding="SAME")(x))
            x = nn.max_pool(x, (2,), (2,))  # [b, l/2, 8]
            return nn.Dense(32)(x.reshape(x.shape[0], -1)).reshape(x.shape[0], 1, 32)

    model, tx = M(), optax.sgd(0.1)
    ids = jax.random.randint(jax.random.key(2), (8, 12), 0, 32)
    params = model.init(jax.random.key(3), ids)["params"]
    opt = tx.init(params)

    def step(params, opt, ids):
        def loss(p):
            logits = model.apply({"params": p}, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, :1]).mean()

        l, g = jax.value_and_grad(loss)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, l

    args = (params, opt, ids)
    af = shardc.auto(step, mesh=mesh, search=False)
    c, flat = _run(af, args)
    topo = as_topology("h100-sxm-8")
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True, reduce_scatter=topo.reduce_scatter)
    for prim in ("conv_general_dilated", "reduce_window_max", "select_and_scatter_add"):  # batch-split, local
        assert _node_layouts(pcg, prim) and all(ins[0].dims[0] == ("data",) for ins in _node_layouts(pcg, prim))
    out = lower_pcg(pcg)(*flat)
    ref = jax.tree.leaves(jax.jit(step)(*args))
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    plan_t = simulate(c.plan, topo).step_time
    pcg_sim = simulate_pcg(pcg, topo).result
    assert pcg_sim.payload == simulate(c.plan, topo).payload
    assert abs(pcg_sim.step_time / plan_t - 1) < 0.02


def test_vocab_split_embedding_gradient_scatters_locally(mesh):
    """The gradient of a vocab-split embedding (table rows over model, its columns over data, as gpt12's
    searched plan has it): each device adds the updates of the rows it holds; no all-gather of the updates,
    the lowering equals jax.jit and the compiled collectives are the PCG's."""

    def f(table, ids, g):
        table = split(split(table, 0, "model"), 1, "data")
        return table.at[ids].add(split(g, 2, "data"))

    table = jax.random.normal(jax.random.key(4), (64, 16))
    ids = jax.random.randint(jax.random.key(5), (4, 6), 0, 64)
    g = jax.random.normal(jax.random.key(6), (4, 6, 16))
    c, flat = _run(shardc.auto(f, mesh=mesh, search=False), (table, ids, g))
    pcg = build_pcg(c.plan, c.closed_jaxpr)
    ((t, _, u),) = _node_layouts(pcg, "scatter-add")
    assert t.dims == (("model",), ("data",)) and u.dims[2] == ("data",)  # scattered into the local rows
    assert not pcg.collectives()["all-gather"]
    fn = lower_pcg(pcg)
    np.testing.assert_allclose(fn(*flat)[0], jax.jit(f)(table, ids, g), rtol=1e-6, atol=1e-6)
    assert hlo_collectives(fn.lower(*flat).compile().as_text()) == pcg.collectives()


def test_random_bits_split_are_drawn_by_pieces_equal_to_the_whole(mesh):
    """Dropout's mask and random bytes of a 3-D shape, split over both mesh axes and over one: each device draws
    its own piece (JAX's partitionable threefry: the hash of each element's index), bit for bit those of the
    whole array, with the plan's FLOPs. Before, the PCG drew the whole array on every device and sliced
    it (8x the FLOPs and the memory: flax lm1b's step on CPU devices priced 14 ms more)."""
    def f(key, x, w):
        h = split(split(x, 0, "data") @ w, 1, "model")
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        u = jax.random.bits(jax.random.fold_in(key, 1), (h.shape[0], 4, h.shape[1] // 4), jnp.uint8)
        return jnp.where(keep, h / 0.9, 0.0) @ w.T, split(u, 2, "model"), split(keep, 1, "model")

    args = (jax.random.key(3), jax.random.normal(jax.random.key(1), (64, 32)),
            jax.random.normal(jax.random.key(2), (32, 128)))
    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    topo = as_topology("h100-sxm-8")
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True, reduce_scatter=topo.reduce_scatter)
    assert [tuple(map(bool, pcg.tensors[n.outputs[0]].sharding.dims)) for n in pcg.nodes
            if isinstance(n.op, Compute) and n.op.primitive == "random_bits"] == [(True, True), (False, False, True)]
    plan_sim, pcg_sim = simulate(c.plan, topo), simulate_pcg(pcg, topo).result
    assert pcg_sim.flops == plan_sim.flops
    g = lower_pcg(pcg)
    got, want = g(*args), f(*args)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-3)
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hlo_collectives(g.lower(*args).compile().as_text()) == pcg.collectives()
