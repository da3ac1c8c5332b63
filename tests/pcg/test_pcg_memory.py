"""The rewriting keeps nothing of the candidates it tried (issue 18: the 48-layer GPT's `search+pcg` grew past
14 GB). The search runs it with the cyclic collector paused (shardc.gc_pause), so a candidate PCG or a simulated
graph caught in a reference cycle would live until the search ends: everything must be freed by reference
counting alone."""
import gc
import importlib
import itertools
import weakref

import jax
import jax.numpy as jnp
import shardc
from shardc import split
from shardc.pcg.choice import choose_pcg

TOPO = "h100-sxm-8"
# (the modules: shardc.pcg re-exports functions of the same names)
optimize_mod = importlib.import_module("shardc.pcg.optimize")
simcost_mod = importlib.import_module("shardc.pcg.simcost")


def two_branch(x, w1, w2):
    """Two row-parallel matmuls whose partial sums meet in an add (rewrites pay: test_pcg_loop.py)."""
    x = split(split(x, 0, "data"), 1, "model")
    w1, w2 = split(w1, 0, "model"), split(w2, 0, "model")
    return split(jnp.tanh(x @ w1 + jnp.tanh(x) @ w2), 1, "model")


def test_rewriting_frees_candidates_and_simulations_with_gc_paused(monkeypatch):
    mesh = shardc.make_mesh({"data": 2, "model": 4}, jax.devices()[:8])
    k = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(k[0], (256, 512)), jax.random.normal(k[1], (512, 512)) / 20,
            jax.random.normal(k[2], (512, 512)) / 20)
    c = shardc.auto(two_branch, mesh=mesh, search=False).compiled_info(*args)
    choose_pcg(c.plan, c.closed_jaxpr, TOPO, max_evaluations=2)  # (rules proved, module caches warm)

    graphs: list[weakref.ref] = []  # the graph of every PCG plan the rewriting simulated
    candidates: list[weakref.ref] = []  # every rewritten PCG it built

    def pcg_plan(pcg):
        plan, origin = real_plan(pcg)
        graphs.append(weakref.ref(plan.graph))
        return plan, origin

    def apply_match(pcg, m, **kw):
        new = real_apply(pcg, m, **kw)
        candidates.append(weakref.ref(new))
        return new

    real_plan, real_apply = simcost_mod.pcg_plan, optimize_mod.apply_match
    monkeypatch.setattr(simcost_mod, "pcg_plan", pcg_plan)
    monkeypatch.setattr(optimize_mod, "apply_match", apply_match)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        ch = choose_pcg(c.plan, c.closed_jaxpr, TOPO, max_evaluations=30)
        assert ch.steps and len(graphs) > 5 and len(candidates) > 5
        assert [r for r in graphs if r() is not None] == []
        alive = [r() for r in candidates if r() is not None]
        assert all(p is ch.pcg for p in alive), f"{len(alive)} candidate PCGs kept"
    finally:
        if was:
            gc.enable()


def test_find_and_apply_leave_no_cycles():
    """find_matches, apply_match and Rule.var_kinds (recursive walks) leave no cyclic garbage."""
    from shardc.pcg.library import all_rules
    from shardc.pcg.optimize import usable_rules
    from shardc.pcg.match import RewriteError, apply_match, find_matches
    from shardc.pcg import build_pcg

    mesh = shardc.make_mesh({"data": 2, "model": 4}, jax.devices()[:8])
    args = (jnp.zeros((64, 128)), jnp.zeros((128, 128)), jnp.zeros((128, 128)))
    c = shardc.auto(two_branch, mesh=mesh, search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True, reduce_scatter=True)
    rules = usable_rules(all_rules())
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        built = 0
        for rule in rules:
            rule.var_kinds()
            for m in itertools.islice(find_matches(pcg, rule), 3):
                try:
                    apply_match(pcg, m, require_proof=False)
                    built += 1
                except RewriteError:
                    pass
        assert built > 0
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()
