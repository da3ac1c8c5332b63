"""XLA merges independent all-reduces (the gradients of data parallelism) into one, which pays one fixed cost:
the simulation's step time counts one per merged group where collectives run on the compute stream (XLA:CPU),
and the timeline keeps one task per member."""
import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc import split
from shardc.cost.collectives import Collective, collective_fixed
from shardc.cost.presets import preset
from shardc.cost.topology import CollectiveFit, Level, Topology
from shardc.sim import simulator_for
from shardc.sim.result import PS

US = 1e-6


def _cpu_like(overlap: bool) -> Topology:
    fits = (CollectiveFit("all-reduce", 300 * US, 20 * US, 1e-9, 0.0),
            CollectiveFit("all-gather", 250 * US, 20 * US, 5e-10, 0.0))
    return Topology("cpu-like", preset("h100-sxm-8").device, (Level("host", 8, 1e9, 20 * US, None, fits),),
                    overlap=overlap, reduce_scatter=False, combine_bytes=float("inf"), backend="cpu")


def _step(w1, w2, w3, x):
    def loss(ws):
        h = split(x, 0, "data")
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    g = jax.grad(loss)((w1, w2, w3))
    return tuple(w - 0.1 * d for w, d in zip((w1, w2, w3), g))


@pytest.fixture(scope="module")
def plan():
    ws = [jnp.ones((64, 64)) * 0.01 for _ in range(3)]
    return shardc.plan(_step, *ws, jnp.ones((64, 64)), mesh=shardc.make_mesh({"data": 8}), search=False)


def test_merged_gradient_all_reduces_pay_one_fixed_cost(plan):
    topo = _cpu_like(overlap=False)
    sim = simulator_for(plan, topo)
    res = sim.full(plan)
    ars = [e for s in res.slots for e in s.ars]
    assert len(ars) == 3  # one gradient all-reduce per weight, independent of each other: XLA merges them
    fixed = collective_fixed(Collective("all-reduce", ("data",), 64 * 64 * 4), topo, topo.map_mesh({"data": 8}),
                             {"data": 8})
    assert fixed == pytest.approx(300 * US + 7 * 20 * US)
    assert res.merged_ps == 2 * round(fixed * PS)  # two of the three do not pay it again
    assert res.step_time == pytest.approx((res.makespan_ps - res.merged_ps) / PS + res.fresh_memory_time)
    assert "merged all-reduces" in res.summary()
    # the same plan on a topology whose collectives overlap compute: the timeline decides, nothing is subtracted
    assert simulator_for(plan, _cpu_like(overlap=True)).full(plan).merged_ps == 0
    # and a preset keeps its old step time (no fits, overlap)
    h100 = shardc.simulate(plan, "h100-sxm-8")
    assert h100.merged_ps == 0 and h100.step_time == pytest.approx(h100.makespan_ps / PS + h100.fresh_memory_time)
