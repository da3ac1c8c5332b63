"""XLA:CPU convolutions are priced by timing them on this host's devices under contention (shardc/cost/host_ops.py)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import shardc
import shardc.cost.host_ops as host_ops
from shardc.cost.cache import DiskCache
from shardc.cost.estimator import AnalyticalEstimator, OpKey, params_key
from shardc.cost.host_ops import HostMeasuredEstimator, contended_time, default_estimator
from shardc.cost.profile import find_primitive

CONV = dict(window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
            dimension_numbers=jax.lax.conv_dimension_numbers((1, 8, 8, 16), (3, 3, 16, 16), ("NHWC", "HWIO", "NHWC")),
            feature_group_count=1, batch_group_count=1, precision=None, preferred_element_type=None, out_sharding=None)


def conv_key(batch: int) -> OpKey:
    return OpKey("conv_general_dilated", params_key(CONV), ((batch, 8, 8, 16), (3, 3, 16, 16)), ((batch, 8, 8, 16),),
                 ("float32", "float32"), ("float32",))


def test_a_convolution_is_timed_on_every_device_once_then_read_from_the_cache(tmp_path):
    topo = shardc.Topology.preset("cpu-host")
    est = HostMeasuredEstimator(topo.device, min_time=0.0, cache=DiskCache("ops", str(tmp_path)))
    small, large = est.op_time(conv_key(2), CONV), est.op_time(conv_key(64), CONV)
    assert est.measured == 2 and 0 < small < large  # 32x the work takes longer
    assert all(est.cache.get(est.cache_key(conv_key(b))) >= 0 for b in (2, 64))  # timed, not the roofline's fallback
    again = HostMeasuredEstimator(topo.device, min_time=0.0, cache=DiskCache("ops", str(tmp_path)))
    assert again.op_time(conv_key(64), CONV) == large and again.measured == 0


def test_only_the_listed_primitives_above_min_time_are_timed_the_rest_is_the_roofline(tmp_path, monkeypatch):
    topo = shardc.Topology.preset("cpu-host")
    monkeypatch.setattr(host_ops, "contended_time", lambda *a: 0.25)
    roof = AnalyticalEstimator(topo.device)
    dims = {"dimension_numbers": (((1,), (0,)), ((), ()))}
    dot = OpKey("dot_general", params_key(dims), ((64, 64), (64, 64)), ((64, 64),), ("float32",) * 2, ("float32",))
    tanh = OpKey("tanh", (), ((4096, 4096),), ((4096, 4096),), ("float32",), ("float32",))
    convs_only = HostMeasuredEstimator(topo.device, primitives=frozenset({"conv_general_dilated"}), min_time=0.0,
                                       cache=DiskCache("ops", str(tmp_path)))
    assert convs_only.op_time(dot, dims) == roof.op_time(dot, dims)
    assert convs_only.op_time(tanh) == roof.op_time(tanh) and roof.op_time(tanh) > 1e-3  # big, but not listed
    assert convs_only.op_time(conv_key(4), CONV) == pytest.approx(0.25 + topo.device.op_overhead)
    assert convs_only.measured == 1
    # listed primitives are timed when the roofline prices them at `min_time` (1 ms) or more
    est = HostMeasuredEstimator(topo.device, primitives=frozenset({"conv_general_dilated", "dot_general"}),
                                cache=DiskCache("ops2", str(tmp_path)))
    assert roof.op_time(dot, dims) < est.min_time and est.op_time(dot, dims) == roof.op_time(dot, dims)
    big = OpKey("dot_general", params_key(dims), ((1024, 1024), (1024, 1024)), ((1024, 1024),), ("float32",) * 2,
                ("float32",))
    assert roof.op_time(big, dims) >= est.min_time
    assert est.op_time(big, dims) == pytest.approx(0.25 + topo.device.op_overhead) and est.measured == 1


def test_contended_time_runs_the_primitive_at_its_local_shapes():
    prim = find_primitive("conv_general_dilated")
    t = contended_time(prim, CONV, ((4, 8, 8, 16), (3, 3, 16, 16)), ("float32", "float32"))
    assert t >= 0
    with pytest.raises(Exception):  # shapes the primitive rejects are an error here (the estimator falls back)
        contended_time(prim, CONV, ((4, 8, 8, 16), (3, 3, 7, 16)), ("float32", "float32"))


def test_the_measured_cpu_host_times_convolutions_and_a_reference_profile_does_not():
    """The tests' stored reference measurement (conftest) has no `host_measured_ops`: purely analytical, so the
    tests' plans do not depend on this machine; a measurement made here names the convolutions."""
    reference = shardc.Topology.preset("cpu-host")
    assert reference.device.measured_ops == () and isinstance(default_estimator(reference.device), AnalyticalEstimator)
    measured = dataclasses.replace(reference.device, measured_ops=("conv_general_dilated",))
    assert isinstance(default_estimator(measured), HostMeasuredEstimator)
    topo = shardc.Topology("t", measured, reference.levels, overlap=False)
    assert shardc.Topology.from_dict(topo.to_dict()).device.measured_ops == ("conv_general_dilated",)


def test_a_simulation_on_the_measured_host_prices_each_convolution_as_timed(monkeypatch, tmp_path):
    ref = shardc.Topology.preset("cpu-host")  # the tests' reference measurement: no measured ops
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))  # the timings below stay out of the tests' cache
    monkeypatch.setattr(host_ops, "contended_time", lambda *a: 0.5)
    dev = dataclasses.replace(ref.device, measured_ops=("conv_general_dilated",))
    topo = shardc.Topology("cpu-host", dev, ref.levels, overlap=False, reduce_scatter=False, backend="cpu")

    def step(x, w):
        return jnp.sum(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))

    x, w = jnp.ones((64, 32, 32, 16)), jnp.ones((3, 3, 16, 16))  # a convolution the roofline prices over 1 ms
    plan = shardc.auto(step, mesh=shardc.make_mesh({"data": 8}), search=False).plan(x, w)
    timed = shardc.simulate(plan, topo)
    modelled = shardc.simulate(plan, ref)
    assert timed.step_time >= 0.5 > modelled.step_time  # the one convolution at the timed 0.5 s


def test_narrow_matmuls_are_timed_and_wide_ones_keep_the_roofline(tmp_path, monkeypatch):
    """`narrow_matmul`: a dot_general with a contracted or result dim of at most 64 per device (a Megatron split
    of 32-wide attention heads) runs far below the roofline on XLA:CPU, so it is timed; a wide one is not (timing
    every matmul made the search trust small timed differences, docs/simulator.md)."""
    topo = shardc.Topology.preset("cpu-host")
    monkeypatch.setattr(host_ops, "contended_time", lambda *a: 0.25)
    roof = AnalyticalEstimator(topo.device)
    dims = {"dimension_numbers": (((1,), (0,)), ((), ()))}

    def dot(m, k, n):
        return OpKey("dot_general", params_key(dims), ((m, k), (k, n)), ((m, n),), ("float32",) * 2, ("float32",))

    est = HostMeasuredEstimator(topo.device, primitives=frozenset({host_ops.NARROW_MATMUL}),
                                cache=DiskCache("ops", str(tmp_path)))
    wide, narrow_k, narrow_n = dot(2048, 1024, 1024), dot(8192, 32, 8192), dot(8192, 1024, 32)
    assert all(roof.op_time(k, dims) >= est.min_time for k in (wide, narrow_k, narrow_n))
    assert est.op_time(wide, dims) == roof.op_time(wide, dims) and est.measured == 0
    assert est.op_time(narrow_k, dims) == pytest.approx(0.25 + topo.device.op_overhead)
    assert est.op_time(narrow_n, dims) == pytest.approx(0.25 + topo.device.op_overhead) and est.measured == 2
    tiny = dot(64, 32, 64)  # narrow, but under a tenth of `min_time`: the roofline's
    assert roof.op_time(tiny, dims) < est.min_time / 10
    assert est.op_time(tiny, dims) == roof.op_time(tiny, dims) and est.measured == 2
    # narrow and under `min_time`, but not under a tenth of it: timed (its error is a factor, not a few percent)
    small = next(dot(8192 // d, 32, 8192 // d) for d in (2, 4, 8, 16)
                 if roof.op_time(dot(8192 // d, 32, 8192 // d), dims) < est.min_time)
    assert roof.op_time(small, dims) >= est.min_time / 10
    assert est.op_time(small, dims) == pytest.approx(0.25 + topo.device.op_overhead) and est.measured == 3
