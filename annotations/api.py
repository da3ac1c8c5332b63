"""The user API: GShard-style `split`, `replicate` and `shard` hints.

Each call validates the request, records the caller's source line and binds `hint_p` (identity in value).
The mesh the hint refers to is found by `annotations.context.lookup_mesh()`:
`mesh_context(mesh)`, then `jax.set_mesh(mesh)`, then `with mesh:`; with no mesh the hint is recorded
with `mesh=None`, checked only for what needs no mesh, and lowers to the identity.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec

from annotations.context import lookup_mesh
from annotations.errors import ShardingError, SourceLine, caller_source_line
from annotations.primitive import bind_hint
from annotations.spec import UNCONSTRAINED, DimHint, HintSpec
from annotations.validate import _at, check_array, check_spec, normalize_axes, normalize_dim

__all__ = ["split", "replicate", "shard"]

Axes = str | tuple[str, ...] | int


def _hint(x: Any, kind: str, dims: tuple[DimHint, ...], shape, dtype, source: SourceLine | None):
    spec = HintSpec(kind=kind, dims=dims, source=source)
    mesh = lookup_mesh()
    check_spec(spec, shape, dtype, mesh)
    return bind_hint(x, spec, mesh)


def split(x: Any, dim: int, axes: Axes) -> Any:
    """Split dim `dim` of `x` over mesh axes `axes`; the other dims stay open (UNCONSTRAINED).

    `axes` is a mesh axis name, a tuple of names (major to minor), or an int n > 0: GShard's
    `split(x, dim, n)`, n parts over mesh axes shardc picks (`resolve_count`); n = 1 replicates the dim.
    The split dim is closed: propagation may not change it.
    """
    source = caller_source_line()
    shape, dtype = check_array("split", x, source)
    d = normalize_dim("split", shape, dtype, dim, source)
    if axes is None or axes is UNCONSTRAINED or axes is PartitionSpec.UNCONSTRAINED:
        raise ShardingError(
            f"split: the axes of dim {d} (size {shape[d]}) of tensor shape {shape} must be a mesh axis "
            f"name, a tuple of names or an int > 0, got {axes!r}{_at(source)}"
        )
    dims = [UNCONSTRAINED] * len(shape)
    dims[d] = normalize_axes("split", shape, dtype, d, axes, source)
    return _hint(x, "split", tuple(dims), shape, dtype, source)


def replicate(x: Any) -> Any:
    """Replicate `x` on every device: all dims closed and unsplit. `x` may be a pytree of arrays."""
    source = caller_source_line()

    def one(leaf):
        shape, dtype = check_array("replicate", leaf, source)
        return _hint(leaf, "replicate", ((),) * len(shape), shape, dtype, source)

    return jax.tree_util.tree_map(one, x)


def shard(x: Any, spec: Sequence[Any] | PartitionSpec) -> Any:
    """Give every dim of one array its own hint, like a `PartitionSpec`.

    Entries: a mesh axis name or tuple of names (closed, split over them); None (closed, replicated);
    UNCONSTRAINED or `PartitionSpec.UNCONSTRAINED` (open); an int n > 0 (n parts, see `split`).
    A spec shorter than the rank leaves the remaining dims open.
    """
    source = caller_source_line()
    shape, dtype = check_array("shard", x, source)
    if isinstance(spec, (str, bytes)) or not isinstance(spec, (Sequence, PartitionSpec)):
        raise ShardingError(
            f"shard: spec must be a sequence or PartitionSpec with one entry per dim of tensor shape "
            f"{shape}, got {type(spec).__name__} {spec!r}{_at(source)}"
        )
    entries = list(spec)
    if len(entries) > len(shape):
        raise ShardingError(
            f"shard: spec {spec!r} has {len(entries)} entries but tensor shape {shape} has only "
            f"{len(shape)} dims{_at(source)}"
        )
    dims = [normalize_axes("shard", shape, dtype, i, e, source) for i, e in enumerate(entries)]
    dims += [UNCONSTRAINED] * (len(shape) - len(dims))
    return _hint(x, "shard", tuple(dims), shape, dtype, source)
