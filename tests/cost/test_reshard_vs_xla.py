"""The reshard model predicts the collectives XLA compiles, kind by kind and byte for byte."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardc
from shardc.cost.hlo import collectives
from shardc.cost.reshard import reshard_collectives
from shardc.sharding import Sharding

MESH = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh(MESH)


def _sh(spec):
    return Sharding(tuple(() if a is None else ((a,) if isinstance(a, str) else tuple(a)) for a in spec))


def _compiled(mesh, fn, args, in_specs, out_spec):
    f = jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, P(*s)) for s in in_specs),
                out_shardings=NamedSharding(mesh, P(*out_spec)))
    txt = f.lower(*args).compile().as_text()
    return sorted((c.kind, c.bytes) for c in collectives(txt, list(MESH.items())))


def _predicted(src, dst, shape, partial=()):
    s = Sharding(_sh(src).dims, frozenset(partial))
    cs = reshard_collectives(s, _sh(dst), shape, 4, MESH, reduce_scatter=False)
    return sorted((c.kind, c.bytes) for c in cs)


DIMS_CASES = [
    ((64, 64), ("data", None), (None, None)),
    ((64, 64), (("data", "model"), None), (None, None)),
    ((64, 64), ("data", "model"), (None, None)),
    ((64, 64), ("model", "data"), (None, None)),
    ((64, 64), ("data", None), (None, "data")),
    ((64, 64), ("model", None), (None, "model")),
    ((64, 64), (("data", "model"), None), (None, ("data", "model"))),
    ((64, 64), (("data", "model"), None), ("data", None)),
    ((64, 64), (("data", "model"), None), ("model", None)),
    ((64, 64), (("model", "data"), None), (("data", "model"), None)),
    ((64, 64), ("data", "model"), ("model", "data")),
    ((64, 64), ("data", None), ("model", None)),
    ((64, 64), ("model", None), ("data", None)),
    ((64, 64), (None, None), ("data", "model")),
    ((64, 64), ("data", "model"), ("data", None)),
    ((64, 64), ("data", "model"), (None, "model")),
    ((64, 64), ("data", None), ("data", "model")),
    ((64, 64), ("model", None), (("data", "model"), None)),
    ((8, 64, 64), ("data", None, "model"), (None, "model", "data")),
    ((8, 64, 64), ("data", None, None), (None, None, "model")),
    ((8, 64, 64), ("data", "model", None), (None, None, None)),
    ((8, 64, 64), ("data", None, "model"), (None, "data", "model")),
    ((8, 64, 64), ("data", None, "model"), (None, ("data", "model"), None)),
    ((8, 64, 64), (None, None, ("model", "data")), (None, None, "model")),
    ((8, 64, 64), (None, None, ("data", "model")), (None, None, "model")),
    ((8, 64, 64), (None, "model", None), (None, None, "model")),
    ((8, 64, 64), ("data", "model", None), ("data", None, "model")),
]


# XLA reshards these by involuntary full rematerialization (the model's collectives are checked for them too)
REMAT_CASES = {((8, 64, 64), ("data", None, None), (None, None, "model")),
               ((8, 64, 64), ("data", None, "model"), (None, ("data", "model"), None))}


@pytest.mark.parametrize("shape,src,dst", [
    pytest.param(*c, marks=pytest.mark.involuntary_remat("XLA's fallback is the case checked"))
    if c in REMAT_CASES else c for c in DIMS_CASES], ids=[f"{s}->{d}" for _, s, d in DIMS_CASES])
def test_dims_reshard_matches_xla(mesh, shape, src, dst):
    def fn(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(*dst))) * 3

    got = _compiled(mesh, fn, (jnp.ones(shape),), (src,), dst)
    assert got == _predicted(src, dst, shape)


PARTIAL_CASES = [  # (result dims before the reduction, contracted axis, target)
    ((None, None, None), "data", (None, None, "data")),
    ((None, None, None), "data", ("data", None, None)),
    ((None, None, "data"), "model", ("data", None, None)),
    ((None, None, "data"), "model", (None, None, "data")),
    (("data", None, None), "model", (None, None, "data")),
    ((None, None, "model"), "data", ("data", None, "model")),
    ((None, None, "model"), "data", (None, None, ("model", "data"))),
    ((None, None, "model"), "data", (None, None, ("data", "model"))),
    (("data", None, None), "model", ("data", "model", None)),
    (("data", None, None), "model", (None, None, None)),
]


@pytest.mark.parametrize("made,k,dst", PARTIAL_CASES, ids=[f"{m}+{k}->{d}" for m, k, d in PARTIAL_CASES])
def test_partial_reshard_matches_xla(mesh, made, k, dst):
    """A dot contracting over a sharded dim, its result pinned to its natural layout, then resharded —
    what shardc's lowering emits for a partial-sum reshard."""
    def W(x, s):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*s)))

    def fn(x, w):
        y = jnp.einsum("bsk,kn->bsn", W(x * 2, (made[0], made[1], k)), W(w * 2, (k, made[2])))
        return W(W(y, made), dst) * 3

    shape, n = (16, 32, 64), 128
    got = _compiled(mesh, fn, (jnp.ones(shape), jnp.ones((64, n))), ((made[0], made[1], k), (k, made[2])), dst)
    assert got == _predicted(made, dst, (16, 32, n), partial=(k,))


BROADCAST_CASES = [(shape, src, dst, along) for shape, src, dst in DIMS_CASES if len(shape) == 2
                   for along in ((0, 1), (0,), (1,))]


@pytest.mark.parametrize("shape,src,dst,along", BROADCAST_CASES,
                         ids=[f"{s}->{d}/{a}" for _, s, d, a in BROADCAST_CASES])
def test_broadcast_reshard_matches_xla(mesh, shape, src, dst, along):
    """A value that is a broadcast along `along` (of a scalar, a row or a column): XLA copies where a
    collective-permute would only move data along those dims."""
    kept = [d for d in range(len(shape)) if d not in along]

    def fn(x):
        b = jax.lax.broadcast_in_dim(x, shape, tuple(kept))
        b = jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P(*src)))
        return jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P(*dst))) * 3

    arg = jnp.arange(int(jnp.prod(jnp.array([shape[d] for d in kept]))), dtype=jnp.float32).reshape(
        [shape[d] for d in kept])
    got = _compiled(mesh, fn, (arg,), ((None,) * len(kept),), dst)
    cs = reshard_collectives(_sh(src), _sh(dst), shape, 4, MESH, reduce_scatter=False, bcast=frozenset(along))
    assert got == sorted((c.kind, c.bytes) for c in cs)


def test_a_reshard_through_xlas_cached_layout_is_two_steps_and_a_second_use_of_it_is_free():
    """XLA reshards [-, y, x] -> [-, -, y] (x=2, y=4) by replicating x first through its cached Reshard
    ([-, y, -]: an all-gather) and then an all-to-all; with another consumer needing [-, y, -] the value is
    all-gathered once. The path is two steps, and the compiled program of both reshards has one all-gather."""
    from shardc.cost.reshard_path import reshard_steps
    mesh_sizes = {"x": 2, "y": 4}
    src, mid, dst = Sharding(((), ("y",), ("x",))), Sharding(((), ("y",), ())), Sharding(((), (), ("y",)))
    steps = reshard_steps(src, dst, (1, 4, 12), 4, mesh_sizes)
    assert [layout for layout, _ in steps] == [mid, dst]
    assert [c.kind for _, cs in steps for c in cs] == ["all-gather", "all-to-all"]
    assert reshard_steps(src, mid, (1, 4, 12), 4, mesh_sizes)[0][1] == steps[0][1]
    mesh = shardc.make_mesh(mesh_sizes)
    named = lambda s: NamedSharding(mesh, P(*[d[0] if d else None for d in s.dims]))  # noqa: E731
    f = jax.jit(lambda v: (jax.lax.with_sharding_constraint(v, named(mid)),
                           jax.lax.with_sharding_constraint(v, named(dst))),
                in_shardings=named(src))
    found = collectives(f.lower(jnp.ones((1, 4, 12))).compile().as_text(), list(mesh_sizes.items()))
    assert sorted(c.kind for c in found) == ["all-gather", "all-to-all"]


def test_an_argmax_over_an_axis_of_size_one_gathers_nothing():
    from types import SimpleNamespace
    from shardc.cost.op_collectives import op_collectives
    argmax = SimpleNamespace(primitive="argmax", params={"axes": (1,), "index_dtype": "int32"})
    split = Sharding(((), ("x",)))
    assert op_collectives(argmax, [split], [(3, 8)], [4], {"x": 1, "y": 8}).all == ()
    assert [c.kind for c in op_collectives(argmax, [split], [(3, 8)], [4], {"x": 2, "y": 4}).after] == ["all-gather"] * 2
