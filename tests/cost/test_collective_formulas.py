"""Collective formulas against hand-computed values; topologies, presets and the mesh mapping."""
import json

import pytest

import shardc
from shardc.cost.collectives import Collective, collective_phases, collective_time, ring_time
from shardc.cost.topology import Level, Topology

GB = 1e9
US = 1e-6


def two_level(inner=8, outer=2):
    return Topology.from_dict({
        "name": "test", "device": {"peak_flops": {"float32": 1e12}, "mem_bandwidth": 1e12, "memory": 1e10},
        "levels": [{"name": "fast", "size": inner, "bandwidth": 100 * GB, "latency": 1 * US},
                   {"name": "slow", "size": outer, "bandwidth": 10 * GB, "latency": 10 * US}],
    })


def test_ring_formulas_by_hand():
    B = 8e6
    # all-reduce on 4 devices: 2 * 3/4 * 8 MB / 100 GB/s + 2 * 3 * 1 us = 120 us + 6 us
    t, sent = ring_time("all-reduce", 4, B, 100 * GB, 1 * US)
    assert t == pytest.approx(126e-6)
    assert sent == pytest.approx(12e6)
    t, _ = ring_time("all-gather", 4, B, 100 * GB, 1 * US)
    assert t == pytest.approx(60e-6 + 3e-6)
    t, _ = ring_time("reduce-scatter", 8, B, 100 * GB, 1 * US)
    assert t == pytest.approx(7 / 8 * 80e-6 + 7e-6)
    t, _ = ring_time("collective-permute", 2, B, 100 * GB, 1 * US)
    assert t == pytest.approx(80e-6 + 1e-6)
    assert ring_time("all-reduce", 1, B, 100 * GB, 1 * US) == (0.0, 0.0)


def test_hierarchical_all_reduce_by_hand():
    topo = two_level()
    mapping = topo.map_mesh({"data": 2, "model": 8})  # model inside a node, data across nodes
    mesh = {"data": 2, "model": 8}
    B = 16e6
    phases = collective_phases(Collective("all-reduce", ("data", "model"), int(B)), topo, mapping, mesh)
    assert [(p.level, p.kind) for p in phases] == [("fast", "reduce-scatter"), ("slow", "all-reduce"),
                                                     ("fast", "all-gather")]
    rs = 7 / 8 * B / (100 * GB) + 7 * US            # reduce-scatter of 16 MB over 8 on NVLink-like links
    ar = 2 * 1 / 2 * (B / 8) / (10 * GB) + 2 * 10 * US  # all-reduce of the 2 MB shard across the 2 nodes
    ag = rs
    assert [p.seconds for p in phases] == pytest.approx([rs, ar, ag])
    assert collective_time(Collective("all-reduce", ("data", "model"), int(B)), topo, mapping, mesh) == pytest.approx(rs + ar + ag)


def test_all_gather_outer_first_and_all_to_all_split():
    topo = two_level()
    mapping = topo.map_mesh({"data": 2, "model": 8})
    mesh = {"data": 2, "model": 8}
    B = 16e6
    ag = collective_phases(Collective("all-gather", ("data", "model"), int(B)), topo, mapping, mesh)
    assert [p.level for p in ag] == ["slow", "fast"]
    assert ag[0].seconds == pytest.approx(1 / 2 * (B / 8) / (10 * GB) + 10 * US)
    assert ag[1].seconds == pytest.approx(7 / 8 * B / (100 * GB) + 7 * US)
    a2a = collective_phases(Collective("all-to-all", ("data", "model"), int(B)), topo, mapping, mesh)
    # 7/16 of the buffer goes to peers in the node, 8/16 to the other node
    assert a2a[0].bytes == pytest.approx(7 / 16 * B)
    assert a2a[1].bytes == pytest.approx(8 / 16 * B)
    # a single-axis collective stays on its level
    only = collective_phases(Collective("all-reduce", ("model",), int(B)), topo, mapping, mesh)
    assert [p.level for p in only] == ["fast"]


def test_a_group_of_part_of_an_axis_is_priced_where_its_devices_are():
    """XLA gathers among part of an axis: every 4th device of a 16-device axis that spans two nodes of 8 is two
    devices in each node and two nodes (`Collective.stride`, read from the compiled program's replica groups by
    `shardc.cost.reshard`); the 4 consecutive devices stay in one node. Before the stride, both were priced as
    the consecutive ones (the 8x8 MLP's search plan 2% under its own collectives' cost)."""
    topo = two_level(8, 2)
    mesh = {"model": 4, "data": 16}
    mapping = topo.map_mesh({"data": 16}, order=["data"])
    B = 16e6
    near = collective_phases(Collective("all-gather", ("data",), int(B), 4), topo, mapping, mesh)
    apart = collective_phases(Collective("all-gather", ("data",), int(B), 4, stride=4), topo, mapping, mesh)
    assert [(p.level, p.kind) for p in near] == [("fast", "all-gather")]
    assert near[0].seconds == pytest.approx(3 / 4 * B / (100 * GB) + 3 * US)
    assert [p.level for p in apart] == ["slow", "fast"]  # (an all-gather: outermost first)
    assert apart[0].seconds == pytest.approx(1 / 2 * (B / 2) / (10 * GB) + 10 * US)
    assert apart[1].seconds == pytest.approx(1 / 2 * B / (100 * GB) + 1 * US)
    # every 8th: one device per node, the two nodes only; every 2nd of 8: inside the node
    assert [(p.level) for p in collective_phases(Collective("all-gather", ("data",), int(B), 2, stride=8), topo,
                                                  mapping, mesh)] == ["slow"]
    assert [(p.level) for p in collective_phases(Collective("all-gather", ("data",), int(B), 4, stride=2), topo,
                                                  mapping, mesh)] == ["fast"]


def test_mesh_mapping_spans_levels():
    topo = two_level(8, 4)
    m = topo.map_mesh({"data": 4, "model": 8})
    assert m.levels_of("model") == (("fast", 8),)
    assert m.levels_of("data") == (("slow", 4),)
    m = topo.map_mesh({"data": 2, "model": 16})
    assert m.levels_of("model") == (("fast", 8), ("slow", 2))
    assert m.inside("fast") == []
    m = topo.map_mesh({"data": 4, "model": 8}, order=["model", "data"])  # data minor: inside the node
    assert m.levels_of("data") == (("fast", 4),)
    with pytest.raises(shardc.ShardingError, match="needs 64 devices"):
        topo.map_mesh({"data": 8, "model": 8})
    with pytest.raises(shardc.ShardingError, match="does not divide"):
        two_level(8, 3).map_mesh({"a": 3, "b": 8}, order=["b", "a"])


def test_presets_and_their_sources():
    h = Topology.preset("h100-sxm-8x8")
    assert h.num_devices == 64 and [lv.name for lv in h.levels] == ["nvlink", "infiniband"]
    assert h.device.flops_per_s("bfloat16") == pytest.approx(989.4e12)
    assert "datasheet" in h.source
    for name in ("h100-sxm-8", "h100-sxm-8x2", "h100-sxm-8x64", "a100-40g-8", "tpu-v4-8", "tpu-v4-32",
                 "tpu-v5e-8", "tpu-v5e-16"):
        t = Topology.preset(name)
        assert t.num_devices > 0 and t.source
    assert Topology.preset("tpu-v4-8").num_devices == 4  # TensorCores: 2 per chip
    with pytest.raises(shardc.ShardingError, match="unknown topology preset"):
        Topology.preset("h200-9000")


def test_topology_from_dict_json_yaml(tmp_path):
    d = {"name": "mine", "device": {"name": "acc", "peak_flops": {"bfloat16": "400T", "float32": "100T"},
                                    "mem_bandwidth": "2TB/s", "memory": "40GiB"},
         "levels": [{"name": "nv", "size": 4, "bandwidth": "200GB/s", "latency": "2us"},
                    {"name": "eth", "size": 2, "bandwidth": "12.5GB/s", "latency": "20us"}]}
    t = Topology.from_dict(d)
    assert t.device.flops_per_s("bfloat16") == 400e12 and t.device.memory == 40 * 2**30
    assert t.levels[1].latency == pytest.approx(20e-6) and t.levels[0].bandwidth == 200e9
    (tmp_path / "t.json").write_text(json.dumps(d))
    assert Topology.from_file(tmp_path / "t.json").to_dict() == t.to_dict()
    yaml = pytest.importorskip("yaml")
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(d))
    assert shardc.sim.as_topology(str(tmp_path / "t.yaml")).num_devices == 8
    with pytest.raises(shardc.ShardingError, match="bad topology"):
        Topology.from_dict({"device": {}})
    with pytest.raises(shardc.ShardingError):
        Topology.from_dict({**d, "levels": [{"name": "x", "size": 2, "bandwidth": 0}]})


def test_level_dataclass_round_trip():
    lv = Level("ici", 4, 1e11, 1e-6)
    t = Topology("t", Topology.preset("tpu-v5e-8").device, (lv,))
    assert Topology.from_dict(t.to_dict()).levels == (lv,)
