"""The cpu-host topology is measured once on this machine and cached on disk."""
import os

import pytest

import shardc
import shardc.cost.calibrate as calibrate
from shardc.cost.topology import COLLECTIVE_KINDS
from shardc.cost.host_ops import HOST_MEASURED


def test_cpu_host_measured_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    topo = shardc.Topology.preset("cpu-host")
    assert topo.num_devices == 8 and topo.backend == "cpu"
    assert not topo.overlap and not topo.reduce_scatter  # XLA:CPU: collectives on the compute threads
    assert topo.device.flops_per_s("float32") > 1e7 and topo.device.mem_bandwidth > 1e6
    assert topo.levels[0].bandwidth > 0 and topo.levels[0].latency > 0 and topo.device.op_overhead > 0
    # a permute's fixed cost, measured: above the floor a chain lost to a busy machine would be fitted to (on a
    # quiet machine it is ~10x the ring's per-step latency; a CI run under load once measured it at the floor)
    assert topo.levels[0].permute_latency > 10 * calibrate._MIN_FIXED
    # every collective kind fitted: a fixed cost per group size (a rendezvous of the group's device threads,
    # more than one ring step over all 8) and, for the all-reduce at least, a cost per byte
    level = topo.levels[0]
    assert {f.kind for f in level.collectives} == set(COLLECTIVE_KINDS)
    assert all(f.fixed(8) > 0 and f.seconds(8, 1 << 20) >= f.fixed(8) for f in level.collectives)
    assert level.fit("all-reduce").per_byte > 0
    assert level.fit("all-to-all").fixed(8) > 2 * level.latency
    assert (tmp_path / "cpu-host.json").exists()
    assert topo.device.measured_ops == HOST_MEASURED  # XLA:CPU convolutions and transposed reads: timed
    if (os.cpu_count() or 1) <= 4:  # 8 devices on a few cores: one device alone runs several times faster
        assert calibrate.contention() > 2

    def boom():
        raise AssertionError("measured again instead of using the cache")

    monkeypatch.setattr(calibrate, "measure_cpu_host", boom)
    again = calibrate.cpu_host()
    assert again.to_dict() == topo.to_dict()
    with pytest.raises(AssertionError, match="measured again"):
        calibrate.cpu_host(refresh=True)


def test_a_measurement_on_a_busy_machine_warns_and_says_so(tmp_path, monkeypatch):
    """Measured with more runnable processes than cores: a warning that says how to measure again, and the
    topology's source (what explain() prints) gives the load; on a quiet machine neither."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def no_busy_warning():
        with warnings.catch_warnings():
            warnings.simplefilter("error", calibrate.BusyHostWarning)
            yield

    import conftest

    monkeypatch.setattr(calibrate, "measure_cpu_host", lambda: dict(conftest.REFERENCE_CPU_HOST))
    monkeypatch.setattr(calibrate.os, "cpu_count", lambda: 2)
    for load, busy in ((0.5, False), (40.0, True)):
        monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path / str(load)))
        monkeypatch.setattr(calibrate.os, "getloadavg", lambda load=load: (load, load, load))
        with pytest.warns(calibrate.BusyHostWarning, match="load average 40.0") if busy else no_busy_warning():
            topo = calibrate.cpu_host(refresh=True)
        assert ("load average 40.0" in topo.source) is busy
        with no_busy_warning():  # the cache: the same topology, no second warning
            assert calibrate.cpu_host().to_dict() == topo.to_dict()


def test_a_measurement_is_kept_for_the_processor_it_was_made_on(monkeypatch):
    """Virtual machines of one host name may run on different processors: the cache key names the processor, so a
    home directory carried to another machine does not price plans with the first machine's speeds."""
    here = calibrate.host_key()
    assert calibrate.host_key() == here  # (stable on one machine)
    if os.path.exists("/proc/cpuinfo"):
        assert "model name" not in calibrate.cpu_model() and calibrate.cpu_model().count("/") == 4
    monkeypatch.setattr(calibrate, "cpu_model", lambda: "GenuineIntel/6/143/8/another processor")
    assert calibrate.host_key() != here
