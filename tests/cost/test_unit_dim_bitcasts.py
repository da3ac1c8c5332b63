"""An op that only adds, drops or moves dims of size 1 of its local operand (a reduce over such dims included)
keeps the operand's bytes in order: XLA makes it a bitcast. The simulator prices it as free, on every backend
(it priced a copy: in a pipelined step the stage-weight reorders `[layers] -> [stages, layers per stage]`,
local `[3, ...] -> [1, 3, ...]`, cost a pass over the stage's weights each)."""
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardc
from annotations import split
from shardc.cost.program import moves_no_data
from shardc.sim import as_topology

F = ("float32",)


@pytest.mark.parametrize("prim, params, src, dst, free", [
    ("reshape", {}, (3, 64, 32), (1, 3, 64, 32), True),
    ("reshape", {}, (3, 64, 32), (3, 2048), False),                       # merges dims: XLA may copy (layouts)
    ("squeeze", {}, (4, 1, 6, 8), (4, 6, 8), True),
    ("broadcast_in_dim", {}, (3, 6, 8), (3, 1, 6, 8), True),
    ("broadcast_in_dim", {}, (3, 6, 8), (3, 2, 6, 8), False),             # a real broadcast
    ("transpose", {"permutation": (1, 0, 2, 3)}, (3, 1, 6, 8), (1, 3, 6, 8), True),
    ("transpose", {"permutation": (1, 0, 2)}, (3, 6, 8), (6, 3, 8), False),
    ("transpose", {"permutation": (2, 1, 0)}, (3, 1, 8), (8, 1, 3), False),  # moves two non-unit dims
    ("reduce_sum", {"axes": (1,)}, (3, 1, 8), (3, 8), True),
    ("reduce_sum", {"axes": (1,)}, (3, 2, 8), (3, 8), False),
    ("mul", {}, (3, 8), (3, 8), False),
])
def test_moves_no_data(prim, params, src, dst, free):
    assert moves_no_data(prim, params, (src,), (dst,), F, F) is free


def test_reorders_of_a_split_dim_priced_as_the_bitcasts_xla_makes():
    """A batch split over 'data' reshaped to [4, 2, ...] (dim 0 split: local [1, 2, ...]) and transposed to
    [2, 4, ...] (local [2, 1, ...]) before a dot: XLA reads the parameter through bitcasts, no copy or
    transpose; the simulator prices neither op."""
    mesh = shardc.make_mesh({"data": 4, "model": 2})

    def f(x, w):
        y = split(x.reshape(4, 2, 64, 32), 0, "data")
        t = split(jnp.transpose(y, (1, 0, 2, 3)), 1, "data")
        return jnp.einsum("abij,jk->abik", t, w)

    x, w = jnp.ones((8, 64, 32)), jnp.ones((32, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ('model' unused: irrelevant here)
        plan = shardc.auto(f, mesh=mesh, search=False, in_shardings=(P("data"), None)).plan(x, w)
    ops = {o.primitive: o.compute for o in shardc.simulate(plan, as_topology("h100-sxm-8")).per_op()}
    assert "dot_general" in ops and "reshape" not in ops and "transpose" not in ops, ops
    jitted = jax.jit(f, in_shardings=(NamedSharding(mesh, P("data")), None))
    with jax.set_mesh(mesh):
        hlo = jitted.lower(x, w).compile().as_text()
    assert not re.search(r"= \S+ transpose\(", hlo)
    assert re.search(r"= \S+ bitcast\(%param", hlo)
