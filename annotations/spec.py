"""The value carried by every annotation: which mesh axes each dim of a tensor should be split over.

A `HintSpec` is hashable (it is a JAX primitive parameter). Per dim it holds one of:

* a tuple of mesh axis names (major to minor) — the dim is split over those axes and *closed*:
  propagation may not change it. The empty tuple means "replicated, final".
* an `int` n > 1 — GShard's `split(x, dim, n)`: split into n parts over mesh axes that shardc picks
  (`resolve_count`); closed once resolved.
* `UNCONSTRAINED` — the hint says nothing about this dim (*open*): propagation or the search decides.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Union

from annotations.errors import ShardingError, SourceLine

__all__ = ["UNCONSTRAINED", "DimHint", "HintSpec", "resolve_count"]


class _Unconstrained:
    """Marker for a dim the hint leaves open. A singleton; prints as `?` (Shardy's notation)."""

    _instance: "_Unconstrained | None" = None

    def __new__(cls) -> "_Unconstrained":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCONSTRAINED"

    def __reduce__(self):
        return (_Unconstrained, ())


UNCONSTRAINED = _Unconstrained()

DimHint = Union[tuple[str, ...], int, _Unconstrained]


@dataclasses.dataclass(frozen=True, slots=True)
class HintSpec:
    """A user's sharding hint on one tensor.

    kind: "split", "replicate" or "shard" (which API call made it, for messages).
    dims: one DimHint per tensor dim.
    source: the user's line that wrote the hint.
    priority: Shardy-style priority; lower is stronger. User hints default to 0.
    """

    kind: str
    dims: tuple[DimHint, ...]
    source: SourceLine | None = None
    priority: int = 0

    def describe(self) -> str:
        parts = []
        for d in self.dims:
            if d is UNCONSTRAINED:
                parts.append("?")
            elif isinstance(d, int):
                parts.append(f"{d}-way")
            elif not d:
                parts.append("-")
            else:
                parts.append(",".join(d))
        return f"{self.kind}[{' | '.join(parts)}]"

    def where(self) -> str:
        return f" (at {self.source})" if self.source else ""

    def insert_dim(self, position: int) -> "HintSpec":
        """The same hint on a tensor with one more, unconstrained dim at `position` (vmap's batch dim)."""
        dims = self.dims[:position] + (UNCONSTRAINED,) + self.dims[position:]
        return dataclasses.replace(self, dims=dims)

    def remove_dim(self, position: int) -> "HintSpec":
        return dataclasses.replace(self, dims=self.dims[:position] + self.dims[position + 1 :])


def resolve_count(
    count: int,
    mesh_shape: Mapping[str, int],
    taken: frozenset[str] | set[str] = frozenset(),
    *,
    tensor: str = "tensor",
    dim: int | None = None,
    source: SourceLine | None = None,
) -> tuple[str, ...]:
    """Mesh axes (in mesh order) whose sizes multiply to `count`, for GShard's `split(x, dim, count)`.

    Deterministic: prefers the fewest axes, then the earliest in mesh order. Axes in `taken` (already
    used by another dim of the same tensor) are skipped. Raises ShardingError when no product matches.
    """
    names = [a for a in mesh_shape if a not in taken]
    for k in range(1, len(names) + 1):
        for combo in itertools.combinations(names, k):
            size = 1
            for a in combo:
                size *= mesh_shape[a]
            if size == count:
                return combo
    where = f" (at {source})" if source else ""
    dim_txt = f" dim {dim}" if dim is not None else ""
    raise ShardingError(
        f"split of {tensor}{dim_txt} into {count} parts: no product of mesh axes "
        f"{dict(mesh_shape)} (excluding {sorted(taken)}) equals {count}{where}"
    )
