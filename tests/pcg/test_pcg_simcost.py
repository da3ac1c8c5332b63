"""The simulator prices PCGs: one communication task per parallel op, and it decides which rewrites pay."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc import replicate, split
from shardc.cost.topology import Topology
from shardc.pcg import build_pcg, bytes_moved, hlo_collectives, lower_pcg, optimize
from shardc.pcg.library import library_rules
from shardc.pcg.match import apply_match, find_matches
from shardc.pcg.simcost import SimCost, simulate_pcg
from shardc.pcg.verify import verify_rule


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def pcg_of(f, mesh, *args, fuse=False):
    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    return build_pcg(c.plan, c.closed_jaxpr, fuse=fuse)


def two_layers(x, w1, w2):
    """Two dense layers, the hidden dim split over `model` (Megatron's pairing), the batch over `data`."""
    h = jax.nn.relu(split(x, 0, "data") @ split(w1, 1, "model"))
    return split(h @ split(w2, 0, "model"), 1, "model")


def two_layers_args():
    k = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(k[0], (64, 256)), jax.random.normal(k[1], (256, 512)),
            jax.random.normal(k[2], (512, 256)))


def rule(name):
    r = next(r for r in library_rules() if r.name == name)
    assert verify_rule(r).proved
    return r


def task_kinds(sim):
    return collections.Counter(k for _, _, k in sim.comm_tasks())


def test_one_comm_task_per_parallel_op(mesh):
    def f(x, w1, w2, y):
        h = jax.nn.relu(split(x, 0, "data") @ split(w1, 1, "model"))
        out = split(h @ split(w2, 0, "model"), 1, "model")  # partial sums -> reduce-scatter
        z = split(jnp.sin(split(y, 0, "model")), 1, "model")  # dim 0 -> dim 1: all-to-all
        return out, replicate(z)  # all-gather

    k = jax.random.split(jax.random.key(0), 4)
    args = (jax.random.normal(k[0], (8, 16)), jax.random.normal(k[1], (16, 32)),
            jax.random.normal(k[2], (32, 24)), jax.random.normal(k[3], (16, 8)))
    for fuse in (False, True):
        pcg = pcg_of(f, mesh, *args, fuse=fuse)
        sim = simulate_pcg(pcg, "h100-sxm-8")
        tasks = sim.comm_tasks()
        # each parallel op that moves data is one task of its own kind, and nothing else communicates
        assert sorted((node, kind) for _, node, kind in tasks) == \
            sorted((t.node, t.collective) for t in pcg.communication())
        assert task_kinds(sim) == pcg.collectives()
        if fuse:  # XLA's collectives on these CPU devices (no reduce-scatter there: all-reduce, then slice)
            assert {"all-reduce", "all-to-all", "all-gather"} <= set(pcg.collectives())
            assert "reduce-scatter" not in pcg.collectives()
        assert sim.step_time > 0


def test_a_rewrite_is_decided_by_the_simulator(mesh):
    def f(x, w):
        return split(replicate(jnp.tanh(x)) @ w, 0, "model")

    k = jax.random.split(jax.random.key(1), 2)
    args = (jax.random.normal(k[0], (512, 512)), jax.random.normal(k[1], (512, 64)))
    pcg = pcg_of(f, mesh, *args)
    (m,) = find_matches(pcg, rule("partition_ew1"))  # slice x before tanh instead of after
    new = apply_match(pcg, m)
    sim = SimCost("h100-sxm-8")
    # less local work, the same bytes: the stand-in says it pays, the simulated step is not faster (the
    # tanh is off the critical path, which the dot reading the sliced copy sets)
    assert bytes_moved(new) < bytes_moved(pcg) and new.comm_bytes() == pcg.comm_bytes()
    assert sim(new) >= sim(pcg)
    assert [s.rule for s in optimize(pcg, [rule("partition_ew1")], cost_fn=bytes_moved).steps] == ["partition_ew1"]
    assert optimize(pcg, [rule("partition_ew1")]).steps == ()  # the default cost is the simulator


def test_simulated_time_never_goes_up(mesh):
    def f(x, w):
        return (jnp.tanh(replicate(split(x, 0, "model"))) * 2.0) @ w

    k = jax.random.split(jax.random.key(2), 2)
    args = (jax.random.normal(k[0], (1024, 512)), jax.random.normal(k[1], (512, 4)))
    pcg = pcg_of(f, mesh, *args)
    sim = SimCost("h100-sxm-8")
    res = optimize(pcg, cost_fn=sim)
    # moving the all-gather across tanh alone is slower (XLA no longer fuses tanh into the multiply);
    # the lookahead finds that moving it on across the dot pays
    assert [s.rule for s in res.steps] == ["combine_ew1", "combine_ew1", "combine_dot"]
    assert res.steps[0].cost_after > res.initial_cost
    assert res.cost == sim(res.pcg) < sim(pcg)
    assert optimize(pcg, cost_fn=sim, lookahead=None).steps == ()  # purely greedy: stuck
    fn = lower_pcg(res.pcg)
    np.testing.assert_allclose(np.asarray(fn(*args)[0]), np.asarray(f(*args)), rtol=1e-5, atol=1e-5)
    assert hlo_collectives(fn.lower(*args).compile().as_text()) == res.pcg.collectives()


def test_topology_changes_the_verdict(mesh):
    def f(x, w1, w2):
        h = jax.nn.relu(split(x, 0, "data") @ split(w1, 1, "model"))
        return split(h @ split(w2, 0, "model"), 1, "model")

    k = jax.random.split(jax.random.key(3), 3)
    args = (jax.random.normal(k[0], (64, 256)), jax.random.normal(k[1], (256, 512)), jax.random.normal(k[2], (512, 256)))
    pcg = build_pcg(shardc.plan(f, *args, mesh=mesh, search=False))  # the plan records its program
    # a GPU has a native reduce-scatter; a backend without one (XLA:CPU) runs an all-reduce and a slice
    assert [s.rule for s in optimize(pcg, topology="h100-sxm-8").steps] == ["reduce_scatter"]
    no_rs = dataclasses.replace(Topology.preset("h100-sxm-8"), reduce_scatter=False)
    assert optimize(pcg, [rule("reduce_scatter")], topology=no_rs).steps == ()


def _simulated_alike(f, mesh, *args):
    """The plan of f (its hints) and its PCG (fused collectives, as the loop builds it), simulated."""
    from shardc.sim import as_topology, simulate

    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    topo = as_topology("h100-sxm-8")
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True, reduce_scatter=topo.reduce_scatter)
    return simulate(c.plan, topo), simulate_pcg(pcg, topo).result


def test_a_loops_carry_runs_every_trip_in_the_pcg_as_in_its_plan(mesh):
    """The gradient of a scan whose initial carry is a constant: the backward scan's carry (the gradient of the
    carry) is computed every trip though its final value is read by no one. The simulated PCG inlines the loop as
    the graph builder does (the carry tied back across iterations, ties at "in"/"out"), so the carry's dot is
    priced as in the plan; before, the PCG had no back edge and priced that dot as dead (the zoo LSTM's PCG
    simulated 7.2% faster than its plan)."""
    def f(w, xs):
        def loss(w):
            def cell(h, x):
                h = jnp.tanh(h @ w + x)
                return h, h

            _, hs = jax.lax.scan(cell, jnp.zeros((8, 64)), split(xs, 1, "data"))
            return jnp.sum(hs ** 2)

        return jax.grad(loss)(w)

    k = jax.random.split(jax.random.key(0))
    args = (jax.random.normal(k[0], (64, 64)) / 8, jax.random.normal(k[1], (5, 8, 64)))
    plan_sim, pcg_sim = _simulated_alike(f, mesh, *args)
    assert pcg_sim.flops == pytest.approx(plan_sim.flops, rel=1e-9)
    assert pcg_sim.step_time == pytest.approx(plan_sim.step_time, rel=1e-6)
    assert pcg_sim.payload == plan_sim.payload


def test_the_same_collective_of_one_value_computed_twice_is_priced_once(mesh):
    """Two `tanh`s of one value (XLA's CSE keeps one), each gathered whole: the plan prices one all-gather, and so
    does the PCG (its two Combine nodes were two all-gathers, as `PCG.collectives()` already counted once; the
    full-size zoo LSTM's backward scans re-gathered a concatenate the same way: 0.8 GB of all-gathers more)."""
    def f(x, w):
        x = split(x, 0, "data")
        u, v = jnp.tanh(x), jnp.tanh(x)
        return replicate(u) @ w + replicate(v) @ (w * 2)

    k = jax.random.split(jax.random.key(3))
    args = (jax.random.normal(k[0], (64, 128)), jax.random.normal(k[1], (128, 128)))
    plan_sim, pcg_sim = _simulated_alike(f, mesh, *args)
    assert plan_sim.payload.get("all-gather", 0) > 0
    assert pcg_sim.payload == plan_sim.payload
    assert pcg_sim.step_time == pytest.approx(plan_sim.step_time, rel=1e-6)


def test_a_bitcast_of_a_split_value_runs_on_its_pieces_as_in_its_plan(mesh):
    """Dropout's mask (flax `nn.Dropout`: random bits, shifted, bitcast to floats) on a value split over `model`: a
    same-width `bitcast_convert_type` maps each element alone, so the PCG bitcasts the local pieces as the plan does.
    Before, the PCG gathered the value whole for the bitcast and split it again (an all-gather the plan does not
    make: flax's lm1b train step's PCG simulated 1.5% slower than its plan)."""
    def f(x, w):
        h = split(x @ w, 1, "model")
        bits = jax.lax.bitcast_convert_type(h, jnp.uint32)
        m = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
        return (h * m) @ w.T

    k = jax.random.split(jax.random.key(5))
    args = (jax.random.normal(k[0], (64, 128)), jax.random.normal(k[1], (128, 256)))
    plan_sim, pcg_sim = _simulated_alike(f, mesh, *args)
    assert pcg_sim.payload == plan_sim.payload and "all-gather" not in pcg_sim.payload
    assert pcg_sim.step_time == pytest.approx(plan_sim.step_time, rel=1e-6)
    c = shardc.auto(f, mesh=mesh, search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)
    fn = lower_pcg(pcg)
    np.testing.assert_allclose(np.asarray(fn(*args)[0]), np.asarray(f(*args)), rtol=1e-5, atol=1e-4)
    assert hlo_collectives(fn.lower(*args).compile().as_text()) == pcg.collectives()


def test_the_pcgs_literals_are_the_plans_for_what_xla_folds(mesh):
    """flax lm1b's `shift_right` (a pad, then a dynamic slice at literal starts, which XLA's simplifier makes a
    slice and fuses): the PCG's simulated program keeps its constants' values, as the plan's graph does, so the
    program analysis folds what it folds in the plan. Before, the PCG's literals were values of unknown contents:
    a pad and a dynamic slice of kernels of their own (8 us more on lm1b's step)."""
    def f(x, w):
        x = split(x, 0, "data")
        shifted = jax.lax.dynamic_slice_in_dim(jnp.pad(x, ((0, 0), (1, 0))), 0, x.shape[1], axis=1)
        return jnp.tanh(shifted @ w)

    k = jax.random.split(jax.random.key(6))
    args = (jax.random.normal(k[0], (64, 128)), jax.random.normal(k[1], (128, 128)))
    plan_sim, pcg_sim = _simulated_alike(f, mesh, *args)
    assert pcg_sim.step_time == pytest.approx(plan_sim.step_time, rel=1e-6)
    assert pcg_sim.flops == pytest.approx(plan_sim.flops, rel=1e-9)


def test_a_scatter_add_summed_after_its_all_reduce_is_priced_as_in_its_plan(mesh):
    """The gradient of an embedding table looked up with ids split over `data` and also read elsewhere: a
    scatter-add of partial sums, all-reduced, then added to the other gradient (XLA's simplifier writes the
    scatter into that sum). The PCG's Reduce between them is looked through as the plan's reshard is (the MoE
    zoo model's PCG priced that scatter as a kernel of its own: this step 28% slower than its plan). (What is left:
    the add reads the all-reduce's buffer in the PCG, the scatter's fused result in the plan's model.)"""
    def f(table, ids, x):
        def loss(t):
            return jnp.sum(t[split(ids, 0, "data")] * x) + 0.01 * jnp.sum(t ** 2)

        return jax.grad(loss)(table)

    k = jax.random.split(jax.random.key(4), 3)
    args = (jax.random.normal(k[0], (256, 64)), jax.random.randint(k[1], (8, 16), 0, 256),
            jax.random.normal(k[2], (8, 16, 64)))
    plan_sim, pcg_sim = _simulated_alike(f, mesh, *args)
    assert plan_sim.payload.get("all-reduce", 0) > 0 and pcg_sim.payload == plan_sim.payload

    def scatter_time(sim):
        return sum(s.compute_ps for s in sim.slots if sim.plan.graph.ops[s.op].primitive == "scatter-add")

    assert scatter_time(pcg_sim) == scatter_time(plan_sim) > 0
    assert pcg_sim.step_time == pytest.approx(plan_sim.step_time, rel=0.005)


def test_a_rewrite_of_repeated_layers_is_simulated_once_per_form(mesh):
    """Four layers alike (the same ops on values of the same shapes and layouts): the rewriting prices one
    match of a local form (`local_form`) for all four, then applies the other three together and keeps them if
    that pays too: 3 cost evaluations where one per match and one per follow-up made 8, and the same result."""
    def f(xs, w):
        return [split(replicate(jnp.tanh(x)) @ w, 0, "model") for x in xs]

    k = jax.random.split(jax.random.key(1), 5)
    xs, w = [jax.random.normal(k[i], (512, 512)) for i in range(4)], jax.random.normal(k[4], (512, 64))
    pcg = pcg_of(f, mesh, xs, w)
    assert len(list(find_matches(pcg, rule("partition_ew1")))) == 4
    calls = []

    def counted(p):
        calls.append(p)
        return bytes_moved(p)

    res = optimize(pcg, [rule("partition_ew1")], cost_fn=counted)
    assert len(calls) == 3  # the PCG, the first match's rewrite, the other three's together
    assert [s.rule for s in res.steps] == ["partition_ew1", "partition_ew1"] and "(and 2 more alike)" in res.steps[1].where
    one_at_a_time = pcg
    for _ in range(4):
        one_at_a_time = apply_match(one_at_a_time, next(find_matches(one_at_a_time, rule("partition_ew1"))))
    assert res.cost == bytes_moved(one_at_a_time) < bytes_moved(pcg)
    out = lower_pcg(res.pcg)(*xs, w)
    for got, want in zip(out, f(xs, w)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _simulated_in_full(topology):
    """A cost function without `below`: every PCG simulated with its memory model (as before `SimCost.below`)."""
    return lambda p: simulate_pcg(p, topology).step_time


def test_a_rewrite_that_does_not_pay_is_priced_without_the_memory_model(mesh, monkeypatch):
    """On a device that charges nothing for fresh memory the step time does not read the memory model, which only
    says whether a faster PCG fits: `SimCost` runs it for the rewrites that pay alone, and the rewriting keeps the
    same rewrites at the same costs as with every candidate simulated in full."""
    import shardc.cost.memory as memory

    def f(x, w):
        return (jnp.tanh(replicate(split(x, 0, "model"))) * 2.0) @ w

    k = jax.random.split(jax.random.key(2), 2)
    args = (jax.random.normal(k[0], (1024, 512)), jax.random.normal(k[1], (512, 4)))
    pcg = pcg_of(f, mesh, *args)
    full = optimize(pcg, cost_fn=_simulated_in_full("h100-sxm-8"))
    runs = []
    model_full = memory.MemoryModel.full
    monkeypatch.setattr(memory.MemoryModel, "full", lambda self, *a, **kw: runs.append(1) or model_full(self, *a, **kw))
    sim = SimCost("h100-sxm-8")
    lazy = optimize(pcg, cost_fn=sim)
    assert [(s.rule, s.cost_before, s.cost_after) for s in lazy.steps] == \
        [(s.rule, s.cost_before, s.cost_after) for s in full.steps] and len(lazy.steps) == 3
    assert lazy.cost == full.cost and lazy.pcg.key() == full.pcg.key()
    # the PCG itself and the sequence's end (whose step pays) are measured in full; the other candidates are not
    assert 2 <= len(runs) < sim.simulations
    measured = len(runs)
    assert sim(lazy.pcg) == lazy.cost and len(runs) == measured  # (measured in full already: memoised)


def test_a_faster_pcg_over_the_memory_limit_is_never_kept(mesh):
    """`SimCost.below(pcg, bound)`: a PCG slower than the bound costs its step time, whatever its memory; one faster
    than the bound must fit the memory limit, or it costs infinity."""
    pcg = pcg_of(two_layers, mesh, *two_layers_args(), fuse=True)
    t = SimCost("h100-sxm-8")(pcg)
    nothing_fits = SimCost("h100-sxm-8", memory_limit=1.0)
    assert nothing_fits.below(pcg, t / 2) == t and nothing_fits.simulations == 1
    assert nothing_fits.below(pcg, 2 * t) == float("inf") and nothing_fits.simulations == 1  # (completed)
    assert SimCost("h100-sxm-8", memory_limit=1e12).below(pcg, 2 * t) == t
    assert optimize(pcg, topology="h100-sxm-8").steps  # (a rewrite pays here) ...
    assert optimize(pcg, cost_fn=nothing_fits).steps == ()  # ... and is not kept when nothing fits
