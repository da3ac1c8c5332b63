"""Deferred weight gradients of a pipelined layer stack (the "W" pass of zero-bubble pipelines).

In the GPipe loop JAX differentiates, every backward iteration computes each layer's weight gradient for
its microbatch (`dW += x_m^T dy_m`) and adds it into an accumulator carried by the loop: the GEMM's output
written, then read again with the accumulator and written back, once per iteration, bubble iterations
included. With the weight gradients deferred, a weight's matmul inside the loop differentiates only into
its input (`dx = dy w^T`); the loop hands the matmul's input and output cotangent of every iteration out of
the backward loop, and after it one GEMM per weight contracts over all microbatches at once
(`dW = X^T dY`, K = every row of the batch): no accumulation and no weight-gradient work inside the loop.

How, with JAX's own differentiation of the loop:

* the layer body is traced to a jaxpr once (`layer_sites`, `find_sites`); a **site** is a `dot_general`
  whose one operand comes from a stacked per-layer input (a "weight leaf") through linear unary ops (casts,
  reshapes, transposes, shardc hints; into `jax.jit` calls) and whose other does not, without batch dims. A
  leaf is *deferred* when every use of it is such a site;
* inside the loop the deferred leaves are `stop_gradient`ed (no accumulator), and each site runs as
  `deferred_dot(x, w, probe_y, probe_x)`: the dot, whose custom VJP returns `dx` and, as the cotangents of
  the two probes (zeros handed to the loop per iteration, never read), `dy` and the residual `x`;
* the probes come from `make_probes`: a custom-VJP function of the deferred (stage-layout) weights whose
  backward receives the stacked cotangents of every probe, `[iterations, stages, (shards,) ...]`, and
  returns the weights' gradients (`stack_grads`): per site, the transpose (in the weight) of
  `dot(X, chain(w))` applied to `dY`.

The iterations in which a stage holds no microbatch have `dY = 0` exactly, so including them would be exact;
each stage's own `microbatches * repeats` iterations are sliced out first so the GEMMs do no bubble work.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src import source_info_util
from jax.extend import core as jcore

from annotations import split
from annotations.errors import ShardingError
from shardc.ir.jaxpr_env import JaxprEnv

__all__ = ["DotSite", "Sites", "find_sites", "layer_sites", "eval_deferring", "deferred_dot", "stack_grads",
           "make_probes"]

# unary ops that are linear in their operand and only move, cast or hint it: a weight reaches its dot through these
_LINEAR_UNARY = ("convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p",
                 "shardc_hint")
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr"}


@dataclasses.dataclass(frozen=True)
class DotSite:
    """A matmul of a weight leaf in the layer body: where it is (`path`: eqn indices through inlined calls),
    which stacked input it reads (`leaf`) through which linear unary eqns (`chain`), which operand the weight
    is, and its dot_general params."""

    path: tuple[int, ...]
    leaf: int
    chain: tuple[Any, ...]
    weight_is_lhs: bool
    params: Any
    x_aval: Any
    y_aval: Any


@dataclasses.dataclass(frozen=True)
class Sites:
    """The deferred sites of a layer body, and which weight leaves (indices into the body's stacked inputs)
    they cover (every use of such a leaf is a site)."""

    sites: tuple[DotSite, ...]
    leaves: frozenset[int]

    def at(self, path: tuple[int, ...]) -> DotSite | None:
        return self._by_path.get(path)

    def under(self, path: tuple[int, ...]) -> bool:
        """Whether a site lies inside the call at `path`."""
        return any(s.path[:len(path)] == path and len(s.path) > len(path) for s in self.sites)

    @functools.cached_property
    def _by_path(self) -> dict:
        return {s.path: s for s in self.sites}


def _is_float(aval: Any) -> bool:
    return jnp.issubdtype(getattr(aval, "dtype", jnp.int32), jnp.floating)


def find_sites(closed: Any, weight_invars: Sequence[int]) -> Sites:
    """The deferrable weight matmuls of `closed` (the layer body's jaxpr), whose invars at `weight_invars`
    are the per-layer weight leaves (float ones only count); a site's `leaf` indexes `weight_invars`."""
    found: list[DotSite] = []
    spoiled: set[int] = set()

    def walk(jaxpr: Any, derived: dict, prefix: tuple[int, ...]) -> None:
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [derived.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
            if not any(ins):
                continue
            name = eqn.primitive.name
            if name in _LINEAR_UNARY and len(eqn.invars) == 1:
                leaf, chain = ins[0]
                derived[eqn.outvars[0]] = (leaf, chain + (eqn,))
            elif name == "dot_general" and sum(x is not None for x in ins) == 1 \
                    and eqn.params["dimension_numbers"][1] == ((), ()):
                lhs = ins[0] is not None
                leaf, chain = ins[0] if lhs else ins[1]
                x = eqn.invars[1] if lhs else eqn.invars[0]
                found.append(DotSite(prefix + (i,), leaf, chain, lhs, eqn.params, x.aval, eqn.outvars[0].aval))
            elif name in _CALLS:
                inner = eqn.params[_CALLS[name]]
                walk(inner.jaxpr, {v: d for v, d in zip(inner.jaxpr.invars, ins) if d is not None}, prefix + (i,))
            else:
                spoiled.update(d[0] for d in ins if d is not None)
        for v in jaxpr.outvars:
            if isinstance(v, jcore.Var) and v in derived:
                spoiled.add(derived[v][0])

    top = closed.jaxpr
    walk(top, {top.invars[i]: (n, ()) for n, i in enumerate(weight_invars) if _is_float(top.invars[i].aval)}, ())
    sites = tuple(s for s in found if s.leaf not in spoiled)
    return Sites(sites, frozenset(s.leaf for s in sites))


# -- the dot whose weight gradient leaves the loop ------------------------------------------------------

def _dot(x: jax.Array, w: jax.Array, order: tuple) -> jax.Array:
    weight_is_lhs, dims, precision, preferred = order
    lhs, rhs = (w, x) if weight_is_lhs else (x, w)
    return jax.lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=preferred)


def deferred_dot(x: jax.Array, w: jax.Array, probe_y: jax.Array, probe_x: jax.Array, site: DotSite) -> jax.Array:
    """`dot_general` of the activation `x` and weight `w` as `site` says; differentiated, `x` gets its
    cotangent, `w` none, and the probes `dy` and `x` (the loop carries them out as stacked cotangents)."""
    p = site.params
    order = (site.weight_is_lhs, p["dimension_numbers"], p.get("precision"), p.get("preferred_element_type"))

    y_dtype, x_dtype = probe_y.dtype, probe_x.dtype

    @jax.custom_vjp
    def dot(x, w, probe_y, probe_x):
        return _dot(x, w, order)

    def fwd(x, w, probe_y, probe_x):
        return _dot(x, w, order), (x, w)

    def bwd(res, dy):
        x, w = res
        dx, = jax.linear_transpose(lambda a: _dot(a, w, order), x)(dy)
        return dx, jnp.zeros_like(w), dy.astype(y_dtype), x.astype(x_dtype)

    dot.defvjp(fwd, bwd)
    return dot(x, w, probe_y, probe_x)


def eval_deferring(closed: Any, args: Sequence[Any], sites: Sites, probes: dict[tuple[int, ...], tuple]) -> list:
    """Evaluate `closed` on `args` with each site's dot run as `deferred_dot` on its probes (`probes[path]` =
    (probe_y, probe_x)); every other eqn is bound as it is, with its source line and name scope."""

    def run(jaxpr: Any, consts: Sequence[Any], vals: Sequence[Any], prefix: tuple[int, ...]) -> list:
        env = JaxprEnv(jaxpr, consts, vals)
        for i, eqn in enumerate(jaxpr.eqns):
            path = prefix + (i,)
            invals = env.reads(eqn.invars)
            names = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=names), eqn.ctx.manager:
                site = sites.at(path)
                if site is not None:
                    x, w = (invals[1], invals[0]) if site.weight_is_lhs else (invals[0], invals[1])
                    outs = [deferred_dot(x, w, *probes[path], site)]
                elif eqn.primitive.name in _CALLS and sites.under(path):
                    inner = eqn.params[_CALLS[eqn.primitive.name]]
                    outs = run(inner.jaxpr, inner.consts, invals, path)
                else:
                    ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                    outs = list(ans) if eqn.primitive.multiple_results else [ans]
            env.write(eqn.outvars, outs)
        return env.reads(jaxpr.outvars)

    return run(closed.jaxpr, closed.consts, args, ())


# -- the weight gradients, after the loop -----------------------------------------------------------------

def _replay(chain: Sequence[Any], w: jax.Array) -> jax.Array:
    for eqn in chain:
        w = eqn.primitive.bind(w, **eqn.primitive.get_bind_params(eqn.params))
    return w


def _site_of_stack(site: DotSite) -> tuple:
    """The site's dot with the activation operand given a leading dim (the loop's iterations, or the
    microbatches a stage ran): the dims of `x` shift by one, and so does the output if the weight is lhs."""
    (cl, cr), _ = site.params["dimension_numbers"]
    if site.weight_is_lhs:
        dims = ((tuple(cl), tuple(c + 1 for c in cr)), ((), ()))
    else:
        dims = ((tuple(c + 1 for c in cl), tuple(cr)), ((), ()))
    return (site.weight_is_lhs, dims, site.params.get("precision"), site.params.get("preferred_element_type"))


def stack_grads(leaf_sites: Sequence[tuple[int, DotSite]], w_aval: Any, pieces: Callable[[jax.Array], list],
                stacked: Sequence[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """The gradient of one stage's stacked weight leaf (`w_aval`, [layers per stage, ...]) from its sites:
    `leaf_sites` = (layer within the stage, site), `pieces(w)` cuts the leaf into its layers' weights as
    the loop does, `stacked` = per site, (dY, X) with a leading dim of the microbatches this stage ran.
    The transpose (in w) of sum over sites of dot(X, chain(piece)) applied to the dYs: one GEMM per site
    contracting every microbatch's rows."""

    def forward(w: jax.Array) -> list:
        ws = pieces(w)
        out = []
        for (layer, site), (_, x) in zip(leaf_sites, stacked):
            out.append(_dot(x, _replay(site.chain, ws[layer]), _site_of_stack(site)))
        return out

    cts = []
    for (_, site), (dy, _) in zip(leaf_sites, stacked):
        if site.weight_is_lhs:  # output dims: the weight's free dims, then the stack dim, then x's free dims
            free_w = len(site.y_aval.shape) - (len(site.x_aval.shape) - len(site.params["dimension_numbers"][0][1]))
            dy = jnp.moveaxis(dy, 0, free_w)
        cts.append(dy)
    grad, = jax.linear_transpose(forward, jax.ShapeDtypeStruct(w_aval.shape, w_aval.dtype))(cts)
    return grad


# -- wiring into the pipeline loop ------------------------------------------------------------------------

def layer_sites(body: Callable, carry: Sequence[Any], carry_tree: Any, xs: Sequence[Any], xs_tree: Any,
                where: str) -> tuple[Any, Sites, Any]:
    """The layer body traced once at one layer's shapes (`carry`: the carry leaves as a stage holds them,
    `xs`: one layer's slice of each stacked input) and its sites: (closed jaxpr, Sites, the ys' treedef)."""
    nc, ys_def = len(carry), []

    def flat(*args: Any) -> list:
        out, ys = body(jax.tree.unflatten(carry_tree, list(args[:nc])), jax.tree.unflatten(xs_tree, list(args[nc:])))
        if jax.tree.leaves(ys):
            raise ShardingError(f"{where}: the layer body returns per-layer outputs ({jax.tree.structure(ys)}); "
                                f"a pipelined stack can only carry its activations (return None as the scan's y)")
        ys_def.append(jax.tree.structure(ys))
        return jax.tree.leaves(out)

    closed = jax.make_jaxpr(flat)(*carry, *xs)
    return closed, find_sites(closed, range(nc, nc + len(xs))), ys_def[0]


def make_probes(sites: Sites, weights: Sequence[jax.Array], p: Any) -> tuple[list, list]:
    """(probes, loop weights) for the pipeline `p`'s loop: `probes[j]` = layer j's (probe_y, probe_x) per site,
    each stacked [iterations, stages, (shards,) ...] for the loop to slice; the loop weights are `weights`
    (the stage layout) with the deferred leaves `stop_gradient`ed. The probes' backward computes the
    deferred leaves' gradients from the stacked (dY, X) of every site (`stack_grads`, per stage and shard,
    on the iterations the stage held a microbatch)."""
    k, r, s, g, m = p.layers_per_stage, p.repeats, p.stages, p.shards, p.microbatches
    sd = 1 if r == 1 else 2
    lead = (p.iterations, s) + ((g,) if g > 1 else ())
    leaves = sorted(sites.leaves)
    pairs = [(j, site) for j in range(k) for site in sites.sites]
    avals = [w.shape for w in weights]
    dtypes = [weights[i].dtype for i in leaves]

    def hinted(x: jax.Array) -> jax.Array:
        x = split(x, 1, p.axis)
        return split(x, 2, p.data) if g > 1 else x

    def zeros() -> list:
        return [hinted(jnp.zeros(lead + tuple(a.shape), a.dtype))
                for _, site in pairs for a in (site.y_aval, site.x_aval)]

    def pieces(w: jax.Array) -> list:
        return [w[0]] if k == 1 else [jax.lax.squeeze(q, (0,)) for q in jax.lax.split(w, (1,) * k, axis=0)]

    def leaf_grad(leaf: int, dtype: Any, stk: list) -> jax.Array:
        mine = [n for n, (_, site) in enumerate(pairs) if site.leaf == leaf]
        leaf_sites = [pairs[n] for n in mine]
        shape = (k,) + tuple(avals[leaf][sd + (2 if g > 1 else 1):])
        w_aval = jax.ShapeDtypeStruct(shape, dtype)

        def on_stage(st: list, s_idx: jax.Array) -> jax.Array:
            st = [tuple(jax.lax.dynamic_slice_in_dim(a, s_idx, m * r, axis=0) for a in pair) for pair in st]
            if r == 1:
                return stack_grads(leaf_sites, w_aval, pieces, st)
            by_rep = [[tuple(a.reshape((r, m) + a.shape[1:])[q] for a in pair) for pair in st] for q in range(r)]
            return jnp.stack([stack_grads(leaf_sites, w_aval, pieces, one) for one in by_rep])

        f = on_stage
        if g > 1:
            f = jax.vmap(f, in_axes=(1, None), out_axes=sd, spmd_axis_name=p.data)
        f = jax.vmap(f, in_axes=(1, 0), out_axes=sd, spmd_axis_name=p.axis)
        return f([stk[n] for n in mine], jnp.arange(s))

    @jax.custom_vjp
    def probes_for(ws: tuple) -> list:
        return zeros()

    def fwd(ws: tuple) -> tuple[list, None]:
        return zeros(), None

    def bwd(_: None, cts: list) -> tuple:
        stk = [(cts[2 * n], cts[2 * n + 1]) for n in range(len(pairs))]
        return (tuple(leaf_grad(leaf, dtype, stk) for leaf, dtype in zip(leaves, dtypes)),)

    probes_for.defvjp(fwd, bwd)
    flat = probes_for(tuple(weights[i] for i in leaves))
    n = len(sites.sites)
    probes = [[(flat[2 * (j * n + i)], flat[2 * (j * n + i) + 1]) for i in range(n)] for j in range(k)]
    loop_weights = [jax.lax.stop_gradient(w) if i in sites.leaves else w for i, w in enumerate(weights)]
    return probes, loop_weights
