"""The per-call fast path (shardc/fast_call.py): a training loop's repeated calls skip the full route and still
compute what jax.jit computes; anything the full route would decide differently still takes it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc.auto import AutoFunction

MESH = {"data": 4, "model": 2}


def _step(params, x):
    h = shardc.split(x, 0, "data") @ params["w"]
    loss = jnp.mean(jnp.tanh(h) ** 2)
    grads = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def _params():
    return {"w": np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8)}


def _batch(i):
    return np.random.default_rng(i).normal(size=(32, 16)).astype(np.float32)


@pytest.fixture
def full_route_calls(monkeypatch):
    """Counts the calls that took the full route (planning lookup, placement checks)."""
    calls = []
    original = AutoFunction._compiled

    def counted(self, args, kwargs):
        calls.append(1)
        return original(self, args, kwargs)

    monkeypatch.setattr(AutoFunction, "_compiled", counted)
    return calls


def test_a_training_loop_takes_the_fast_path_and_computes_what_jit_computes(full_route_calls):
    f = shardc.auto(_step, mesh=shardc.make_mesh(MESH), search=False, donate_argnums=0)
    ref = jax.jit(_step)
    p, q = _params(), _params()
    for i in range(4):  # numpy batches: placed as the plan takes them; params: the previous step's outputs
        p, loss = f(p, _batch(i))
        q, want = ref(q, _batch(i))
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(q["w"]), rtol=1e-5, atol=1e-7)
    assert len(full_route_calls) == 1  # the first call only
    # a jnp batch on the default device (uncommitted) is placed the same way
    p, _ = f(p, jnp.asarray(_batch(9)))
    assert len(full_route_calls) == 1


def test_other_shapes_layouts_or_a_double_donation_take_the_full_route(full_route_calls):
    mesh = shardc.make_mesh(MESH)
    f = shardc.auto(_step, mesh=mesh, search=False, donate_argnums=0)
    p, _ = f(_params(), _batch(0))
    p, _ = f(p, _batch(1))
    n = len(full_route_calls)
    # another batch size: another plan, and its numbers are right
    p2, loss = f(jax.tree.map(np.asarray, p), _batch(2)[:16])
    assert len(full_route_calls) == n + 1
    np.testing.assert_allclose(float(loss), float(jax.jit(_step)(jax.tree.map(np.asarray, p), _batch(2)[:16])[1]),
                               rtol=1e-6)
    # a batch the user laid out in a layout of their own: the full route decides (and reports) its placement
    p, _ = f(_params(), _batch(3))
    laid_out = jax.device_put(_batch(4), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model")))
    n = len(full_route_calls)
    f(p, laid_out)
    assert len(full_route_calls) == n + 1
    # the same array donated twice, after the fast path was recorded: still the error that names both
    g = shardc.auto(lambda a, b: (a + 1, b + 1), mesh=mesh, search=False, donate_argnums=(0, 1))
    a, b = g(np.ones(8, np.float32), np.ones(8, np.float32))
    a, b = g(a, b)
    with pytest.raises(shardc.ShardingError, match="donate it once"):
        g(a, a)


def test_a_deleted_argument_is_not_run(full_route_calls):
    f = shardc.auto(_step, mesh=shardc.make_mesh(MESH), search=False, donate_argnums=0)
    p, _ = f(_params(), _batch(0))
    old = p
    p, _ = f(p, _batch(1))  # donates `old`
    assert old["w"].is_deleted()
    with pytest.raises(shardc.ShardingError, match=r"argument params\[.w.\] \(float32\[16, 8\]\) was deleted"):
        f(old, _batch(2))


def test_a_learning_rate_passed_as_a_python_float_each_step_takes_the_fast_path(full_route_calls):
    def step(params, x, lr):
        grads = jax.grad(lambda p: jnp.mean(jnp.tanh(shardc.split(x, 0, "data") @ p["w"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    f = shardc.auto(step, mesh=shardc.make_mesh(MESH), search=False)
    ref = jax.jit(step)
    p, q = _params(), _params()
    for i, lr in enumerate([0.1, 0.05, 0.025]):  # a schedule's value, a new Python float every call
        p, q = f(p, _batch(i), lr), ref(q, _batch(i), lr)
    np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(q["w"]), rtol=1e-5, atol=1e-7)
    assert len(full_route_calls) == 1
    f(p, _batch(5), 1)  # an int where a float was: traced as an int32, so the full route decides
    assert len(full_route_calls) == 2
