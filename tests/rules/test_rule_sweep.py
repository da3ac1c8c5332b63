"""Sweep: every first-order primitive of a Flax Transformer-ish train step (forward, backward, adamw update)
has a rule that fits its eqn — no conservative fallbacks."""
from __future__ import annotations

import collections
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.extend import core as jcore

import shardc.rules as R


@jax.custom_vjp
def _scale_grad(x):
    return x


_scale_grad.defvjp(lambda x: (x, None), lambda _, g: (0.5 * g,))


class Block(nn.Module):
    d: int = 32
    heads: int = 4
    ff: int = 64

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=0.1, deterministic=False)(h, h, mask=mask)
        x = x + nn.Dropout(0.1, deterministic=False)(h)
        h = nn.RMSNorm()(x)
        h = nn.Dense(self.ff)(h)
        h = nn.gelu(h) + jax.nn.relu(h)  # relu is a custom_jvp
        h = nn.Dense(self.d)(_scale_grad(h))  # a custom_vjp
        return x + h, None


class Model(nn.Module):
    vocab: int = 50
    d: int = 32
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(self.vocab, self.d)
        x = emb(ids) + self.param("pos", nn.initializers.normal(0.02), (ids.shape[1], self.d))
        stack = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=self.layers,
        )
        x, _ = stack(name="layers")(x, None)
        x, _ = Block(name="last")(x)
        x = nn.LayerNorm()(x)
        return emb.attend(x)


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for w in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(w, jcore.ClosedJaxpr):
                yield w.jaxpr
            elif isinstance(w, jcore.Jaxpr):
                yield w


def _sweep(jaxpr, seen, higher, failures):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = list(_subjaxprs(eqn))
        if name in R.HIGHER_ORDER_PRIMITIVES:
            higher[name] += 1
            for sub in subs:
                _sweep(sub, seen, higher, failures)
            continue
        ins = [tuple(v.aval.shape) for v in eqn.invars]
        outs = [tuple(v.aval.shape) for v in eqn.outvars]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", R.NoShardingRuleWarning)
            rule, conservative = R.rule_or_conservative(name, ins, outs, eqn.params)
        rule.validate(ins, outs)
        seen[name] += 1
        if conservative:
            failures.append((name, ins, outs, {k: v for k, v in eqn.params.items() if k not in ("jaxpr",)}))


@pytest.fixture(scope="module")
def jaxprs():
    model = Model()
    ids = jnp.zeros((2, 8), jnp.int32)
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, ids)["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))
    opt = tx.init(params)

    def train_step(params, opt, ids, labels, rng):
        def loss_fn(p):
            logits = model.apply({"params": p}, ids, rngs={"dropout": rng})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, jnp.mean(jnp.argmax(logits, -1) == labels)

        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss, acc

    def forward(params, ids, rng):
        return model.apply({"params": params}, ids, rngs={"dropout": rng})

    key = jax.random.key(2)
    return {
        "train_step": jax.make_jaxpr(train_step)(params, opt, ids, ids, key).jaxpr,
        "forward": jax.make_jaxpr(forward)(params, ids, key).jaxpr,
    }


def test_every_primitive_of_a_train_step_has_a_fitting_rule(jaxprs):
    seen, higher, failures = collections.Counter(), collections.Counter(), []
    for jaxpr in jaxprs.values():
        _sweep(jaxpr, seen, higher, failures)
    assert not failures, failures[:5]
    # the sweep really went through the model, its gradient and the optimizer
    assert {"dot_general", "gather", "scatter-add", "reshape", "broadcast_in_dim", "reduce_sum",
            "reduce_max", "argmax", "random_bits", "select_n", "transpose", "integer_pow", "sqrt"} <= set(seen)
    assert {"scan", "custom_jvp_call", "custom_vjp_call"} <= set(higher)
    assert set(higher) & {"remat2", "checkpoint", "remat"}
    assert set(higher) & {"jit", "pjit"}
