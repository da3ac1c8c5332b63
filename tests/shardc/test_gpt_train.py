"""A GPT-style LM as a user writes it: hints on the batch and on the weights (Megatron layout), trained
for several steps under @shardc.auto; same losses as plain jax.jit, every param placed as hinted."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardc
from shardc import split


def k(names):
    return nn.with_partitioning(nn.initializers.normal(0.02), names)


class Block(nn.Module):
    d: int = 64
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        hd = self.d // self.heads

        def heads(name):  # column-parallel projection, split into heads: [b, s, h, hd], h on "model"
            return nn.Dense(self.d, kernel_init=k((None, "model")), name=name)(nn.LayerNorm()(x)).reshape(b, s, self.heads, hd)

        q, kk, v = heads("q"), heads("k"), heads("v")
        att = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(self.d // self.heads)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att), v)
        x = x + nn.Dense(self.d, kernel_init=k(("model", None)), name="o")(o.reshape(b, s, self.d))
        h = nn.gelu(nn.Dense(4 * self.d, kernel_init=k((None, "model")))(nn.LayerNorm()(x)))
        return x + nn.Dense(self.d, kernel_init=k(("model", None)))(h)


class GPT(nn.Module):
    vocab: int = 128
    d: int = 64
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        ids = split(ids, 0, "data")
        x = nn.Embed(self.vocab, self.d, embedding_init=k(("model", None)))(ids)
        for _ in range(self.layers):
            x = Block(self.d)(x)
        return nn.Dense(self.vocab, kernel_init=k((None, "model")))(nn.LayerNorm()(x))


def test_gpt_trains_like_jit_and_places_params():
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    model = GPT()
    ids = jax.random.randint(jax.random.key(0), (8, 17), 0, model.vocab)
    params = model.init(jax.random.key(1), ids[:, :-1])["params"]
    tx = optax.adamw(3e-3)

    def train_step(params, opt_state, ids):
        def loss_fn(p):
            logits = model.apply({"params": p}, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref_step, auto_step = jax.jit(train_step), shardc.auto(train_step, mesh=mesh, search=False)
    a = b = (params, tx.init(params))
    ref_losses, losses = [], []
    for _ in range(4):
        *a, la = ref_step(*a, ids)
        *b, lb = auto_step(*b, ids)
        ref_losses.append(float(la))
        losses.append(float(lb))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert losses[-1] < losses[0]

    boxed = jax.tree_util.tree_leaves(b[0], is_leaf=lambda x: isinstance(x, nn.Partitioned))
    checked = 0
    for leaf in boxed:
        if isinstance(leaf, nn.Partitioned):
            assert leaf.value.sharding.spec == jax.sharding.PartitionSpec(*leaf.names), leaf.names
            checked += 1
    assert checked == 2 * 6 + 2
    plan = auto_step.plan(params, tx.init(params), ids)
    assert all(r.kind != "all-gather" or r.bytes < 64 * 1024 for r in plan.reshards)
