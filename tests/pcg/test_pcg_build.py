"""Parallel ops and the decomposition of reshards into them."""
import pytest

from shardc import ShardingError
from shardc.pcg.build import reshard_ops
from shardc.pcg.ops import (AllToAll, CollectivePermute, Combine, Partition, Reduce, ReduceScatter, Replicate,
                            comm_bytes)
from shardc.sharding import Sharding

MESH = {"data": 2, "model": 4}


def S(*dims, partial=()):
    return Sharding(tuple(tuple(d) for d in dims), frozenset(partial))


def apply_all(ops, s):
    for op in ops:
        s = op.apply(s)
    return s


def test_op_sharding_transfer():
    s = S((), ())
    assert Partition(("model",), 1).apply(s) == S((), ("model",))
    assert Combine(("model",), 1).apply(S((), ("model",))) == s
    assert Reduce(("model",)).apply(S((), (), partial=["model"])) == s
    assert ReduceScatter(("model",), 0).apply(S((), (), partial=["model"])) == S(("model",), ())
    assert AllToAll(("model",), 0, 1).apply(S(("model",), ())) == S((), ("model",))
    assert Replicate(("model",)).apply(s) == s
    assert CollectivePermute.of(0, ("data", "model"), ("model", "data")).apply(S(("data", "model"), ())) \
        == S(("model", "data"), ())
    with pytest.raises(ShardingError, match="minor-most"):
        Combine(("data",), 0).apply(S(("data", "model"), ()))
    with pytest.raises(ShardingError, match="already used"):
        Partition(("model",), 1).apply(S(("model",), ()))
    with pytest.raises(ShardingError, match="no partial"):
        Reduce(("model",)).apply(s)


def test_comm_bytes_ring():
    assert comm_bytes(Reduce(("model",)), 400, MESH) == 2 * 400 * 3 / 4
    assert comm_bytes(ReduceScatter(("model",), 0), 400, MESH) == 400 * 3 / 4
    assert comm_bytes(Combine(("model",), 0), 100, MESH) == 300
    assert comm_bytes(Partition(("model",), 0), 100, MESH) == 0


def test_permute_sources_are_a_permutation():
    op = CollectivePermute.of(0, ("data",), ("model",))
    src = op.source_of({"data": 4, "model": 4})
    assert sorted(src.values()) == sorted(src.keys())
    assert src[(1, 2)] == (2, 1)


@pytest.mark.parametrize("src, dst, naive, fused", [
    (S((), (), partial=["model"]), S((), ("model",)), ["reduce", "partition"], ["reduce_scatter"]),
    (S(("model",), ()), S((), ("model",)), ["combine", "partition"], ["all_to_all"]),
    (S(("data",), ("model",)), S(("model",), ("data",)), None, None),
    (S(("data", "model"), ()), S(("model", "data"), ()), ["combine", "partition"], ["shuffle"]),
    (S(("data",), (), partial=["model"]), S(("data",), ()), ["reduce"], ["reduce"]),
    (S((), ()), S(("data",), ("model",)), ["partition", "partition"], ["partition", "partition"]),
    (S(("data",), ("model",)), S((), ()), ["combine", "combine"], ["combine", "combine"]),
])
def test_reshard_decomposition(src, dst, naive, fused):
    for fuse, want in ((False, naive), (True, fused)):
        ops = reshard_ops(src, dst, MESH, fuse=fuse, shape=(16, 32))
        assert apply_all(ops, src) == dst
        if want is not None:
            assert [o.kind for o in ops] == want
        if not fuse:
            assert all(o.kind in ("partition", "combine", "reduce") for o in ops)


def test_reshard_cannot_create_partial_sums():
    with pytest.raises(ShardingError, match="partial sums cannot be created"):
        reshard_ops(S(()), S((), partial=["model"]), MESH)


def _builder():
    import shardc
    from shardc.pcg.graph import GraphBuilder
    return GraphBuilder(shardc.make_mesh(MESH))


def test_uneven_pieces_have_no_pcg():
    """A shard_map's pieces are equal: a tensor split unevenly (XLA pads its last piece) is found, so
    `build_pcg` refuses the plan and `apply_match` the rewrite."""
    import numpy as np
    b = _builder()
    even = b.add_tensor((4, 8), np.float32, S((), ()), "even")
    odd = b.add_tensor((6, 8), np.float32, S((), ()), "odd")
    pcg = b.finish([even, odd], [b.parallel(Partition(("model",), 0), even), b.parallel(Partition(("data",), 0), odd)])
    assert pcg.uneven() is None
    b = _builder()
    odd = b.add_tensor((6, 8), np.float32, S((), ()), "odd")
    pcg = b.finish([odd], [b.parallel(Partition(("model",), 0), odd)])
    assert pcg.uneven() == "odd dim 0 (size 6) split 4 ways over ('model',)"


def test_collectives_are_counted_as_xla_merges_them():
    """Two all-gathers of one value computed twice (a rewrite pushing a combine into both operands of
    `neg(x) + neg(x)`) are one after XLA's CSE; the count the PCG names is the compiled one."""
    import jax
    import numpy as np
    from shardc.pcg import hlo_collectives, lower_pcg
    from shardc.pcg.graph import Compute
    b = _builder()
    x = b.add_tensor((8, 4), np.float32, S(("model",), ()), "x")
    gathered = []
    for _ in range(2):
        n = b.add_tensor((8, 4), np.float32, S(("model",), ()), "n")
        b.add_node(Compute.of(jax.lax.neg_p, {}), [x], [n])
        gathered.append(b.parallel(Combine(("model",), 0), n))
    s = b.add_tensor((8, 4), np.float32, S((), ()), "s")
    b.add_node(Compute.of(jax.lax.add_p, {}), gathered, [s])
    pcg = b.finish([x], [s])
    assert len(pcg.parallel_nodes()) == 2 and pcg.collectives() == {"all-gather": 1}
    fn = lower_pcg(pcg)
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert hlo_collectives(fn.lower(value).compile().as_text()) == pcg.collectives()
    np.testing.assert_allclose(np.asarray(fn(value)[0]), -2 * value)


def test_a_rewrite_of_scalars_is_a_scalar():
    """A rule's right-hand side built on scalars only (no operand of rank > 0) lays out a scalar, partial
    where an operand is."""
    import numpy as np
    from shardc.pcg.bind import _transfer
    from shardc.pcg.graph import Tensor
    a = Tensor(0, (), np.dtype(np.float32), S(partial=("data",)))
    c = Tensor(1, (), np.dtype(np.float32), S())
    assert _transfer("add", (), [a, c]) == S(partial=("data",))
