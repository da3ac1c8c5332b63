"""A reshard whose all-to-all pairs only work in sequence (each moves a count onto a dim an earlier pair
emptied) is done pair by pair: [stage, data, -, -, model] -> [data, -, -, model, stage] on 64 devices, the
layout change of a pipelined stack's gradient buffer. It used to raise IndexError inside the model."""
from shardc.cost.reshard import is_involuntary_remat, reshard_collectives
from shardc.sharding import Sharding


def test_chained_pairs_are_sequential_all_to_alls():
    src = Sharding((("stage",), ("data",), (), (), ("model",)), frozenset())
    dst = Sharding((("data",), (), (), ("model",), ("stage",)), frozenset())
    mesh = {"stage": 4, "data": 2, "model": 8}
    shape = (4, 2, 1, 8, 16)
    assert not is_involuntary_remat(src, dst, shape, mesh)
    colls = reshard_collectives(src, dst, shape, 4, mesh)
    local = 4 * 2 * 1 * 8 * 16 * 4 // 64
    assert [(c.kind, c.axes, c.bytes) for c in colls] == [
        ("all-to-all", ("model",), local), ("all-to-all", ("stage",), local), ("all-to-all", ("data",), local)]
