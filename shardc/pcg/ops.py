"""Parallel operators: the explicit data movement on the edges of a Parallel Computation Graph.

Each operator acts on one *axes group* (a tuple of mesh axes, major to minor, treated as one axis of
degree = product of their sizes) and maps a tensor's `Sharding` to a new one. Dims are split over their
axes major to minor, so Partition appends the group as the minor-most split of a dim and Combine removes
it from there. Each lowers to exactly one local slice or collective:

| op                | sharding change                              | lowered to                  |
|-------------------|----------------------------------------------|-----------------------------|
| Partition(d, A)   | dim d gains A (minor)                        | local slice (no traffic)    |
| Combine(d, A)     | dim d loses A (minor)                        | all-gather                  |
| Replicate(A)      | none: every device holds the whole value     | nothing (SPMD copies)       |
| Reduce(A)         | partial sums over A are added                | all-reduce                  |
| ReduceScatter(d,A)| partial over A added, dim d gains A          | reduce-scatter              |
| AllToAll(s, t, A) | dim s loses A, dim t gains A                 | all-to-all                  |
| CollectivePermute(d, A, B) | dim d split over A becomes split over B (same devices) | collective-permute |
| ReduceScatterDims(A, ds) | partial over A added, axis A[i] joins dim ds[i] | reduce-scatter |
| Shuffle(A, src, dst) | layout src becomes dst: each device's new piece lies in one old piece | slice + collective-permute |
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from annotations.errors import ShardingError
from shardc.sharding import Sharding

__all__ = [
    "Axes", "ParallelOp", "Partition", "Combine", "Replicate", "Reduce", "ReduceScatter", "AllToAll",
    "CollectivePermute", "Shuffle", "ReduceScatterDims", "PARALLEL_OPS", "group_size", "comm_bytes", "collective_kind",
]

Axes = tuple[str, ...]


def group_size(axes: Axes, mesh: Mapping[str, int]) -> int:
    """Degree of an axes group: the product of its mesh axis sizes."""
    return math.prod(mesh[a] for a in axes)


def _free(s: Sharding, axes: Axes, what: str) -> None:
    used = s.axes() | s.partial
    if set(axes) & used:
        raise ShardingError(f"{what}: axes {axes} already used by {s}")


def _with_dim(s: Sharding, d: int, axes: Axes) -> Sharding:
    dims = list(s.dims)
    dims[d] = axes
    return Sharding(tuple(dims), s.partial)


def _check_dim(s: Sharding, d: int, what: str) -> None:
    if not 0 <= d < s.rank:
        raise ShardingError(f"{what}: dim {d} out of range for rank {s.rank} ({s})")


def _drop_minor(s: Sharding, d: int, axes: Axes, what: str) -> Sharding:
    _check_dim(s, d, what)
    have = s.dims[d]
    if not axes or have[len(have) - len(axes):] != axes:
        raise ShardingError(f"{what}: dim {d} of {s} is not split minor-most over {axes}")
    return _with_dim(s, d, have[:len(have) - len(axes)])


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelOp:
    """Base class: `axes` is the group the op works on."""

    axes: Axes

    kind = "parallel"
    collective = "none"

    def apply(self, s: Sharding) -> Sharding:  # pragma: no cover - abstract
        raise NotImplementedError

    def short(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def __str__(self) -> str:
        return self.short()


@dataclasses.dataclass(frozen=True, slots=True)
class Partition(ParallelOp):
    """Split dim `dim` over `axes`: each device keeps its slice (no communication)."""

    dim: int = 0
    kind = "partition"
    collective = "slice"

    def apply(self, s: Sharding) -> Sharding:
        _check_dim(s, self.dim, str(self))
        _free(s, self.axes, str(self))
        return _with_dim(s, self.dim, s.dims[self.dim] + self.axes)

    def short(self) -> str:
        return f"partition[{self.dim},{'+'.join(self.axes)}]"


@dataclasses.dataclass(frozen=True, slots=True)
class Combine(ParallelOp):
    """Undo a split of dim `dim` over `axes`: all-gather."""

    dim: int = 0
    kind = "combine"
    collective = "all-gather"

    def apply(self, s: Sharding) -> Sharding:
        if set(self.axes) & s.partial:
            raise ShardingError(f"{self}: {s} holds partial sums over {self.axes}")
        return _drop_minor(s, self.dim, self.axes, str(self))

    def short(self) -> str:
        return f"combine[{self.dim},{'+'.join(self.axes)}]"


@dataclasses.dataclass(frozen=True, slots=True)
class Replicate(ParallelOp):
    """Hand every device of the group its own copy of a value (SPMD devices already hold it)."""

    kind = "replicate"
    collective = "none"

    def apply(self, s: Sharding) -> Sharding:
        _free(s, self.axes, str(self))
        return s

    def short(self) -> str:
        return f"replicate[{'+'.join(self.axes)}]"


@dataclasses.dataclass(frozen=True, slots=True)
class Reduce(ParallelOp):
    """Add up (or max/min) the partial values held over `axes`: all-reduce."""

    op: str = "sum"
    kind = "reduce"
    collective = "all-reduce"

    def apply(self, s: Sharding) -> Sharding:
        if not set(self.axes) <= s.partial:
            raise ShardingError(f"{self}: {s} holds no partial sums over {self.axes}")
        return Sharding(s.dims, s.partial - set(self.axes))

    def short(self) -> str:
        op = "" if self.op == "sum" else f",{self.op}"
        return f"reduce[{'+'.join(self.axes)}{op}]"


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceScatter(ParallelOp):
    """Reduce partial sums over `axes` and split dim `dim` over them: reduce-scatter."""

    dim: int = 0
    kind = "reduce_scatter"
    collective = "reduce-scatter"

    def apply(self, s: Sharding) -> Sharding:
        r = Reduce(self.axes).apply(s)
        return Partition(self.axes, self.dim).apply(r)

    def short(self) -> str:
        return f"reduce_scatter[{self.dim},{'+'.join(self.axes)}]"


@dataclasses.dataclass(frozen=True, slots=True)
class AllToAll(ParallelOp):
    """Move the split over `axes` from dim `src` to dim `dst`: all-to-all."""

    src: int = 0
    dst: int = 1
    kind = "all_to_all"
    collective = "all-to-all"

    def apply(self, s: Sharding) -> Sharding:
        if self.src == self.dst:
            raise ShardingError(f"{self}: source and target dim are the same")
        mid = Combine(self.axes, self.src).apply(s)
        return Partition(self.axes, self.dst).apply(mid)

    def short(self) -> str:
        return f"all_to_all[{self.src},{self.dst},{'+'.join(self.axes)}]"


@dataclasses.dataclass(frozen=True, slots=True)
class CollectivePermute(ParallelOp):
    """Dim `dim` split minor-most over `src_axes` becomes split over `dst_axes` (the same devices, the
    same degree): each device sends its slice to the device that needs it. `axes` is the union of both,
    in the order the permutation is expressed."""

    dim: int = 0
    src_axes: Axes = ()
    dst_axes: Axes = ()
    kind = "permute"
    collective = "collective-permute"

    def apply(self, s: Sharding) -> Sharding:
        mid = _drop_minor(s, self.dim, self.src_axes, str(self))
        rest = tuple(a for a in self.dst_axes if a not in self.src_axes)
        _free(mid, rest, str(self))
        return _with_dim(mid, self.dim, mid.dims[self.dim] + self.dst_axes)

    @classmethod
    def of(cls, dim: int, src_axes: Axes, dst_axes: Axes) -> "CollectivePermute":
        union = tuple(src_axes) + tuple(a for a in dst_axes if a not in src_axes)
        return cls(union, dim, tuple(src_axes), tuple(dst_axes))

    def short(self) -> str:
        return f"permute[{self.dim},{'+'.join(self.src_axes)}->{'+'.join(self.dst_axes)}]"

    def source_of(self, mesh: Mapping[str, int]) -> dict[tuple[int, ...], tuple[int, ...]]:
        """For each device (coordinates over `axes`), the device whose slice it needs."""
        sizes = [mesh[a] for a in self.axes]
        idx = {a: i for i, a in enumerate(self.axes)}
        src_only = [a for a in self.axes if a not in self.src_axes]
        dst_only = [a for a in self.axes if a not in self.dst_axes]
        out = {}
        for c in _coords(sizes):
            want = _linear([c[idx[a]] for a in self.dst_axes], [mesh[a] for a in self.dst_axes])
            src = [0] * len(sizes)
            for a, v in zip(self.src_axes, _delinear(want, [mesh[a] for a in self.src_axes])):
                src[idx[a]] = v
            rest = _linear([c[idx[a]] for a in dst_only], [mesh[a] for a in dst_only])
            for a, v in zip(src_only, _delinear(rest, [mesh[a] for a in src_only])):
                src[idx[a]] = v
            out[tuple(c)] = tuple(src)
        return out


def _coords(sizes: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for n in sizes:
        out = [c + [i] for c in out for i in range(n)]
    return out


def _linear(coords: Sequence[int], sizes: Sequence[int]) -> int:
    v = 0
    for c, n in zip(coords, sizes):
        v = v * n + c
    return v


def _delinear(v: int, sizes: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(sizes):
        out.append(v % n)
        v //= n
    return out[::-1]


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceScatterDims(ParallelOp):
    """Reduce partial sums over `axes` and split several dims by them at once: axis `axes[i]` joins dim
    `dims[i]` (minor-most, in the listed order). One reduce-scatter, as XLA does it when the reduced axes
    end up on different dims (a `ReduceScatter` splits one dim)."""

    dims: tuple[int, ...] = ()
    kind = "reduce_scatter_dims"
    collective = "reduce-scatter"

    def apply(self, s: Sharding) -> Sharding:
        if len(self.dims) != len(self.axes):
            raise ShardingError(f"{self}: one dim per axis")
        out = Reduce(tuple(self.axes)).apply(s)
        for a, d in zip(self.axes, self.dims):
            out = Partition((a,), d).apply(out)
        return out

    def short(self) -> str:
        return f"reduce_scatter[{','.join(f'{a}->{d}' for a, d in zip(self.axes, self.dims))}]"


@dataclasses.dataclass(frozen=True, slots=True)
class Shuffle(ParallelOp):
    """Layout `src` (dims only) becomes `dst` by one collective-permute: every device's piece under `dst`
    lies inside some device's piece under `src` (each dim split at least as finely, a multiple of the
    source's degree), so each device slices from its piece the part one other device needs and sends it
    there (XLA's `ReshardWithCollectivePermute`, after a local slice when the target is finer). `axes`:
    every mesh axis (mesh order), so that devices are numbered as XLA numbers them."""

    src: tuple[Axes, ...] = ()
    dst: tuple[Axes, ...] = ()
    kind = "shuffle"
    collective = "collective-permute"

    def apply(self, s: Sharding) -> Sharding:
        if s.partial or s.dims != self.src:
            raise ShardingError(f"{self}: expects {Sharding(self.src)}, got {s}")
        return Sharding(self.dst)

    def short(self) -> str:
        return f"shuffle[{Sharding(self.src)}->{Sharding(self.dst)}]"

    def sources(self, mesh: Mapping[str, int], shape: Sequence[int]) -> dict[int, int] | None:
        """For each device (linear index over `axes`, major to minor), the device whose `src` piece holds its
        `dst` piece: XLA's pairs when XLA does this change as one collective-permute
        (`shardc.cost.reshard.permute_pairs`), else a bijection that keeps as many devices on their own
        piece as possible; None when there is none (a piece of `dst` lies in no piece of `src`)."""
        from shardc.cost.reshard import permute_pairs

        sizes = tuple(mesh[a] for a in self.axes)
        if [a for a in mesh if mesh[a] > 1] == [a for a in self.axes if mesh[a] > 1]:
            pairs = permute_pairs(Sharding(self.src), Sharding(self.dst), shape, mesh)
            if pairs is not None:
                return {t: f for f, t in pairs}
        return _shuffle_sources(self.src, self.dst, self.axes, sizes)

    def pair_axes(self, mesh: Mapping[str, int], shape: Sequence[int]) -> Axes:
        """The mesh axes along which a device and the device it receives from differ (what XLA reports
        as the collective-permute's axes)."""
        sizes = [mesh[a] for a in self.axes]
        varying: set[str] = set()
        for j, i in (self.sources(mesh, shape) or {}).items():
            cj, ci = _delinear(j, sizes), _delinear(i, sizes)
            varying.update(a for a, x, y in zip(self.axes, cj, ci) if x != y)
        return tuple(a for a in self.axes if a in varying)

    def offsets(self, mesh: Mapping[str, int], shape: Sequence[int]) -> dict[int, tuple[int, ...]]:
        """For each sending device, where in its local `src` piece (per dim) the piece it sends starts."""
        srcs = self.sources(mesh, shape) or {}
        sizes = [mesh[a] for a in self.axes]
        out = {}
        for j, i in srcs.items():
            cj = dict(zip(self.axes, _delinear(j, sizes)))
            starts = []
            for d, n in enumerate(shape):
                ks, kd = group_size(self.src[d], mesh), group_size(self.dst[d], mesh)
                starts.append((_index(cj, self.dst[d], mesh) % (kd // ks)) * (n // kd))
            out[i] = tuple(starts)
        return out


def _index(coords: Mapping[str, int], axes: Axes, mesh: Mapping[str, int]) -> int:
    """The piece index a device holds along a dim split over `axes` (major to minor)."""
    return _linear([coords[a] for a in axes], [mesh[a] for a in axes])


def _shuffle_sources(src: tuple[Axes, ...], dst: tuple[Axes, ...], axes: Axes, sizes: tuple[int, ...]
                     ) -> dict[int, int] | None:
    mesh = dict(zip(axes, sizes))
    n = math.prod(sizes)
    coords = [dict(zip(axes, _delinear(i, list(sizes)))) for i in range(n)]
    ratio = []
    for s, t in zip(src, dst):
        ks, kd = group_size(s, mesh), group_size(t, mesh)
        if kd % ks:
            return None
        ratio.append(kd // ks)

    def holds(i: int, j: int) -> bool:  # device i's src piece contains device j's dst piece
        return all(_index(coords[i], s, mesh) == _index(coords[j], t, mesh) // r for s, t, r in zip(src, dst, ratio))

    holders = [[i for i in range(n) if holds(i, j)] for j in range(n)]
    owner: dict[int, int] = {}  # source device -> receiver
    for j in range(n):  # devices that already hold their piece keep it
        if j in holders[j]:
            owner[j] = j

    def augment(j: int, seen: set[int]) -> bool:
        for i in holders[j]:
            if i in seen:
                continue
            seen.add(i)
            if i not in owner or augment(owner[i], seen):
                owner[i] = j
                return True
        return False

    for j in range(n):
        if owner.get(j) != j and not augment(j, set()):
            return None
    return {j: i for i, j in owner.items()}


PARALLEL_OPS = (Partition, Combine, Replicate, Reduce, ReduceScatter, AllToAll, CollectivePermute, Shuffle,
                ReduceScatterDims)


def collective_kind(op: ParallelOp) -> str:
    """The HLO collective an op lowers to ("slice"/"none" for the local ones)."""
    return op.collective


def comm_bytes(op: ParallelOp, in_local_bytes: int, mesh: Mapping[str, int]) -> float:
    """Bytes one device sends for `op` on an input of `in_local_bytes` per device (ring algorithms)."""
    n = group_size(op.axes, mesh)
    if n <= 1:
        return 0.0
    if isinstance(op, Reduce):
        return 2.0 * in_local_bytes * (n - 1) / n
    if isinstance(op, (ReduceScatter, ReduceScatterDims)):
        return in_local_bytes * (n - 1) / n
    if isinstance(op, Combine):
        return float(in_local_bytes * (n - 1))
    if isinstance(op, AllToAll):
        return in_local_bytes * (n - 1) / n
    if isinstance(op, (CollectivePermute, Shuffle)):
        return float(in_local_bytes) if isinstance(op, CollectivePermute) else float(in_local_bytes) / _ratio(op, mesh)
    return 0.0


def _ratio(op: Shuffle, mesh: Mapping[str, int]) -> int:
    """How many times smaller a device's piece is under `dst` than under `src`."""
    return math.prod(group_size(t, mesh) // group_size(s, mesh) for s, t in zip(op.src, op.dst))
