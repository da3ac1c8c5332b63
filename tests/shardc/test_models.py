"""Sharded equals unsharded for the model families a user brings: Transformer block, NNX, nn.scan,
embedding + softmax cross-entropy, vmap with hints."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardc
from shardc import replicate, split

PS = jax.sharding.PartitionSpec


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def kernel(names):
    return nn.with_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    d: int = 32
    heads: int = 4
    ff: int = 64

    @nn.compact
    def __call__(self, x):
        x = split(x, 0, "data")
        b, s, _ = x.shape
        h = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * self.d, kernel_init=kernel((None, "model")), use_bias=False)(h)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        shape = (b, s, self.heads, self.d // self.heads)
        q, k, v = (t.reshape(shape) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.d // self.heads)
        mask = jnp.tril(jnp.ones((s, s), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, self.d)
        x = x + nn.Dense(self.d, kernel_init=kernel(("model", None)), use_bias=False)(o)
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(self.ff, kernel_init=kernel((None, "model")))(h))
        return x + nn.Dense(self.d, kernel_init=kernel(("model", None)))(h)


def test_transformer_block_train_step(mesh):
    model = Block()
    x = jax.random.normal(jax.random.key(1), (4, 8, 32))
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.adamw(1e-3)

    def step(params, opt, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss

    opt = tx.init(params)
    ref = jax.jit(step)(params, opt, x)
    got = shardc.auto(step, mesh=mesh, search=False)(params, opt, x)
    close(got, ref, 2e-5)
    assert got[0]["Dense_0"]["kernel"].value.sharding.spec == PS(None, "model")
    assert got[0]["Dense_1"]["kernel"].value.sharding.spec == PS("model", None)


def test_nnx_model(mesh):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")), rngs=rngs)
            self.l2 = nnx.Linear(32, 8, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None)), rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(split(x, 0, "data"))))

    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.key(2), (8, 16))

    def loss(state, x):
        m = nnx.merge(graphdef, state)
        return jnp.mean(m(x) ** 2)

    def step(state, x):
        l, g = jax.value_and_grad(loss)(state, x)
        return jax.tree.map(lambda p, d: p - 0.1 * d, state, g), l

    ref = jax.jit(step)(state, x)
    f = shardc.auto(step, mesh=mesh, search=False)
    got = f(state, x)
    close(got, ref)
    plan = f.plan(state, x)
    names = plan.input_names
    k1 = [i for i, n in enumerate(names) if "l1" in n and "kernel" in n][0]
    assert plan.input_shardings()[k1].dims == ((), ("model",))
    assert jax.tree.leaves(got[0])[k1].sharding.spec == PS(None, "model")


def test_nn_scan_over_layers(mesh):
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dense(32, kernel_init=kernel((None, "model")))(x)
            return x + nn.Dense(16, kernel_init=kernel(("model", None)))(jax.nn.relu(h)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = split(x, 0, "data")
            ScanLayer = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
                                metadata_params={nn.PARTITION_NAME: None})
            return ScanLayer()(x, None)[0]

    model = Stack()
    x = jax.random.normal(jax.random.key(3), (8, 16))
    params = model.init(jax.random.key(0), x)["params"]

    def step(params, x):
        l, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), l

    ref = jax.jit(step)(params, x)
    got = shardc.auto(step, mesh=mesh, search=False)(params, x)
    close(got, ref)
    k = got[0]["ScanLayer_0"]["Dense_0"]["kernel"].value
    assert k.shape == (3, 16, 32) and k.sharding.spec == PS(None, None, "model")


def test_embedding_softmax_cross_entropy(mesh):
    vocab, d = 64, 16

    def loss(table, w, ids, labels):
        ids = split(ids, 0, "data")
        h = jnp.take(table, ids, axis=0)              # [b, s, d]
        logits = h @ w                                 # [b, s, vocab]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    table = jax.random.normal(jax.random.key(0), (vocab, d))
    w = jax.random.normal(jax.random.key(1), (d, vocab))
    ids = jax.random.randint(jax.random.key(2), (8, 4), 0, vocab)
    labels = jax.random.randint(jax.random.key(3), (8, 4), 0, vocab)
    f = jax.value_and_grad(loss, argnums=(0, 1))
    ref = jax.jit(f)(table, w, ids, labels)
    got = shardc.auto(f, mesh=mesh, search=False)(table, w, ids, labels)
    close(got, ref)


def test_vmapped_function_with_hints(mesh):
    def per_example(x, w):
        h = split(x @ w, 0, "model")   # [16] per example
        return jnp.tanh(h).sum()

    f = jax.vmap(per_example, in_axes=(0, None))
    x = jax.random.normal(jax.random.key(0), (8, 32))
    w = jax.random.normal(jax.random.key(1), (32, 16))
    auto_f = shardc.auto(f, mesh=mesh, search=False)
    np.testing.assert_allclose(auto_f(x, w), f(x, w), rtol=1e-5)
    plan = auto_f.plan(x, w)
    hint = [op for op in plan.graph.ops if op.primitive == "shardc_hint"][0]
    # vmap inserted the batch dim in front: the hint now pins dim 1 of [8, 16]
    assert plan.shardings[hint.outputs[0]].dims[1] == ("model",)


def test_replicate_hint_is_kept(mesh):
    def f(x):
        x = split(x, 0, "data")
        y = replicate(jnp.sin(x))
        return y * 2

    x = jnp.ones((8, 4))
    auto_f = shardc.auto(f, mesh=mesh, search=False)
    plan = auto_f.plan(x)
    hint = [op for op in plan.graph.ops if op.primitive == "shardc_hint"][1]
    assert plan.shardings[hint.outputs[0]].dims == ((), ())
    np.testing.assert_allclose(auto_f(x), f(x))
