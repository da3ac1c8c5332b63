"""hint_p with a mesh: lowering to sharding constraints, compiled shardings, mesh lookup order."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import annotations as A
from annotations import UNCONSTRAINED, HintSpec, hint_p


def make_mesh(shape=(2, 4), names=("data", "model")):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


MESH = make_mesh()
X = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)


def constraints(text):
    """The sdy/mhlo sharding constraints in a lowered module's text."""
    return re.findall(r"sdy\.sharding_constraint [^<]*<@mesh, (\[[^\]]*\])>", text)


def out_spec(fn, x=X, mesh=MESH):
    """The PartitionSpec of a jitted fn's (single) output, normalised to full rank."""
    x = jax.device_put(x, NamedSharding(mesh, P()))
    compiled = jax.jit(fn).lower(x).compile()
    s = compiled.output_shardings
    assert isinstance(s, NamedSharding) and s.mesh.shape == mesh.shape
    return tuple(s.spec) + (None,) * (x.ndim - len(s.spec))


def test_compiled_output_shardings():
    with jax.set_mesh(MESH):
        assert out_spec(lambda x: A.split(x * 2, 1, "model")) == (None, "model")
        assert out_spec(lambda x: A.split(x * 2, 0, ("data", "model"))) == (("data", "model"), None)
        assert out_spec(lambda x: A.shard(x * 2, ("model", "data"))) == ("model", "data")
        assert out_spec(lambda x: A.shard(x * 2, P("data", None))) == ("data", None)
        assert out_spec(lambda x: A.replicate(x * 2)) == (None, None)
        # GShard counts: 4 -> "model", 2 -> "data", 8 -> both; 2 with "data" taken -> impossible
        assert out_spec(lambda x: A.split(x * 2, 1, 4)) == (None, "model")
        assert out_spec(lambda x: A.shard(x * 2, ("model", 2))) == ("model", "data")
        assert out_spec(lambda x: A.split(x * 2, 0, 8)) == (("data", "model"), None)
        # result sharding of an actual run
        r = jax.jit(lambda x: A.split(x + 1, 1, "model"))(X)
        assert r.sharding.spec == P(None, "model")
        np.testing.assert_array_equal(r, X + 1)


def test_lowered_text_open_and_closed_dims():
    with jax.set_mesh(MESH):
        text = jax.jit(lambda x: A.split(x, 1, "model")).lower(X).as_text()
        assert constraints(text) == ['[{?}, {"model"}]']
        text = jax.jit(lambda x: A.shard(x, (None, UNCONSTRAINED))).lower(X).as_text()
        assert constraints(text) == ["[{}, {?}]"]
        text = jax.jit(A.replicate).lower(X).as_text()
        assert constraints(text) == ["[{}, {}]"]


def test_grad_and_scan_lower_to_constraints():
    def loss(x):
        def body(c, xi):
            c = A.split(c * jnp.tanh(xi), 0, "model")
            return c, A.replicate(c.sum())

        c, ys = jax.lax.scan(body, x[0], x)
        return c.sum() + ys.sum()

    with jax.set_mesh(MESH):
        text = jax.jit(jax.grad(loss)).lower(X).as_text()
        found = constraints(text)
        # forward body: split (the replicated primal ys is dead under grad and DCE'd);
        # backward body: the cotangents of both hints
        assert found.count('[{"model"}]') >= 2 and found.count("[]") >= 1
        g = jax.jit(jax.grad(loss))(X / 100)
    ref = jax.grad(lambda x: jax.lax.scan(lambda c, xi: (c * jnp.tanh(xi), (c * jnp.tanh(xi)).sum()), x[0], x)
                   [1].sum() + jax.lax.scan(lambda c, xi: (c * jnp.tanh(xi), None), x[0], x)[0].sum())(X / 100)
    np.testing.assert_allclose(g, ref, rtol=1e-5)


def test_remat_and_vmap_with_mesh():
    f = jax.checkpoint(lambda x: A.split(jnp.sin(x), 1, "model"))
    with jax.set_mesh(MESH):
        text = jax.jit(jax.value_and_grad(lambda x: f(x).sum())).lower(X).as_text()
        assert constraints(text).count('[{?}, {"model"}]') >= 2
        text = jax.jit(jax.vmap(lambda r: A.split(r, 0, "model"), in_axes=1, out_axes=1)).lower(X).as_text()
        assert constraints(text) == ['[{"model"}, {?}]']
        # spmd_axis_name puts the batch dim on that axis
        vf = jax.vmap(lambda r: A.split(r, 0, "model"), spmd_axis_name="data")
        assert out_spec(vf) == ("data", "model")
        with pytest.raises(A.ShardingError, match="spmd_axis_name"):
            jax.make_jaxpr(jax.vmap(lambda r: A.split(r, 0, "data"), spmd_axis_name="data"))(X)


def test_eager_hint_places_value():
    with jax.set_mesh(MESH):
        y = A.split(X, 0, "data")
        assert isinstance(y.sharding, NamedSharding) and y.sharding.spec[0] == "data"
        y = A.shard(X, ("data", "model"))
        assert y.sharding.spec == P("data", "model")
        np.testing.assert_array_equal(y, X)
        # eager grad goes through the impl for the cotangent too
        g = jax.grad(lambda x: jnp.sum(A.split(x, 1, "model") ** 2))(X)
        np.testing.assert_allclose(g, 2 * X)


def test_mesh_param_and_lookup_order():
    other = make_mesh((4, 2), ("x", "y"))
    f = lambda x: A.split(x, 0, 2)
    (eqn,) = jax.make_jaxpr(f)(X).eqns
    assert eqn.primitive is hint_p and eqn.params["mesh"] is None
    assert A.current_mesh() is None and A.lookup_mesh() is None
    with jax.set_mesh(MESH):
        assert A.lookup_mesh() is MESH
        assert jax.make_jaxpr(f)(X).eqns[0].params["mesh"] is MESH
        with A.mesh_context(other):  # the explicit mesh wins
            assert A.current_mesh() is other and A.lookup_mesh() is other
            assert jax.make_jaxpr(f)(X).eqns[0].params["mesh"] is other
    with A.mesh_context(other):
        assert out_spec(f, mesh=other) == ("y", None)  # 2 parts: the size-2 axis
    with A.mesh_context(Mesh(np.empty((), object), ())):  # empty mesh counts as none
        assert A.current_mesh() is None


def test_mesh_context_retraces_cached_functions():
    inner = jax.jit(lambda x: A.split(x, 0, "data"))
    outer = lambda x: inner(x) + 1
    mesh_of = lambda: _first_hint(jax.make_jaxpr(outer)(X)).params["mesh"]
    assert mesh_of() is None
    with A.mesh_context(MESH):
        assert mesh_of() is MESH
    assert mesh_of() is None


def _first_hint(closed):
    import jax.extend as jex

    def walk(j):
        for e in j.eqns:
            if e.primitive is hint_p:
                return e
            for sub in jex.core.jaxprs_in_params(e.params):
                r = walk(sub)
                if r is not None:
                    return r
        return None

    return walk(closed.jaxpr)


def test_mesh_context_with_placed_inputs_and_device_mismatch():
    f = jax.jit(lambda x: A.split(x * 2, 1, "model"))
    with A.mesh_context(MESH):
        xs = jax.device_put(X, NamedSharding(MESH, P()))
        assert f(xs).sharding.spec == P(None, "model")
        # uncommitted input, no jax.set_mesh: compiled for one device -> error, not a dropped hint
        with pytest.raises(A.ShardingError, match=r"compiled for 1 device.*test_hint_mesh.py:\d+"):
            f(X)


def test_partition_spec_helpers():
    spec = HintSpec("shard", (2, ("model",), UNCONSTRAINED, ()))
    assert A.partition_spec(spec, MESH) == P("data", "model", P.UNCONSTRAINED, None)
    assert A.resolve_dims(HintSpec("split", (8, 1)), MESH) == (("data", "model"), ())
    s = A.named_sharding(HintSpec("split", (4, UNCONSTRAINED)), MESH)
    assert s.mesh is MESH and s.spec == P("model", P.UNCONSTRAINED)


class _Cell(nn.Module):
    @nn.compact
    def __call__(self, c, xi):
        return jnp.tanh(A.split(nn.Dense(16)(c), 1, "model") + xi), None


def test_flax_nn_scan_remat_lowering():
    scan = nn.scan(nn.remat(_Cell), variable_broadcast="params", split_rngs={"params": False}, length=4)
    x = jnp.ones((4, 2, 16))
    params = scan().init(jax.random.PRNGKey(0), jnp.zeros((2, 16)), x)
    loss = lambda p: jnp.sum(scan().apply(p, jnp.zeros((2, 16)), x)[0] ** 2)
    with jax.set_mesh(MESH):
        text = jax.jit(jax.value_and_grad(loss)).lower(params).as_text()
        assert constraints(text).count('[{?}, {"model"}]') >= 2
        v, g = jax.jit(jax.value_and_grad(loss))(params)
    v_ref, g_ref = jax.value_and_grad(loss)(params)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g, g_ref)


def test_inside_shard_map():
    body = lambda x: (A.split(x * 2, 1, "model"), A.split(x * 3, 1, 4))
    f = jax.jit(jax.shard_map(body, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}))
    with jax.set_mesh(MESH):
        a, b = f(X)
        assert a.sharding.spec == P("data", "model") and b.sharding.spec == P("data", "model")
        np.testing.assert_array_equal(a, X * 2)
        # a manual axis cannot be named, and counts skip manual axes
        bad = jax.shard_map(lambda x: A.split(x, 1, "data"), in_specs=P("data"), out_specs=P("data"),
                            axis_names={"data"})
        with pytest.raises(A.ShardingError, match="manual here"):
            jax.jit(bad).lower(X)
        bad = jax.shard_map(lambda x: A.split(x, 1, 2), in_specs=P("data"), out_specs=P("data"),
                            axis_names={"data"})
        with pytest.raises(A.ShardingError, match="2 parts"):
            jax.jit(bad).lower(X)


def test_cond_with_mesh():
    f = lambda p, x: jax.lax.cond(p, lambda x: A.split(x * 2, 1, "model"), lambda x: x, x)
    with jax.set_mesh(MESH):
        assert '[{?}, {"model"}]' in constraints(jax.jit(f).lower(True, X).as_text())
        np.testing.assert_array_equal(jax.jit(f)(True, X), X * 2)
