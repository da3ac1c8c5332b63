"""hint_p without a mesh: identity in value, visible in jaxprs, correct under jit/grad/vmap/scan/remat/flax."""
import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest

import annotations as A
from annotations import UNCONSTRAINED, HintSpec, hint_p


def hint_eqns(jaxpr):
    """All shardc_hint equations of a (closed) jaxpr, including nested ones, in order."""
    out = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive is hint_p:
                out.append(eqn)
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return out


X = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100


def f_hinted(x):
    y = A.split(x, 1, "model")
    return jnp.sum(jnp.sin(y) ** 2)


def f_plain(x):
    return jnp.sum(jnp.sin(x) ** 2)


def test_primitive_identity_eager_and_jit():
    assert hint_p.name == "shardc_hint"
    for fn in (lambda x: A.split(x, 0, "data"), A.replicate, lambda x: A.shard(x, ("data", None))):
        np.testing.assert_array_equal(fn(X), X)
        np.testing.assert_array_equal(jax.jit(fn)(X), X)
    # numpy input comes back as a jax array with the same value
    out = A.replicate(np.ones((2, 3), np.float32))
    assert isinstance(out, jax.Array) and out.shape == (2, 3)


def test_jaxpr_records_spec_mesh_and_source():
    (eqn,) = hint_eqns(jax.make_jaxpr(lambda x: A.split(x, 1, "model"))(X))
    spec = eqn.params["spec"]
    assert eqn.params["mesh"] is None
    assert spec.kind == "split" and spec.dims == (UNCONSTRAINED, ("model",))
    assert spec.source.file.endswith("test_hint_primitive.py") and spec.source.function == "<lambda>"
    assert eqn.outvars[0].aval.shape == X.shape


def test_api_specs():
    def spec_of(fn, x=X):
        (eqn,) = hint_eqns(jax.make_jaxpr(fn)(x))
        return eqn.params["spec"]

    assert spec_of(lambda x: A.split(x, -1, ("data", "model"))).dims == (UNCONSTRAINED, ("data", "model"))
    assert spec_of(lambda x: A.split(x, 0, 4)).dims == (4, UNCONSTRAINED)
    assert spec_of(lambda x: A.split(x, 0, 1)).dims == ((), UNCONSTRAINED)
    assert spec_of(A.replicate).dims == ((), ())
    assert spec_of(lambda x: A.shard(x, ("data",))).dims == (("data",), UNCONSTRAINED)
    assert spec_of(lambda x: A.shard(x, [None, UNCONSTRAINED])).dims == ((), UNCONSTRAINED)
    ps = jax.sharding.PartitionSpec(("data", "model"), jax.sharding.PartitionSpec.UNCONSTRAINED)
    assert spec_of(lambda x: A.shard(x, ps)).dims == (("data", "model"), UNCONSTRAINED)
    assert spec_of(lambda x: A.shard(x, (2, None))).dims == (2, ())
    assert spec_of(lambda x: A.shard(x, (1, None))).dims == ((), ())
    assert spec_of(A.replicate, jnp.float32(3.0)).dims == ()


def test_replicate_pytree():
    tree = {"a": X, "b": (jnp.ones(3), jnp.zeros((2, 2)))}
    out = A.replicate(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert len(hint_eqns(jax.make_jaxpr(A.replicate)(tree))) == 3


def test_grad_value_and_jaxpr_has_cotangent_hint():
    np.testing.assert_allclose(jax.grad(f_hinted)(X), jax.grad(f_plain)(X), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f_hinted))(X), jax.grad(f_plain)(X), rtol=1e-6)
    v, g = jax.value_and_grad(f_hinted)(X)
    np.testing.assert_allclose(v, f_plain(X), rtol=1e-6)
    eqns = hint_eqns(jax.make_jaxpr(jax.grad(f_hinted))(X))
    # one on the primal, one on the cotangent flowing back through the hint, with the same spec
    assert len(eqns) == 2
    assert eqns[0].params == eqns[1].params
    assert eqns[1].params["spec"].dims == (UNCONSTRAINED, ("model",))


def test_jvp_hints_tangent_and_symbolic_zeros():
    jp = jax.make_jaxpr(lambda x, t: jax.jvp(f_hinted, (x,), (t,)))(X, X)
    assert len(hint_eqns(jp)) == 2  # primal and tangent
    # a hint on a value that does not depend on the input: symbolic zero tangent/cotangent
    def h(x):
        c = A.replicate(jnp.ones(16))
        return jnp.sum(x * c)

    np.testing.assert_allclose(jax.grad(h)(X), jnp.ones_like(X))
    np.testing.assert_allclose(jax.jit(jax.grad(h))(X), jnp.ones_like(X))
    # linear: linear_transpose works and is the identity
    (t,) = jax.linear_transpose(lambda x: A.split(x, 0, 2), X)(X)
    np.testing.assert_array_equal(t, X)


def test_integer_input_under_grad():
    def h(x):
        idx = A.replicate(jnp.arange(16))
        return jnp.sum(x * idx)

    np.testing.assert_allclose(jax.grad(h)(X), jnp.broadcast_to(jnp.arange(16.0), X.shape))


def test_vmap_inserts_unconstrained_batch_dim():
    f = lambda r: A.split(r * 2, 0, "model")
    for in_axes, out_axes in ((0, 0), (1, 1), (1, 0)):
        out = jax.vmap(f, in_axes=in_axes, out_axes=out_axes)(X)
        ref = jax.vmap(lambda r: r * 2, in_axes=in_axes, out_axes=out_axes)(X)
        np.testing.assert_array_equal(out, ref)
    (eqn,) = hint_eqns(jax.make_jaxpr(jax.vmap(f, in_axes=1, out_axes=1))(X))
    assert eqn.params["spec"].dims == (("model",), UNCONSTRAINED)
    (eqn,) = hint_eqns(jax.make_jaxpr(jax.vmap(f, in_axes=0))(X))
    assert eqn.params["spec"].dims == (UNCONSTRAINED, ("model",))
    # nested vmap: two inserted dims
    x3 = jnp.ones((2, 3, 4))
    (eqn,) = hint_eqns(jax.make_jaxpr(jax.vmap(jax.vmap(lambda r: A.split(r, 0, "data"))))(x3))
    assert eqn.params["spec"].dims == (UNCONSTRAINED, UNCONSTRAINED, ("data",))
    # unbatched operand inside vmap keeps its spec
    (eqn,) = hint_eqns(jax.make_jaxpr(jax.vmap(lambda r: r + A.replicate(jnp.ones(16))))(X))
    assert eqn.params["spec"].dims == ((),)
    # vmap of grad
    g = jax.vmap(jax.grad(lambda r: A.split(r, 0, 4).sum() ** 2))(X)
    np.testing.assert_allclose(g, jax.vmap(jax.grad(lambda r: r.sum() ** 2))(X), rtol=1e-6)


def _scan_loss(hinted):
    def body(c, xi):
        c = c * jnp.tanh(xi)
        if hinted:
            c = A.split(c, 0, "data")
        y = c.sum()
        return c, (A.replicate(y) if hinted else y)

    def loss(x):
        c, ys = jax.lax.scan(body, x[0], x)
        return c.sum() + ys.sum()

    return loss


def test_scan_grad_remat_combos():
    hinted, plain = _scan_loss(True), _scan_loss(False)
    ref = jax.grad(plain)(X)
    np.testing.assert_allclose(hinted(X), plain(X), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(hinted)(X), ref, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(hinted))(X), ref, rtol=1e-6)
    v, g = jax.jit(jax.value_and_grad(jax.checkpoint(hinted)))(X)
    np.testing.assert_allclose(g, ref, rtol=1e-6)
    # remat inside the scan body
    def loss_remat(x):
        body = jax.checkpoint(lambda c, xi: (A.split(c * jnp.tanh(xi), 0, "data"), None))
        c, _ = jax.lax.scan(body, x[0], x)
        return c.sum()

    def loss_ref(x):
        c, _ = jax.lax.scan(lambda c, xi: (c * jnp.tanh(xi), None), x[0], x)
        return c.sum()

    np.testing.assert_allclose(jax.jit(jax.grad(loss_remat))(X), jax.grad(loss_ref)(X), rtol=1e-6)
    # the hints are in the scan bodies of the forward and backward pass
    eqns = hint_eqns(jax.make_jaxpr(jax.grad(hinted))(X))
    assert len(eqns) >= 4


def test_while_loop():
    f = lambda x: jax.lax.fori_loop(0, 3, lambda i, c: A.split(c * 2.0, 1, "model"), x)
    np.testing.assert_allclose(jax.jit(f)(X), X * 8)


class _Cell(nn.Module):
    @nn.compact
    def __call__(self, c, xi):
        h = A.split(nn.Dense(16)(c), 1, "model")
        return jnp.tanh(h + xi), None


class _Model(nn.Module):
    hinted: bool = True

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(nn.remat(_Cell), variable_broadcast="params", split_rngs={"params": False},
                       length=x.shape[0])
        c, _ = scan(name="cell")(jnp.zeros(x.shape[1:]), x)
        return jnp.sum(c**2)


def test_flax_nn_scan_and_remat():
    x = jnp.ones((4, 2, 16)) * 0.1
    m = _Model()
    params = m.init(jax.random.PRNGKey(0), x)
    loss = lambda p: m.apply(p, x)
    g = jax.jit(jax.grad(loss))(params)
    g_eager = jax.grad(loss)(params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g, g_eager)
    eqns = hint_eqns(jax.make_jaxpr(jax.grad(loss))(params))
    assert len(eqns) >= 2
    assert all(e.params["spec"].source.file.endswith("test_hint_primitive.py") for e in eqns)
    assert {e.params["spec"].source.function for e in eqns} == {"__call__"}


def test_rank_mismatch_in_bind_is_an_error():
    spec = HintSpec("split", (("data",),))
    with pytest.raises(A.ShardingError, match="has 1 dims but the tensor"):
        A.bind_hint(X, spec, None)


def test_cond():
    f = lambda p, x: jax.lax.cond(p, lambda x: A.split(x * 2, 0, "data"), lambda x: A.replicate(x), x)
    np.testing.assert_array_equal(jax.jit(f)(True, X), X * 2)
    np.testing.assert_array_equal(jax.jit(f)(False, X), X)
    assert len(hint_eqns(jax.make_jaxpr(f)(True, X))) == 2
