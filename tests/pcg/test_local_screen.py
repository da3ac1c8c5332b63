"""Screening rewrites of a large PCG by their neighbourhood (`shardc.pcg.local_screen`): the part cut out keeps its
boundary, and the rewriting keeps the same rewrites at the same simulated costs with fewer full simulations."""
import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc import replicate, split
from shardc.pcg import build_pcg, optimize
from shardc.pcg.local_screen import local_gain, neighbourhood, sub_pcg
from shardc.pcg.match import apply_match, apply_matches, find_matches, independent
from shardc.pcg.simcost import SimCost, simulate_pcg
from tests.pcg.test_pcg_simcost import pcg_of, rule, two_layers, two_layers_args


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="module")
def layers_pcg(mesh):
    return build_pcg(shardc.plan(two_layers, *two_layers_args(), mesh=mesh, search=False))


def test_a_neighbourhood_cut_out_keeps_its_boundary(layers_pcg):
    pcg = layers_pcg
    whole = sub_pcg(pcg, {n.outputs for n in pcg.nodes})
    assert whole.nodes == pcg.nodes and set(whole.inputs) == set(pcg.inputs) and set(whole.outputs) == set(pcg.outputs)
    assert simulate_pcg(whole).step_time == simulate_pcg(pcg).step_time
    dot = next(n for n in pcg.nodes if getattr(n.op, "primitive", "") == "dot_general")
    assert neighbourhood(pcg, {dot.id}, 0) == {dot.outputs}
    part = sub_pcg(pcg, neighbourhood(pcg, {dot.id}, 1))
    made = {t for n in part.nodes for t in n.outputs}
    read = {t for n in part.nodes for t in n.inputs}
    assert dot in part.nodes and len(part.nodes) < len(pcg.nodes)
    assert set(part.inputs) == read - made - set(pcg.consts)  # what it reads and does not make ...
    outside = [n for n in pcg.nodes if n not in part.nodes]
    assert set(part.outputs) == {t for t in made if t in pcg.outputs or any(t in n.inputs for n in outside)}
    assert set(part.outputs) < made  # ... and what the rest of the program reads of it (not its inner tensors)


def test_the_local_gain_of_a_collective_fused_has_the_sign_of_the_full_one(layers_pcg):
    pcg = layers_pcg
    m = next(find_matches(pcg, rule("reduce_scatter")))
    new = apply_match(pcg, m)
    sim = SimCost("h100-sxm-8")
    full = sim(pcg) - sim(new)
    local = local_gain(pcg, new, m.nodes, lambda p: simulate_pcg(p).step_time)
    assert full > 0 and local > 0  # (an all-reduce and a slice become a reduce-scatter: faster on a GPU)
    assert sim.local_gain(pcg, new, m.nodes) is None  # a PCG this small is priced whole ...
    screened = SimCost("h100-sxm-8", screen_from=0)
    assert screened.local_gain(pcg, new, m.nodes) == pytest.approx(local)  # ... unless asked


def _screened_and_full(pcg):
    full_cost, screened_cost = SimCost("h100-sxm-8", screen_from=None), SimCost("h100-sxm-8", screen_from=0)
    return optimize(pcg, cost_fn=full_cost), full_cost, optimize(pcg, cost_fn=screened_cost), screened_cost


def test_screening_keeps_the_rewrite_that_pays_with_fewer_simulations(layers_pcg):
    full, full_cost, screened, screened_cost = _screened_and_full(layers_pcg)
    assert [s.rule for s in full.steps] == ["reduce_scatter"]
    assert [(s.rule, s.cost_before, s.cost_after) for s in screened.steps] == \
        [(s.rule, s.cost_before, s.cost_after) for s in full.steps]
    assert screened.pcg.key() == full.pcg.key() and screened.cost == full.cost
    assert screened_cost.local_simulations > 0 and screened_cost.simulations <= full_cost.simulations


def test_screening_finds_the_lookahead_sequence_and_prices_its_steps_in_full(mesh):
    """Moving an all-gather across tanh alone is slower; on across the dot it pays (a sequence the lookahead finds,
    `test_pcg_simcost.test_simulated_time_never_goes_up`), here in three layers of other sizes: screened, the same
    sequence with its steps' costs still full simulations', and fewer of those."""
    def f(xs, ws):
        return [(jnp.tanh(replicate(split(x, 0, "model"))) * 2.0) @ w for x, w in zip(xs, ws)]

    k = jax.random.split(jax.random.key(2), 6)
    xs = [jax.random.normal(k[i], (512 * (i + 1), 256)) for i in range(3)]
    ws = [jax.random.normal(k[3 + i], (256, 4)) for i in range(3)]
    pcg = pcg_of(f, mesh, xs, ws)
    full, full_cost, screened, screened_cost = _screened_and_full(pcg)
    assert [s.rule for s in full.steps] == [s.rule for s in screened.steps] \
        == ["combine_ew1", "combine_ew1", "combine_dot"]
    assert screened.pcg.key() == full.pcg.key() and screened.cost == full.cost
    assert screened_cost.simulations < full_cost.simulations
    # (the layer it starts in may differ) each step's costs are the simulated step times of the PCGs around it
    simulated = {c for c, _, _ in screened_cost._memo.values()} | set(screened_cost._times.values())
    costs = [screened.initial_cost] + [s.cost_after for s in screened.steps]
    assert [s.cost_before for s in screened.steps] == costs[:-1] and set(costs) <= simulated
    assert costs[-1] < costs[0]


def _repeated_layers_pcg(mesh, layers, seed):
    """The PCG of `layers` two-layer MLPs alike (`two_layers` on their own inputs and weights)."""
    k = jax.random.split(jax.random.key(seed), 3 * layers)
    xs = [jax.random.normal(k[i], (64, 256)) for i in range(layers)]
    w1s = [jax.random.normal(k[layers + i], (256, 512)) for i in range(layers)]
    w2s = [jax.random.normal(k[2 * layers + i], (512, 256)) for i in range(layers)]
    return pcg_of(lambda xs, w1s, w2s: [two_layers(*a) for a in zip(xs, w1s, w2s)], mesh, xs, w1s, w2s)


def test_a_screened_rewrite_of_repeated_layers_is_verified_with_all_its_layers(mesh):
    """Four layers alike: the screened rewriting prices the reduce-scatter in all four at once (one full simulation
    besides the PCG's own, where the first layer's and then the other three's took two), to the PCG the unscreened
    rewriting reaches."""
    full, full_cost, screened, screened_cost = _screened_and_full(_repeated_layers_pcg(mesh, 4, seed=3))
    assert [(s.rule, "(and 3 more alike)" in s.where) for s in screened.steps] == [("reduce_scatter", True)]
    assert screened_cost.simulations == 2 < full_cost.simulations
    assert screened.cost == full.cost < full.initial_cost == screened.steps[0].cost_before
    assert screened.steps[0].cost_after == screened.cost


def test_independent_matches_applied_together_make_the_pcg_of_one_after_another(mesh):
    """`apply_matches`: a repeated layer's matches rewritten in one pass over the nodes, key for key the PCG that
    applying them one at a time (re-found on each PCG between) makes; overlapping matches are not `independent`."""
    pcg = _repeated_layers_pcg(mesh, 3, seed=4)
    ms = list(find_matches(pcg, rule("reduce_scatter")))
    assert len(ms) == 3 and independent(ms)
    one_by_one = pcg
    for m in ms:
        again = next(a for a in find_matches(one_by_one, rule("reduce_scatter"), frozenset(m.roots))
                     if a.roots == m.roots)
        one_by_one = apply_match(one_by_one, again)
    together = apply_matches(pcg, ms)
    assert together.key() == one_by_one.key() != pcg.key()
    assert SimCost("h100-sxm-8")(together) == SimCost("h100-sxm-8")(one_by_one)
    assert not independent([ms[0], ms[0]])
    with pytest.raises(ValueError, match="overlap"):
        apply_matches(pcg, [ms[1], ms[1]])


def test_a_neighbourhood_is_priced_on_a_device_that_charges_fresh_memory(layers_pcg):
    """`cpu-host` (what `shardc.auto(pcg=True)` prices on for CPU devices) charges fresh memory, so a step time
    reads the memory model: a neighbourhood is simulated with it. Before, the screening asked the simulator for the
    step time alone and stopped with an internal error (flax lm1b's train step on the 8 CPU devices)."""
    from shardc.sim import as_topology

    assert as_topology("cpu-host").device.fresh_memory_cost > 0
    pcg = layers_pcg
    m = next(find_matches(pcg, rule("reduce_scatter")))
    new = apply_match(pcg, m)
    whole = lambda p: simulate_pcg(p, "cpu-host").step_time  # noqa: E731
    screened = SimCost("cpu-host", screen_from=0)
    assert screened.local_gain(pcg, new, m.nodes) == pytest.approx(local_gain(pcg, new, m.nodes, whole))
    full, screened_run = optimize(pcg, cost_fn=SimCost("cpu-host", screen_from=None)), optimize(pcg, cost_fn=screened)
    assert screened_run.cost == full.cost and screened_run.pcg.key() == full.pcg.key()
