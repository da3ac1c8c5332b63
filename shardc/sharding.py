"""The Sharding value type and mesh helpers.

A Sharding says, for each dim of one tensor, which mesh axes it is split over (major to minor), and over
which axes the tensor holds partial sums not yet reduced. Axes not mentioned are replicated. This is
GSPMD's and Shardy's representation (and DTensor's Shard/Partial/Replicate), with axis names kept.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from annotations.errors import ShardingError

__all__ = ["Sharding", "make_mesh", "mesh_shape", "replicated"]

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Sharding:
    """Per-dim mesh axes (major to minor) and the set of axes holding unreduced partial sums."""

    dims: tuple[Axes, ...]
    partial: frozenset[str] = frozenset()

    @property
    def rank(self) -> int:
        return len(self.dims)

    def axes(self) -> frozenset[str]:
        """Every mesh axis that splits some dim."""
        return frozenset(a for d in self.dims for a in d)

    def is_replicated(self) -> bool:
        return not self.axes() and not self.partial

    def spec(self) -> PartitionSpec:
        """The jax PartitionSpec (partial sums are not expressible there and are dropped)."""
        entries = [None if not d else (d[0] if len(d) == 1 else d) for d in self.dims]
        return PartitionSpec(*entries)

    def named(self, mesh: Mesh) -> NamedSharding:
        return NamedSharding(mesh, self.spec())

    def shards_per_dim(self, mesh_sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(math.prod(mesh_sizes[a] for a in d) for d in self.dims)

    def local_shape(self, shape: Sequence[int], mesh_sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Shape of one device's shard (dims are required to divide evenly)."""
        return tuple(-(-s // n) for s, n in zip(shape, self.shards_per_dim(mesh_sizes)))

    def without_partial(self) -> "Sharding":
        return Sharding(self.dims)

    def __str__(self) -> str:
        body = ", ".join("-" if not d else "+".join(d) for d in self.dims)
        part = f" partial({','.join(sorted(self.partial))})" if self.partial else ""
        return f"[{body}]{part}"

    @classmethod
    def from_spec(cls, spec: PartitionSpec, rank: int) -> "Sharding":
        dims: list[Axes] = []
        for i in range(rank):
            entry = spec[i] if i < len(spec) else None
            if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                dims.append(())
            elif isinstance(entry, str):
                dims.append((entry,))
            else:
                dims.append(tuple(entry))
        return cls(tuple(dims))


def replicated(rank: int) -> Sharding:
    return Sharding(((),) * rank)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """Axis name -> size, in mesh order (a jax Mesh or an AbstractMesh)."""
    return dict(mesh.shape)


def make_mesh(axes: Mapping[str, int] | Sequence[tuple[str, int]], devices: Iterable[jax.Device] | None = None) -> Mesh:
    """A jax Mesh with the given named axes (in order), all of type AxisType.Auto.

    `axes` is e.g. `{"data": 2, "model": 4}`. Devices default to all of `jax.devices()`; the product of
    axis sizes must equal the number of devices used (a ShardingError otherwise).
    """
    items = list(axes.items()) if isinstance(axes, Mapping) else list(axes)
    if not items:
        raise ShardingError("make_mesh needs at least one axis, e.g. {'data': 8}")
    names = [n for n, _ in items]
    sizes = [s for _, s in items]
    if len(set(names)) != len(names):
        raise ShardingError(f"make_mesh: axis names repeat in {names}")
    for n, s in items:
        if not isinstance(n, str) or not isinstance(s, (int, np.integer)) or s < 1:
            raise ShardingError(f"make_mesh: axis {n!r} needs a str name and a positive int size, got {s!r}")
    devs = list(jax.devices() if devices is None else devices)
    total = math.prod(sizes)
    if total != len(devs):
        hint = "" if devices is not None or total > len(devs) else f"; pass devices=jax.devices()[:{total}] to use fewer"
        raise ShardingError(
            f"make_mesh: axes {dict(items)} need {total} devices, but {len(devs)} are available "
            f"({jax.default_backend()}){hint}"
        )
    arr = np.array(devs, dtype=object).reshape(sizes)
    return Mesh(arr, tuple(names), axis_types=(AxisType.Auto,) * len(names))
