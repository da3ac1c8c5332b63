"""A GPT-style Flax linen LM with Megatron-style partitioning metadata, for benchmarks and examples."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardc import split


def _kernel(names):
    return nn.with_partitioning(nn.initializers.normal(0.02), names)


class Block(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        h = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * self.d, kernel_init=_kernel((None, "model")))(h)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        hd = self.d // self.heads
        q, k, v = (t.reshape(b, s, self.heads, hd) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(b, s, self.d)
        x = x + nn.Dense(self.d, kernel_init=_kernel(("model", None)))(o)
        h = nn.gelu(nn.Dense(4 * self.d, kernel_init=_kernel((None, "model")))(nn.LayerNorm()(x)))
        return x + nn.Dense(self.d, kernel_init=_kernel(("model", None)))(h)


class GPT(nn.Module):
    vocab: int = 512
    d: int = 128
    heads: int = 4
    layers: int = 12
    seq: int = 64

    @nn.compact
    def __call__(self, ids):
        ids = split(ids, 0, "data")
        x = nn.Embed(self.vocab, self.d, embedding_init=_kernel(("model", None)))(ids)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d))[None]
        for _ in range(self.layers):
            x = Block(self.d, self.heads)(x)
        return nn.Dense(self.vocab, kernel_init=_kernel((None, "model")))(nn.LayerNorm()(x))


class _ScanBlock(nn.Module):
    """A Block as an `nn.scan` body: (carry, x) -> (carry, y)."""

    d: int
    heads: int

    @nn.compact
    def __call__(self, x, _):
        return Block(self.d, self.heads)(x), None


class ScanGPT(GPT):
    """The same LM with its blocks as one `nn.scan` over stacked parameters (MaxText's `scan_layers=True`):
    the form shardc can cut into pipeline stages. Each block's parameters gain a leading layer dim
    (partitioning name "layers")."""

    @nn.compact
    def __call__(self, ids):
        ids = split(ids, 0, "data")
        x = nn.Embed(self.vocab, self.d, embedding_init=_kernel(("model", None)))(ids)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.d))[None]
        blocks = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = blocks(self.d, self.heads, name="blocks")(x, None)
        return nn.Dense(self.vocab, kernel_init=_kernel((None, "model")))(nn.LayerNorm()(x))


def make_train_step(model: GPT, tx: optax.GradientTransformation):
    def train_step(params, opt_state, ids):
        def loss_fn(p):
            logits = model.apply({"params": p}, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def setup(layers: int = 12, batch: int = 8, seq: int = 64, scan: bool = False, **kw):
    model = (ScanGPT if scan else GPT)(layers=layers, seq=seq, **kw)
    ids = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, model.vocab)
    params = model.init(jax.random.key(1), ids[:, :-1])["params"]
    tx = optax.adamw(1e-3)
    return model, tx, params, tx.init(params), ids
