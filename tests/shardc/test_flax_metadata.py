"""Flax partitioning metadata read as a PartitionSpec: fewer names than dims leave the rest replicated (what
nn.DenseGeneral needs, whose initializer sees the flattened 2-D kernel)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardc


class Heads(nn.Module):
    names: tuple

    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.lecun_normal(), self.names)
        return nn.DenseGeneral((4, 16), kernel_init=init)(x).sum(-1)


def _step(model, tx):
    def step(params, opt_state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def test_dense_general_with_leading_names_only_is_split_and_trains_as_jax_jit():
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    model, tx = Heads((None, "model")), optax.adam(1e-2)
    x = jnp.linspace(-1, 1, 8 * 64).reshape(8, 64)
    params = model.init(jax.random.key(0), x)["params"]
    opt = tx.init(params)
    f = shardc.auto(_step(model, tx), mesh=mesh, search=False)
    plan = f.plan(params, opt, x)
    kernel = plan.input_names.index("params['DenseGeneral_0']['kernel'].value")
    assert plan.input_shardings()[kernel].dims == ((), ("model",), ())  # [in, heads, head_dim]: heads split
    ours, ref = (params, opt), (params, opt)
    for _ in range(2):
        *ours, l_ours = f(*ours, x)
        *ref, l_ref = jax.jit(_step(model, tx))(*ref, x)
        np.testing.assert_allclose(l_ours, l_ref, rtol=1e-5)
    np.testing.assert_allclose(nn.unbox(ours[0])["DenseGeneral_0"]["kernel"],
                               nn.unbox(ref[0])["DenseGeneral_0"]["kernel"], rtol=1e-5, atol=1e-7)


def test_dense_general_with_a_name_per_kernel_dim_is_a_clear_error():
    """Flax re-runs the initializer on the flattened 2-D kernel under the mesh, where 3 names do not fit:
    plain jax.jit under jax.set_mesh fails too; shardc says why and what to write instead."""
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    model, tx = Heads((None, "model", None)), optax.adam(1e-2)
    x = jnp.ones((8, 64))
    params = model.init(jax.random.key(0), x)["params"]
    with pytest.raises(shardc.ShardingError, match=r"DenseGeneral.*\(None, 'model'\)"):
        shardc.auto(_step(model, tx), mesh=mesh, search=False).plan(params, tx.init(params), x)


def test_more_names_than_dims_is_an_error():
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    boxed = nn.Partitioned(jnp.ones((8, 4)), names=(None, "model", None))
    with pytest.raises(shardc.ShardingError, match=r"3 axis names .* shape \(8, 4\)"):
        shardc.auto(lambda p: p * 2, mesh=mesh, search=False).plan(boxed)


def test_more_than_three_axes_with_mesh_none_is_a_clear_error():
    from shardc import split

    def f(x):
        return split(split(x, 0, ("data", "seq")), 1, ("fsdp", "stage")) * 2

    with pytest.raises(shardc.ShardingError, match="name 4 mesh axes.*at most 3 axes.*pass mesh="):
        shardc.auto(f, budget_s=1).plan(jnp.ones((8, 8)))
