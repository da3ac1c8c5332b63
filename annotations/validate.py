"""Call-time checks of a hint. Every failure is a `ShardingError` naming the hint kind, the tensor's shape,
the dim, the sizes involved and the user's source line."""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from annotations.context import mesh_is_provisional
from annotations.errors import ShardingError, SourceLine
from annotations.spec import UNCONSTRAINED, DimHint, HintSpec

__all__ = ["check_array", "normalize_dim", "normalize_axes", "check_spec", "repeated_axis"]


def _at(source: SourceLine | None) -> str:
    return f" (at {source})" if source is not None else ""


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # JAX extended dtypes (typed PRNG keys) are not numpy dtypes
        return str(dtype)


def _tensor(shape: tuple[int, ...], dtype: Any) -> str:
    return f"tensor {_dtype_name(dtype)}{list(shape)} (shape {tuple(shape)})"


def check_array(kind: str, x: Any, source: SourceLine | None) -> tuple[tuple[int, ...], Any]:
    """The shape and dtype of `x`; `x` must be a jax array, a tracer or a numpy array."""
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        raise ShardingError(
            f"{kind}: expected a jax or numpy array, got {type(x).__name__} {x!r:.60}{_at(source)}"
        )
    return tuple(np.shape(x)), x.dtype


def normalize_dim(kind: str, shape: tuple[int, ...], dtype: Any, dim: Any,
                  source: SourceLine | None) -> int:
    """`dim` as a non-negative index (python-style negatives); out of range is an error."""
    ndim = len(shape)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise ShardingError(
            f"{kind}: dim must be an int, got {type(dim).__name__} {dim!r} for "
            f"{_tensor(shape, dtype)}{_at(source)}"
        )
    dim = int(dim)
    if not -ndim <= dim < ndim:
        raise ShardingError(
            f"{kind}: dim {dim} is out of range for {_tensor(shape, dtype)} with {ndim} dims "
            f"(valid dims are {-ndim}..{ndim - 1}){_at(source)}"
        )
    return dim % ndim


def normalize_axes(kind: str, shape: tuple[int, ...], dtype: Any, dim: int, axes: Any,
                   source: SourceLine | None) -> DimHint:
    """One dim's hint from what the user wrote: str -> (str,), tuple of str, int n (1 -> ()), open."""
    if axes is UNCONSTRAINED or axes is jax.sharding.PartitionSpec.UNCONSTRAINED:
        return UNCONSTRAINED
    if axes is None:
        return ()
    if isinstance(axes, str) and axes:
        return (axes,)
    if isinstance(axes, tuple) and all(isinstance(a, str) and a for a in axes):
        return axes
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
        n = int(axes)
        if n < 1:
            raise ShardingError(
                f"{kind}: number of partitions of dim {dim} (size {shape[dim]}) of "
                f"{_tensor(shape, dtype)} must be >= 1, got {n}{_at(source)}"
            )
        return () if n == 1 else n
    raise ShardingError(
        f"{kind}: the axes of dim {dim} (size {shape[dim]}) of {_tensor(shape, dtype)} must be a mesh "
        f"axis name, a tuple of names or an int > 0, got {type(axes).__name__} {axes!r}{_at(source)}"
    )


def _manual_axes() -> frozenset[str]:
    """Mesh axes that are Manual where the hint is written (inside `shard_map`)."""
    try:
        am = jax.sharding.get_abstract_mesh()
        return frozenset(n for n, t in zip(am.axis_names, am.axis_types) if t == AxisType.Manual)
    except Exception:  # pragma: no cover - other jax versions
        return frozenset()


def repeated_axis(dims: Any) -> tuple[str, int, int] | None:
    """The first mesh axis named twice in a tensor's per-dim axes (tuples; other entries name none), as
    (axis, the dim that named it first, the dim that names it again), or None. An axis splits one dim once."""
    owner: dict[str, int] = {}
    for i, d in enumerate(dims):
        if isinstance(d, tuple):
            for a in d:
                if a in owner:
                    return a, owner[a], i
                owner[a] = i
    return None


def check_spec(spec: HintSpec, shape: tuple[int, ...], dtype: Any, mesh: Mesh | None) -> None:
    """Axes used at most once; int counts divide their dim; with a mesh: axes exist, are Auto (and not
    manual in an enclosing shard_map), divide."""
    from annotations.primitive import resolve_dims  # local: primitive imports nothing from here

    kind, where, tensor = spec.kind, _at(spec.source), _tensor(shape, dtype)
    owner: dict[str, int] = {}
    for i, d in enumerate(spec.dims):
        if isinstance(d, tuple):
            for a in d:
                if a in owner:
                    other = "the same dim" if owner[a] == i else f"dim {owner[a]}"
                    raise ShardingError(
                        f"{kind}: mesh axis {a!r} is used twice, by dim {i} (size {shape[i]}) and "
                        f"{other} (size {shape[owner[a]]}) of {tensor}{where}"
                    )
                owner[a] = i
        elif isinstance(d, int) and shape[i] % d:
            raise ShardingError(
                f"{kind}: dim {i} of {tensor} has size {shape[i]}, which is not divisible into "
                f"{d} parts{where}"
            )
    if mesh is None:
        return
    sizes = dict(mesh.shape)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    for a, i in owner.items():
        if a not in sizes:
            raise ShardingError(
                f"{kind}: unknown mesh axis {a!r} in dim {i} (size {shape[i]}) of {tensor}; the mesh "
                f"has axes {list(mesh.axis_names)} with sizes {sizes}{where}"
            )
        if types[a] != AxisType.Auto:
            raise ShardingError(
                f"{kind}: mesh axis {a!r} (dim {i} of {tensor}) is {types[a]}, but hints need Auto "
                f"axes (use jax.sharding.reshard for Explicit axes){where}"
            )
    manual = _manual_axes()
    for a, i in owner.items():
        if a in manual:
            raise ShardingError(
                f"{kind}: mesh axis {a!r} (dim {i} of {tensor}) is manual here (inside shard_map); "
                f"hints may only name the mesh's non-manual axes{where}"
            )
    try:
        resolved = resolve_dims(spec, mesh, tensor=tensor, exclude=manual)
    except ShardingError as e:
        raise ShardingError(f"{kind}: {e}") from None
    if mesh_is_provisional():
        return  # the sizes are a stand-in's: the search checks divisibility on each mesh it tries
    for i, d in enumerate(resolved):
        if isinstance(d, tuple) and d:
            prod = math.prod(sizes[a] for a in d)
            if shape[i] % prod:
                raise ShardingError(
                    f"{kind}: dim {i} of {tensor} has size {shape[i]}, which is not divisible by "
                    f"{prod}, the product of the sizes of mesh axes {d} "
                    f"({', '.join(f'{a}={sizes[a]}' for a in d)}){where}"
                )
