"""An argmax / argmin over a dim split across devices, in the PCG as XLA's SPMD partitioner runs it.

Each device finds the best element of its piece (value and global index), the candidates are gathered (one
per piece: a small all-gather, where gathering the operand whole would move all of it), and the best candidate
wins. Ties go to the first piece, and within it to the first element, as the global argmax's do; a NaN is the
best of its piece and of the candidates (XLA's max/min propagate it, argmax/argmin take the first NaN), as it
is of the whole. The plan prices this as the op's own all-gathers (`SELF_COMBINED`); its PCG had gathered the
operand whole (flax lm1b's accuracy metric: a 4 MB all-gather of the logits where the plan moves 8 KB; at a
real vocabulary and batch, gigabytes that put the PCG over the memory limit, so that no rewrite could be kept).
The collectives are now XLA's (two all-gathers per op: values and indices). The simulated step is not yet the
plan's: the piece's best value and its index are two reductions here, one variadic reduce in XLA's program,
and the final pick is a few small ops where the plan prices none (a few us on `h100-sxm-8`).

Every node is a primitive the PCG already runs on local pieces (reshape, reduce_max/min, argmax/argmin, iota,
broadcast_in_dim, mul, add, eq, select_n, reduce_sum), so the rewriting, the simulator and the lowering treat
them as any others.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from shardc.pcg.graph import Compute
from shardc.sharding import Sharding

__all__ = ["INDEX_REDUCTIONS", "split_axes", "split_index_reduction"]

# argmax / argmin -> the reduction giving each piece's best value
INDEX_REDUCTIONS = {"argmax": jax.lax.reduce_max_p, "argmin": jax.lax.reduce_min_p}


def split_axes(op: Any, eqn: Any, strat: Any, sizes: Mapping[str, int], shape: Sequence[int]
               ) -> tuple[str, ...] | None:
    """The mesh axes plan op `op` (an argmax/argmin, jaxpr equation `eqn`, on an operand of `shape`) splits its
    reduced dim over under strategy `strat`, when they cut it into equal pieces; None otherwise (it runs on the
    whole operand)."""
    (dim,) = eqn.params["axes"]
    factors = op.rule.operands[0][dim]
    if len(factors) != 1 or not strat.factor_axes[factors[0]]:
        return None
    axes = tuple(strat.factor_axes[factors[0]])
    return None if shape[dim] % math.prod(sizes[a] for a in axes) else axes


def split_index_reduction(scope: Any, op: Any, eqn: Any, operand: int, axes: tuple[str, ...]) -> int:
    """The result tensor of plan op `op` (an argmax/argmin, jaxpr equation `eqn`) computed by pieces from the PCG
    tensor `operand`, laid out as the op's strategy needs it (its reduced dim split over `axes`, `split_axes`). The
    result is in the layout the strategy gives it (the reduced dim dropped)."""
    b = scope.b
    (dim,) = eqn.params["axes"]
    pieces = math.prod(scope.ctx.sizes[a] for a in axes)
    shape, dims = b.tensors[operand].shape, b.tensors[operand].sharding.dims
    dtype, index, name = b.tensors[operand].dtype, eqn.params["index_dtype"], b.tensors[operand].name

    def node(prim: Any, params: dict, args: list[int], shape: Sequence[int], dtype: Any, dims: Sequence[Any],
             what: str) -> int:
        out = b.add_tensor(shape, dtype, Sharding(tuple(dims)), f"{name}: {what}")
        b.add_node(Compute.of(prim, params, op.source), args, [out], cause=f"{op.primitive} by pieces: {what}")
        return out

    split_shape = shape[:dim] + (pieces, shape[dim] // pieces) + shape[dim + 1:]
    split_dims = dims[:dim] + (axes, ()) + dims[dim + 1:]
    best_shape = shape[:dim] + (pieces,) + shape[dim + 1:]
    best_dims = dims[:dim] + (axes,) + dims[dim + 1:]
    whole_dims = dims[:dim] + ((),) + dims[dim + 1:]
    out_shape = shape[:dim] + shape[dim + 1:]
    out_dims = dims[:dim] + dims[dim + 1:]
    pieced = node(jax.lax.reshape_p, {"new_sizes": split_shape, "dimensions": None, "sharding": None}, [operand],
                  split_shape, dtype, split_dims, "one row per piece")
    best = node(INDEX_REDUCTIONS[op.primitive], {"axes": (dim + 1,)}, [pieced], best_shape, dtype, best_dims,
                "each piece's best value")
    at = node(eqn.primitive, {"axes": (dim + 1,), "index_dtype": index}, [pieced], best_shape, index, best_dims,
              "where in its piece")
    piece = node(jax.lax.iota_p, {"dtype": index, "shape": best_shape, "dimension": dim, "sharding": None}, [],
                 best_shape, index, best_dims, "each piece's number")
    width = b.add_const(np.asarray(shape[dim] // pieces, dtype=index), name="piece width")
    widths = node(jax.lax.broadcast_in_dim_p, {"shape": best_shape, "broadcast_dimensions": (), "sharding": None},
                  [width], best_shape, index, best_dims, "the piece width")
    start = node(jax.lax.mul_p, {"out_dtype": None}, [piece, widths], best_shape, index, best_dims,
                 "each piece's first index")
    at = node(jax.lax.add_p, {}, [at, start], best_shape, index, best_dims, "each piece's best index")
    gathered = f"the best of each piece of {name} gathered ({op.primitive} over {', '.join(axes)})"
    best = scope.reshard(best, Sharding(whole_dims), gathered)
    at = scope.reshard(at, Sharding(whole_dims), gathered)
    winner = node(eqn.primitive, {"axes": (dim,), "index_dtype": index}, [best], out_shape, index, out_dims,
                  "the winning piece")
    number = node(jax.lax.iota_p, {"dtype": index, "shape": best_shape, "dimension": dim, "sharding": None}, [],
                  best_shape, index, whole_dims, "each candidate's piece")
    kept = tuple(d for d in range(len(shape)) if d != dim)
    winners = node(jax.lax.broadcast_in_dim_p, {"shape": best_shape, "broadcast_dimensions": kept, "sharding": None},
                   [winner], best_shape, index, whole_dims, "the winning piece")
    hit = node(jax.lax.eq_p, {}, [number, winners], best_shape, np.dtype(bool), whole_dims, "the winner")
    zeros = scope.zeros(b.tensors[at], Sharding(whole_dims))
    picked = node(jax.lax.select_n_p, {}, [hit, zeros, at], best_shape, index, whole_dims, "the winner's index")
    return node(jax.lax.reduce_sum_p, {"axes": (dim,), "out_sharding": None}, [picked], out_shape, index, out_dims,
                "the winner's index")
