"""The pipelined layer stack: what a `lax.scan` over stacked layer parameters becomes (GSPMD §3.3).

`pipelined_scan(body, init, xs, pipeline)` computes what `lax.scan(body, init, xs)` computes — the carry
(the activations, batch on dim 0) through every layer of the stack — as one SPMD loop:

* the stacked per-layer inputs `xs` (parameters, per-layer RNG keys) are laid out
  [layers_per_stage, stages, ...] ([repeats, layers_per_stage, stages, ...] for the circular schedule),
  the stage dim hinted onto the pipeline's mesh axis;
* the batch is cut into `microbatches` (strided: microbatch m holds rows m, m + M, m + 2M, ..., so a batch
  split over data axes stays split inside each microbatch) and kept in an input/output buffer
  [stages, microbatches / stages, microbatch, ...] split over the stage axis;
* the loop runs `pipeline.iterations` iterations; in each, every stage applies its layers (the original
  scan body, called once per layer on `lax.split` slices of the stage's weights, `vmap`ped over the stage
  dim) to the microbatch it holds; the stage outputs move one stage on
  (`stage_shift`: one collective-permute), stage 0 takes its next microbatch from the buffer and the last
  stage writes its finished one there (the buffer's column rotates one stage back each visit, another
  collective-permute, so neither a broadcast nor a gather is needed);
* iterations in which a stage holds no real microbatch (the bubble) compute on zeros whose results are
  never read: their gradients are exact zeros;
* under `jax.grad` the loop is differentiated as it is: the backward loop shifts the other way, and each
  stage's parameter gradients accumulate over the microbatches in its carry (never across stages);
* "1f1b": each stage's layers run under `jax.checkpoint` (nothing saved but the stage's input);
* `defer_wgrad`: the layer body runs through `shardc.pipeline.wgrad.eval_deferring`, its weight matmuls'
  gradients leave the backward loop as stacked (dY, X) and are computed after it, one GEMM per matmul
  over every microbatch (no per-iteration accumulation, no weight-gradient work in the bubble).

Per-layer RNG keys (dropout) get the microbatch index folded in, so microbatches draw independent masks
(not the unpipelined step's masks: see docs/pipeline.md). The body's per-layer outputs (`ys`) must be empty.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from annotations import split
from annotations.errors import ShardingError
from shardc.pipeline.fixpoint import known_fixpoint
from shardc.pipeline.shift import stage_shift
from shardc.pipeline.value import Pipeline
from shardc.pipeline.wgrad import eval_deferring, layer_sites, make_probes

__all__ = ["pipelined_scan", "is_key", "LOOP_SCOPE"]

LOOP_SCOPE = "shardc_pipeline"  # the name scope of the pipeline loop


def is_key(x: Any) -> bool:
    """A PRNG key array: typed (`jax.random.key`), or raw uint32 key data ([..., 2], `jax.random.PRNGKey`)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == jnp.uint32 and x.ndim >= 1 and x.shape[-1] == 2


def _fold(key: jax.Array, m: jax.Array) -> jax.Array:
    """`key` with the microbatch index folded in (a typed key, or raw key data kept raw)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.fold_in(key, m)
    return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), m))


def _to_microbatches(x: jax.Array, p: Pipeline) -> jax.Array:
    """[B, ...] -> [stages, M / stages, B / M, ...] with microbatch m = rows m, m + M, ... (strided)."""
    m, b = p.microbatches, x.shape[0]
    mb = b // m
    x = x.reshape((mb, m) + x.shape[1:])
    x = jnp.moveaxis(x, 1, 0)
    return x.reshape((p.stages, m // p.stages, mb) + x.shape[2:])


def _from_microbatches(io: jax.Array, p: Pipeline) -> jax.Array:
    """The inverse of `_to_microbatches`, on the buffer after the loop: microbatch m's output sits at row
    m // K, column (m + stages - 1) mod K (K = M / stages), where the last stage's column rotation left it."""
    k = io.shape[1]
    io = jnp.roll(io, -(p.stages - 1), axis=1)  # the column dim is never split: a local permutation
    x = io.reshape((p.microbatches,) + io.shape[2:])
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0] * p.microbatches,) + x.shape[2:])


def _stage_dim(x: jax.Array, p: Pipeline) -> jax.Array:
    """`x` with its leading (stage) dim split over the pipeline's mesh axis."""
    return split(x, 0, p.axis)


def _check_carry(leaves: list[Any], p: Pipeline, where: str) -> int:
    if not leaves:
        raise ShardingError(f"{where}: the layer scan carries nothing, so there are no activations to pipeline")
    for i, c in enumerate(leaves):
        shape = getattr(c, "shape", ())
        if not shape:
            raise ShardingError(f"{where}: carry leaf {i} is a scalar; every carried value of a pipelined layer scan "
                                f"needs the batch on dim 0")
        if shape[0] != leaves[0].shape[0]:
            raise ShardingError(f"{where}: carry leaf {i} {tuple(shape)} has dim 0 of {shape[0]} but carry leaf 0 has "
                                f"{leaves[0].shape[0]}; every carried value needs the batch on dim 0")
    b = leaves[0].shape[0]
    if b % p.microbatches:
        raise ShardingError(f"{where}: the batch (dim 0 of the carry, {b}) is not divisible by {p.microbatches} "
                            f"microbatches")
    return b


def pipelined_scan(body: Callable, init: Any, xs: Any, p: Pipeline, scan: Callable, where: str = "layer scan") -> tuple[Any, Any]:
    """`scan(body, init, xs)` run as the pipeline `p` (bound to the stack's length). `scan` is the original
    `lax.scan` (for the loop); returns (carry, ys) like it."""
    carry_leaves, carry_tree = jax.tree.flatten(init)
    b = _check_carry(carry_leaves, p, where)
    s, r, k, g = p.stages, p.repeats, p.layers_per_stage, p.shards
    if (b // p.microbatches) % g:
        raise ShardingError(f"{where}: a microbatch of {b // p.microbatches} rows (batch {b} / {p.microbatches} "
                            f"microbatches) does not split over {'+'.join(p.data)} ({g} devices)")
    xs_leaves, xs_tree = jax.tree.flatten(xs)
    keys = [is_key(x) for x in xs_leaves]

    sd = 1 if r == 1 else 2  # the weights' stage dim: [(repeats,) k, stages, (shards,) ...]

    def by_stage(x: jax.Array) -> jax.Array:
        """A stacked per-layer input as [(repeats,) k, stages, (shards,) ...]: the layer dim leads, as the layer
        scan inside a stage reads it, so neither the scan's reads nor its stacked gradients (the per-iteration
        gradient the loop accumulates) move a dim; the one reorder from the stack's [layers, ...] is here, once
        per step. Each data shard gets its own copy of the stage's parameters (made once, before the loop),
        whose gradient it accumulates alone."""
        if r == 1:
            x = jnp.moveaxis(x.reshape((s, k) + x.shape[1:]), 0, 1)
        else:
            x = jnp.moveaxis(x.reshape((r, s, k) + x.shape[1:]), 1, 2)
        if g > 1:
            x = split(jnp.broadcast_to(jnp.expand_dims(x, sd + 1), x.shape[:sd + 1] + (g,) + x.shape[sd + 1:]),
                      sd + 1, p.data)
        return split(x, sd, p.axis)

    weights = [by_stage(x) for x in xs_leaves]
    ys_tree: list[Any] = []

    def layer_inputs(w: list[jax.Array]) -> list[list[jax.Array]]:
        """Per layer of the stage, its slice of each stacked input: `lax.split` along the layer dim, whose
        transpose is one concatenate of the layers' gradients (fused by XLA into the accumulation over the
        microbatches; a layer scan instead writes each gradient into a stacked buffer, a copy per layer and
        iteration). Keys (no gradient) are indexed."""
        cols = [[x[i] for i in range(k)] if key or k == 1 else
                [jax.lax.squeeze(piece, (0,)) for piece in jax.lax.split(x, (1,) * k, axis=0)]
                for x, key in zip(w, keys)]
        return [[c[i] for c in cols] for i in range(k)]

    deferral = None
    if p.defer_wgrad:  # the layer body traced once at a stage's shapes, its weight matmuls found
        share = b // p.microbatches // g
        deferral = layer_sites(body, [jax.ShapeDtypeStruct((share,) + c.shape[1:], c.dtype) for c in carry_leaves],
                               carry_tree, [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs_leaves], xs_tree,
                               where)

    def stage(h: list[jax.Array], w: list[jax.Array], m: jax.Array, probes: list) -> list[jax.Array]:
        """One stage's layers, unrolled, on one microbatch (or its share on one data shard); `m` is folded into
        the per-layer keys (microbatch index, times shards, plus the shard). With deferred weight gradients,
        `probes[j]` are layer j's probes, one (y, x) pair per site."""
        w = [_fold(x, m) if key else x for x, key in zip(w, keys)]
        out = jax.tree.unflatten(carry_tree, h)
        for j, x in enumerate(layer_inputs(w)):
            if deferral is not None:
                closed, sites, ys_def = deferral
                ys_tree.append(ys_def)
                res = eval_deferring(closed, jax.tree.leaves(out) + x, sites,
                                     {site.path: pr for site, pr in zip(sites.sites, probes[j])})
                out = jax.tree.unflatten(carry_tree, res[:len(carry_leaves)])
                continue
            out, ys = body(out, jax.tree.unflatten(xs_tree, x))
            if jax.tree.leaves(ys):
                raise ShardingError(f"{where}: the layer body returns per-layer outputs ({jax.tree.structure(ys)}); "
                                    f"a pipelined stack can only carry its activations (return None as the scan's y)")
            ys_tree.append(jax.tree.structure(ys))
        return jax.tree.leaves(out)

    if p.remat:
        stage = jax.checkpoint(stage, policy=jax.checkpoint_policies.nothing_saveable)
    # the weights are vmapped at dim 1 ([k, stages, (shards,) ...], one repeat taken): the layer scan's own dim
    run = stage
    if g > 1:
        run = jax.vmap(run, in_axes=(0, 1, 0, 0), spmd_axis_name=p.data)
    run = jax.vmap(run, in_axes=(0, 1, 0, 0), spmd_axis_name=p.axis)

    def run_stages(ins: list[jax.Array], w: list[jax.Array], micro: jax.Array, probes: list) -> list[jax.Array]:
        if g == 1:
            return run(ins, w, micro, probes)
        ins = [_stage_dim(split(x.reshape((s, g, x.shape[1] // g) + x.shape[2:]), 1, p.data), p) for x in ins]
        outs = run(ins, w, micro[:, None] * g + jnp.arange(g)[None, :], probes)
        return [o.reshape((s, o.shape[1] * o.shape[2]) + o.shape[3:]) for o in outs]

    io = [_stage_dim(_to_microbatches(c, p), p) for c in carry_leaves]
    shift = [_stage_dim(jnp.zeros((s,) + c.shape[2:], c.dtype), p) for c in io]
    rows = jnp.arange(s)
    first_final = p.microbatches * (r - 1) + s - 1  # the first iteration whose last-stage output is final

    def take_repeat(x: jax.Array, i: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)

    if deferral is None:
        probes: list = []
        loop_weights = weights
    else:
        probes, loop_weights = make_probes(deferral[1], weights, p)

    def iteration(state: tuple[list, list], step: tuple) -> tuple[tuple[list, list], None]:
        io, shift = state
        t, probes_t = step
        slot = t % io[0].shape[1]
        cols = [jax.lax.dynamic_index_in_dim(b, slot, axis=1, keepdims=False) for b in io]

        def row_is(i: Any, x: jax.Array) -> jax.Array:
            return jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == i

        ins = [_stage_dim(jnp.where(row_is(0, c) & (t < p.microbatches), c, sh), p) for c, sh in zip(cols, shift)]
        done = jnp.maximum(t - rows, 0)  # per stage: pieces of work taken so far
        w = loop_weights if r == 1 else [
            split(jax.vmap(take_repeat, in_axes=(sd, 0), out_axes=1)(x, jnp.minimum(done // p.microbatches, r - 1)),
                  1, p.axis) for x in loop_weights]
        outs = [_stage_dim(o, p) for o in run_stages(ins, w, done % p.microbatches, probes_t)]
        shift = [stage_shift(o, 1) for o in outs]
        final = t >= first_final
        cols = [jnp.where(row_is(s - 1, o) & final, o, stage_shift(c, -1)) for o, c in zip(outs, cols)]
        io = [jax.lax.dynamic_update_index_in_dim(b, c, slot, axis=1) for b, c in zip(io, cols)]
        return (io, shift), None

    with jax.named_scope(LOOP_SCOPE), known_fixpoint(len(io)):  # (named: how the simulator finds the loop's ops)
        (io, _), _ = scan(iteration, (io, shift), (jnp.arange(p.iterations, dtype=jnp.int32), probes))
    out = [_from_microbatches(bf, p) for bf in io]
    return jax.tree.unflatten(carry_tree, out), jax.tree.unflatten(ys_tree[0], [])
