"""Small programs for the search tests (a helper module, not a test file)."""
import jax
import jax.numpy as jnp

from shardc.ir.build import build_graph
from shardc.search.evaluate import Problem


def mlp_forward(x, w1, w2):
    return jnp.tanh(jnp.tanh(x @ w1) @ w2)


def mlp_args(b=1024, d=512, f=2048):
    return (jnp.ones((b, d)) * 0.01, jnp.ones((d, f)) * 0.01, jnp.ones((f, d)) * 0.01)


def graph_of(fun, args, names=None):
    closed = jax.make_jaxpr(fun)(*args)
    names = names or [f"arg{i}" for i in range(len(args))]
    outs = [f"out{i}" for i in range(len(closed.jaxpr.outvars))]
    return build_graph(closed, names, outs), closed, names, outs


def problem_of(fun, args, *, topology="h100-sxm-8", seeds=(), memory_limit=None):
    g, closed, names, outs = graph_of(fun, args)
    return Problem(g, list(seeds), topology, names, outs, (), (), closed, memory_limit)
