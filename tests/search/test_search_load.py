"""Same seed, same plan on a busy machine: the search counts simulated plans, not seconds, so a run with
CPU-burning processes beside it plans exactly what a quiet run plans."""
import contextlib
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import optax

import shardc
import shardc.search.integrate as integrate
from shardc.search.budget import SearchTimeCapWarning

TX = optax.adam(1e-3)
LAYERS = 3
BUDGET_S = 0.5  # (the old default wall-clock cap was budget_s: the busy run below takes longer than this)


def _step(params, opt_state, x):
    def loss(p):
        h = x
        for w in p:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    l, g = jax.value_and_grad(loss)(params)
    updates, opt_state = TX.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, l


@contextlib.contextmanager
def _burning(n: int):
    """`n` processes spinning on the CPU while the block runs; yields a list that receives the CPU seconds
    they used."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    used: list[float] = []
    try:
        yield used
    finally:
        for p in procs:
            p.kill()
            _, _, usage = os.wait4(p.pid, 0)
            used.append(usage.ru_utime + usage.ru_stime)


def _plan(args):
    """A fresh search (not this process's plan cache) with the defaults: mesh, topology, no time cap."""
    integrate._PLAN_CACHE.clear()
    f = shardc.auto(_step, budget_s=BUDGET_S, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SearchTimeCapWarning)
        return f.plan(*args)


def test_same_seed_same_plan_with_the_cpu_busy():
    params = [jnp.ones((128, 512)) * 0.01, jnp.ones((512, 128)) * 0.01] * LAYERS
    args = (params, TX.init(params), jnp.ones((256, 128)))
    quiet = _plan(args)
    with _burning(2) as used:
        busy = _plan(args)
    assert sum(used) > 0.2  # the burners really ran beside the second search
    q, b = quiet.search, busy.search
    assert not q.capped and not b.capped
    assert (b.evaluations, b.plan_budget) == (q.evaluations, q.plan_budget)
    assert busy.mesh_sizes == quiet.mesh_sizes and busy.fingerprint() == quiet.fingerprint()
    assert b.chosen.score == q.chosen.score
