"""XLA:CPU all-gathers a dim that is not the most major one by copying the operand into an order with the
gathered dim first and the gathered buffer back into row-major order: two transpose kernels per such reshard,
which the simulator prices (shardc/cost/program.py `gathered_order`, shardc/sim/tasks.py `_relayout_task`,
timed on the host as `RELAYOUT_COPY` by shardc/cost/host_ops.py)."""
import dataclasses
import re

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardc
import shardc.cost.host_ops as host_ops
from annotations import shard
from shardc.cost.cache import DiskCache
from shardc.cost.host_ops import RELAYOUT_COPY, HostMeasuredEstimator, contended_relayout
from shardc.cost.program import gathered_order

B, T, D, LAYERS = 32, 128, 512, 3
MINOR = (("f", None, "t"), ("f", None, None))  # gathers dim 2 over t: dims 0 and 1 before it have > 1 element
MAJOR = ((("f", "t"), None, None), ("f", None, None))  # gathers dim 0: row-major already


def chain(src, dst):
    def step(x, w):
        for _ in range(LAYERS):
            x = shard(jnp.tanh(x) * 1.01, P(*src))
            x = shard(x, P(*dst)) @ w
        return x
    return step


def planned(layouts):
    f = shardc.auto(chain(*layouts), mesh=shardc.make_mesh({"f": 4, "t": 2}), search=False)
    x, w = jnp.ones((B, T, D)), jnp.ones((D, D))
    return f, f.plan(x, w), (x, w)


def test_gathered_order_puts_the_gathered_dims_first_unless_row_major_already():
    assert gathered_order(((), (), ("t",)), ((), (), ()), (8, 128, 512)) == (2, 0, 1)
    assert gathered_order((("f", "t"), (), ()), (("f",), (), ()), (8, 128, 512)) is None
    assert gathered_order(((), ("t",), ()), ((), (), ()), (1, 128, 512)) is None  # a size-1 dim before it
    assert gathered_order(((), ("t",), ("f",)), ((), (), ()), (2, 128, 512)) == (1, 2, 0)
    assert gathered_order(((), (), ("t",)), ((), (), ("t",)), (8, 128, 256)) is None  # nothing gathered


def test_xla_cpu_copies_around_a_non_major_all_gather():
    """The rule, on the compiled programs: two copies per gather of dim 2 (into and out of the gathered
    order), none for a gather of dim 0 with the same bytes."""
    for layouts, copies in ((MINOR, 2 * LAYERS), (MAJOR, 0)):
        f, _, a = planned(layouts)
        text = f.lower(*a).compile().as_text()
        assert len(re.findall(r" all-gather\(", text)) == LAYERS
        assert text.count(" copy(") == copies


def test_the_simulation_prices_two_relayout_copies_per_non_major_gather(monkeypatch, tmp_path):
    ref = shardc.Topology.preset("cpu-host")  # the tests' reference measurement: copies on the roofline
    _, minor, _ = planned(MINOR)
    _, major, _ = planned(MAJOR)
    assert shardc.simulate(minor, ref).comm_bytes == shardc.simulate(major, ref).comm_bytes
    roofline = shardc.simulate(minor, ref).step_time - shardc.simulate(major, ref).step_time
    assert roofline > 0
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(host_ops, "contended_relayout", lambda *a: 0.01)
    dev = dataclasses.replace(ref.device, measured_ops=(RELAYOUT_COPY,))
    timed = dataclasses.replace(ref, device=dev)
    extra = shardc.simulate(minor, timed).step_time - shardc.simulate(major, timed).step_time
    per_copy = 0.01 + ref.device.op_overhead  # (a kernel of its own)
    assert extra == pytest.approx(2 * LAYERS * per_copy, rel=0.02)
    assert len(_relayouts(shardc.simulate(minor, timed))) == 2 * LAYERS
    assert not _relayouts(shardc.simulate(major, timed))
    assert not _relayouts(shardc.simulate(minor, shardc.Topology.preset("h100-sxm-8")))  # an XLA:CPU rule only


def _relayouts(result):
    return [t for slot in result.slots for t in slot.tasks if t.name.startswith("all-gather relayout")]


def test_a_relayout_is_timed_once_per_shape_and_small_ones_are_not(tmp_path, monkeypatch):
    dev = shardc.Topology.preset("cpu-host").device
    calls = []
    monkeypatch.setattr(host_ops, "contended_relayout", lambda *a: calls.append(a) or 0.004)
    est = HostMeasuredEstimator(dev, primitives=frozenset({RELAYOUT_COPY}), cache=DiskCache("ops", str(tmp_path)))
    assert est.relayout_time((512, 8, 128), "float32", (1, 2, 0)) == pytest.approx(0.004 + dev.op_overhead)
    assert est.relayout_time((512, 8, 128), "float32", (1, 2, 0)) == pytest.approx(0.004 + dev.op_overhead)
    assert len(calls) == 1
    assert est.relayout_time((16, 8, 64), "float32", (1, 2, 0)) is None  # 32 KiB: cache-sized, the roofline's
    other = HostMeasuredEstimator(dev, primitives=frozenset({"conv_general_dilated"}),
                                  cache=DiskCache("ops", str(tmp_path)))
    assert other.relayout_time((512, 8, 128), "float32", (1, 2, 0)) is None


def test_contended_relayout_of_a_transpose_costs_more_than_nothing():
    assert contended_relayout((512, 8, 128), "float32", (1, 2, 0)) > 0


def test_host_timing_works_under_the_users_mesh_context(monkeypatch):
    """A step planned inside `jax.set_mesh(<the user's mesh>)` (the Flax NNX examples) times its ops on the
    host's own mesh: before, shard_map refused the mismatch and the op was cached as free. (A strided read may
    cost nothing beyond an ordered one on some CPUs, so its two timed calls are what is checked.)"""
    import jax

    timed, real = [], host_ops._on_every_device
    monkeypatch.setattr(host_ops, "_on_every_device", lambda *a: timed.append(real(*a)) or timed[-1])
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    with jax.set_mesh(mesh):
        assert contended_relayout((512, 8, 128), "float32", (1, 2, 0)) > 0
        assert host_ops.contended_strided_read((512, 1024), "float32", (1, 0)) >= 0
    assert len(timed) >= 3 and all(t > 0 for t in timed)
