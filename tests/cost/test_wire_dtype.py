"""Collectives of bfloat16 values on XLA:CPU move float32 bytes (`shardc.cost.wire`): the plan's reshards,
the simulator and the compiled program agree on them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import shardc
from shardc.cost.hlo import collectives
from shardc.cost.wire import wire_itemsize


def test_bfloat16_widens_on_cpu_only():
    bf16, f16, f32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
    assert wire_itemsize(bf16, "cpu") == 4
    assert wire_itemsize(bf16, "gpu") == wire_itemsize(bf16, "tpu") == wire_itemsize(bf16, "") == 2
    assert wire_itemsize(f16, "cpu") == 2 and wire_itemsize(f32, "cpu") == 4
    assert wire_itemsize(None, "cpu") == 4


def _step(x, w):
    """Every collective kind XLA:CPU has, on bfloat16 values: an all-gather (x's rows), an all-to-all (h from
    rows to columns), a collective-permute (y's rows to other devices) and an all-reduce (the contraction
    over the split dim)."""
    x = shardc.split(x, 0, "a")
    h = jnp.tanh(x @ w)
    h = shardc.split(h, 1, "b")
    y = shardc.shard(jnp.sin(h), (("a", "b"), None))
    y = shardc.shard(y * 2, (("b", "a"), None))
    s = jnp.sum(y * y, axis=0)
    return shardc.replicate(jnp.tanh(x)), s


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_collective_bytes_are_the_plans(dtype):
    mesh = shardc.make_mesh({"a": 2, "b": 4})
    x = jnp.ones((32, 16), dtype)
    w = jnp.ones((16, 64), dtype)
    f = shardc.auto(_step, mesh=mesh, search=False)
    plan = f.plan(x, w)
    report = shardc.check(plan)
    kinds = {c.kind for c in collectives(f.lower(x, w).compile().as_text())}
    assert {"all-gather", "all-to-all", "all-reduce", "collective-permute"} <= kinds, kinds
    for kind in kinds:
        row = report.row(f"{kind} bytes")
        assert row.ok, str(report)
    # the planner's reshards say the same: bfloat16 moves float32's bytes on this backend, float16 its own
    def reshards(dt):
        plan = shardc.plan(_step, x.astype(dt), w.astype(dt), mesh=mesh, search=False)
        return [(r.kind, r.bytes) for r in plan.reshards]

    if dtype == jnp.bfloat16:
        assert reshards(jnp.bfloat16) == reshards(jnp.float32) != reshards(jnp.float16)
