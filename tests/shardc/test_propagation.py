"""Propagation unit tests: each built from a tiny jaxpr, seeded with hints, checked value by value."""
import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc import replicate, shard, split
from shardc.ir.build import build_graph
from shardc.plan import build_plan
from shardc.propagate import project_dim, propagate
from shardc.seeds import program_seeds


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def planned(fn, mesh, *args):
    import annotations

    with annotations.mesh_context(mesh):
        closed = jax.make_jaxpr(fn)(*args)
    g = build_graph(closed)
    prop = propagate(g, dict(mesh.shape), program_seeds(g, mesh))
    return g, build_plan(g, mesh, prop)


def out_sharding(plan, i=0):
    return plan.shardings[plan.graph.outputs[i]].dims


def in_sharding(plan, i=0):
    return plan.shardings[plan.graph.inputs[i]].dims


def test_project_dim_splits_axes_over_factors():
    mesh = {"data": 2, "model": 4}
    # dim of size 32 = factors h(8) x d(4): data,model -> h takes both (8 % 2 == 0, 4 % 4 == 0)
    assert project_dim(("data", "model"), (0, 1), (8, 4), mesh) == ({0: ("data", "model"), 1: ()}, True)
    # h(2) takes data, is full, so model moves on to d(4)
    assert project_dim(("data", "model"), (0, 1), (2, 4), mesh) == ({0: ("data",), 1: ("model",)}, True)
    # model(4) does not divide h(2): cannot be represented without sub-axes
    assert project_dim(("model",), (0, 1), (2, 16), mesh)[1] is False


def test_elementwise_forward_and_backward(mesh):
    def f(x, y):
        a = split(x, 0, "data")
        return jnp.tanh(a) + y

    x = jnp.ones((8, 16))
    _, plan = planned(f, mesh, x, x)
    assert out_sharding(plan) == (("data",), ())
    assert in_sharding(plan, 1) == (("data",), ())  # y follows backward through the add


def test_dot_general_megatron_pair(mesh):
    def f(x, w1, w2):
        x = split(x, 0, "data")
        w1 = shard(w1, (None, "model"))
        h = jax.nn.relu(x @ w1)
        return h @ w2

    _, plan = planned(f, mesh, jnp.ones((8, 32)), jnp.ones((32, 64)), jnp.ones((64, 16)))
    g = plan.graph
    # w2's contracting dim follows h's hidden dim: row-parallel.
    assert in_sharding(plan, 2) == (("model",), ())
    assert out_sharding(plan) == (("data",), ())
    # The second matmul leaves partial sums over model, reduced once.
    reduces = [r for r in plan.reshards if r.kind == "all-reduce"]
    assert len(reduces) == 1 and reduces[0].src.partial == frozenset({"model"})
    assert reduces[0].bytes > 0


def test_reshape_split_dim_survives(mesh):
    def f(x):
        x = shard(x, (None, None, "model"))
        return x.reshape(2, 8, 4, 16)  # (b, s, h*d) -> (b, s, h, d)

    _, plan = planned(f, mesh, jnp.ones((2, 8, 64)))
    assert out_sharding(plan) == ((), (), ("model",), ())
    assert not plan.reshards


def test_reshape_merge_dims(mesh):
    def f(x):
        x = split(x, 0, "data")
        return x.reshape(16, 16)  # (b, s, d) -> (b*s, d)

    _, plan = planned(f, mesh, jnp.ones((2, 8, 16)))
    assert out_sharding(plan) == (("data",), ())


def test_reshape_backward(mesh):
    def f(x):
        y = x.reshape(4, 4, 8)
        return split(y, 1, "model")

    _, plan = planned(f, mesh, jnp.ones((16, 8)))
    # dim 0 (16) = (4 x 4); model(4) on the minor factor is only representable with a sub-axis: stays put
    assert in_sharding(plan) in (((), ()), (("model",), ()))
    def g(x):
        y = x.reshape(4, 4, 8)
        return split(y, 0, "model")

    _, plan = planned(g, mesh, jnp.ones((16, 8)))
    assert in_sharding(plan) == (("model",), ())


def test_transpose_permutes(mesh):
    def f(x):
        x = shard(x, ("data", "model"))
        return x.T

    _, plan = planned(f, mesh, jnp.ones((8, 16)))
    assert out_sharding(plan) == (("model",), ("data",))


def test_reduction_makes_partial_then_all_reduce(mesh):
    def f(x):
        x = shard(x, ("data", "model"))
        return replicate(x.sum(axis=1))

    _, plan = planned(f, mesh, jnp.ones((8, 16)))
    kinds = sorted(r.kind for r in plan.reshards)
    assert "all-reduce" in kinds or "all-gather" in kinds
    assert out_sharding(plan) == ((),)


def test_conflict_resolved_toward_larger_tensor(mesh):
    def f(big, small):
        big = shard(big, ("data", None))
        small = shard(small, ("model", None))
        return big + small

    _, plan = planned(f, mesh, jnp.ones((8, 1024)), jnp.ones((8, 1024)))
    # equal sizes: deterministic; now make one larger via broadcasting-free sizes
    def h(a, b):
        a = shard(a, (None, "data"))   # [8, 1024] -> 'data' on dim 1
        b = shard(b, (None, "model"))
        return jnp.dot(a, b.T)         # [8, 8]

    def k(big, small):
        big = shard(big, ("data", None))
        small = shard(small, ("model",))
        return big * small[:, None]

    _, plan = planned(k, mesh, jnp.ones((8, 4096)), jnp.ones((8,)))
    # the result follows the big operand; the small one is resharded
    assert out_sharding(plan) == (("data",), ())
    small = plan.graph.inputs[1]
    assert any(r.kind != "none" for r in plan.reshards if r.value != plan.graph.inputs[0])
    assert plan.shardings[small].dims == (("model",),)


def test_broadcast_propagates_last(mesh):
    def f(x, b):
        x = split(x, 1, "model")
        return x + b[None, :]

    _, plan = planned(f, mesh, jnp.ones((8, 16)), jnp.ones((16,)))
    assert in_sharding(plan, 1) == (("model",),)


def test_scan_carry_tied(mesh):
    def f(c0, xs):
        c0 = split(c0, 0, "data")

        def body(c, x):
            return jnp.tanh(c * x), c.sum()

        return jax.lax.scan(body, c0, xs)

    _, plan = planned(f, mesh, jnp.ones((8, 4)), jnp.ones((3, 8, 4)))
    assert out_sharding(plan, 0) == (("data",), ())
    # the stacked xs: scanned dim replicated, dim 1 like the carry
    assert in_sharding(plan, 1) == ((), ("data",), ())


def test_int_count_resolves_to_axes(mesh):
    def f(x):
        return split(x, 0, 8)

    _, plan = planned(f, mesh, jnp.ones((16, 4)))
    assert out_sharding(plan) == (("data", "model"), ())


def test_a_dim_moving_to_another_axis_moves_bytes():
    """Regression: [data, -] -> [model, -] was an 'all-gather' of 0 bytes in the plan. The plan's reshard
    costs are the one reshard model's (shardc.cost.reshard), which tests/cost checks against XLA."""
    from shardc.cost.reshard import reshard_collectives
    from shardc.plan import reshard_cost
    from shardc.sharding import Sharding

    mesh = {"data": 2, "model": 4}
    for src, dst in [((("data",), ()), (("model",), ())), ((("data",), ()), ((), ())),
                     ((("data", "model"), ()), (("data",), ()))]:
        src, dst = Sharding(src), Sharding(dst)
        cost = reshard_cost(src, dst, (16, 32), 4, mesh)
        colls = reshard_collectives(src, dst, (16, 32), 4, mesh)
        assert cost.collectives == colls and cost.payload == sum(c.bytes for c in colls) > 0
        assert cost.kind == "+".join(dict.fromkeys(c.kind for c in colls))


def test_plan_reshards_carry_the_collectives_of_the_one_reshard_model():
    mesh = shardc.make_mesh({"data": 2, "model": 4})

    def f(x, w):
        return jnp.tanh(split(x, 0, "data") @ split(w, 0, "model")).sum(0)

    _, plan = planned(f, mesh, jnp.ones((16, 32)), jnp.ones((32, 64)))
    assert plan.reshards
    from shardc.plan import reshard_cost

    for r in plan.reshards:
        val = plan.graph.values[r.value]
        cost = reshard_cost(r.src, r.dst, val.shape, val.dtype.itemsize, plan.mesh_sizes, reduce_scatter=False)
        assert (r.kind, r.bytes, r.collectives) == (cost.kind, cost.payload, cost.collectives)