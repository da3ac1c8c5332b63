"""The cpu-host topology is measured once on this machine and cached on disk."""
import pytest

import shardc
import shardc.cost.calibrate as calibrate
from shardc.cost.topology import COLLECTIVE_KINDS


def test_cpu_host_measured_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    topo = shardc.Topology.preset("cpu-host")
    assert topo.num_devices == 8 and topo.backend == "cpu"
    assert not topo.overlap and not topo.reduce_scatter  # XLA:CPU: collectives on the compute threads
    assert topo.device.flops_per_s("float32") > 1e7 and topo.device.mem_bandwidth > 1e6
    assert topo.levels[0].bandwidth > 0 and topo.levels[0].latency > 0 and topo.device.op_overhead > 0
    assert topo.levels[0].permute_latency >= topo.levels[0].latency  # a permute's fixed cost, measured
    # every collective kind fitted: a fixed cost per group size (a rendezvous of the group's device threads,
    # more than one ring step over all 8) and, for the all-reduce at least, a cost per byte
    level = topo.levels[0]
    assert {f.kind for f in level.collectives} == set(COLLECTIVE_KINDS)
    assert all(f.fixed(8) > 0 and f.seconds(8, 1 << 20) >= f.fixed(8) for f in level.collectives)
    assert level.fit("all-reduce").per_byte > 0
    assert level.fit("all-to-all").fixed(8) > 2 * level.latency
    assert (tmp_path / "cpu-host.json").exists()

    def boom():
        raise AssertionError("measured again instead of using the cache")

    monkeypatch.setattr(calibrate, "measure_cpu_host", boom)
    again = calibrate.cpu_host()
    assert again.to_dict() == topo.to_dict()
    with pytest.raises(AssertionError, match="measured again"):
        calibrate.cpu_host(refresh=True)
