"""@shardc.auto(search=...): a given mesh is the only one tried; a .json search path saves, then loads."""
import os

import jax
import numpy as np

import shardc
from search_models import mlp_args, mlp_forward


def _step(x, w1, w2):
    l, g = jax.value_and_grad(lambda w1, w2: mlp_forward(x, w1, w2).mean(), argnums=(0, 1))(w1, w2)
    return w1 - g[0], w2 - g[1], l


def test_given_mesh_and_json_roundtrip(tmp_path):
    args = mlp_args(256, 128, 512)
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    path = str(tmp_path / "plan.json")
    f = shardc.auto(_step, mesh=mesh, search=path, budget_s=3)
    plan = f.plan(*args)
    assert plan.mesh_sizes == {"data": 2, "model": 4}
    assert plan.search is not None and plan.search.meshes == [{"data": 2, "model": 4}]
    assert os.path.exists(path)
    again = shardc.auto(_step, mesh=mesh, search=path).plan(*args)
    assert again.fingerprint() == plan.fingerprint()
    out = f(*args)
    np.testing.assert_allclose(float(out[2]), float(_step(*args)[2]), rtol=1e-5)


def test_hint_that_only_smaller_meshes_divide():
    """A batch of 12 hinted onto `data` on 8 devices: the search keeps the meshes whose `data` divides 12
    (the tracing mesh's data=8 is a stand-in, not a check); a dim no mesh divides is a ShardingError."""
    import pytest

    def step(w, x):
        x = shardc.split(x, 0, "data")
        l, g = jax.value_and_grad(lambda w: jax.numpy.mean(jax.numpy.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, l

    w, x = jax.numpy.ones((8, 16)) * 0.1, jax.random.normal(jax.random.key(0), (12, 8))
    f = shardc.auto(step, budget_s=1)
    plan = f.plan(w, x)
    assert 12 % plan.mesh_sizes["data"] == 0
    np.testing.assert_allclose(float(f(w, x)[1]), float(jax.jit(step)(w, x)[1]), rtol=1e-5)
    with pytest.raises(shardc.ShardingError, match=r"dim 0 .* size 7.*test_search_auto.py"):
        shardc.auto(step, budget_s=1).plan(w, x[:7])
    with pytest.raises(shardc.ShardingError, match=r"size 12, which is not divisible by 8"):  # a given mesh is checked
        shardc.auto(step, mesh=shardc.make_mesh({"data": 8})).plan(w, x)
