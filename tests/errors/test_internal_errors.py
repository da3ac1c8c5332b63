"""An unexpected exception inside one of shardc's passes reaches the user as one ShardingError that names
the function, the pass and the failing line inside shardc and says it is a shardc bug (SHARDC_DEBUG=1
lets the original through). A typed PRNG key argument (once such a crash) plans and runs."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc

auto_mod = importlib.import_module("shardc.auto")

MESH = shardc.make_mesh({"data": 2, "model": 4})


def _boom(*args, **kwargs):
    raise KeyError("lost value 17")


def step(x):  # the function named in the message
    return shardc.split(x, 0, "data") * 2


def test_internal_failure_becomes_a_sharding_error_naming_the_pass(monkeypatch):
    monkeypatch.delenv("SHARDC_DEBUG", raising=False)
    monkeypatch.setattr(auto_mod, "propagate", _boom)
    with pytest.raises(shardc.ShardingError) as info:
        shardc.auto(step, mesh=MESH, search=False).plan(jnp.ones((8, 4)))
    msg = str(info.value)
    for words in ("propagating shardings in step", "test_internal_errors.py:", "internal KeyError",
                  "lost value 17", "bug in shardc", "SHARDC_DEBUG=1"):
        assert words in msg, msg
    assert isinstance(info.value.internal, KeyError)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_shardc_debug_lets_the_original_through(monkeypatch):
    monkeypatch.setenv("SHARDC_DEBUG", "1")
    monkeypatch.setattr(auto_mod, "build_plan", _boom)
    with pytest.raises(KeyError, match="lost value 17"):
        shardc.auto(step, mesh=MESH, search=False).plan(jnp.ones((8, 4)))


def test_user_errors_pass_through_unchanged():
    with pytest.raises(TypeError, match="dot_general"):
        shardc.auto(lambda x: x @ x, mesh=MESH, search=False).plan(jnp.ones((8, 4)))


def test_typed_prng_key_arguments_plan_and_run():
    def f(key, x):
        k1, k2 = jax.random.split(key)
        return shardc.split(x, 0, "data") * jax.random.normal(k1, x.shape), k2

    key, x = jax.random.key(0), jnp.ones((8, 4))
    got, want = shardc.auto(f, mesh=MESH, search=False)(key, x), jax.jit(f)(key, x)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    np.testing.assert_array_equal(jax.random.key_data(got[1]), jax.random.key_data(want[1]))
    ks = jax.random.split(key, 8)
    draw = lambda ks: jax.vmap(lambda k: jax.random.uniform(k, (4,)))(ks)  # noqa: E731
    got = shardc.auto(lambda ks: draw(shardc.split(ks, 0, "data")), mesh=MESH, search=False)(ks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(draw)(ks)), rtol=1e-6)


def test_tracing_errors_name_the_users_function_and_explain_static_values():
    def step(x):  # returns a string: JAX's error must name `step`, not shardc's wrapper
        return x, "not an array"

    with pytest.raises(TypeError, match=r"function step at .*test_internal_errors.py"):
        shardc.auto(step, mesh=MESH, search=False).plan(jnp.ones((8, 4)))

    def reshape(x, n):
        return x.reshape(n, -1)

    with pytest.raises(TypeError, match="concrete") as info:
        shardc.auto(reshape, mesh=MESH, search=False).plan(jnp.ones((8, 4)), 4)
    assert any("functools.partial" in n for n in getattr(info.value, "__notes__", []))


def test_auto_function_called_inside_another_is_inlined():
    x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64
    inner = shardc.auto(lambda u: shardc.split(u, 1, "model") * 2, mesh=MESH, search=False)
    outer = shardc.auto(lambda v: inner(shardc.split(v, 0, "data")) + 1, mesh=MESH, search=False)
    np.testing.assert_allclose(np.asarray(outer(x)), np.asarray(x * 2 + 1), rtol=1e-6)
    hints = [op.params["spec"].describe() for op in outer.plan(x).graph.ops if op.primitive == "shardc_hint"]
    assert hints == ["split[data | ?]", "split[? | model]"]
    np.testing.assert_allclose(np.asarray(jax.grad(lambda v: inner(v).sum())(x)), 2.0)


def test_an_error_raised_in_a_library_names_the_shardc_line_that_called_it(monkeypatch):
    """A library shardc calls raising (numpy here) is reported at shardc's own line, the library's after it (the
    message of a crash in a zoo run named only a numpy file, cut to `at /` by the table)."""
    monkeypatch.delenv("SHARDC_DEBUG", raising=False)
    monkeypatch.setattr(auto_mod, "propagate", lambda *a, **k: np.reshape(np.arange(3), (2, 2)))
    with pytest.raises(shardc.ShardingError) as info:
        shardc.auto(step, mesh=MESH, search=False).plan(jnp.ones((8, 4)))
    msg = str(info.value)
    assert "internal ValueError at shardc/auto.py:" in msg and "(raised in " in msg and "numpy" in msg, msg
