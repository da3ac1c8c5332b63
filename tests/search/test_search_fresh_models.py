"""Judge-style checks of the default `@shardc.auto` (search on) on small Flax/optax train steps written
outside shardc's own model helpers (bench/fresh_models.py): the searched run gives `jax.jit`'s numbers for
a few steps, and the chosen plan fits memory and is no slower than any baseline; `shardc.plan_for` plans
for larger named topologies without crashing."""
import jax
import pytest
from flax import linen as nn

import shardc
from bench.fresh_models import MEDIUM, MODELS, check_report, compare, run_steps, nnx_mlp


# (the models MEDIUM sizes up are checked at those sizes, where the searched plan shards, below)
@pytest.mark.parametrize("name", sorted(set(MODELS) - set(MEDIUM)))
def test_auto_matches_jit_and_beats_baselines(name):
    step, args = MODELS[name]()
    f = shardc.auto(step, budget_s=1.0)
    plan = f.plan(*args)
    assert plan.search is not None
    assert check_report(plan.search) is None, plan.search.summary()
    # the search's mesh is the run's, axis order included (a regression: {data: 4, expert: 2} chosen, traced
    # as {expert: 2, data: 4}: the dicts compared equal, the arguments went to the tracing mesh, jax.jit refused)
    assert list(f.mesh.shape.items()) == list(plan.mesh_sizes.items())
    # priced on the CPU host these plans shard: Adam moves elements whose gradient is ~0 by ~+-lr
    compare(run_steps(f, args, 2), run_steps(jax.jit(step), args, 2), atol=1e-4)


@pytest.mark.parametrize("name", sorted(MEDIUM))
def test_sharded_plan_matches_jit(name):
    """Sizes at which the searched plan shards: same numbers as jax.jit for 2 steps."""
    step, args = MODELS[name](**MEDIUM[name])
    f = shardc.auto(step, budget_s=1.0)
    plan = f.plan(*args)
    assert check_report(plan.search) is None, plan.search.summary()
    assert list(f.mesh.shape.items()) == list(plan.mesh_sizes.items())
    # adam/adamw models: elements with ~zero gradient move by ~+-lr(1e-3) whatever the summation order
    compare(run_steps(f, args, 2), run_steps(jax.jit(step), args, 2), atol=1e-4)


@pytest.mark.parametrize("name,topology", [("scan_gqa", "h100-sxm-8x8"), ("recsys", "tpu-v5e-8")])
def test_plan_for_named_topology(name, topology):
    step, args = MODELS[name]()
    plan = shardc.plan_for(step, *args, topology=topology, budget_s=1.5)
    assert check_report(plan.search) is None, plan.search.summary()
    assert sum(1 for _ in plan.mesh_sizes) >= 1


def test_nnx_metadata_axis_not_in_default_mesh():
    """Regression: NNX `with_partitioning` naming 'model' with mesh=None used to fail on the default
    tracing mesh ('data' only) before the search could choose a mesh with that axis."""
    step, args = nnx_mlp()
    plan = shardc.auto(step, budget_s=1).plan(*args)
    assert "model" in plan.mesh_sizes
    assert all("model" in c.mesh for c in plan.search.baselines)


def test_metadata_dim_not_divisible_by_all_devices():
    """Regression: the provisional tracing mesh (model=8) rejected a 'model' dim of 12 before the search
    could choose model=2 or 4; a dim no mesh divides gets a ShardingError naming it."""
    step, args = nnx_mlp(batch=16, d=16, h=12, classes=8)
    f = shardc.auto(step, budget_s=1)
    assert 12 % f.plan(*args).mesh_sizes["model"] == 0
    compare(run_steps(f, args, 1), run_steps(jax.jit(step), args, 1), atol=1e-4)
    step, args = nnx_mlp(batch=16, d=16, h=7, classes=8)
    with pytest.raises(shardc.ShardingError, match=r"fc1.*size 7"):
        shardc.auto(step, budget_s=1).plan(*args)


def test_linen_partitioned_custom_axis_name():
    """The same for linen `nn.with_partitioning` naming an axis outside the default names."""
    import jax.numpy as jnp

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tp")))(x)

    x = jnp.ones((16, 8))
    params = M().init(jax.random.key(0), x)["params"]

    def step(params, x):
        g = jax.grad(lambda p: M().apply({"params": p}, x).sum())(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g)

    f = shardc.auto(step, budget_s=1)
    assert "tp" in f.plan(params, x).mesh_sizes
    compare([nn.unbox(f(params, x))], [nn.unbox(jax.jit(step)(params, x))])


def test_logical_rules_target_axes_are_in_the_searched_mesh():
    """Regression: rules mapping logical names onto mesh axes outside the default names ('fsdp', 'tensor')
    made every candidate mesh reject the hints."""
    import jax.numpy as jnp

    init = nn.initializers.lecun_normal()

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
            return nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.relu(h))

    x = jnp.ones((16, 32))
    params = M().init(jax.random.key(0), x)["params"]

    def step(params, x):
        g = jax.grad(lambda p: (M().apply({"params": p}, x) ** 2).mean())(params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g)

    f = shardc.auto(step, budget_s=1, rules=[("embed", "fsdp"), ("mlp", "tensor")])
    sizes = f.plan(params, x).mesh_sizes
    assert "fsdp" in sizes and "tensor" in sizes
    compare([nn.unbox(f(params, x))], [nn.unbox(jax.jit(step)(params, x))])
