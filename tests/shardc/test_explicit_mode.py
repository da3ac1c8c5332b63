"""Steps written for JAX's explicit sharding mode (`jax.make_mesh` gives Explicit axes by default) under
`@shardc.auto`, compared with `jax.jit` on the same mesh: `out_sharding=` on einsums, `jax.sharding.reshard`,
NNX parameters created with `out_sharding` metadata, `donate_argnames` / `static_argnames` as the Flax NNX
examples pass them (shardc/explicit.py, shardc/donation.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import shardc
from shardc.explicit import to_auto


def explicit_mesh():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    return mesh


def mlp(w1, w2, x):
    h = jnp.einsum("bd,df->bf", x, w1, out_sharding=P("data", "model"))
    h = jax.sharding.reshard(jnp.tanh(h), P("data", None))
    return jnp.einsum("bf,fd->bd", h, w2, out_sharding=P("data", None))


def placed(mesh):
    k = jax.random.split(jax.random.key(0), 3)
    w1 = jax.device_put(jax.random.normal(k[0], (16, 32)), NamedSharding(mesh, P(None, "model")))
    w2 = jax.device_put(jax.random.normal(k[1], (32, 16)), NamedSharding(mesh, P("model", None)))
    x = jax.device_put(jax.random.normal(k[2], (8, 16)), NamedSharding(mesh, P("data", None)))
    return w1, w2, x


@pytest.mark.parametrize("search", [False, True])
def test_einsum_out_sharding_and_reshard_run_as_under_jax_jit(search):
    mesh = explicit_mesh()
    args = placed(mesh)
    with jax.set_mesh(mesh):
        want = jax.jit(mlp)(*args)
        f = shardc.auto(mlp, search=search)
        got = f(*args)
        plan = f.plan(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the written shardings are hints: the first einsum's result is split as its out_sharding says
    dots = [op for op in plan.graph.ops if op.primitive == "dot_general"]
    assert plan.shardings[dots[0].outputs[0]].dims == (("data",), ("model",))
    assert plan.shardings[dots[-1].outputs[0]].dims == (("data",), ())


def test_written_shardings_become_hints_with_the_users_line():
    mesh = explicit_mesh()
    w1, w2, x = placed(mesh)
    with jax.set_mesh(mesh):
        closed = jax.make_jaxpr(mlp)(w1, w2, x)
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names)
    from annotations import mesh_context

    with mesh_context(auto), jax.set_mesh(auto):
        rewritten = to_auto(closed)
    hints = [e for e in rewritten.jaxpr.eqns if e.primitive.name == "shardc_hint"]
    assert len(hints) == 3  # two out_shardings and one reshard
    assert all(e.params["spec"].source is not None and e.params["spec"].source.file == __file__ for e in hints)
    assert not any(e.primitive.name == "reshard" for e in rewritten.jaxpr.eqns)
    assert not any(e.params.get("out_sharding") is not None for e in rewritten.jaxpr.eqns)


def test_plain_step_called_under_an_explicit_set_mesh():
    """A step with shardc's own hints, called inside `jax.set_mesh` of an Explicit mesh: the planned
    program runs under the plan's (Auto) mesh, where its constraints are constraints, not asserts."""
    mesh = explicit_mesh()

    def step(w, x):
        return shardc.split(jnp.tanh(x @ w), 1, "model").sum(axis=0)

    w = jax.random.normal(jax.random.key(1), (16, 32))
    x = jax.device_put(jax.random.normal(jax.random.key(2), (8, 16)), NamedSharding(mesh, P("data", None)))
    with jax.set_mesh(mesh):
        got = shardc.auto(step, search=False)(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.tanh(x @ w).sum(axis=0)), rtol=1e-5, atol=1e-5)


class Block(nnx.Module):
    """A Flax-example-style NNX block: kernels typed by `out_sharding` metadata, activations by `out_sharding=`."""

    def __init__(self, d: int, f: int, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(d, f, use_bias=False, kernel_metadata={"out_sharding": P("data", "model")}, rngs=rngs)
        self.down = nnx.Linear(f, d, use_bias=False, kernel_metadata={"out_sharding": P("model", "data")}, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.gelu(self.up(x, out_sharding=P("data", None, "model")))
        return self.down(h, out_sharding=P("data", None, None))


def nnx_train_step(model, optimizer, rngs, batch, scale=1.0):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    noisy = batch + 0.1 * jax.random.normal(rngs.dropout(), batch.shape, out_sharding=P("data"))

    def loss_fn(params):
        y = nnx.merge(graphdef, params, rest)(noisy)
        return scale * jnp.mean((y - batch) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer, rngs)), loss


def make_nnx(mesh):
    rngs = nnx.Rngs(params=0, dropout=1)
    with jax.set_mesh(mesh):
        model = Block(16, 64, rngs)
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    batch = jax.device_put(jax.random.normal(jax.random.key(4), (8, 4, 16)), NamedSharding(mesh, P("data")))
    return model, optimizer, rngs, batch


def test_nnx_step_with_explicit_shardings_matches_jax_jit():
    """The Flax NNX Gemma example's pattern: jit over (model, optimizer, rngs, batch) with donate_argnames
    and static_argnames called positionally, the state returned and written back with nnx.update."""
    mesh = explicit_mesh()
    opts = dict(static_argnames=("scale",), donate_argnames=("model", "optimizer"))
    runs = {}
    for name, step in (("jit", jax.jit(nnx_train_step, **opts)), ("shardc", shardc.auto(nnx_train_step, **opts))):
        model, optimizer, rngs, batch = make_nnx(mesh)
        losses = []
        with jax.set_mesh(mesh):
            for _ in range(3):
                state, loss = step(model, optimizer, rngs, batch, 2.0)
                nnx.update((model, optimizer, rngs), state)
                losses.append(float(loss))
        runs[name] = (losses, nnx.state(model, nnx.Param))
        if name == "shardc":
            kernel = model.up.kernel[...]
            assert kernel.sharding.spec == P("data", "model")  # the parameters keep the authors' layout
    np.testing.assert_allclose(runs["shardc"][0], runs["jit"][0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(runs["shardc"][1]), jax.tree.leaves(runs["jit"][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def scaled(w, x, scale=1.0):
    return w - scale * (x.T @ (x @ w))


def test_donate_argnames_donates_as_jax_jit_does():
    w, x = jnp.ones((16, 8)), jnp.ones((4, 16))
    f = shardc.auto(scaled, donate_argnames=("w",), static_argnames=("scale",), search=False)
    assert f.plan(w, x, scale=2.0).donated == (0,)  # passed positionally: donated by name, as jax.jit does
    assert f.plan(x=x, w=w).donated == (0,)  # by keyword (keyword leaves come in name order: w, x)
    g = shardc.auto(scaled, donate_argnums=(1,), search=False)
    assert g.plan(x=x, w=w).donated == (1,)  # a donated position passed by keyword
    with pytest.raises(shardc.ShardingError, match="no argument 2 to donate"):
        shardc.auto(scaled, donate_argnums=(2,), search=False).plan(w, x)
    want = jax.jit(scaled, donate_argnames=("w",), static_argnames=("scale",))(w.copy(), x, scale=2.0)
    np.testing.assert_allclose(np.asarray(f(w.copy(), x, scale=2.0)), np.asarray(want))


def test_donate_argnames_names_a_parameter():
    with pytest.raises(shardc.ShardingError, match="donate_argnames='weights'.*no such parameter"):
        shardc.auto(scaled, donate_argnames=("weights",))
    with pytest.raises(shardc.ShardingError, match="needs strings"):
        shardc.auto(scaled, donate_argnames=(0,))


def test_results_come_back_on_the_callers_explicit_mesh():
    """As jax.jit returns them under an Explicit mesh: the same step's next call under plain jax.jit (the
    Flax example's eval step) takes them, and a donated argument is consumed."""
    mesh = explicit_mesh()

    def step(w, x):
        h = jnp.tanh(jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model")))
        return w - 0.1 * jnp.einsum("bd,bf->df", x, h, out_sharding=P(None, "model")), h.sum()

    w = jax.device_put(jnp.ones((16, 32)) / 16, NamedSharding(mesh, P(None, "model")))
    x = placed(mesh)[2]
    f = shardc.auto(step, donate_argnums=0)
    with jax.set_mesh(mesh):
        w1, _ = f(w, x)
        assert w.is_deleted()
        assert w1.sharding.mesh.axis_types == mesh.axis_types and w1.sharding.spec == P(None, "model")
        want, _ = jax.jit(step)(w1, x)  # fails on results typed on shardc's Auto mesh
        got, _ = f(w1, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_auto_axes_region_is_no_replication_hint():
    """`jax.sharding.auto_axes` enters its region through a reshard to the Auto axes (spec all None): that
    leaves the layout to shardc, it does not pin the value replicated."""
    mesh = explicit_mesh()

    def top2(x):
        shd = jax.typeof(x).sharding
        values, _ = jax.sharding.auto_axes(lambda a: jax.lax.top_k(a, 2), out_sharding=shd)(jnp.abs(x))
        return values.sum(axis=1)

    x = placed(mesh)[2]
    with jax.set_mesh(mesh):
        closed = jax.make_jaxpr(top2)(x)
        want = jax.jit(top2)(x)
        got = shardc.auto(top2, search=False)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names)
    from annotations import mesh_context

    with mesh_context(auto), jax.set_mesh(auto):
        hints = [e.params["spec"] for e in to_auto(closed).jaxpr.eqns if e.primitive.name == "shardc_hint"]
    assert [h.dims for h in hints] == [(("data",), ()), (("data",), ())]  # the two reshards back to the types
