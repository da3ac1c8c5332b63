"""Every call-time check raises a ShardingError naming the kind, shape, dim, sizes and this file's line.

Each `expect(lambda: ..., ...)` call is written on one line: the hint is written on that line, so the
error must name it.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import annotations as A
from annotations import ShardingError, replicate, shard, split

MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
X = jnp.ones((8, 6))
X12 = jnp.ones((12, 16))


def expect(thunk, *fragments):
    """Run thunk, expect a ShardingError that names this file's calling line and every fragment."""
    line = sys._getframe(1).f_lineno
    with pytest.raises(ShardingError) as info:
        thunk()
    msg = str(info.value)
    assert f"test_hint_errors.py:{line}" in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return msg


def test_sharding_error_is_a_value_error():
    assert issubclass(ShardingError, ValueError)


def test_dim_out_of_range():
    expect(lambda: split(X, 2, "data"), "split", "dim 2", "(8, 6)", "2 dims", "-2..1")
    expect(lambda: split(X, -3, "data"), "split", "dim -3", "(8, 6)")
    expect(lambda: split(X, "0", "data"), "split", "dim must be an int", "(8, 6)")
    expect(lambda: split(jnp.float32(1.0), 0, "data"), "split", "dim 0", "0 dims")
    # in-range negative dims are normalised python-style
    (eqn,) = jax.make_jaxpr(lambda x: split(x, -1, "model"))(X).eqns
    assert eqn.params["spec"].dims == (A.UNCONSTRAINED, ("model",))


def test_non_array_input():
    expect(lambda: split([1.0, 2.0], 0, "data"), "split", "expected a jax or numpy array", "list")
    expect(lambda: replicate(3.0), "replicate", "float")
    expect(lambda: replicate({"a": X, "b": 2}), "replicate", "int")
    expect(lambda: shard("abc", ("data",)), "shard", "str")


def test_bad_axes():
    expect(lambda: split(X, 0, 2.5), "split", "dim 0 (size 8)", "(8, 6)", "2.5")
    expect(lambda: split(X, 0, ["data"]), "split", "dim 0", "list")
    expect(lambda: split(X, 1, ("data", 3)), "split", "dim 1 (size 6)")
    expect(lambda: split(X, 0, None), "split", "dim 0", "None")
    expect(lambda: split(X, 0, ""), "split", "dim 0")
    expect(lambda: split(X, 0, True), "split", "bool")
    expect(lambda: shard(X, [1.5]), "shard", "dim 0 (size 8)", "1.5")
    expect(lambda: shard(X, "data"), "shard", "spec must be a sequence")
    expect(lambda: shard(X, ("data", None, None)), "shard", "3 entries", "(8, 6)", "2 dims")


def test_repeated_axes():
    expect(lambda: split(X, 0, ("data", "data")), "split", "'data'", "dim 0 (size 8)", "the same dim")
    expect(lambda: shard(X, ("model", "model")), "shard", "'model'", "dim 1 (size 6)", "dim 0 (size 8)")
    expect(lambda: shard(X, (("data", "model"), "data")), "shard", "'data'", "used twice")


def test_bad_counts():
    expect(lambda: split(X, 0, 0), "split", "dim 0 (size 8)", ">= 1, got 0")
    expect(lambda: split(X, 1, -2), "split", "dim 1 (size 6)", "got -2")
    expect(lambda: split(X, 1, 4), "split", "dim 1", "size 6", "not divisible into 4 parts")
    expect(lambda: shard(X, (3, None)), "shard", "dim 0", "size 8", "3 parts")


def test_mesh_errors():
    with jax.set_mesh(MESH):
        msg = expect(lambda: split(X, 0, "expert"), "split", "unknown mesh axis 'expert'", "dim 0 (size 8)")
        assert "['data', 'model']" in msg and "{'data': 2, 'model': 4}" in msg
        expect(lambda: split(X, 1, "model"), "split", "dim 1", "(8, 6)", "size 6", "not divisible by 4", "model=4")
        expect(lambda: shard(X12, (("data", "model"), None)), "shard", "dim 0", "size 12", "by 8", "data=2, model=4")
        expect(lambda: split(X12, 0, 3), "split", "(12, 16)", "dim 0", "3 parts", "'model': 4")
        expect(lambda: shard(X12, ("data", 2)), "shard", "dim 1", "2 parts", "excluding ['data']")
        expect(lambda: split(X, 0, 16), "split", "dim 0", "16 parts")
        # inside jit the same checks run at trace time
        expect(lambda: jax.jit(lambda x: split(x, 1, "model"))(X), "split", "size 6", "not divisible by 4")
    # an explicit mesh from mesh_context is used the same way
    with A.mesh_context(MESH):
        expect(lambda: split(X, 0, "nope"), "split", "unknown mesh axis 'nope'")
    # without a mesh, axis names cannot be checked: no error
    split(X, 0, "nope")


def test_explicit_axes_are_rejected():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    with A.mesh_context(mesh):
        expect(lambda: split(X, 0, "a"), "split", "'a'", "Explicit", "dim 0")


def test_device_count_mismatch_names_the_hint_line():
    with A.mesh_context(MESH):
        expect(lambda: jax.jit(lambda x: split(x, 0, "data"))(jnp.ones((8, 8))), "split", "[8,8]",
               "8 devices", "compiled for 1 device")
