"""A transpose moving the minor dim, fused into loop fusions, is read across memory order in each of them on
XLA:CPU (shardc/cost/program.py `strided_readers`, shardc/cost/host_ops.py, shardc/sim/tasks.py); one reading a
dot's result as the dot makes it is folded into the dot."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardc
import shardc.cost.host_ops as host_ops
from shardc.cost.cache import DiskCache
from shardc.cost.host_ops import STRIDED_READ, HostMeasuredEstimator, contended_strided_read
from shardc.cost.program import program_info

D_IN, D_OUT, BATCH = 256, 512, 64


def adam_like_step(x, w, m, v):
    """A weight gradient (a dot, then the transpose of its result that JAX's dot rule emits) read by two
    elementwise updates, as Adam's moments read it."""
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    return m * 0.9 + g * 0.1, v * 0.99 + g * g * 0.01


def data_parallel_step(x, w, m, v):
    return adam_like_step(shardc.split(x, 0, "data"), w, m, v)


def args():
    return (jnp.ones((BATCH, D_IN)), jnp.ones((D_IN, D_OUT)), jnp.ones((D_IN, D_OUT)), jnp.ones((D_IN, D_OUT)))


def plan_of(fn, mesh_axes, *a):
    return shardc.auto(fn, mesh=shardc.make_mesh(mesh_axes), search=False).plan(*a)


def minor_transposes(graph):
    return [op.id for op in graph.ops if op.primitive == "transpose"
            and op.params["permutation"][-1] != len(op.params["permutation"]) - 1]


def test_strided_readers_count_the_loop_fusions_reading_a_fused_transpose():
    plan = plan_of(adam_like_step, {"data": 8}, *args())
    info = program_info(plan.graph, "cpu")
    (t,) = minor_transposes(plan.graph)
    assert info.strided == {t: 2}  # the two moment updates
    assert program_info(plan.graph, "gpu").strided == {}  # an XLA:CPU rule

    def into_dot_and_keeping_minor(x, w, y):
        a = jnp.swapaxes(x.reshape(8, 8, 32), 0, 1) * 2.0  # keeps the minor dim: contiguous rows
        return jnp.sum(a), (w.T @ y)  # a transpose read only by a dot is folded into it

    p2 = plan_of(into_dot_and_keeping_minor, {"data": 8}, jnp.ones((64, 32)), jnp.ones((32, 64)), jnp.ones((32, 4)))
    assert program_info(p2.graph, "cpu").strided == {}


def _fusions_with_transposes(compiled_text: str) -> int:
    """Loop fusions whose computation transposes (XLA:CPU emits the fused transpose as a strided read)."""
    comps = {m.group(1): m.group(2)
             for m in re.finditer(r"^%?([\w.]+) [^\n]*\{\n(.*?)\n\}", compiled_text, re.M | re.S)}
    calls = re.findall(r"fusion\([^\n]*kind=kLoop, calls=%?([\w.]+)", compiled_text)
    return sum(1 for c in calls if " transpose(" in comps.get(c, ""))


def test_xla_folds_the_transpose_into_the_dot_unless_the_gradient_is_all_reduced_between():
    """The rule the simulator prices, checked on the compiled programs: replicated, the weight gradient's dot
    writes the transposed order itself; data parallel, its all-reduce sits between dot and transpose, and each of
    the two updates reading it transposes it in its loop."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    a = args()
    dp = jax.jit(adam_like_step, in_shardings=(rows, rep, rep, rep), out_shardings=rep).lower(*a).compile()
    alone = jax.jit(adam_like_step, in_shardings=(rep,) * 4, out_shardings=rep).lower(*a).compile()
    assert _fusions_with_transposes(dp.as_text()) == 2
    assert _fusions_with_transposes(alone.as_text()) == 0


def test_a_strided_read_is_timed_once_per_shape_then_cached_and_small_or_unlisted_ones_are_free(tmp_path, monkeypatch):
    dev = shardc.Topology.preset("cpu-host").device
    calls = []
    monkeypatch.setattr(host_ops, "contended_strided_read", lambda *a: calls.append(a) or 0.003)
    est = HostMeasuredEstimator(dev, primitives=frozenset({STRIDED_READ}), cache=DiskCache("ops", str(tmp_path)))
    assert est.strided_read_time((512, 1024), "float32", (1, 0)) == 0.003
    assert est.strided_read_time((512, 1024), "float32", (1, 0)) == 0.003 and len(calls) == 1
    assert est.strided_read_time((64, 64), "float32", (1, 0)) == 0.0  # 16 KiB: cache-sized, not timed
    again = HostMeasuredEstimator(dev, primitives=frozenset({STRIDED_READ}), cache=DiskCache("ops", str(tmp_path)))
    assert again.strided_read_time((512, 1024), "float32", (1, 0)) == 0.003 and len(calls) == 1  # from disk
    convs = HostMeasuredEstimator(dev, primitives=frozenset({"conv_general_dilated"}),
                                  cache=DiskCache("ops", str(tmp_path)))
    assert convs.strided_read_time((512, 1024), "float32", (1, 0)) == 0.0
    assert est.strided_read_time((512, 1024), "key<fry>", (1, 0)) == 0.0 and len(calls) == 1  # no numpy dtype


def test_contended_strided_read_costs_more_than_reading_in_order():
    assert contended_strided_read((512, 1024), "float32", (1, 0)) > 0


@pytest.mark.parametrize("step, priced", [(data_parallel_step, True), (adam_like_step, False)])
def test_the_simulation_prices_each_loop_fusion_reading_an_unfolded_transpose(monkeypatch, tmp_path, step, priced):
    """Data parallel: the gradient is all-reduced between dot and transpose, so both updates pay the timed strided
    read; replicated (no hints), the transpose folds into the dot and costs nothing."""
    ref = shardc.Topology.preset("cpu-host")  # the tests' reference measurement: nothing timed
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(host_ops, "contended_strided_read", lambda *a: 0.25)
    dev = dataclasses.replace(ref.device, measured_ops=(STRIDED_READ,))
    timed = shardc.Topology("cpu-host", dev, ref.levels, overlap=False, reduce_scatter=False, backend="cpu")
    plan = plan_of(step, {"data": 8}, *args())
    extra = shardc.simulate(plan, timed).step_time - shardc.simulate(plan, ref).step_time
    assert extra == pytest.approx(2 * 0.25 if priced else 0.0, abs=1e-6)
