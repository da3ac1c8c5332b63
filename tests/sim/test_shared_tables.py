"""Tables the simulators of one graph share across meshes (computed once per graph and ProgramInfo) equal what
each simulator would compute for itself, and a simulation that uses the shared tables gives the result of one
that computes them afresh."""
import jax.numpy as jnp
import pytest

import shardc
from shardc.sharding import Sharding
from shardc.sim import simulator_for
from shardc.sim.tasks import TaskBuilder
from tests.sim.test_delta_equals_full import Block
from tests.sim.test_fidelity_vs_xla import train_step


def _plan(mesh: dict[str, int]):
    step, args = train_step(Block(), jnp.ones((8, 16, 32)), shardc.make_mesh(mesh))
    return step.plan(*args)


@pytest.fixture(scope="module")
def plan():
    return _plan({"data": 2, "model": 4})


def _same(a, b):
    return (a.makespan_ps, a.starts, a.ends, a.payload, a.wire, a.flops, a.memory) == \
        (b.makespan_ps, b.starts, b.ends, b.payload, b.wire, b.flops, b.memory)


def _variant(plan):
    """`plan` with its first dot's result laid out otherwise (a delta simulation's change)."""
    from shardc.sim.variants import with_sharding

    op = next(o for o in plan.graph.ops if o.primitive == "dot_general")
    v = op.outputs[0]
    dims = [()] * plan.graph.values[v].rank
    dims[-1] = ("model",)
    return with_sharding(plan, v, Sharding(tuple(dims)))


def _runs(sim, plan, other):
    """A full simulation of `plan`, a delta to `other` and back (the delta's memory update walks fused reads)."""
    return sim.full(plan, plan.donated), sim.delta(other, plan.donated), sim.delta(plan, plan.donated)


def test_memory_walks_are_shared_and_equal_a_recompute(plan):
    a = simulator_for(plan, "h100-sxm-8")
    b = simulator_for(plan, "h100-sxm-8", mapping=("model", "data"))  # another simulator of the graph
    walks = a.memory._walked()
    assert walks  # (the test model has fused values whose reads the walk decides)
    assert b.memory._walked() is walks  # the cache hit
    assert walks == a.memory._walks_of() == b.memory._walks_of()  # what a recompute gives


def test_canonical_inputs_are_shared_and_equal_a_recompute(plan):
    a = simulator_for(plan, "h100-sxm-8").builder
    b = simulator_for(plan, "h100-sxm-8", mapping=("model", "data")).builder
    table = a._canon_inputs()
    assert b._canon_inputs() is table
    info = a.info
    fresh = []
    for op in plan.graph.ops:
        cs = tuple(info.canon[v] for v in op.inputs)
        ok = info.live[op.id] and not (op.primitive == "tie" and op.region == "io") and len(set(cs)) == len(cs) \
            and not any((op.id, i) in info.unread for i in range(len(op.inputs)))
        fresh.append(cs if ok else None)
    assert table == fresh
    assert any(c is None for c in table) and any(c is not None for c in table)


def test_a_simulation_with_the_shared_tables_equals_one_without(plan):
    other = _variant(plan)
    analyses = plan.graph.__dict__.setdefault("_shardc_analyses", {})
    analyses.pop("memory_walks", None)
    analyses.pop("canon_inputs", None)
    # (one ProgramInfo for both plans, so that the deltas are deltas: the variant's per-device shapes differ)
    want = _runs(simulator_for(plan, "h100-sxm-8", device_shapes=False), plan, other)  # computes and caches the tables
    assert analyses["memory_walks"] and analyses["canon_inputs"]
    assert not _same(want[0], want[1])  # (the variant simulates otherwise)
    again = _runs(simulator_for(plan, "h100-sxm-8", device_shapes=False), plan, other)  # with the cached tables
    assert all(_same(a, b) for a, b in zip(again, want))
    assert _same(want[0], want[2])


def test_layout_drops_unit_axes_and_is_the_identity_without_them(plan):
    g = plan.graph
    topo = shardc.sim.as_topology("h100-sxm-8")
    from shardc.sim import _mapping

    plain = TaskBuilder(g, topo, _mapping(topo, {"data": 2, "model": 4}, None), {"data": 2, "model": 4})
    s = Sharding((("data",), (), ("model",)), frozenset({"model"}))
    assert plain.layout(s) is s and plain.vkey((3, s, 0)) == (3, s, 0)
    unit = TaskBuilder(g, topo, _mapping(topo, {"data": 2, "one": 1, "model": 4}, None),
                       {"data": 2, "one": 1, "model": 4})
    t = Sharding((("data", "one"), ("one",), ("model",)), frozenset({"one", "model"}))
    assert unit.layout(t) == Sharding((("data",), (), ("model",)), frozenset({"model"}))
    assert unit.layout(t) is unit.layout(t)  # (memoised)
    assert unit.vkey((3, t, 0)) == (3, unit.layout(t), 0)


def test_value_bytes_memo_equals_a_recompute(plan):
    import math

    sim = simulator_for(plan, "h100-sxm-8")
    sim.full(plan, plan.donated)
    mem, keys = sim.memory, sim.builder.key_list
    value_keys = [k for k in range(len(keys)) if sim.builder.is_value_key[k]]
    assert mem._vbytes and set(mem._vbytes) <= set(value_keys)
    for k in value_keys:
        c, s, _ = keys[k]
        v = plan.graph.values[c]
        want = v.dtype.itemsize * math.prod(-(-d // math.prod(mem.mesh[a] for a in ax)) for d, ax in zip(v.shape, s.dims))
        assert mem._value_bytes(k) == want  # (a hit for the keys the run sized, a miss for the others)
        assert mem._vbytes[k] == want
