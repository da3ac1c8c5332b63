"""The search space: mesh candidates, decision groups shared by repeated layers, legal choices only."""
import math

import jax
import jax.numpy as jnp

from shardc.propagate import Cause, Seed
from shardc.search.space import build_space, mesh_candidates, mesh_orders, mixing_domains, project_plan, seeds_for
from search_models import graph_of


def test_mesh_candidates_factorise_the_device_count():
    ms = mesh_candidates(8)
    assert {"data": 8} in ms and {"data": 2, "model": 4} in ms and {"data": 2, "model": 2, "expert": 2} in ms
    assert all(math.prod(m.values()) == 8 and 1 <= len(m) <= 3 for m in ms)
    assert len({tuple(m.items()) for m in ms}) == len(ms)
    assert mesh_candidates(8, fixed={"x": 8}) == [{"x": 8}]
    for m in mesh_candidates(8, ["model", "data"]):
        assert "model" in m and "data" in m


def test_which_axis_lies_inside_a_node_is_a_choice_on_multi_level_topologies():
    from shardc.cost import Topology

    single = mesh_candidates(8, ["data", "model"], topology="h100-sxm-8")
    assert single == mesh_candidates(8, ["data", "model"])  # one level: the order changes nothing
    multi = mesh_candidates(64, ["data", "model"], topology="h100-sxm-8x8")
    keys = [tuple(m.items()) for m in multi]
    assert len(keys) == len(set(keys)) and all(math.prod(m.values()) == 64 for m in multi)
    a, b = keys.index((("data", 8), ("model", 8))), keys.index((("model", 8), ("data", 8)))  # dicts ignore order
    assert b == a + 1  # each variant follows its mesh
    assert list(multi[a]) == ["data", "model"] and list(multi[b]) == ["model", "data"]
    topo = Topology.preset("h100-sxm-8x8")
    assert topo.map_mesh(multi[a]).inside("nvlink") == ["model"]
    assert topo.map_mesh(multi[b]).inside("nvlink") == ["data"]
    three = mesh_orders({"data": 2, "model": 4, "expert": 8})
    assert [list(m)[-1] for m in three] == ["expert", "model", "data"]  # each axis innermost once
    assert len(mesh_candidates(64, ["data"], topology="h100-sxm-8x8")) > len(mesh_candidates(64, ["data"]))


def _deep_mlp(depth):
    def f(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x
    return f, (jnp.ones((64, 32)), [jnp.ones((32, 32))] * depth)


def test_repeated_layers_share_decisions():
    sizes = []
    for depth in (2, 6):
        f, args = _deep_mlp(depth)
        g, *_ = graph_of(lambda x, *ws: f(x, ws), (args[0], *args[1]))
        sp = build_space(g, {"data": 2, "model": 2})
        ops = [grp for grp in sp.groups if grp.kind == "op"]
        assert len(ops) == 1 and len(ops[0].members) == depth
        sizes.append(len(sp.groups))
    assert sizes[0] == sizes[1]


def test_choices_are_legal():
    g, *_ = graph_of(lambda x, w: x @ w, (jnp.ones((6, 8)), jnp.ones((8, 4))))
    mesh = {"data": 2, "model": 4}
    sp = build_space(g, mesh)
    assert sp.groups
    for grp in sp.groups:
        sizes = g.ops[grp.members[0]].rule.sizes if grp.kind == "op" else g.values[grp.members[0]].shape
        for c in grp.choices:
            axes = [a for ax in c for a in ax]
            assert len(axes) == len(set(axes))  # no axis twice
            for size, ax in zip(sizes, c):
                assert size % math.prod(mesh[a] for a in ax) == 0  # divisible
    # dim of size 6 can take "data" (2) but never "model" (4)
    x_group = next(grp for grp in sp.groups if grp.kind == "input" and g.inputs[0] in grp.members)
    assert all("model" not in c[0] for c in x_group.choices) and any(c[0] == ("data",) for c in x_group.choices)


def test_pinned_dims_are_respected():
    g, *_ = graph_of(lambda x, w: x @ w, (jnp.ones((8, 8)), jnp.ones((8, 8))))
    mesh = {"data": 2, "model": 2}
    x = g.inputs[0]
    user = [Seed(x, (("data",), None), Cause("hint", "test"))]
    sp = build_space(g, mesh, user)
    dot = next(grp for grp in sp.groups if grp.kind == "op")
    rule = g.ops[dot.members[0]].rule
    for c in dot.choices:  # the dot's factor on x's dim 0 is always on "data"
        f = rule.operands[0][0][0]
        assert c[f] == ("data",)
    for a in sp.all_assignments():
        for s in seeds_for(sp, a, user):
            assert not (s.value == x and s.dims[0] is not None)


def test_continued_propagation_equals_full_propagation():
    from shardc.propagate import propagate
    from shardc.search.evaluate import UserPropagation
    from search_models import mlp_args, mlp_forward

    g, *_ = graph_of(mlp_forward, mlp_args(64, 32, 64))
    mesh = {"data": 2, "model": 2}
    user = [Seed(g.inputs[1], ((), ("model",)), Cause("hint", "test"))]
    sp = build_space(g, mesh, user)
    base = UserPropagation(g, mesh, user)
    for k, a in enumerate(sp.all_assignments()):
        if k % 13:
            continue
        extra = seeds_for(sp, a, user)
        full = propagate(g, mesh, user + extra)
        again = base.run(extra)
        assert again.axes == full.axes and again.closed == full.closed and again.origin == full.origin


def test_baselines_are_reproduced_exactly_and_mixed_per_group():
    import jax
    from shardc.search.baselines import baseline_seeds
    from shardc.search.evaluate import Evaluator
    from shardc.sharding import make_mesh
    from search_models import mlp_args, mlp_forward, problem_of

    def sgd_step(w1, w2, x):
        loss, (g1, g2) = jax.value_and_grad(lambda a, b: jnp.mean(mlp_forward(x, a, b) ** 2), (0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2, loss

    x, w1, w2 = mlp_args(256, 128, 512)
    pb = problem_of(sgd_step, (w1, w2, x))
    sizes = {"data": 2, "model": 2}
    mesh = make_mesh(sizes, jax.devices()[:4])
    sp = build_space(pb.graph, sizes)
    ev = Evaluator(pb, mesh, sp, [])
    points = []
    for name in ("data-parallel", "fsdp"):
        plan = ev.plan_with(baseline_seeds(name, pb.graph, sizes))
        a = project_plan(sp, plan)
        assert ev.score(a) == ev.score_plan(plan)[0], name  # the projection is the baseline itself
        points.append(a)
    doms = mixing_domains(sp, points)
    assert all(0 in d and all(p[i] in d for p in points) for i, d in enumerate(doms))


def test_only_meshes_that_lay_onto_the_topology():
    """2 nodes of 3 GPUs: an axis of 2 must span the nodes; meshes that cannot be laid out are skipped (they
    used to abort the search), and a device count that fits no mesh is a clear error."""
    import pytest

    from shardc import ShardingError
    from shardc.cost import Topology

    topo = Topology.from_dict({"name": "2x3", "device": {"name": "gpu", "peak_flops": {"float32": "60T"},
                                                         "mem_bandwidth": "3TB/s", "memory": "80GiB"},
                               "levels": [{"name": "nvlink", "size": 3, "bandwidth": "400GB/s"},
                                          {"name": "eth", "size": 2, "bandwidth": "3GB/s"}]})
    ms = mesh_candidates(6, ["data", "model"], topology=topo)
    assert ms and all(topo.map_mesh(m) for m in ms)
    orders = [list(m.items()) for m in ms]
    assert [("data", 2), ("model", 3)] in orders and [("model", 2), ("data", 3)] in orders  # the 2 across nodes
    assert [("data", 3), ("model", 2)] not in orders  # model=2 inside a node of 3
    with pytest.raises(ShardingError, match="no mesh of 4 devices lays onto topology"):
        mesh_candidates(4, ["data"], topology=topo)


def test_pins_grouped_by_value_decide_as_the_pinned_dims_do():
    """`_dims_ok` on the pins grouped per value (`_pins_by_value`) decides as the definition on the flat pinned
    dims does: pinned dims must match, and no other dim may reuse an axis pinned on the value."""
    import random

    from shardc.search.space import _dims_ok, _pins_by_value

    def reference(vid, dims, pinned):
        used = {a for (v, d), ax in pinned.items() if v == vid for a in ax}
        return all(ax == pinned[(vid, d)] if (vid, d) in pinned else not used & set(ax) for d, ax in enumerate(dims))

    rng = random.Random(0)
    axes = ("data", "model", "expert")

    def some_axes():
        return tuple(rng.sample(axes, rng.randrange(3)))

    outcomes = set()
    for _ in range(400):
        pinned = {(rng.randrange(4), rng.randrange(3)): some_axes() for _ in range(rng.randrange(5))}
        pins = _pins_by_value(pinned)
        for vid in range(5):
            dims = tuple(some_axes() for _ in range(rng.randrange(1, 4)))
            want = reference(vid, dims, pinned)
            assert _dims_ok(vid, dims, pins) == want
            outcomes.add(want)
    assert outcomes == {True, False}
