"""Judge-style check of `@shardc.auto` on small Flax models written outside shardc's own helpers.

Each model is a real optax train step (NNX MLP with partitioning metadata, a BatchNorm CNN, a scanned
GQA/rotary Transformer, an embedding-heavy recommender, a hint-free linen LM, a model with cond/while_loop,
a top-1 mixture-of-experts LM).
For each, on the 8 local devices: `shardc.auto(step)` with its defaults must give `jax.jit(step)`'s numbers,
and its search report must show the chosen plan no slower than any baseline and fitting memory. Then
`shardc.plan_for(step, *args, topology=T)` for the named topologies: chosen <= best feasible baseline, or a
ShardingError saying nothing fits. Prints a table with planning times.

    python -m bench.fresh_models [--budget 6] [--models mlp,cnn] [--topologies h100-sxm-8,tpu-v5e-8]
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

# ---------------------------------------------------------------- models -----------------------------------


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class _NnxMlp(nnx.Module):
    def __init__(self, d: int, h: int, out: int, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.fc1 = nnx.Linear(d, h, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
        self.fc2 = nnx.Linear(h, h, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)
        self.head = nnx.Linear(h, out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.fc2(nnx.gelu(self.fc1(x)))))


def nnx_mlp(batch: int = 64, d: int = 64, h: int = 256, classes: int = 16) -> tuple[Callable, tuple]:
    with nnx.use_eager_sharding(False):  # the mesh is shardc's choice: keep the metadata, place nothing yet
        model = _NnxMlp(d, h, classes, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)  # an nnx.State of Params carrying their sharding names
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            m = nnx.merge(graphdef, p)
            return _xent(m(x), y)
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    k = jax.random.key(1)
    x = jax.random.normal(k, (batch, d))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, classes)
    return step, (params, opt_state, x, y)


class _Cnn(nn.Module):
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for feat in (16, 32):
            x = nn.Conv(feat, (3, 3), use_bias=False)(x)  # a bias before BatchNorm has zero gradient
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.classes)(x)


def cnn_bn(batch: int = 16, hw: int = 16) -> tuple[Callable, tuple]:
    model = _Cnn()
    x = jax.random.normal(jax.random.key(0), (batch, hw, hw, 3))
    y = jax.random.randint(jax.random.key(1), (batch,), 0, 10)
    variables = model.init(jax.random.key(2), x, train=False)
    params, stats = variables["params"], variables["batch_stats"]
    tx = optax.sgd(0.05, momentum=0.9)
    opt_state = tx.init(params)

    def step(params, stats, opt_state, x, y):
        def loss_fn(p):
            logits, upd = model.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            return _xent(logits, y), upd["batch_stats"]
        (loss, new_stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), new_stats, opt_state, loss

    return step, (params, stats, opt_state, x, y)


def _rope(x: jax.Array) -> jax.Array:
    t, d = x.shape[-3], x.shape[-1]
    freq = 1.0 / (10000 ** (jnp.arange(0, d, 2) / d))
    ang = jnp.arange(t)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


class _GqaBlock(nn.Module):
    d: int
    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        b, t, _d = x.shape
        hd = self.d // self.heads
        h = nn.RMSNorm()(x)
        q = nn.DenseGeneral((self.heads, hd), use_bias=False, name="q")(h)
        k = nn.DenseGeneral((self.kv_heads, hd), use_bias=False, name="k")(h)
        v = nn.DenseGeneral((self.kv_heads, hd), use_bias=False, name="v")(h)
        q, k = _rope(q), _rope(k)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        mask = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(mask, s, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
        x = x + nn.DenseGeneral(self.d, axis=(-2, -1), use_bias=False, name="o")(a)
        h = nn.RMSNorm()(x)
        gate = nn.Dense(4 * self.d, use_bias=False)(h)
        up = nn.Dense(4 * self.d, use_bias=False)(h)
        return x + nn.Dense(self.d, use_bias=False)(nn.silu(gate) * up), None


class _ScanLm(nn.Module):
    vocab: int
    d: int
    layers: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        emb = nn.Embed(self.vocab, self.d)
        x = emb(ids)
        Stack = nn.scan(_GqaBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        x, _ = Stack(self.d, 4, 2)(x, None)
        return emb.attend(nn.RMSNorm()(x))


def scan_gqa(batch: int = 8, t: int = 16, vocab: int = 256, d: int = 64, layers: int = 3) -> tuple[Callable, tuple]:
    model = _ScanLm(vocab, d, layers)
    ids = jax.random.randint(jax.random.key(0), (batch, t + 1), 0, vocab)
    params = model.init(jax.random.key(1), ids[:, :-1])["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    opt_state = tx.init(params)

    def step(params, opt_state, ids):
        def loss_fn(p):
            return _xent(model.apply({"params": p}, ids[:, :-1]), ids[:, 1:])
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    return step, (params, opt_state, ids)


class _Recsys(nn.Module):
    users: int
    items: int
    d: int

    @nn.compact
    def __call__(self, user: jax.Array, hist: jax.Array, cand: jax.Array) -> jax.Array:
        ut = self.param("user_table", nn.initializers.normal(0.02), (self.users, self.d))
        it = self.param("item_table", nn.initializers.normal(0.02), (self.items, self.d))
        u = jnp.take(ut, user, axis=0)                      # [B, d]
        hv = it[hist]                                       # [B, H, d]
        mask = (hist >= 0)[..., None]
        pooled = jnp.sum(hv * mask, 1) / jnp.maximum(mask.sum(1), 1)
        c = jnp.take(it, cand, axis=0)                      # [B, C, d]
        q = nn.Dense(self.d)(nn.relu(nn.Dense(4 * self.d)(jnp.concatenate([u, pooled], -1))))
        return jnp.einsum("bd,bcd->bc", q, c)


def recsys(batch: int = 32, users: int = 4096, items: int = 8192, d: int = 32, hist: int = 8,
           cands: int = 16) -> tuple[Callable, tuple]:
    model = _Recsys(users, items, d)
    ks = jax.random.split(jax.random.key(0), 4)
    user = jax.random.randint(ks[0], (batch,), 0, users)
    h = jax.random.randint(ks[1], (batch, hist), 0, items)
    cand = jax.random.randint(ks[2], (batch, cands), 0, items)
    label = jax.random.randint(ks[3], (batch,), 0, cands)
    params = model.init(jax.random.key(1), user, h, cand)["params"]
    tx = optax.adagrad(0.05)
    opt_state = tx.init(params)

    def step(params, opt_state, user, h, cand, label):
        loss, g = jax.value_and_grad(lambda p: _xent(model.apply({"params": p}, user, h, cand), label))(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    return step, (params, opt_state, user, h, cand, label)


class _PlainLm(nn.Module):
    vocab: int
    d: int
    layers: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        t = ids.shape[1]
        x = nn.Embed(self.vocab, self.d)(ids) + self.param("pos", nn.initializers.normal(0.02), (t, self.d))
        for _ in range(self.layers):
            h = nn.LayerNorm()(x)
            x = x + nn.SelfAttention(num_heads=4, qkv_features=self.d, use_bias=False, deterministic=True)(
                h, mask=nn.make_causal_mask(ids))
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(self.d)(nn.gelu(nn.Dense(4 * self.d)(h)))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def plain_lm(batch: int = 8, t: int = 16, vocab: int = 256, d: int = 64, layers: int = 2) -> tuple[Callable, tuple]:
    model = _PlainLm(vocab, d, layers)
    ids = jax.random.randint(jax.random.key(0), (batch, t + 1), 0, vocab)
    params = model.init(jax.random.key(1), ids[:, :-1])["params"]
    tx = optax.adamw(1e-3, weight_decay=0.01)
    opt_state = tx.init(params)

    def step(params, opt_state, ids):
        loss, g = jax.value_and_grad(lambda p: _xent(model.apply({"params": p}, ids[:, :-1]), ids[:, 1:]))(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    return step, (params, opt_state, ids)


class _Controlled(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense_a, dense_b = nn.Dense(self.d, name="a"), nn.Dense(self.d, name="b")
        if self.is_initializing():
            dense_b(dense_a(x))
        w_a, w_b = self.variables["params"]["a"]["kernel"], self.variables["params"]["b"]["kernel"]
        h = jax.lax.cond(jnp.mean(x) > 0, lambda v: v @ w_a, lambda v: v @ w_b, x)

        def body(c):
            i, v = c
            return i + 1, jnp.tanh(v @ w_a) + v
        _, h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, h))
        return nn.Dense(8, name="head")(h)


def control_flow(batch: int = 32, d: int = 64) -> tuple[Callable, tuple]:
    model = _Controlled(d)
    x = jax.random.normal(jax.random.key(0), (batch, d))
    y = jax.random.randint(jax.random.key(1), (batch,), 0, 8)
    params = model.init(jax.random.key(2), x)["params"]
    tx = optax.sgd(0.1)
    opt_state = tx.init(params)

    def step(params, opt_state, x, y):
        # while_loop is not reverse-differentiable: the loss's gradient flows through cond and the head only
        def loss_fn(p):
            return _xent(model.apply({"params": p}, x), y)
        loss = loss_fn(params)
        g = jax.grad(lambda p: _xent(nn.Dense(8).apply({"params": p["head"]}, jax.lax.cond(
            jnp.mean(x) > 0, lambda v: v @ p["a"]["kernel"], lambda v: v @ p["b"]["kernel"], x)), y))(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    return step, (params, opt_state, x, y)


class _Top1Experts(nn.Module):
    """Switch-style top-1 routing with a capacity, one-hot einsum dispatch, and a load-balancing loss."""

    experts: int
    hidden: int
    capacity_factor: float = 2.0

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        from shardc import split

        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        capacity = int(self.capacity_factor * b * t / self.experts)
        probs = jax.nn.softmax(nn.Dense(self.experts, use_bias=False, name="router")(tokens), -1)
        choice = jax.nn.one_hot(jnp.argmax(probs, -1), self.experts, dtype=x.dtype)  # [N, E]
        position = (jnp.cumsum(choice, 0) - 1) * choice
        kept = choice * (position < capacity)
        slot = jax.nn.one_hot(jnp.sum(position * kept, -1).astype(jnp.int32), capacity, dtype=x.dtype)
        dispatch = kept[:, :, None] * slot[:, None, :]  # [N, E, C]
        expert_in = split(jnp.einsum("nec,nd->ecd", dispatch, tokens), 0, "expert")
        w_in = self.param("w_in", nn.initializers.lecun_normal(), (self.experts, d, self.hidden))
        w_out = self.param("w_out", nn.initializers.lecun_normal(), (self.experts, self.hidden, d))
        expert_out = jnp.einsum("ech,ehd->ecd", jax.nn.relu(jnp.einsum("ecd,edh->ech", expert_in, w_in)), w_out)
        y = jnp.einsum("nec,ecd->nd", dispatch * jnp.max(probs, -1)[:, None, None], expert_out)
        balance = self.experts * jnp.sum(jnp.mean(choice, 0) * jnp.mean(probs, 0))
        return y.reshape(b, t, d), balance


class _Top1MoeLM(nn.Module):
    vocab: int
    d: int
    layers: int
    experts: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        from shardc import split

        ids = split(ids, 0, "data")
        x = nn.Embed(self.vocab, self.d)(ids)
        balance = jnp.zeros(())
        for _ in range(self.layers):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, use_bias=False)(h, mask=nn.make_causal_mask(ids))
            y, b = _Top1Experts(self.experts, 2 * self.d)(nn.LayerNorm()(x))
            x, balance = x + y, balance + b
        return nn.Dense(self.vocab)(nn.LayerNorm()(x)), balance


def top1_moe(batch: int = 16, t: int = 16, vocab: int = 256, d: int = 64, layers: int = 2,
             experts: int = 8) -> tuple[Callable, tuple]:
    """A decoder LM whose FFNs are top-1 mixtures of experts (hints: batch on `data`, experts on `expert`),
    trained with gradient clipping and Adafactor."""
    model = _Top1MoeLM(vocab, d, layers, experts)
    ids = jax.random.randint(jax.random.key(0), (batch, t + 1), 0, vocab)
    params = model.init(jax.random.key(1), ids[:, :-1])["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(1e-2))
    opt_state = tx.init(params)

    def step(params, opt_state, ids):
        def loss_fn(p):
            logits, balance = model.apply({"params": p}, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean() + 0.01 * balance
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    return step, (params, opt_state, ids)


MODELS: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "nnx_mlp": nnx_mlp, "cnn_bn": cnn_bn, "scan_gqa": scan_gqa, "recsys": recsys, "plain_lm": plain_lm,
    "control_flow": control_flow, "top1_moe": top1_moe,
}
TOPOLOGIES = ("h100-sxm-8", "h100-sxm-8x8", "tpu-v5e-8")
# Sizes at which the search shards (rather than replicates) on h100-sxm-8, still quick on CPU (priced on
# the CPU host, the default on CPU devices, the search shards the default sizes too).
# (cnn_bn at batch 128: the plan is right but plain jax.jit's f32 BatchNorm backward on one CPU device is
# off by up to 4e-3 from a float64 reference there, while shardc's sharded run is within 1e-6; scan_gqa
# stays replicated at CPU-friendly sizes.)
MEDIUM: dict[str, dict[str, int]] = {
    "nnx_mlp": dict(batch=256, d=256, h=1024, classes=64),
    "recsys": dict(batch=256, users=8192, items=32768, d=64),
    "plain_lm": dict(batch=16, t=64, vocab=1024, d=256, layers=2),
    "control_flow": dict(batch=256, d=512),
}

# ---------------------------------------------------------------- judge ------------------------------------


def check_report(report: Any) -> str | None:
    """None when the chosen plan fits memory and is no slower than every feasible baseline; else why not."""
    chosen = report.chosen.score
    if not chosen.feasible:
        return f"chosen plan does not fit memory (peak {chosen.peak})"
    for c in report.baselines:
        if c.score.feasible and c.score.time < chosen.time * (1 - 1e-9):
            return f"baseline {c.name} {c.mesh} {c.score.time:.3e} s beats chosen {chosen.time:.3e} s"
    return None


def run_steps(f: Callable, args: tuple, steps: int) -> list[Any]:
    outs, cur = [], args
    for _ in range(steps):
        out = f(*cur)
        outs.append(out)
        n_state = len(out) - 1
        cur = tuple(out[:n_state]) + tuple(cur[n_state:])
    return outs


def compare(a: list[Any], b: list[Any], rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Every leaf of every step's outputs equal within rtol/atol. (Adam's first steps move an element whose
    gradient is near zero by about +-lr whatever the summation order, so Adam models need atol ~ lr / 10.)"""
    for x, y in zip(a, b):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def main() -> None:
    import shardc

    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--medium", action="store_true", help="the MEDIUM sizes (models listed there only)")
    o = ap.parse_args()
    print(f"{'model':14} {'target':14} {'plan s':>7} {'chosen':>10} {'best base':>10} {'numerics':>9}  verdict  "
          f"(chosen plan)")
    for name in o.models.split(","):
        if o.medium and name not in MEDIUM:
            continue
        step, args = MODELS[name](**(MEDIUM[name] if o.medium else {}))
        opts = {} if o.budget is None else {"budget_s": o.budget}
        t0 = time.perf_counter()
        try:
            f = shardc.auto(step, **opts)
            plan = f.plan(*args)
            dt = time.perf_counter() - t0
            ref = run_steps(jax.jit(step), args, o.steps)
            got = run_steps(f, args, o.steps)
            try:
                compare(got, ref, atol=1e-4)  # Adam: near-zero gradients move by ~+-lr (1e-3), see compare
                num = "ok"
            except AssertionError:
                num = "DIFF"
            rep = plan.search
            best = min((c.score.time for c in rep.baselines if c.score.feasible), default=math.nan)
            bad = check_report(rep)
            print(f"{name:14} {'8 cpu (auto)':14} {dt:7.1f} {rep.chosen.score.time * 1e3:9.4f}m "
                  f"{best * 1e3:9.4f}m {num:>9}  {bad or 'ok'}  ({rep.chosen.name} {rep.chosen.mesh})")
        except Exception as e:  # noqa: BLE001 - the table reports it
            print(f"{name:14} {'8 cpu (auto)':14} {'':7} CRASH {type(e).__name__}: {str(e)[:200]}")
        for topo in o.topologies.split(","):
            t0 = time.perf_counter()
            try:
                plan = shardc.plan_for(step, *args, topology=topo, **opts)
                dt = time.perf_counter() - t0
                rep = plan.search
                best = min((c.score.time for c in rep.baselines if c.score.feasible), default=math.nan)
                bad = check_report(rep)
                print(f"{name:14} {topo:14} {dt:7.1f} {rep.chosen.score.time * 1e3:9.4f}m {best * 1e3:9.4f}m "
                      f"{'':>9}  {bad or 'ok'}  ({rep.chosen.name} {rep.chosen.mesh})")
            except shardc.ShardingError as e:
                print(f"{name:14} {topo:14} {time.perf_counter() - t0:7.1f} ShardingError: {str(e)[:160]}")
            except Exception as e:  # noqa: BLE001
                print(f"{name:14} {topo:14} {'':7} CRASH {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    import os
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    main()
