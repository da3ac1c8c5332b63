"""MoE layer (GShard Algorithm 2): loop reference, sharding, collectives, gradients, NNX."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import moe
from moe.layer import MoeFeedForward, MoeFeedForwardNNX, moe_ffn, reference_moe_loop, resolve_num_groups


def _mesh(shape: dict):
    return jax.make_mesh(tuple(shape.values()), tuple(shape.keys()), axis_types=(AxisType.Auto,) * len(shape))


def _count(txt: str, op: str) -> int:
    # Matches sync and async forms: "all-to-all(", "all-gather-start(", tuple-shaped results included.
    return len(re.findall(r"\b%s(?:-start)?\(" % re.escape(op), txt))


def _collectives(txt: str) -> dict:
    return {op: _count(txt, op) for op in ("all-to-all", "all-gather", "all-reduce", "collective-permute")}


def _init(m, x):
    v = jax.jit(m.init)({"params": jax.random.key(1)}, x)
    return nn.unbox(v)["params"], nn.get_partition_spec(v)["params"]


def test_equals_per_token_loop_reference():
    x = jax.random.normal(jax.random.key(0), (4, 16, 32))
    # capacity >= S and the "all" policy: nothing dropped, every token gets its top-2 experts.
    m = MoeFeedForward(num_experts=4, hidden_dim=48, num_groups=2, expert_capacity=32, second_expert_policy="all")
    params, _ = _init(m, x)
    y, aux = jax.jit(m.apply)({"params": params}, x)
    ref = reference_moe_loop(x.reshape(-1, 32), params["gate"], params["wi"], params["wo"])
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 32), ref, atol=1e-5, rtol=1e-5)
    assert np.isfinite(float(aux))


def test_dropped_tokens_and_padding_give_zero_output():
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    pad = jnp.zeros((2, 8), jnp.int32).at[:, 6:].set(1)
    m = MoeFeedForward(num_experts=4, hidden_dim=16, num_groups=1, expert_capacity=16, second_expert_policy="all")
    params, _ = _init(m, x)
    y, _ = jax.jit(m.apply)({"params": params}, x, pad)
    assert np.abs(np.asarray(y)[:, 6:]).max() == 0.0
    # One group of 16 tokens, 4 experts x capacity 1 = 4 slots: at least 12 tokens get no expert.
    m1 = MoeFeedForward(num_experts=4, hidden_dim=16, num_groups=1, expert_capacity=1, second_expert_policy="all")
    y1, _ = jax.jit(m1.apply)({"params": params}, x)
    zero_rows = (np.abs(np.asarray(y1).reshape(-1, 16)).max(-1) == 0).sum()
    assert zero_rows >= 12


def test_parameters_and_partitioning_metadata():
    x = jnp.ones((2, 8, 16))
    v = MoeFeedForward(num_experts=4, hidden_dim=24, num_groups=2).init(jax.random.key(0), x)
    specs = nn.get_partition_spec(v)["params"]
    assert specs["wi"] == P("expert", None, None)
    assert specs["wo"] == P("expert", None, None)
    assert specs["gate"] == P(None, None)
    shapes = jax.tree.map(jnp.shape, nn.unbox(v)["params"])
    assert shapes == {"gate": (16, 4), "wi": (4, 16, 24), "wo": (4, 24, 16)}


def test_no_expert_axes_leaves_expert_layout_open():
    """expert_axes=None: wi/wo carry no partitioning metadata (all-None metadata would be a hint pinning
    them replicated), so shardc's search may split the experts."""
    x = jnp.ones((2, 8, 16))
    v = MoeFeedForward(num_experts=4, hidden_dim=24, num_groups=2, group_axes=None, expert_axes=None).init(
        jax.random.key(0), x)
    params = v["params"]
    assert isinstance(params["gate"], nn.Partitioned)
    assert not isinstance(params["wi"], nn.Partitioned) and not isinstance(params["wo"], nn.Partitioned)
    m = MoeFeedForwardNNX(16, 4, 24, rngs=nnx.Rngs(0), num_groups=2, group_axes=None, expert_axes=None)
    assert m.gate.get_metadata().get("out_sharding") == (None, None)
    assert "out_sharding" not in m.wi.get_metadata() and "out_sharding" not in m.wo.get_metadata()


def _sharded_apply(mesh_shape, group_axes, x, m_kwargs, num_groups=8):
    mesh = _mesh(mesh_shape)
    m = MoeFeedForward(num_groups=num_groups, group_axes=group_axes, expert_axes=("expert",), **m_kwargs)
    params, specs = _init(m, x)
    y0, aux0 = jax.jit(lambda p, x: m.apply({"params": p}, x))(params, x)
    with jax.set_mesh(mesh):
        ps = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        xs = jax.device_put(x, NamedSharding(mesh, P(group_axes)))
        f = jax.jit(lambda p, x: m.apply({"params": p}, x))
        compiled = f.lower(ps, xs).compile()
        y1, aux1 = f(ps, xs)
    return (y0, aux0), (y1, aux1), compiled, ps


@pytest.mark.parametrize(
    "mesh_shape,group_axes",
    [({"expert": 8}, ("expert",)), ({"data": 2, "expert": 4}, ("data", "expert"))],
)
def test_sharded_equals_unsharded_and_two_all_to_alls(mesh_shape, group_axes):
    x = jax.random.normal(jax.random.key(0), (16, 32, 16))
    kw = dict(num_experts=8, hidden_dim=32, second_expert_policy="all")
    (y0, aux0), (y1, aux1), compiled, ps = _sharded_apply(mesh_shape, group_axes, x, kw)
    np.testing.assert_allclose(np.asarray(y0), np.asarray(y1), atol=1e-5)
    np.testing.assert_allclose(float(aux0), float(aux1), rtol=1e-5)
    txt = compiled.as_text()
    counts = _collectives(txt)
    # GShard: the forward pass is exactly two all-to-alls (dispatch, combine) and never gathers the input.
    assert counts["all-to-all"] == 2, counts
    assert counts["all-gather"] == 0, counts
    # Expert weights stay split: each device holds E / |expert| experts.
    n_exp = mesh_shape["expert"]
    assert ps["wi"].addressable_shards[0].data.shape == (8 // n_exp, 16, 32)


def test_gradients_reach_expert_weights_sharded():
    mesh = _mesh({"expert": 8})
    x = jax.random.normal(jax.random.key(0), (16, 16, 16))
    m = MoeFeedForward(num_experts=8, hidden_dim=32, num_groups=8)
    params, specs = _init(m, x)

    def loss(p, x, key):
        y, aux = m.apply({"params": p}, x, deterministic=False, rngs={"gating": key})
        return jnp.mean(y**2) + 0.01 * aux

    g0 = jax.jit(jax.grad(loss))(params, x, jax.random.key(2))
    with jax.set_mesh(mesh):
        ps = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
        gf = jax.jit(jax.grad(loss))
        g1 = gf(ps, xs, jax.random.key(2))
        txt = gf.lower(ps, xs, jax.random.key(2)).compile().as_text()
    for name in ("wi", "wo", "gate"):
        a = np.asarray(g1[name])
        assert np.isfinite(a).all() and np.abs(a).sum() > 0, name
        np.testing.assert_allclose(np.asarray(g0[name]), a, atol=1e-5, rtol=1e-4)
    # Every expert receives gradient (random init routes tokens to all experts).
    assert (np.abs(np.asarray(g1["wi"])).sum(axis=(1, 2)) > 0).all()
    assert g1["wi"].sharding.spec[0] == "expert"
    assert _count(txt, "all-to-all") >= 2


def test_compiled_program_size_roughly_flat_in_devices():
    """GShard's O(1) compilation: the SPMD program does not grow with the number of devices."""
    sizes = {}
    for n in (2, 8):
        mesh = jax.make_mesh((n,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
        x = jnp.ones((2 * n * 4, 16, 16))
        m = MoeFeedForward(num_experts=2 * n, hidden_dim=16, num_groups=2 * n, second_expert_policy="all")
        params, specs = _init(m, x)
        with jax.set_mesh(mesh):
            ps = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
            xs = jax.device_put(x, NamedSharding(mesh, P("expert")))
            txt = jax.jit(lambda p, x: m.apply({"params": p}, x)[0]).lower(ps, xs).compile().as_text()
        sizes[n] = sum(1 for line in txt.splitlines() if " = " in line)
    assert sizes[8] <= 1.3 * sizes[2], sizes


def test_resolve_num_groups():
    assert resolve_num_groups(64, num_groups=4) == 4
    assert resolve_num_groups(64) == 1  # no mesh -> one group
    assert resolve_num_groups(64, group_size=16) == 4
    assert resolve_num_groups(60, group_size=16) == 4  # 60 / 16 -> 4 groups of 15
    with pytest.raises(ValueError):
        resolve_num_groups(63, num_groups=4)
    with jax.set_mesh(_mesh({"data": 2, "expert": 4})):
        assert resolve_num_groups(64) == 4
        assert resolve_num_groups(64, group_axes=("data", "expert")) == 8
        assert resolve_num_groups(64, group_size=32, group_axes=("expert",)) == 4


def test_nnx_matches_linen():
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    lin = MoeFeedForward(num_experts=4, hidden_dim=24, num_groups=2, second_expert_policy="all")
    params, _ = _init(lin, x)
    mod = MoeFeedForwardNNX(16, 4, 24, rngs=nnx.Rngs(0), num_groups=2, second_expert_policy="all")
    mod.gate[...] = params["gate"]
    mod.wi[...] = params["wi"]
    mod.wo[...] = params["wo"]
    y0, a0 = lin.apply({"params": params}, x)
    y1, a1 = mod(x)
    np.testing.assert_allclose(np.asarray(y0), np.asarray(y1), atol=1e-6)
    np.testing.assert_allclose(float(a0), float(a1), rtol=1e-6)
    # Random routing only with a key; gradients flow to the experts.
    grads = nnx.grad(lambda m: jnp.sum(m(x, rng=jax.random.key(1))[0] ** 2))(mod)
    assert np.abs(np.asarray(grads.wi[...])).sum() > 0


def test_nnx_sharded_params_under_mesh():
    mesh = _mesh({"expert": 4})
    with jax.set_mesh(mesh):
        mod = MoeFeedForwardNNX(16, 4, 24, rngs=nnx.Rngs(0), num_groups=4)
        assert mod.wi[...].sharding.spec == P("expert", None, None)
        y, _ = nnx.jit(lambda m, x: m(x))(mod, jnp.ones((8, 4, 16)))
    assert y.shape == (8, 4, 16)


def test_functional_core_top1_router():
    x = jax.random.normal(jax.random.key(0), (2, 16, 8))
    gk = jax.random.normal(jax.random.key(1), (8, 4))
    wi = jax.random.normal(jax.random.key(2), (4, 8, 12))
    wo = jax.random.normal(jax.random.key(3), (4, 12, 8))
    y, gating = jax.jit(lambda *a: moe_ffn(*a, router="top1", expert_capacity=16))(x, gk, wi, wo)
    # Top-1 without drops: y = p_max * FFN_argmax(x).
    p = jax.nn.softmax(jnp.einsum("gsm,me->gse", x, gk), -1)
    e = np.asarray(jnp.argmax(p, -1))
    xf, yf, pf, wif, wof = (np.asarray(a) for a in (x, y, p, wi, wo))
    for g in range(2):
        for s in range(16):
            h = np.maximum(xf[g, s] @ wif[e[g, s]], 0)
            np.testing.assert_allclose(yf[g, s], pf[g, s, e[g, s]] * (h @ wof[e[g, s]]), rtol=1e-4, atol=1e-4)
    assert moe.GatingOutput is type(gating)


# (x shape, experts): the dispatch mask [G, S, E, C] larger than the tokens [G, S, M]; and d_model M larger
# than E x C, as in real models (d 1024, 64 experts, C 8), where the dispatched tokens [E, G, C, M] are the
# largest tensor of the dispatch einsum yet computing them split on G and moving them is the cheap way.
@pytest.mark.parametrize("x_shape, experts", [((16, 32, 16), 8), ((16, 8, 128), 8)])
def test_shardc_auto_forward_has_two_all_to_alls_and_no_input_all_gather(x_shape, experts):
    shardc = pytest.importorskip("shardc")
    if not hasattr(shardc, "auto"):
        pytest.skip("shardc.auto not available")
    mesh = shardc.make_mesh({"expert": 8})
    x = jax.random.normal(jax.random.key(0), x_shape)
    m = MoeFeedForward(num_experts=experts, hidden_dim=32, num_groups=8, second_expert_policy="all")
    params, _ = _init(m, x)
    y0, _ = m.apply({"params": params}, x)

    @shardc.auto(mesh=mesh, search=False)
    def fwd(p, x):
        return m.apply({"params": p}, x)

    y1, _ = fwd(params, x)
    np.testing.assert_allclose(np.asarray(y0), np.asarray(y1), atol=1e-5)
    counts = _collectives(fwd.lower(params, x).compile().as_text())
    assert counts["all-to-all"] == 2, counts
    assert counts["all-gather"] == 0, counts
