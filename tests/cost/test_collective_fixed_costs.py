"""A collective's fixed cost: a collective-permute's own latency (XLA:CPU meets every device at each one),
reshards priced in seconds on a topology, and op layouts chosen by those seconds (issue 14: the scan LM's
plan made 23 collective-permutes where XLA's made 2, and ran slower than the bytes it moved said)."""
import jax.numpy as jnp
import pytest

import shardc
import shardc.cost.calibrate as calibrate
from shardc.cost.collectives import Collective, collective_time, collectives_time
from shardc.cost.topology import Topology
from shardc.plan import ReshardCost, topology_pricer

US = 1e-6


def one_level(permute_latency=None):
    level = {"name": "host", "size": 8, "bandwidth": 1e9, "latency": 20 * US}
    if permute_latency is not None:
        level["permute_latency"] = permute_latency
    return Topology.from_dict({"name": "t", "device": {"peak_flops": {"float32": 1e10}, "mem_bandwidth": 1e9,
                                                        "memory": 1e9}, "levels": [level]})


def test_permute_fixed_cost_is_the_levels_permute_latency():
    mesh = {"x": 4, "y": 2}
    cp = Collective("collective-permute", ("x", "y"), 32768)
    plain, cpu = one_level(), one_level(400 * US)
    # B / bw + one latency step, as on accelerators ...
    assert collective_time(cp, plain, plain.map_mesh(mesh), mesh) == pytest.approx(32768 / 1e9 + 20 * US)
    # ... or the level's own permute latency, as XLA:CPU's
    assert collective_time(cp, cpu, cpu.map_mesh(mesh), mesh) == pytest.approx(32768 / 1e9 + 400 * US)
    # other kinds keep the ring formula
    ag = Collective("all-gather", ("x",), 65536)
    assert collective_time(ag, cpu, cpu.map_mesh(mesh), mesh) == collective_time(ag, plain, plain.map_mesh(mesh), mesh)
    # and the level round-trips through a dict (a topology file)
    assert Topology.from_dict(cpu.to_dict()).levels[0].permute_latency == pytest.approx(400 * US)


def test_cpu_host_carries_the_measured_permute_cost():
    # tests/conftest.py pins a measurement with a collective-permute fit of 340 us whatever the group: the
    # topology is built from it, and a permute inside pairs costs what one over all 8 devices costs
    topo = calibrate.cpu_host()
    level = topo.levels[0]
    assert level.fit("collective-permute").fixed(2) == pytest.approx(3.4e-4)
    mesh = {"x": 4, "y": 2}
    pair, all8 = (collective_time(Collective("collective-permute", axes, 1024), topo, topo.map_mesh(mesh), mesh)
                  for axes in (("y",), ("x", "y")))
    assert pair == pytest.approx(all8) and pair > 10 * level.latency  # (more than a ring step, as measured)


def test_many_small_collectives_cost_more_than_one_big_one():
    topo = calibrate.cpu_host()
    mesh = {"fsdp": 4, "tensor": 2}
    price = topology_pricer(topo, mesh)
    one = ReshardCost((Collective("all-gather", ("fsdp",), 8 * 65536),), "all-gather", 8 * 65536, 6 * 65536)
    many = ReshardCost(tuple(Collective("all-gather", ("fsdp",), 65536) for _ in range(8)), "all-gather",
                       8 * 65536, 6 * 65536)
    assert one.sent == many.sent  # the same bytes ...
    assert price(many) > price(one) + 6 * topo.levels[0].latency  # ... but 7 more collectives' fixed costs
    assert price(many) == pytest.approx(collectives_time(many.collectives, topo, topo.map_mesh(mesh), mesh))
    assert price(ReshardCost((), "none", 0, 0)) == 0.0


def _out_projection(a, w):
    """The scan LM's attention output projection with the authors' layouts (MaxText rules)."""
    a = shardc.shard(a, ("fsdp", None, "tensor", None))  # [batch, length, heads, kv]
    w = shardc.shard(w, ("tensor", None, "fsdp"))  # [heads, kv, embed]
    return shardc.shard(jnp.einsum("bthd,hde->bte", a, w), ("fsdp", None, "tensor"))


def test_op_layout_is_chosen_by_seconds_on_the_topology():
    mesh = shardc.make_mesh({"fsdp": 4, "tensor": 2})
    a, w = jnp.ones((16, 64, 4, 64)), jnp.ones((4, 64, 256))
    by_bytes = shardc.plan(_out_projection, a, w, mesh=mesh, search=False)
    by_time = shardc.plan(_out_projection, a, w, mesh=mesh, search=False, topology="cpu-host")
    kinds = lambda p: sorted(k for r in p.reshards for k in r.kind.split("+"))  # noqa: E731
    # fewest bytes: keep the result's layout, move the weight by a collective-permute and an all-gather
    assert kinds(by_bytes) == ["all-gather", "all-gather", "collective-permute"]
    # fewest seconds on cpu-host: contract the heads where they are, one all-reduce, no permute
    assert kinds(by_time) == ["all-gather", "all-reduce"]
    sim = {name: shardc.simulate(p, "cpu-host") for name, p in (("bytes", by_bytes), ("time", by_time))}
    sent = {name: sum(b for per in r.comm_by_level.values() for b in per.values()) for name, r in sim.items()}
    assert sent["bytes"] < sent["time"]  # more bytes ...
    assert sim["time"].step_time < sim["bytes"].step_time  # ... in less time
