"""Attention's three projections of one input (q, k, v as separate Dense layers) are fused into one matmul by
the PCG engine (`fuse_dots3`: `fuse_dots` alone fuses two, then the third weight's shape differs) when the
simulator says one launch instead of three pays, and left apart when concatenating the weights every step
costs more (8 CPU devices, Megatron hints on data=2 x model=4, priced on h100-sxm-8)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardc
from shardc import split
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg, optimize
from shardc.pcg.library import library_rules
from shardc.pcg.simcost import SimCost

FUSIONS = ("fuse_dots3", "fuse_dots3~rev", "fuse_dots", "fuse_dots~rev")


class Attention(nn.Module):
    d: int
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        kern = lambda names: nn.with_partitioning(nn.initializers.lecun_normal(), names)  # noqa: E731
        x = split(x, 0, "data")
        b, s, _ = x.shape
        h = nn.LayerNorm()(x)
        q, k, v = (nn.Dense(self.d, kernel_init=kern((None, "model")), use_bias=False, name=n)(h) for n in "qkv")
        q, k, v = (t.reshape(b, s, self.heads, self.d // self.heads) for t in (q, k, v))
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.d // self.heads), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, self.d)
        return x + nn.Dense(self.d, kernel_init=kern(("model", None)), use_bias=False, name="o")(o)


def _step_and_args(d, b, s):
    model, tx = Attention(d), optax.sgd(1e-2)
    x = jax.random.normal(jax.random.key(1), (b, s, d))
    params = model.init(jax.random.key(0), x)["params"]

    def step(params, opt, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss

    return step, (params, tx.init(params), x)


def _dots(pcg):
    return sum(1 for n in pcg.nodes if not n.is_parallel and n.op.primitive == "dot_general")


def _optimized(d, b, s):
    step, args = _step_and_args(d, b, s)
    c = shardc.auto(step, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)
    sim = SimCost("h100-sxm-8")
    rules = [r for r in library_rules() if r.name in FUSIONS]
    return step, args, pcg, sim, optimize(pcg, rules, cost_fn=sim)


def test_small_qkv_projections_fused_into_one_matmul():
    step, args, pcg, sim, res = _optimized(32, 4, 8)
    assert [s.rule for s in res.steps] == ["fuse_dots3"], res
    assert _dots(res.pcg) == _dots(pcg) - 2 and res.cost < sim(pcg)
    # each device concatenates its own column pieces of Wq, Wk, Wv: its heads' q, k and v, no new collective
    assert res.pcg.collectives() == pcg.collectives()
    fn, flat = lower_pcg(res.pcg), jax.tree.leaves(args)
    for got, want in zip(fn(*flat), jax.tree.leaves(jax.jit(step)(*args)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert hlo_collectives(fn.lower(*flat).compile().as_text()) == res.pcg.collectives()


@pytest.mark.parametrize("d", [2048])
def test_wide_qkv_projections_left_apart(d):
    """At d=2048 the per-step concatenation of the three weights costs more than the two launches saved."""
    _, _, pcg, sim, res = _optimized(d, 2, 8)
    assert res.steps == () and res.cost == sim(pcg)
    fused = optimize(pcg, [r for r in library_rules() if r.name == "fuse_dots3"], cost_fn=_dots)
    assert [s.rule for s in fused.steps] == ["fuse_dots3"] and sim(fused.pcg) > sim(pcg)
