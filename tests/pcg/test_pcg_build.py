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
