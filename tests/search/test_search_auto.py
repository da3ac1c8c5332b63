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
