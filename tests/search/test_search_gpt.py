"""A searched plan of a small GPT train step runs under @shardc.auto on 8 CPU devices with the losses of
the unsharded step; the search picks the mesh when none is given."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardc
from bench.gpt import make_train_step


class Block(nn.Module):
    d: int = 32
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        hd = self.d // self.heads
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(self.d, name=n)(h).reshape(b, s, self.heads, hd) for n in "qkv")
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att), v).reshape(b, s, self.d)
        x = x + nn.Dense(self.d, name="o")(o)
        return x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))


class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(64, 32)(ids)
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(64)(x)


def test_searched_transformer_train_step_matches_unsharded():
    model, tx = LM(), optax.adam(1e-2)
    ids = jax.random.randint(jax.random.key(0), (16, 17), 0, 64)
    params = model.init(jax.random.key(1), ids[:, :-1])["params"]
    opt = tx.init(params)

    step = make_train_step(model, tx)  # next-token cross-entropy, optax update

    searched = shardc.auto(step, search="mcmc", budget_s=2, seed=0)
    plan = searched.plan(params, opt, ids)
    assert plan.search is not None and len(plan.search.meshes) > 1
    assert plan.search.chosen.score.time <= min(c.score.time for c in plan.search.baselines if c.score.feasible)
    ref = jax.jit(step)
    p1, o1, p2, o2 = params, opt, params, opt
    for _ in range(3):
        p1, o1, l1 = searched(p1, o1, ids)
        p2, o2, l2 = ref(p2, o2, ids)
        np.testing.assert_allclose(float(l1), float(l2), rtol=2e-5, atol=2e-6)
