"""Indexing and convolution ops run on local pieces, as XLA's SPMD partitioner runs them.

Elementwise ops, dots, reshapes and the like compute a local piece from local pieces whatever their
strategy (`shardc.pcg.build.LOCAL_PRIMITIVES`). These ops do so only for some strategies, each with its
own per-device program:

* `gather`: batch and whole-slice dims split freely; an indexed operand dim taken one row at a time
  (a vocab-split embedding, the rows of the logits a label picks) split too: each device gathers the
  rows it holds (indices shifted to its piece, the others masked to zero) and the result holds partial
  sums over those axes, as GSPMD does;
* `scatter-add`: window and batch dims split; updates split over an implicit batch dim (data-parallel
  embedding gradients) leave partial sums: the operand is added on the first device of those axes only;
  an operand dim indexed one row at a time split too (a vocab-split embedding's gradient): each device
  adds the updates of the rows it holds (indices shifted to its piece, the other updates zeroed);
* `dynamic_slice` / `dynamic_update_slice`: dims taken whole split (a dim the update covers one element
  of is written where it lands by XLA; on local pieces each device would write it: not local);
* `conv_general_dilated` without feature or batch groups: batch, input and output feature dims split
  (spatial dims need halos: not local);
* pooling (`reduce_window_*`, `select_and_scatter_add`): dims outside the window (batch, channels) split;
* `random_bits` of one key (dropout's masks): any result dims split, each device hashing the indices of its
  own elements as JAX's partitionable threefry does (else the whole array drawn and its piece sliced).

`is_local(op, strat, sizes)` says whether a strategy is one of these; `RUNNERS` holds the per-device
programs `shardc.pcg.lower` runs instead of binding the primitive on the local pieces.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from shardc.rules.core import FactorKind

__all__ = ["LOCAL_CHECKS", "is_local", "RUNNERS", "Runner"]

PT, RED = FactorKind.PASS_THROUGH, FactorKind.REDUCTION


def _sharded(strat: Any) -> list[int]:
    return [f for f, axes in enumerate(strat.factor_axes) if axes]


def _dim_of(factors: Sequence[Sequence[int]], f: int) -> int | None:
    return next((d for d, fs in enumerate(factors) if f in fs), None)


def _gather_local(op: Any, strat: Any) -> bool:
    rule, p = op.rule, op.params
    index_map = tuple(p["dimension_numbers"].start_index_map)
    for f in _sharded(strat):
        if rule.kinds[f] is PT:
            continue
        d = _dim_of(rule.operands[0], f)
        if rule.kinds[f] is not RED or d is None or d not in index_map or p["slice_sizes"][d] != 1:
            return False
    return True


def _scatter_local(op: Any, strat: Any) -> bool:
    rule = op.rule
    add = op.primitive in ("scatter-add", "scatter_add")
    for f in _sharded(strat):
        in_updates = _dim_of(rule.operands[2], f) is not None
        if not in_updates and add and rule.kinds[f] is PT and _scattered_row_dim(op, _dim_of(rule.operands[0], f)):
            continue  # rows of the operand split: each device adds the updates of the rows it holds
        if not in_updates or (rule.kinds[f] is RED and not add):
            return False
        if rule.kinds[f] not in (PT, RED):
            return False
    return True


def _scattered_row_dim(op: Any, d: int | None) -> bool:
    """Is operand dim `d` one a scatter indexes one row at a time (an inserted window dim)?"""
    dn = op.params["dimension_numbers"]
    return d is not None and d in tuple(dn.inserted_window_dims) and d in tuple(dn.scatter_dims_to_operand_dims)


def _pass_through_only(op: Any, strat: Any) -> bool:
    return all(op.rule.kinds[f] is PT for f in _sharded(strat))


def _update_slice_local(op: Any, strat: Any) -> bool:
    """A dynamic_update_slice runs locally when every split dim is one the update covers whole: a dim it
    writes one element of passes through the plan's rule (XLA's partitioner writes it with a select where it
    lands), but on local pieces each device would write it at its own offset."""
    return all(op.rule.kinds[f] is PT and _dim_of(op.rule.operands[1], f) is not None for f in _sharded(strat))


def _conv_local(op: Any, strat: Any) -> bool:
    p = op.params
    if int(p.get("feature_group_count", 1) or 1) != 1 or int(p.get("batch_group_count", 1) or 1) != 1:
        return False
    return all(op.rule.kinds[f] in (PT, RED) for f in _sharded(strat))


def _random_bits_local(op: Any, strat: Any) -> bool:
    """Random bits of one key (a key array of shape ()), any dims of the result split: each device computes its
    piece (`_run_random_bits`), as XLA partitions JAX's threefry."""
    return not op.rule.operands[0] and all(op.rule.kinds[f] is PT for f in _sharded(strat))


LOCAL_CHECKS: dict[str, Callable[[Any, Any], bool]] = {
    "gather": _gather_local,
    "scatter-add": _scatter_local, "scatter_add": _scatter_local,
    "dynamic_slice": _pass_through_only, "dynamic_update_slice": _update_slice_local,
    "conv_general_dilated": _conv_local, "random_bits": _random_bits_local,
    # pooling (and its gradient) with the split dims outside the window (batch, channels)
    "reduce_window_max": _pass_through_only, "reduce_window_min": _pass_through_only,
    "reduce_window_sum": _pass_through_only, "select_and_scatter_add": _pass_through_only,
}


def is_local(op: Any, strat: Any) -> bool:
    """Whether `op` (one of `LOCAL_CHECKS`) runs on local pieces under strategy `strat`."""
    check = LOCAL_CHECKS.get(op.primitive)
    return check is not None and check(op, strat)


# -- per-device programs -----------------------------------------------------------------------------

Runner = Callable[[Any, list[Any], list[Any], list[Any], Mapping[str, int]], list[Any]]
# (Compute, args, input Tensors, output Tensors, mesh sizes) -> local results


def _axis(axes: Sequence[str]) -> Any:
    return tuple(axes) if len(axes) > 1 else axes[0]


def _index(axes: Sequence[str]) -> Any:
    return jax.lax.axis_index(_axis(axes))


def _fills(mode: Any) -> bool:
    """Whether a gather/scatter `mode` fills (drops) out of bounds rows; otherwise it clamps them."""
    return "FILL_OR_DROP" in str(mode)  # (as `shardc.cost.windows.gather_window` reads it)


def _fill_value(fill: Any, dtype: Any) -> Any:
    """A gather's fill for out-of-bounds rows (`lax.gather`'s default when None)."""
    if fill is not None:
        return fill
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.nan
    if jnp.issubdtype(dtype, jnp.bool_):
        return True
    return jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.signedinteger) else jnp.iinfo(dtype).max


def _run_gather(node: Any, args: list[Any], ins: list[Any], outs: list[Any], mesh: Mapping[str, int]) -> list[Any]:
    x, idx = args
    p = dict(node.params)
    dn = p["dimension_numbers"]
    local = ins[0].local_shape(mesh)
    sizes = list(p["slice_sizes"])
    fills = _fills(p.get("mode"))
    mask = None
    outside = None  # rows whose index along a split dim is out of the whole dim's bounds (fill mode)
    first = None  # this device is the first of those dims' axes (it alone gives the fill: partial sums)
    shifted = []
    for d, axes in enumerate(ins[0].sharding.dims):
        if not axes:
            continue
        if sizes[d] == ins[0].shape[d]:
            sizes[d] = local[d]  # a whole dim: the whole local piece
            continue
        if d in tuple(getattr(dn, "operand_batching_dims", ())):
            continue  # a batch dim shared with the indices (take_along_axis): split alike, one row each
        k = list(dn.start_index_map).index(d)  # an indexed dim taken one row at a time: shift and mask
        start = _index(axes) * local[d]
        g = idx[..., k]
        if fills:  # (out of bounds of the whole dim: the fill value, given once)
            out = (g < 0) | (g > ins[0].shape[d] - 1)
            outside = out if outside is None else outside | out
            one = _index(axes) == 0
            first = one if first is None else first & one
        else:  # (clamped into the whole dim before it is shifted to the piece)
            g = jnp.clip(g, 0, ins[0].shape[d] - 1)
        i = g - start.astype(idx.dtype)
        ok = (i >= 0) & (i < local[d])
        mask = ok if mask is None else mask & ok
        shifted.append((k, jnp.clip(i, 0, local[d] - 1)))
    for k, i in shifted:
        idx = idx.at[..., k].set(i)
    p["slice_sizes"] = tuple(sizes)
    y = node.prim.bind(x, idx, **p)
    if mask is not None:  # batch dims of the result are the indices' leading dims, in order
        batch = [d for d in range(y.ndim) if d not in tuple(dn.offset_dims)]
        m = jax.lax.broadcast_in_dim(mask, y.shape, tuple(batch))
        y = jnp.where(m, y, jnp.zeros((), y.dtype))
        if outside is not None:
            fill = jnp.asarray(_fill_value(p.get("fill_value"), y.dtype), y.dtype)
            o = jax.lax.broadcast_in_dim(outside & first, y.shape, tuple(batch))
            y = jnp.where(o, fill, y)
    return [y]


def _run_scatter(node: Any, args: list[Any], ins: list[Any], outs: list[Any], mesh: Mapping[str, int]) -> list[Any]:
    x, idx, upd = args
    partial = [a for a in mesh if a in outs[0].sharding.partial and a not in ins[0].sharding.partial]
    if partial:  # the operand counts once in the sum of the devices' partial results
        first = _index(partial) == 0
        x = jnp.where(first, x, jnp.zeros((), x.dtype))
    dn = node.params["dimension_numbers"]
    local = ins[0].local_shape(mesh)
    mask = None
    fills = _fills(node.params.get("mode"))
    for d, axes in enumerate(ins[0].sharding.dims):
        if not axes or not _scattered_row_dim(node, d):
            continue
        # rows split over `axes`: indices shifted to this device's rows, updates of the other rows zeroed
        k = list(dn.scatter_dims_to_operand_dims).index(d)
        g = idx[..., k] if fills else jnp.clip(idx[..., k], 0, ins[0].shape[d] - 1)
        i = g - (_index(axes) * local[d]).astype(idx.dtype)
        ok = (i >= 0) & (i < local[d])
        mask = ok if mask is None else mask & ok
        idx = idx.at[..., k].set(jnp.clip(i, 0, local[d] - 1))
    if mask is not None:  # the updates' scatter dims are the indices' leading dims, in order
        scatter = [d for d in range(upd.ndim) if d not in tuple(dn.update_window_dims)]
        upd = jnp.where(jax.lax.broadcast_in_dim(mask, upd.shape, tuple(scatter)), upd, jnp.zeros((), upd.dtype))
    return [node.prim.bind(x, idx, upd, **node.params)]


def _run_dynamic_slice(node: Any, args: list[Any], ins: list[Any], outs: list[Any], mesh: Mapping[str, int]
                       ) -> list[Any]:
    p = dict(node.params, slice_sizes=tuple(outs[0].local_shape(mesh)))
    return [node.prim.bind(*args, **p)]


def _run_conv(node: Any, args: list[Any], ins: list[Any], outs: list[Any], mesh: Mapping[str, int]) -> list[Any]:
    p = dict(node.params)
    for key in ("lhs_shape", "rhs_shape"):  # (only some jax versions carry shapes)
        p.pop(key, None)
    return [node.prim.bind(*args, **p)]


def _run_random_bits(node: Any, args: list[Any], ins: list[Any], outs: list[Any], mesh: Mapping[str, int]
                     ) -> list[Any]:
    """This device's piece of `random_bits(key, shape)`. JAX's partitionable threefry (`jax_threefry_partitionable`,
    the default) hashes each element's index in the whole array with the key, so a piece is the hash of its
    elements' indices: computed here for those alone. Another key implementation, that flag off, or an array of
    2**32 elements or more: the whole array is drawn and this device's piece sliced out (the same bits)."""
    (key,), p, out = args, node.params, outs[0]
    shape, local = tuple(p["shape"]), tuple(out.local_shape(mesh))
    starts = [_index(axes) * n if axes else 0 for axes, n in zip(out.sharding.dims, local)]
    if not (jax.config.jax_threefry_partitionable and str(jax.random.key_impl(key)) == "threefry2x32"
            and math.prod(shape) < 2 ** 32):
        whole = node.prim.bind(key, **p)
        return [jax.lax.dynamic_slice(whole, [jnp.asarray(s, jnp.uint32) for s in starts], local)]
    index = jnp.zeros(local, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):  # (the element's index in the whole array, row-major)
        at = jax.lax.broadcasted_iota(jnp.uint32, local, d) + jnp.asarray(starts[d], jnp.uint32)
        index = index + at * jnp.uint32(stride)
        stride *= shape[d]
    k = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(k[0], k[1], jnp.zeros(local, jnp.uint32), index)
    width = p["bit_width"]
    if width == 64:
        hi, lo = (jax.lax.convert_element_type(b, jnp.uint64) for b in (bits1, bits2))
        return [jax.lax.shift_left(hi, jnp.asarray(32, jnp.uint64)) | lo]
    bits = bits1 ^ bits2
    return [bits if width == 32 else jax.lax.convert_element_type(bits, {8: jnp.uint8, 16: jnp.uint16}[width])]


RUNNERS: dict[str, Runner] = {
    "gather": _run_gather, "scatter-add": _run_scatter, "scatter_add": _run_scatter,
    "dynamic_slice": _run_dynamic_slice, "conv_general_dilated": _run_conv, "random_bits": _run_random_bits,
}
