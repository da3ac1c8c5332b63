"""Every bad hint is a ShardingError that names the tensor, the dim, the sizes and the user's line."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc import shard, split


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def line_of(fn, marker):
    import inspect

    src, start = inspect.getsourcelines(fn)
    for i, text in enumerate(src):
        if marker in text:
            return start + i
    raise AssertionError(marker)


def check(mesh, fn, marker, *words, args=(jnp.ones((8, 6)),)):
    with pytest.raises(shardc.ShardingError) as info:
        shardc.plan(shardc.auto(fn, mesh=mesh, search=False), *args)
    msg = str(info.value)
    assert f"test_errors.py:{line_of(fn, marker)}" in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_unknown_axis(mesh):
    def f(x):
        return split(x, 0, "dta")  # BAD

    check(mesh, f, "# BAD", "dta", "data", "model")


def test_dim_out_of_range(mesh):
    def f(x):
        return split(x, 2, "data")  # BAD

    check(mesh, f, "# BAD", "dim 2", "(8, 6)")


def test_axis_used_twice(mesh):
    def f(x):
        return shard(x, ("data", "data"))  # BAD

    check(mesh, f, "# BAD", "data", "twice")


def test_not_divisible(mesh):
    def f(x):
        return split(x, 1, "model")  # BAD

    check(mesh, f, "# BAD", "6", "model", "4")


def test_conflicting_pinned_hints_on_carried_state(mesh):
    # The param comes in pinned model-split by its Flax metadata; the step returns its next version
    # pinned data-split: step 2 could not take it as it is, so this is the user's conflict to resolve.
    def f(p):
        return jax.tree.map(lambda v: shard(v * 2, ("data", None)), p)  # BAD

    boxed = nn.Partitioned(jnp.ones((8, 6)), names=("model", None))
    check(mesh, f, "# BAD", "conflict", "model", "data", args=(boxed,))


def test_mesh_that_does_not_match_devices():
    with pytest.raises(shardc.ShardingError, match="need 16 devices, but 8"):
        shardc.make_mesh({"data": 4, "model": 4})


def test_flax_logical_name_without_rule_is_replicated(mesh):
    """As in Flax (nn.logical_to_mesh_axes), a logical name no rule maps is replicated, not an error."""
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

    params = M().init(jax.random.key(0), jnp.ones((2, 6)))["params"]
    f = shardc.auto(lambda p, x: M().apply({"params": p}, x), mesh=mesh, search=False)
    plan = f.plan(params, jnp.ones((2, 6)))
    kernel = [i for i, n in enumerate(plan.input_names) if "kernel" in n][0]
    assert nn.logical_to_mesh_axes(("embed", "mlp"), ()) == jax.sharding.PartitionSpec(None, None)
    assert plan.input_shardings()[kernel].dims == ((), ())
    g = shardc.auto(lambda p, x: M().apply({"params": p}, x), mesh=mesh, rules=[("embed", None), ("mlp", "model")], search=False)
    plan = g.plan(params, jnp.ones((2, 6)))
    kernel = [i for i, n in enumerate(plan.input_names) if "kernel" in n][0]
    assert plan.input_shardings()[kernel].dims == ((), ("model",))


@pytest.mark.parametrize("names,words", [((None, "foo"), ("'foo'", "mesh axis", "Dense_0", "kernel")),
                                         (("model", "model"), ("'model'", "dim 0", "dim 1", "kernel"))])
@pytest.mark.parametrize("given_mesh", [True, False])
def test_flax_mesh_metadata_errors_before_tracing(mesh, names, words, given_mesh):
    """An unknown axis or an axis named twice in linen metadata is a ShardingError, not the JAX error Flax
    raises when it applies the metadata as a sharding constraint inside the trace."""
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), names))(x)

    params = M().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    if not given_mesh and names[1] == "foo":
        pytest.skip("with mesh=None a new axis name makes a mesh axis (docs/search.md)")
    f = shardc.auto(lambda p, x: M().apply({"params": p}, x), mesh=mesh if given_mesh else None, search=not given_mesh,
                    budget_s=1)
    with pytest.raises(shardc.ShardingError) as info:
        f.plan(params, jnp.ones((2, 8)))
    for w in words + ("test_errors.py:",):  # the step's line: the metadata does not record the model's
        assert w in str(info.value), (w, str(info.value))
