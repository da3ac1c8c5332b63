"""The cpu-host topology is measured once on this machine and cached on disk."""
import pytest

import shardc
import shardc.cost.calibrate as calibrate


def test_cpu_host_measured_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    topo = shardc.Topology.preset("cpu-host")
    assert topo.num_devices == 8 and topo.backend == "cpu"
    assert not topo.overlap and not topo.reduce_scatter  # XLA:CPU: collectives on the compute threads
    assert topo.device.flops_per_s("float32") > 1e7 and topo.device.mem_bandwidth > 1e6
    assert topo.levels[0].bandwidth > 0 and topo.levels[0].latency > 0 and topo.device.op_overhead > 0
    assert topo.levels[0].permute_latency >= topo.levels[0].latency  # a permute's fixed cost, measured
    assert (tmp_path / "cpu-host.json").exists()

    def boom():
        raise AssertionError("measured again instead of using the cache")

    monkeypatch.setattr(calibrate, "measure_cpu_host", boom)
    again = calibrate.cpu_host()
    assert again.to_dict() == topo.to_dict()
    with pytest.raises(AssertionError, match="measured again"):
        calibrate.cpu_host(refresh=True)
