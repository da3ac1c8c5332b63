"""@shardc.auto(search=...): a given mesh is the only one tried; a .json search path saves, then loads."""
import json
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


def test_misspelt_axis_in_rules_warns_when_the_search_makes_the_mesh():
    """With mesh=None a name in the rules becomes a mesh axis, so 'modle' would silently be a new axis."""
    import warnings

    import flax.linen as nn
    import optax
    import pytest

    from shardc.search.integrate import AxisNameWarning

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(4)(nn.relu(nn.Dense(24, kernel_init=init)(x)))

    net, x = Net(), jax.numpy.ones((16, 8))
    p = net.init(jax.random.key(0), x)["params"]
    o = optax.sgd(0.1).init(p)

    def step(p, o, x):
        l, g = jax.value_and_grad(lambda q: jax.numpy.mean(net.apply({"params": q}, x) ** 2))(p)
        u, o = optax.sgd(0.1).update(g, o, p)
        return optax.apply_updates(p, u), o, l

    with pytest.warns(AxisNameWarning, match="'modle'.*did you mean 'model'"):
        shardc.auto(step, rules=[("embed", None), ("mlp", "modle")], budget_s=1).plan(p, o, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AxisNameWarning)
        plan = shardc.auto(step, rules=[("embed", None), ("mlp", "tensor")], budget_s=1).plan(p, o, x)
    assert "tensor" in plan.mesh_sizes


def test_bad_search_options_are_errors_before_any_work(tmp_path):
    import pytest

    for bad in ("mcmcc", "DP", str(tmp_path / "plan.txt")):
        with pytest.raises(shardc.ShardingError, match="expected True, False, 'dp', 'mcmc'"):
            shardc.auto(_step, search=bad)
    with pytest.raises(shardc.ShardingError, match="does not exist"):
        shardc.auto(_step, search=str(tmp_path / "missing" / "plan.json"))
    for bad in (0, -1, "5"):
        with pytest.raises(shardc.ShardingError, match="positive number of seconds"):
            shardc.auto(_step, budget_s=bad)


def test_fingerprint_tells_mesh_axis_orders_apart():
    """data=2, model=4 and model=4, data=2 lay devices out differently (which axis spans the slow link):
    the multi-host agreement check must not take one for the other."""
    args = mlp_args(64, 32, 64)
    a = shardc.plan(_step, *args, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=False)
    b = shardc.plan(_step, *args, mesh=shardc.make_mesh({"model": 4, "data": 2}), search=False)
    assert a.shardings == b.shardings and a.fingerprint() != b.fingerprint()


def test_saved_plan_is_not_loaded_for_another_mesh_or_topology(tmp_path):
    import pytest

    args = mlp_args(256, 128, 512)
    path = str(tmp_path / "plan.json")
    shardc.auto(_step, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=path, budget_s=1).plan(*args)
    with pytest.raises(shardc.ShardingError, match=r"made for mesh \{'data': 2, 'model': 4\}.*\{'data': 8\}"):
        shardc.auto(_step, mesh=shardc.make_mesh({"data": 8}), search=path).plan(*args)
    with pytest.raises(shardc.ShardingError, match="searched for topology 'cpu-host'.*'tpu-v5e-8'"):
        shardc.auto(_step, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=path, topology="tpu-v5e-8").plan(*args)


def test_saved_plan_not_given_to_other_hints_and_refused_when_the_file_is_broken(tmp_path):
    import pytest

    from shardc import split

    def hinted(axis):
        def step(x, w1, w2):
            return _step(split(x, 0, axis), w1, w2)
        return step

    args = mlp_args(256, 128, 512)
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    path = str(tmp_path / "plan.json")
    shardc.auto(hinted("data"), mesh=mesh, search=path, budget_s=1).plan(*args)
    again = shardc.auto(hinted("data"), mesh=mesh, search=path).plan(*args)  # the same hints: loads
    assert again.mesh_sizes == {"data": 2, "model": 4}
    assert again.search is None
    # the same program with another hint axis is not given the saved plan: it is searched, and added
    other = shardc.auto(hinted("model"), mesh=mesh, search=path, budget_s=1).plan(*args)
    assert other.search is not None and len(json.load(open(path))["plans"]) == 2
    assert shardc.auto(hinted("model"), mesh=mesh, search=path).plan(*args).search is None
    with open(path, "w") as f:
        f.write('{"version": 1, "gra')  # a save cut off half way
    with pytest.raises(shardc.ShardingError, match="not a plan file shardc saved.*delete it"):
        shardc.auto(hinted("data"), mesh=mesh, search=path).plan(*args)


def test_a_program_naming_axes_is_traced_once_per_axis_the_tracing_mesh_lacks():
    """mesh=None: the stand-in tracing mesh has `data` only; a program that splits over `data` and `expert`
    fails once on `expert` and is traced again on a mesh with both (it used to drop `data` on that retry,
    fail on it, and trace a third time), then once more on the mesh the search chose."""
    calls = []

    def step(w, x):
        calls.append(1)
        x = shardc.split(x, 0, "data")
        w = shardc.split(w, 0, "expert")
        l, g = jax.value_and_grad(lambda w: jax.numpy.mean(jax.numpy.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, l

    w, x = jax.numpy.ones((8, 16)) * 0.1, jax.random.normal(jax.random.key(0), (16, 8))
    f = shardc.auto(step, budget_s=1)
    plan = f.plan(w, x)
    assert set(plan.mesh_sizes) >= {"data", "expert"}
    retraced = list(plan.mesh_sizes.items()) != [("expert", 8), ("data", 1)]
    assert len(calls) == 2 + retraced, len(calls)


def test_a_plan_file_keeps_a_plan_per_batch_shape(tmp_path):
    """A step called with several batch shapes (bucketed sequences) is several programs: with
    search="plan.json" each is searched once and kept in the file, and a later run loads each one's plan
    (a second shape used to fail: the file held the first shape's plan, "made for a different program")."""
    path = str(tmp_path / "plan.json")
    args = mlp_args(256, 128, 512)
    small = (args[0][:128],) + tuple(args[1:])
    f = shardc.auto(_step, search=path, budget_s=1)
    plans = [f.plan(*args), f.plan(*small)]
    again = shardc.auto(_step, search=path)
    for a, p in zip((args, small), plans):
        loaded = again.plan(*a)
        assert loaded.search is None and loaded.fingerprint() == p.fingerprint()
    np.testing.assert_allclose(float(again(*small)[2]), float(_step(*small)[2]), rtol=1e-5)


def test_state_carried_between_programs_of_two_batch_shapes_keeps_one_layout(monkeypatch):
    """A step donating its weights, called with a large and a small batch in turn (bucketed data): the program
    of the second shape takes the weights as the first plan laid them out, so the weights each returns fit the
    other program and no third plan is made. (Each shape's search used to lay them out its own way; the first
    shape, called again with the second's weights, then got a plan of its own: the translation example planned
    four programs for three buckets.)"""
    from shardc.auto import AutoFunction

    builds = []
    real_build = AutoFunction._build
    monkeypatch.setattr(AutoFunction, "_build", lambda self, a, k: builds.append(a[0].shape) or real_build(self, a, k))
    x, w1, w2 = mlp_args(2048, 128, 512)
    small = jax.numpy.ones((8, 128)) * 0.01
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    f = shardc.auto(_step, mesh=mesh, donate_argnums=(1, 2), budget_s=2)
    ref = jax.jit(_step)
    rw1, rw2 = jax.numpy.copy(w1), jax.numpy.copy(w2)  # (f donates w1, w2)
    for batch in (x, small, x, small):
        w1, w2, loss = f(batch, w1, w2)
        rw1, rw2, rloss = ref(batch, rw1, rw2)
        np.testing.assert_allclose(float(loss), float(rloss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(w1), np.asarray(rw1), rtol=1e-5, atol=1e-7)
    assert builds == [(2048, 128), (8, 128)], builds
    weights = [f.plan(b, w1, w2).input_shardings()[1:] for b in (x, small)]
    assert weights[0] == weights[1]
