"""A plan whose reshards XLA makes with collectives among part of a mesh axis: on the mesh with that axis split into
factors (`shardc.pcg.refine`) the PCG names them — the same collectives, device groups and simulated step as the
plan — where on the plan's own mesh it gathers over the whole axis."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc import split
from shardc.cost.hlo import collectives
from shardc.cost.topology import Topology
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg
from shardc.pcg.refine import axis_factors, refined_plan
from shardc.pcg.simcost import simulate_pcg
from shardc.sim import simulate


def _two_nodes_of_four() -> Topology:
    return Topology.from_dict({
        "name": "two nodes of four", "device": {"peak_flops": {"float32": 1e12}, "mem_bandwidth": 1e12, "memory": 1e10},
        "levels": [{"name": "fast", "size": 4, "bandwidth": 100e9, "latency": 1e-6},
                   {"name": "slow", "size": 2, "bandwidth": 10e9, "latency": 1e-5}]})


def _step(x):
    y = jnp.sin(split(x, 1, "b"))
    return jnp.cos(split(y, 1, "a"))  # [-, b] -> [-, a]: XLA permutes, then gathers among every 2nd device of b


def _groups(hlo: str, mesh) -> list[tuple[str, int, int]]:
    return sorted((c.kind, c.group_size, c.stride) for c in collectives(hlo, list(mesh.items())))


def test_a_partial_axis_gather_is_a_parallel_op_on_the_refined_mesh():
    mesh = shardc.make_mesh({"a": 2, "b": 4})
    x = jax.random.normal(jax.random.key(0), (64, 64))
    af = shardc.auto(_step, mesh=mesh, search=False)
    info = af.compiled_info(x)
    plan = info.plan
    assert ("all-gather", ("b",), 2, 2) in [(c.kind, c.axes, c.group, c.stride) for r in plan.reshards
                                           for c in r.collectives]
    assert axis_factors(plan) == {"b": (2, 2)}
    topo = _two_nodes_of_four()
    jit_groups = _groups(af.lower(x).compile().as_text(), plan.mesh_sizes)
    steps = {}
    for label, p in (("plan's mesh", plan), ("refined", refined_plan(plan))):
        pcg = build_pcg(p, info.closed_jaxpr, fuse=True)
        fn = lower_pcg(pcg)
        np.testing.assert_allclose(np.asarray(fn(x)[0]), np.asarray(_step(x)), rtol=1e-5, atol=1e-6)
        hlo = fn.lower(x).compile().as_text()
        assert hlo_collectives(hlo) == pcg.collectives()
        steps[label] = (simulate_pcg(pcg, topo).step_time, _groups(hlo, plan.mesh_sizes), pcg)
    # refined: XLA's own collectives (a permute, an all-gather among every 2nd device of b, a permute) and step
    _, groups, pcg = steps["refined"]
    assert groups == jit_groups == [("all-gather", 2, 2), ("collective-permute", 2, 1), ("collective-permute", 2, 1)]
    assert "combine[1,b.0]" in [str(n.op) for n in pcg.parallel_nodes()]
    assert steps["refined"][0] == pytest.approx(simulate(plan, topo).step_time, rel=1e-9)
    # on the plan's mesh no op gathers part of b: it gathers all of b, and is priced so
    assert ("all-gather", 4, 1) in steps["plan's mesh"][1]
    assert steps["plan's mesh"][0] > 1.2 * steps["refined"][0]


def test_axis_factors_nest_the_group_sizes():
    from types import SimpleNamespace

    from shardc.cost.collectives import Collective

    def plan_with(*colls, data=16):
        return SimpleNamespace(mesh_sizes={"model": 4, "data": data},
                               reshards=[SimpleNamespace(collectives=tuple(colls))])

    ag = lambda g, s=1: Collective("all-gather", ("data",), 1024, g, s)  # noqa: E731
    assert axis_factors(plan_with(ag(4), ag(4, 4))) == {"data": (4, 4)}  # (the 8x8 MLP's)
    assert axis_factors(plan_with(ag(2), ag(8, 2))) == {"data": (8, 2)}
    assert axis_factors(plan_with(ag(2, 8))) == {"data": (2, 8)}  # every 8th: the major 2
    assert axis_factors(plan_with(ag(2), ag(4))) == {"data": (4, 2, 2)}
    assert axis_factors(plan_with(ag(4), ag(6), data=24)) == {}  # (cuts at 4 and at 6 do not nest)
    assert axis_factors(plan_with(Collective("collective-permute", ("model", "data"), 1024, 2), ag(16))) == {}


def test_refined_pcg_keeps_the_plans_mesh_where_the_searches_would_run_long(monkeypatch):
    """On a mesh of sub-axes the op searches ask for XLA's path once per layout of the value (a generated program's
    rank-4 reshards on three axes asked over 6,000 times, 80 s): past `REFINED_MAX_RANK` dims or
    `REFINED_MAX_AXES` axes the PCG is built on the plan's own mesh."""
    import shardc.pcg.refine as refine

    mesh = shardc.make_mesh({"a": 2, "b": 4})
    x = jax.random.normal(jax.random.key(0), (64, 64))
    info = shardc.auto(_step, mesh=mesh, search=False).compiled_info(x)
    assert "b.0" in refine.refined_pcg(info.plan, info.closed_jaxpr, fuse=True).mesh_sizes
    for limit in ("REFINED_MAX_RANK", "REFINED_MAX_AXES"):
        with monkeypatch.context() as m:
            m.setattr(refine, limit, 1 if limit == "REFINED_MAX_RANK" else 2)
            coarse = refine.refined_pcg(info.plan, info.closed_jaxpr, fuse=True)
            assert coarse.mesh_sizes == {"a": 2, "b": 4}
            assert "combine[1,b]" in [str(n.op) for n in coarse.parallel_nodes()]
