"""Small programs for the search tests, and the `forks` fixture of the worker tests (a helper module, not a
test file)."""
import jax
import jax.numpy as jnp
import pytest

from shardc.ir.build import build_graph
from shardc.search.evaluate import Problem


def mlp_forward(x, w1, w2):
    return jnp.tanh(jnp.tanh(x @ w1) @ w2)


def mlp_args(b=1024, d=512, f=2048):
    return (jnp.ones((b, d)) * 0.01, jnp.ones((d, f)) * 0.01, jnp.ones((f, d)) * 0.01)


def graph_of(fun, args, names=None):
    """The graph of fun(*args); outputs that are the next version of an argument are tied to it (carried
    train-step state), as @shardc.auto does."""
    from shardc.auto import _tie_carried_state

    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    names = names or [f"arg{i}" for i in range(len(args))]
    outs = [f"out{i}" for i in range(len(closed.jaxpr.outvars))]
    g = build_graph(closed, names, outs)
    _tie_carried_state(g, None, jax.tree_util.tree_structure(out_shape), args)
    return g, closed, names, outs


def problem_of(fun, args, *, topology="h100-sxm-8", seeds=(), memory_limit=None, names=None):
    g, closed, names, outs = graph_of(fun, args, names)
    return Problem(g, list(seeds), topology, names, outs, (), (), closed, memory_limit)


@pytest.fixture
def forks(monkeypatch):
    """The pids of the search workers forked during the test (import it into the test module to use it)."""
    import shardc.search.workers as workers

    pids = []
    real = workers.MeshPool._fork

    def counted(*a):
        child = real(*a)
        pids.append(child.pid)
        return child

    monkeypatch.setattr(workers.MeshPool, "_fork", staticmethod(counted))
    return pids
