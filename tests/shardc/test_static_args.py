"""static_argnums / static_argnames: untraced arguments, one plan per value, as in jax.jit."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc import split


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


@dataclasses.dataclass(frozen=True)
class Config:
    activation: str
    scale: float


def _step(w, x, config, *, train=True):
    x = split(x, 0, "data")
    act = {"relu": jax.nn.relu, "tanh": jnp.tanh}[config.activation]
    loss_fn = lambda w: jnp.mean(act(x @ w) * config.scale)  # noqa: E731
    loss, g = jax.value_and_grad(loss_fn)(w)
    return (w - 0.1 * g if train else w), loss


def test_static_arguments_match_jax_jit_and_plan_once_per_value(mesh):
    traces = []

    def counted(w, x, config, *, train=True):
        traces.append((config, train))
        return _step(w, x, config, train=train)

    ours = shardc.auto(counted, mesh=mesh, search=False, static_argnums=2, static_argnames="train")
    ref = jax.jit(_step, static_argnums=2, static_argnames="train")
    w, x = jnp.linspace(-1, 1, 64).reshape(8, 8), jnp.linspace(0, 1, 128).reshape(16, 8)
    calls = [(Config("relu", 1.0), True), (Config("relu", 1.0), True), (Config("tanh", 2.0), True),
             (Config("tanh", 2.0), False), (Config("relu", 1.0), True)]
    w_ours = w_ref = w
    for config, train in calls:
        w_ours, l_ours = ours(w_ours, x, config, train=train)
        w_ref, l_ref = ref(w_ref, x, config, train=train)
        np.testing.assert_allclose(l_ours, l_ref, rtol=1e-6)
        np.testing.assert_allclose(w_ours, w_ref, rtol=1e-6)
    assert len(traces) == 3  # one trace per distinct (config, train)
    # the plan's inputs are named by the step's parameters: the static argument takes no input
    assert ours.plan(w, x, Config("relu", 1.0)).input_names == ("w", "x")


def test_static_argnames_covers_a_positional_parameter(mesh):
    f = shardc.auto(lambda x, double: x * 2 if double else x, mesh=mesh, search=False, static_argnames="double")
    np.testing.assert_allclose(f(jnp.ones(8), True), 2.0)
    np.testing.assert_allclose(f(jnp.ones(8), double=False), 1.0)


def test_static_argument_errors(mesh):
    f = shardc.auto(lambda x, opts: x * len(opts), mesh=mesh, search=False, static_argnums=1)
    with pytest.raises(shardc.ShardingError, match="static argument 1 is of type list, which is not hashable"):
        f(jnp.ones(8), [1, 2])
    with pytest.raises(shardc.ShardingError, match="both static and donated"):
        shardc.auto(lambda x, n: x, static_argnums=1, donate_argnums=(1,))
    with pytest.raises(shardc.ShardingError, match="needs ints"):
        shardc.auto(lambda x, n: x, static_argnums="n")


def test_static_argument_with_search(mesh):
    """The search plans each value's program (a different program may get a different plan)."""
    f = shardc.auto(_step, static_argnums=2, budget_s=1)
    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    _, loss = f(w, x, Config("tanh", 3.0))
    np.testing.assert_allclose(loss, jnp.mean(jnp.tanh(x @ w) * 3.0), rtol=1e-6)
    assert f.plan(w, x, Config("tanh", 3.0)).search is not None


def test_static_argument_names_and_positions_are_checked_as_jax_jit_does():
    def step(x, capacity):
        return x * capacity

    with pytest.raises(shardc.ShardingError, match=r"static_argnums=7.*2 positional parameter"):
        shardc.auto(step, static_argnums=7)
    with pytest.raises(shardc.ShardingError, match=r"static_argnames='capacty'.*no such parameter"):
        shardc.auto(step, static_argnames=("capacty",))
    with pytest.raises(shardc.ShardingError, match="seed='abc'"):
        shardc.auto(step, seed="abc")


def test_a_plan_file_per_static_value(mesh, tmp_path):
    """search='plan.json' with static arguments: each value is its own program, so its own file."""
    path = str(tmp_path / "plan.json")
    f = shardc.auto(_step, mesh=mesh, search=path, budget_s=1, static_argnums=2, static_argnames="train")
    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    for train in (True, False, True):
        f(w, x, Config("relu", 1.0), train=train)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(n.startswith("plan.") and n.endswith(".json") for n in files)
    again = shardc.auto(_step, mesh=mesh, search=path, budget_s=1, static_argnums=2, static_argnames="train")
    assert again.plan(w, x, Config("relu", 1.0), train=False).fingerprint() == \
        f.plan(w, x, Config("relu", 1.0), train=False).fingerprint()


def test_static_values_planned_on_different_meshes_warn_once():
    def step(w, x, wide):
        y = x @ w
        return (y.sum() * 2 if wide else y.sum()), w

    f = shardc.auto(step, static_argnums=2, budget_s=1)
    w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
    f(w, x, True)
    meshes = {tuple(s.mesh.shape.items()) for s in f._static_steps.values()}
    f2 = shardc.auto(step, static_argnums=2, budget_s=1, mesh=shardc.make_mesh({"data": 8}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardc.ReplanWarning)  # one mesh given: never
        f2(w, x, True), f2(w, x, False)
    # forced apart: a second value on another mesh warns, once
    f._static_steps[(((2, False),), ())] = shardc.auto(lambda w, x, _: step(w, x, False),
                                                      mesh=shardc.make_mesh({"data": 2, "model": 4}), search=False)
    other = shardc.make_mesh({"data": 2, "model": 4})
    if meshes == {tuple(other.shape.items())}:
        pytest.skip("the search chose the same mesh")
    with pytest.warns(shardc.ReplanWarning, match="different meshes"):
        f(w, x, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardc.ReplanWarning)
        f(w, x, True)
