"""tests/conftest.py fails any test whose compiles made XLA log "[SPMD] Involuntary full rematerialization"
(unless the test is marked `involuntary_remat`): the hook itself, on a program that provokes it."""
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardc


def _remat_compile(rows: int = 16) -> None:
    """[-, data] -> [model, -] on data=2 x model=4: XLA replicates the whole value to reshard it (a shape
    per test: a program compiled before comes from jax's cache, without the warning)."""
    mesh = shardc.make_mesh({"data": 2, "model": 4})

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P("model", None))) * 3

    jax.jit(f, in_shardings=NamedSharding(mesh, P(None, "data"))).lower(jnp.ones((rows, 32))).compile()


class _Item:
    def __init__(self, marked: bool) -> None:
        self.marked = marked

    def get_closest_marker(self, name: str):
        return object() if self.marked and name == "involuntary_remat" else None


def _run_hook(marked: bool, body) -> list[str]:
    """Run `body` inside the hook as pytest would run a test; returns what XLA logged meanwhile."""
    from shardc.check import xla_log

    with xla_log() as lines:
        hook = sys.modules["conftest"].pytest_runtest_call(_Item(marked))
        next(hook)
        body()
        try:
            hook.send(None)
        except StopIteration:
            pass
    return lines


@pytest.mark.involuntary_remat("compiles a program that rematerializes, to check the hook catches it")
def test_a_rematerializing_compile_fails_the_test():
    with pytest.raises(AssertionError, match="involuntary full rematerialization"):
        _run_hook(False, _remat_compile)


@pytest.mark.involuntary_remat("compiles a program that rematerializes, to check the marker excuses it")
def test_the_marker_excuses_it():
    lines = _run_hook(True, lambda: _remat_compile(8))
    assert any("Involuntary full rematerialization" in line for line in lines)


def test_a_clean_compile_passes():
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    _run_hook(False, lambda: jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("data"))).lower(
        jnp.ones((16, 32))).compile())


@pytest.mark.involuntary_remat("compiles a program that rematerializes, from jax's persistent cache and afresh")
def test_a_check_compiles_afresh_what_the_persistent_cache_holds(jax_persistent_cache):
    """`shardc.check` reads XLA's warnings while compiling; a program loaded from jax's persistent compilation
    cache is not compiled and logs nothing, so the check's compile bypasses that cache."""
    from shardc.check import INVOLUNTARY_REMAT, _compile, xla_log

    mesh = shardc.make_mesh({"data": 2, "model": 4})

    def lowered():  # (a new function each time: not one jax keeps compiled in memory)
        def f(x):
            return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P("model", None))) * 5

        return jax.jit(f, in_shardings=NamedSharding(mesh, P(None, "data"))).lower(jnp.ones((24, 32)))

    lowered().compile()  # (fills the cache)
    assert any(jax_persistent_cache.iterdir())
    with xla_log() as loaded:
        lowered().compile()
    assert not any(INVOLUNTARY_REMAT in line for line in loaded)  # (what a cache hit logs)
    _, warnings = _compile(lowered())
    assert any(INVOLUNTARY_REMAT in line for line in warnings)
    with xla_log() as loaded:
        lowered().compile()
    assert not any(INVOLUNTARY_REMAT in line for line in loaded)  # (the cache is on again)
