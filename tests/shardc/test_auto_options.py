"""@shardc.auto's options and entry points: bare decorator, donation, logical rules from Flax's context,
custom primitives with a user rule, regions (while, cond), and lowering."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import shardc
from shardc import split

PS = jax.sharding.PartitionSpec


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def test_bare_decorator_searches_and_keeps_the_hint():
    @shardc.auto
    def f(x):
        return jnp.sin(split(x, 0, "data")) * 2

    x = jnp.arange(16.0).reshape(8, 2)
    np.testing.assert_allclose(f(x), jnp.sin(x) * 2, rtol=1e-6)
    plan = f.plan(x)
    assert plan.search is not None  # the default is to search
    assert math.prod(plan.mesh_sizes.values()) == len(jax.devices()) and plan.mesh_sizes.get("data", 1) > 1
    assert plan.input_shardings()[0].dims[0] == ("data",)  # the user's hint is kept


def test_without_search_and_mesh_every_device_is_on_one_axis():
    f = shardc.auto(lambda x: jnp.sin(split(x, 0, "data")) * 2, search=False)
    x = jnp.arange(16.0).reshape(8, 2)
    np.testing.assert_allclose(f(x), jnp.sin(x) * 2, rtol=1e-6)
    plan = f.plan(x)
    assert plan.search is None
    assert plan.mesh_sizes == {"data": len(jax.devices())}
    assert plan.output_shardings()[0].dims == (("data",), ())


def test_donate_argnums(mesh):
    def step(p, x):
        return p - 0.1 * x.sum(0), (p ** 2).sum()

    f = shardc.auto(step, mesh=mesh, donate_argnums=0, search=False)
    p = jnp.ones((8,))
    lowered = f.lower(p, jnp.ones((4, 8)))
    assert "tf.aliasing_output" in lowered.as_text() or "jax.buffer_donor" in lowered.as_text()
    new_p, loss = f(p, jnp.ones((4, 8)))
    assert p.is_deleted()
    np.testing.assert_allclose(new_p, jnp.full((8,), 0.6), rtol=1e-6)


def test_logical_rules_from_flax_context(mesh):
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

    x = jnp.ones((4, 6))
    params = M().init(jax.random.key(0), x)["params"]
    f = shardc.auto(lambda p, x: M().apply({"params": p}, x), mesh=mesh, search=False)
    with nn.logical_axis_rules([("embed", None), ("mlp", "model")]):
        plan = f.plan(params, x)
        out = f(params, x)
    kernel = [i for i, n in enumerate(plan.input_names) if "kernel" in n][0]
    assert plan.input_shardings()[kernel].dims == ((), ("model",))
    np.testing.assert_allclose(out, M().apply({"params": params}, x), rtol=1e-6)


def test_user_rule_for_custom_primitive(mesh):
    scale_p = Primitive("test_rowscale")  # y[i, j] = x[i, j] * s[i]
    scale_p.def_impl(lambda x, s: x * s[:, None])
    scale_p.def_abstract_eval(lambda x, s: x)
    mlir.register_lowering(scale_p, mlir.lower_fun(lambda x, s: x * s[:, None], multiple_results=False))
    shardc.register_rule(scale_p, "ij,i->ij")

    def f(x, s):
        return scale_p.bind(split(x, 0, "data"), s) + 1

    x, s = jnp.ones((8, 4)), jnp.arange(8.0)
    af = shardc.auto(f, mesh=mesh, search=False)
    plan = af.plan(x, s)
    assert plan.input_shardings()[1].dims == (("data",),)   # propagated through the user's rule
    assert not plan.graph.conservative_primitives
    np.testing.assert_allclose(af(x, s), x * s[:, None] + 1)


def test_while_and_cond_regions(mesh):
    def f(x, n):
        x = split(x, 0, "data")
        x = jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c) + 1.0, x)
        return jax.lax.cond(x.sum() > 0, lambda a: a * 2, lambda a: -a, x)

    x = jnp.ones((8, 4))
    af = shardc.auto(f, mesh=mesh, search=False)
    plan = af.plan(x, 3)
    assert plan.output_shardings()[0].dims == (("data",), ())
    np.testing.assert_allclose(af(x, 3), jax.jit(f)(x, 3), rtol=1e-6)


def test_lower_returns_jax_lowered(mesh):
    f = shardc.auto(lambda x: split(x, 1, "model") @ jnp.ones((8, 2)), mesh=mesh, search=False)
    lowered = f.lower(jnp.ones((4, 8)))
    assert isinstance(lowered, jax.stages.Lowered)
    compiled = lowered.compile()
    assert "all-reduce" in compiled.as_text()


def test_plan_is_cached_per_signature(mesh):
    calls = []

    def g(x):
        calls.append(1)
        return x * 2

    f = shardc.auto(g, mesh=mesh, search=False)
    f(jnp.ones((8, 2)))
    f(jnp.ones((8, 2)))
    assert len(calls) == 1
    f(jnp.ones((16, 2)))
    assert len(calls) == 2


def test_keyword_arguments(mesh):
    f = shardc.auto(lambda x, *, scale: split(x, 0, "data") * scale, mesh=mesh, search=False)
    x = jnp.ones((8, 2))
    np.testing.assert_allclose(f(x, scale=jnp.float32(3.0)), x * 3)
    plan = f.plan(x, scale=jnp.float32(3.0))
    assert plan.input_names == ("x", "scale")


def test_key_placed_by_an_earlier_run_on_another_mesh():
    """Regression: a PRNG key returned by a run on one mesh, passed to a step traced on another, brought
    its mesh into the trace (fold_in failed with 'Mesh for all inputs should be equal')."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def step(key, count, x):
        k = jax.random.fold_in(key, count + 1)
        return key, count + 1, jnp.sum(x * jax.random.normal(k, x.shape))

    key, count, x = jax.random.key(0), jnp.uint32(0), jnp.ones((16, 8))
    key, count, _ = shardc.auto(step, mesh=shardc.make_mesh({"model": 2, "data": 4}), search=False)(key, count, x)
    got = shardc.auto(step, mesh=shardc.make_mesh({"data": 8}), search=False)(key, count, x)
    np.testing.assert_allclose(float(got[2]), float(jax.jit(step)(key, count, x)[2]), rtol=1e-5)


def test_plan_and_plan_for_take_the_steps_keyword_arguments():
    def step(w, *, x):
        return jnp.mean(split(x, 0, "data") @ w)

    w, x = jnp.ones((8, 4)), jnp.ones((16, 8))
    assert shardc.plan(step, w, kwargs={"x": x}, mesh=shardc.make_mesh({"data": 8}), search=False).mesh_sizes == {"data": 8}
    plan = shardc.plan_for(step, w, kwargs={"x": x}, topology="h100-sxm-8x2", budget_s=1)
    assert math.prod(plan.mesh_sizes.values()) == 16
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['x'\].*kwargs=\{'x': \.\.\.\}"):
        shardc.plan_for(step, w, x=x, topology="h100-sxm-8")


def test_the_same_donated_array_twice_is_an_error_not_a_crash():
    """Regression: `f(x, x)` with both donated crashed the process inside XLA on 8 devices."""
    f = shardc.auto(lambda a, b: a + b, mesh=shardc.make_mesh({"data": 8}), search=False, donate_argnums=(0, 1))
    x = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(f._mesh(), PS()))
    with pytest.raises(shardc.ShardingError, match=r"the same array is passed as a and b"):
        f(x, x)
    np.testing.assert_allclose(f(x, jnp.copy(x)), 2 * np.ones((8, 4)))
