"""A known two-op timeline: the all-reduce of one matmul's partial sums overlaps the next matmul."""
import json

import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc import split
from shardc.cost.estimator import FakeEstimator
from shardc.cost.topology import Device, Level, Topology
from shardc.sim import simulate

MS = 1e-3


def topology(overlap: bool) -> Topology:
    # An all-reduce of 1 KiB over 4 devices moves 2 * 3/4 * 1024 B: at 3.072 MB/s that is 0.5 ms (no latency).
    return Topology("toy", Device("toy", {"float32": 1e12}, 1e12, 1e9), (Level("link", 8, 1536 / 0.5e-3, 0.0),),
                    overlap=overlap)


@pytest.fixture(scope="module")
def plan():
    mesh = shardc.make_mesh({"data": 2, "model": 4})

    def f(x, w1, z, w2):
        y1 = split(x, 1, "model") @ split(w1, 0, "model")  # contracting dim split: partial sums
        y2 = z @ w2  # replicated: no communication
        return y1, y2

    args = (jnp.ones((8, 64)), jnp.ones((64, 32)), jnp.ones((8, 64)), jnp.ones((64, 32)))
    return shardc.plan(f, *args, mesh=mesh, search=False)


def test_overlap_makespan_by_hand(plan):
    est = FakeEstimator({"dot_general": 1 * MS})
    r = simulate(plan, topology(True), estimator=est)
    # dot1 [0, 1] ms; all-reduce of y1 [1, 1.5] ms on the link stream; dot2 [1, 2] ms on compute.
    assert r.step_time == pytest.approx(2 * MS)
    assert r.comm_bytes == {"all-reduce": 8 * 32 * 4}
    assert r.comm_time == pytest.approx(0.5 * MS)
    tasks = sorted(r.tasks(), key=lambda t: t[3])
    kinds = [(t[1], t[2], round(t[3] / MS, 6), round(t[4] / MS, 6)) for t in tasks]
    assert kinds == [("compute", "compute", 0.0, 1.0), ("all-reduce", "comm:link", 1.0, 1.5),
                     ("compute", "compute", 1.0, 2.0)]
    path = r.critical_path()
    assert [p[1] for p in path] == ["compute", "compute"]


def test_no_overlap_serialises(plan):
    est = FakeEstimator({"dot_general": 1 * MS})
    r = simulate(plan, topology(False), estimator=est)
    assert r.step_time == pytest.approx(2.5 * MS)
    assert set(t[2] for t in r.tasks()) == {"compute"}


def test_trace_and_gantt_files(plan, tmp_path):
    r = simulate(plan, topology(True), estimator=FakeEstimator({"dot_general": 1 * MS}))
    trace = json.loads(open(r.to_chrome_trace(str(tmp_path / "t.json"))).read())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 and {e["cat"] for e in events} == {"compute", "all-reduce"}
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(2000.0)  # microseconds
    pytest.importorskip("matplotlib")
    png = r.gantt(str(tmp_path / "g.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    ops = r.per_op()
    assert [o.primitive for o in ops] == ["dot_general", "dot_general"]
    assert ops[0].comm == pytest.approx(0.5 * MS) and ops[1].comm == 0
    assert "step time 2.000 ms" in r.summary()


def test_auto_with_topology_explains_cost():
    mesh = shardc.make_mesh({"data": 8})

    @shardc.auto(mesh=mesh, topology="h100-sxm-8", search=False)
    def step(w, x):
        return jnp.mean(split(x, 0, "data") @ w)

    plan = step.plan(jnp.ones((16, 4)), jnp.ones((64, 16)))
    assert plan.cost is not None and plan.cost.topology.name == "h100-sxm-8"
    text = plan.explain()
    assert "simulated cost:" in text and "step time" in text
    assert shardc.simulate(plan, "h100-sxm-8").step_time == pytest.approx(plan.cost.step_time)
    assert jax.device_count() == 8


def test_compute_backfills_while_an_op_waits_for_a_collective():
    """XLA's latency-hiding scheduler runs independent work while a collective is in flight: an op later in
    program order whose operands are ready fills the compute stream's idle interval; one too long for the
    interval waits."""
    mesh = shardc.make_mesh({"data": 2, "model": 4})

    def f(x, w1, z, w2, w3):
        y1 = split(x, 1, "model") @ split(w1, 0, "model")  # partial sums: a 4 KiB all-reduce, 2 ms
        u = y1 * 2.0  # waits for the all-reduce
        return u, z @ w2, z @ w3  # independent of it

    args = (jnp.ones((8, 64)), jnp.ones((64, 128)), jnp.ones((8, 64)), jnp.ones((64, 32)), jnp.ones((64, 32)))
    plan = shardc.plan(f, *args, mesh=mesh, search=False)
    r = simulate(plan, topology(True), estimator=FakeEstimator({"dot_general": 1 * MS, "mul": 0.1 * MS}))
    spans = [(t[0], t[1], round(t[3] / MS, 6), round(t[4] / MS, 6)) for t in sorted(r.tasks(), key=lambda t: t[3])]
    compute = [s[2:] for s in spans if s[1] == "compute"]
    # dot1 [0, 1]; all-reduce [1, 3]; mul [3, 3.1]; z@w2 in the idle interval [1, 2], z@w3 in [2, 3]
    assert compute == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 3.1)]
    assert r.step_time == pytest.approx(3.1 * MS)


def test_collective_backfills_while_an_earlier_one_waits_for_its_operand():
    """The all-gather of an input is ready at the start: it runs while the link waits for the partial sums
    an earlier all-reduce reduces, not after that all-reduce (a collective is issued when its operand is
    ready, not in program order)."""
    mesh = shardc.make_mesh({"data": 2, "model": 4})

    def f(x, w1, z, w2):
        y1 = split(x, 1, "model") @ split(w1, 0, "model")  # a 4 KiB all-reduce of partial sums: [1, 3] ms
        u = y1 * 2.0
        w2_full = shardc.replicate(split(w2, 0, "model"))  # a 2 KiB all-gather (0.5 ms) of an input
        return u, z @ w2_full

    args = (jnp.ones((8, 64)), jnp.ones((64, 128)), jnp.ones((8, 64)), jnp.ones((64, 8)))
    plan = shardc.plan(f, *args, mesh=mesh, search=False)
    r = simulate(plan, topology(True), estimator=FakeEstimator({"dot_general": 1 * MS, "mul": 0.1 * MS}))
    spans = sorted((t[1], round(t[3] / MS, 6), round(t[4] / MS, 6)) for t in r.tasks())
    assert ("all-gather", 0.0, 0.5) in spans and ("all-reduce", 1.0, 3.0) in spans
    assert ("compute", 1.0, 2.0) in spans  # z @ w2 in the compute stream's idle interval
    assert r.step_time == pytest.approx(3.1 * MS)


def test_a_plan_that_does_not_fit_says_so(plan):
    tiny = Topology("tiny", Device("toy", {"float32": 1e12}, 1e12, 1e3), (Level("link", 8, 1e9, 0.0),), overlap=True)
    r = simulate(plan, tiny, estimator=FakeEstimator({"dot_general": 1 * MS}))
    assert not r.fits and "DOES NOT FIT in device memory" in r.summary()
    assert simulate(plan, topology(True), estimator=FakeEstimator({"dot_general": 1 * MS})).fits
