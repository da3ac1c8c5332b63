"""The collectives XLA's SPMD partitioner emits for one change of sharding, and whether it does it by
"involuntary full rematerialization".

`reshard_collectives(src, dst, shape, itemsize, mesh)` gives each collective's kind, the mesh axes its
groups span and its payload per device (as `shardc.cost.hlo` reads them from compiled programs).
`is_involuntary_remat(src, dst, shape, mesh)` says whether XLA logs "[SPMD] Involuntary full
rematerialization" for the reshard: it all-gathers the whole value on every device and slices it, which
`shardc.check` fails; the planner can avoid such reshards or price them (their all-gathers are among the
collectives).

The model replays, on small tuples, what `PartitionedHlo::ReshardNoCache` (xla/service/spmd/
spmd_partitioner.cc) and the routines it calls do in jaxlib 0.10.2. A sharding becomes XLA's HloSharding:
a tile count per dim, a trailing replication count for the unused axes (`last_tile_dim_replicate`), and the
device of every tile (jax lays a NamedSharding's axes out major to minor, the unused ones last in mesh
order). Device order matters: two shardings with the same tile counts but other devices are a
collective-permute apart. Then, in XLA's order of preference:

1. same tile counts, other devices: one collective-permute (`ReshardWithCollectivePermute`);
2. tile counts that are a permutation of each other: all-to-alls, one per pair of dims that swap counts,
   or one for several pairs (`GetReshardAllToAllSourceTargetDims`, `ReshardWithAllToAll`,
   `TryMultipleSourceTargetDims`), then a collective-permute when the devices still differ;
3. from a partially replicated source: local slices where each dim's count divides the target's, and a
   collective-permute when the slices sit on other devices (`ReshardFromPartialReplicateWithDynamicSlice`);
   to a partially replicated target: a collective-permute to a compatible device order, then one all-gather
   per coarsened dim (`ReshardToPartialReplicateWithAllGather`); [a, b] <-> [1, a, b(replicated)] by an
   all-to-all (`ReshardPartialReplicateWithAllToAll`);
4. `TryComplexReshardHandling`: split a dim whose count changes by a factor and reshard in the split shape
   (so an axis can move by an all-to-all and the rest follow by a slice or a permute), replicate one dim
   first, or split a dim over the replicated devices first;
5. dims split alike in source and target: reshard inside the device groups they define
   (`GroupShardingOnDims`, `AlignGroupsWith`), then from the regrouped result to the target;
6. otherwise full replication, one all-gather per split dim, last dim first (`Replicate`,
   `AllGatherShards`), then local slices: the involuntary full rematerialization.

Steps 3 to 5 recurse. An attempt XLA abandons leaves no collectives (its dead code is removed), but a
warning it logged on the way counts. A value that is a broadcast along some dims (`bcast`: XLA's
SpmdBuilder tracks them through broadcasts, elementwise ops, reshapes, transposes, slices and pads) needs no
collective-permute whose source and target differ only along them: XLA copies instead; local slices and
copies keep the value a broadcast, a collective's result is not one (`kept_broadcast`). Partial sums are reduced first: an all-reduce over the partial axes of
the source's shards, or, on backends with one (`reduce_scatter=True`), a reduce-scatter when every partial
axis becomes a new split of the result and nothing else moves (XLA:CPU all-reduces, then slices).

Checked against compiled programs on every (src, dst) pair of the 2x4 and 2x2x2 meshes for 2-D and 3-D
shapes, on partial-sum sources and on samples of 4-D shapes (`bench/reshard_probe.py`,
`tests/cost/test_reshard_exhaustive.py`): the same collectives kind by kind, byte for byte and axis by
axis, and the same rematerialization flag.
Shapes are assumed to divide evenly by their shardings (shardc plans no other): XLA's padding, halo
exchanges and the all-reduce it uses to replicate tiny dims are not modelled (shards are rounded up).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, Iterable, Mapping, Sequence

from shardc.cost.collectives import Collective
from shardc.cost.hlo import even_spacing
from shardc.sharding import Sharding

__all__ = ["reshard_collectives", "is_involuntary_remat", "crashes_xla", "kept_broadcast", "permute_pairs",
           "cached_intermediate"]

Dims = tuple[tuple[str, ...], ...]
Mesh = tuple[tuple[str, int], ...]
Devices = tuple[int, ...]


# ---------------------------------------------------------------------------------------------------------
# Tile assignments: XLA's HloSharding of one array, on tuples
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Tiling:
    """An HloSharding: the tile count of each dim (the last one the replication count when `rep`, XLA's
    `last_tile_dim_replicate`) and the device of each tile, row-major. `dims == ()` is the replicated sharding."""

    dims: tuple[int, ...]
    devices: Devices
    rep: bool = False

    @property
    def replicated(self) -> bool:
        return not self.dims

    @property
    def data(self) -> tuple[int, ...]:
        """Tile counts of the array's dims (the replication count left out)."""
        return self.dims[:-1] if self.rep else self.dims

    def tiles(self) -> int:
        return math.prod(self.data)


REPLICATED = _Tiling((), ())


def _strides(dims: Sequence[int]) -> list[int]:
    out = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        out[i] = out[i + 1] * dims[i + 1]
    return out


@functools.lru_cache(maxsize=4096)
def _indices(dims: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every index of an array of shape `dims`, row-major."""
    return tuple(itertools.product(*(range(n) for n in dims)))


@functools.lru_cache(maxsize=4096)
def _source_positions(dims: tuple[int, ...], perm: tuple[int, ...]) -> tuple[int, ...]:
    """For each row-major position of the transposed array, the position it comes from."""
    st = _strides(dims)
    pst = [st[p] for p in perm]
    return tuple(sum(i * s for i, s in zip(idx, pst)) for idx in _indices(tuple(dims[p] for p in perm)))


def _transpose(dims: Sequence[int], devices: Devices, perm: Sequence[int]) -> tuple[tuple[int, ...], Devices]:
    """TileAssignment::Transpose of a row-major array."""
    new = tuple(dims[p] for p in perm)
    if list(perm) == sorted(perm):
        return new, devices
    return new, _permuted(tuple(devices), _source_positions(tuple(dims), tuple(perm)))


@functools.lru_cache(maxsize=1 << 14)
def _permuted(devices: Devices, positions: tuple[int, ...]) -> Devices:
    return tuple(devices[i] for i in positions)


def _tile(dims: Sequence[int], devices: Devices) -> _Tiling:
    """HloSharding::Tile."""
    return _Tiling(tuple(dims), tuple(devices))


def _partial_tile(dims: Sequence[int], devices: Devices) -> _Tiling:
    """HloSharding::PartialTile: replicated when the last dim holds every device, tiled when it is 1, else the
    devices of each replication group sorted (XLA's canonical form)."""
    n = len(devices)
    if len(dims) == 1 or dims[-1] == n:
        return REPLICATED
    if dims[-1] == 1:
        return _tile(dims[:-1], devices)
    g = dims[-1]
    return _Tiling(tuple(dims), tuple(d for k in range(0, n, g) for d in sorted(devices[k:k + g])), True)


def _like(s: _Tiling, dims: Sequence[int], devices: Devices) -> _Tiling:
    """A sharding of the same kind as `s` (partially replicated or not) with this tile assignment."""
    return _partial_tile(dims, devices) if s.rep else _tile(dims, devices)


@functools.lru_cache(maxsize=4096)
def _from_dims(dims: Dims, mesh: Mesh) -> _Tiling:
    """The HloSharding jax gives a NamedSharding: mesh devices transposed to the dims' axes (major to minor),
    then the unused axes in mesh order as the replication dim."""
    names = [a for a, _ in mesh]
    sizes = dict(mesh)
    used = [a for d in dims for a in d]
    order = used + [a for a in names if a not in used]
    n = math.prod(sizes.values())
    _, devices = _transpose([sizes[a] for a in names], tuple(range(n)), [names.index(a) for a in order])
    tiles = tuple(math.prod(sizes[a] for a in d) for d in dims)
    return _partial_tile(tiles + (n // math.prod(tiles),), devices)


def _can_permute(s: _Tiling, t: _Tiling) -> bool:
    """CanReshardWithCollectivePermute: same tile counts, other devices."""
    return not s.replicated and not t.replicated and s.dims == t.dims and s.rep == t.rep and s.devices != t.devices


def _within(sub: _Tiling, sup: _Tiling, shape: Sequence[int]) -> bool:
    """IsSubTilingOrEqualSharding: every device's tile under `sub` lies inside its tile under `sup`."""
    return _within_cached(sub, sup, tuple(shape))


@functools.lru_cache(maxsize=1 << 14)
def _within_cached(sub: _Tiling, sup: _Tiling, shape: tuple[int, ...]) -> bool:
    if sup.replicated:
        return True
    rank = len(sup.data)
    if sub.replicated or len(sub.data) != rank:
        return False
    where = {dev: idx for idx, dev in zip(_indices(sup.dims), sup.devices)}
    for idx, dev in zip(_indices(sub.dims), sub.devices):
        outer = where[dev]
        for d in range(rank):
            a, b, n = sub.dims[d], sup.dims[d], shape[d]
            if a < b:
                return False
            lo, hi = -(-n // a), -(-n // b)  # tile sizes
            start = idx[d] * lo
            if start < outer[d] * hi or (start + lo <= n and start + lo > (outer[d] + 1) * hi):
                return False
    return True


def _compatible(p: _Tiling, t: _Tiling) -> _Tiling | None:
    """PartialReplicateReshardCompatibleSharding: `t`'s tile counts with devices from `p`'s replication groups,
    so that `p` reaches it by local slices (each dim's new tiles are the minor part, taken from the
    replication dim major first); `t` itself when it already is a sub-tiling of `p`."""
    if not p.rep or t.replicated:
        return None
    rank = len(p.data)
    if len(t.data) != rank:
        return None
    expand: dict[int, int] = {}
    for d in range(rank):
        if t.dims[d] % p.dims[d]:
            return None
        if t.dims[d] > p.dims[d]:
            expand[d] = t.dims[d] // p.dims[d]
    if _within(t, p, t.data):
        return t
    reshape = list(p.dims[:rank]) + list(expand.values()) + ([t.dims[-1]] if t.rep else [])
    slot = {d: rank + i for i, d in enumerate(expand)}
    perm = [x for d in range(rank) for x in ((d, slot[d]) if d in slot else (d,))]
    perm += [len(reshape) - 1] if t.rep else []
    _, devices = _transpose(reshape, p.devices, perm)
    return _like(t, t.dims, devices)


def _all_to_all_dims(s: _Tiling, t: _Tiling) -> list[tuple[int, int]] | None:
    """GetReshardAllToAllSourceTargetDims: (source dim, target dim) pairs, each swapping two dims' tile
    counts, that take `s`'s counts to `t`'s; None when the counts are not a permutation of each other."""
    if s.replicated or t.replicated or len(s.dims) != len(t.dims) or s.tiles() != t.tiles():
        return None
    src: dict[int, list[int]] = {}
    tgt: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(zip(s.dims, t.dims)):
        if a != b:
            src.setdefault(a, []).append(i)
            tgt.setdefault(b, []).append(i)
    if not src or len(src) != len(tgt) or any(len(tgt.get(k, ())) != len(v) for k, v in src.items()):
        return None

    def remove(size: int, dim: int, table: dict[int, list[int]]) -> None:
        table[size] = [x for x in table.get(size, ()) if x != dim]
        if not table[size]:
            del table[size]

    result = []
    while src:
        small = min(src)
        i = src[small][-1]
        need = t.dims[i]
        if need == small:
            remove(small, i, src)
            remove(small, i, tgt)
            continue
        cands = src.get(need)
        if not cands:
            return None
        if small != 1 and need % small:
            return None
        prefer = (lambda j: t.dims[j] != 1) if small == 1 else (lambda j: t.dims[j] == small)
        j = next((c for c in cands if prefer(c)), cands[-1])
        result.append((j, i))
        remove(need, i, tgt)
        src[small][-1] = j
        remove(need, j, src)
    return result


def _all_to_all_tiling(s: _Tiling, sources: Sequence[int], targets: Sequence[int]) -> _Tiling:
    """GetAllToAllSharding: for each pair, the minor part of the source dim (its count over the target's)
    becomes the minor part of the target dim."""
    dims, devices = s.dims, s.devices
    for sd, td in zip(sources, targets):
        a, b = dims[sd], dims[td]
        shape1: list[int] = []
        for k, n in enumerate(dims):
            if k == sd:
                shape1 += [b, a // b]
                added_src = len(shape1) - 1
            elif k == td:
                shape1 += [n, 1]
                added_tgt = len(shape1) - 1
            else:
                shape1.append(n)
        perm = list(range(len(shape1)))
        perm[added_src], perm[added_tgt] = perm[added_tgt], perm[added_src]
        _, devices = _transpose(shape1, devices, perm)
        swapped = list(dims)
        swapped[sd], swapped[td] = swapped[td], swapped[sd]
        dims = tuple(swapped)
    return _like(s, dims, devices)


def _split_dim(s: _Tiling, dim: int, size: int) -> _Tiling:
    """SplitShardingDimension: dim `dim`'s tiles as (size, rest), major to minor."""
    dims = list(s.dims)
    dims[dim:dim + 1] = [size, dims[dim] // size]
    return _like(s, dims, s.devices)


def _merge_dim(s: _Tiling, dim: int) -> _Tiling:
    """MergeShardingDimension: dims `dim` and `dim + 1` as one."""
    dims = list(s.dims)
    dims[dim:dim + 2] = [dims[dim] * dims[dim + 1]]
    return _like(s, dims, s.devices)


def _replicate_dims(s: _Tiling, dims: Sequence[int]) -> _Tiling:
    """PartiallyReplicateTiledShardingOnDims: `dims` unsplit, their devices joining the replication dim
    (as its major part)."""
    if s.replicated:
        return s
    rank = len(s.data)
    dims = [d for d in dims if d < rank]
    count = math.prod(s.dims[d] for d in dims)
    if count == 1:
        return s
    if count == s.tiles():
        return REPLICATED
    perm = sorted(range(rank), key=lambda d: d in dims) + list(range(rank, len(s.dims)))
    _, devices = _transpose(s.dims, s.devices, perm)
    new = [1 if d in dims else n for d, n in enumerate(s.dims)]
    if s.rep:
        new[-1] *= count
    else:
        new.append(count)
    return _partial_tile(new, devices)


def _replication_groups(s: _Tiling, dims: Sequence[int]) -> tuple[Devices, ...]:
    """GetPartitionGroupsForReplication: devices that differ only in their tile index along `dims`."""
    return _replication_groups_cached(s, tuple(dims))


@functools.lru_cache(maxsize=1 << 14)
def _replication_groups_cached(s: _Tiling, dims: tuple[int, ...]) -> tuple[Devices, ...]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for idx, dev in zip(_indices(s.dims), s.devices):
        groups.setdefault(tuple(i for d, i in enumerate(idx) if d not in dims), []).append(dev)
    return tuple(tuple(g) for g in groups.values())


def _groups_across(s: _Tiling, dims: Sequence[int], sizes: Sequence[int]) -> tuple[Devices, ...]:
    """GetPartitionGroupsAcrossTargetDims: devices that differ only in the minor `sizes[i]` part of each
    `dims[i]` (the part an all-to-all moved there)."""
    return _groups_across_cached(s, tuple(dims), tuple(sizes))


@functools.lru_cache(maxsize=1 << 14)
def _groups_across_cached(s: _Tiling, dims: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[Devices, ...]:
    part = dict(zip(dims, sizes))
    groups: dict[tuple[int, ...], list[int]] = {}
    for idx, dev in zip(_indices(s.dims), s.devices):
        groups.setdefault(tuple(i // part[d] if d in part else i for d, i in enumerate(idx)), []).append(dev)
    return tuple(tuple(g) for g in groups.values())


# ---------------------------------------------------------------------------------------------------------
# Grouped shardings (hlo_sharding_util::GroupShardingOnDims / UngroupSharding / AlignGroupsWith)
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Grouped:
    """A sharding split into device groups (along the major part of some dims) and the sharding inside a
    group, over in-group ids."""

    device_groups: tuple[Devices, ...]
    group_dims: tuple[int, ...]
    group_sizes: tuple[int, ...]
    data_rank: int
    tiling: _Tiling


def _group(s: _Tiling, group_dims: Sequence[int], shards: Sequence[int] | None = None) -> _Grouped:
    """GroupShardingOnDims: each of `group_dims` split as (groups, shards) major to minor; the group parts
    index the device groups, the rest is the in-group sharding (an iota over in-group ids)."""
    shards = list(shards) if shards is not None else [1] * len(group_dims)
    split = [(1, n) for n in s.dims]
    sizes = []
    for g, sh in zip(group_dims, shards):
        sizes.append(s.dims[g] // sh)
        split[g] = (s.dims[g] // sh, sh)
    inner = [sh for _, sh in split]
    reshape = list(inner)
    at = {}
    for i, g in enumerate(sorted(group_dims)):
        at[g] = g + i
        reshape.insert(g + i, split[g][0])
    perm = list(range(len(reshape)))
    for i, g in enumerate(group_dims):
        perm.remove(at[g])
        perm.insert(i, at[g])
    _, arr = _transpose(reshape, s.devices, perm)
    size = len(arr) // math.prod(sizes)
    device_groups = tuple(arr[k:k + size] for k in range(0, len(arr), size))
    if math.prod(inner) == 1 or (s.rep and math.prod(inner) == inner[-1]):
        tiling = REPLICATED
    else:
        if s.rep and inner[-1] == 1:
            inner.pop()
        iota = tuple(range(math.prod(inner)))
        tiling = _partial_tile(inner, iota) if s.rep and len(inner) == len(s.dims) else _tile(inner, iota)
    return _Grouped(device_groups, tuple(group_dims), tuple(sizes), len(s.data), tiling)


def _ungroup(g: _Grouped) -> _Tiling:
    """UngroupSharding: the sharding over all devices that a grouped one stands for."""
    inner = g.tiling
    group_size = len(g.device_groups[0])
    if inner.replicated:
        tiling_dims = [1] * g.data_rank
        rep = group_size != 1 or g.data_rank in g.group_dims
        if rep:
            tiling_dims.append(group_size)
        order: Devices = tuple(range(math.prod(tiling_dims)))
    else:
        rep, tiling_dims, order = inner.rep, list(inner.dims), inner.devices
        if len(tiling_dims) in g.group_dims:
            tiling_dims.append(1)
            rep = True
    values = [grp[x] for grp in g.device_groups for x in order] if len(order) == group_size else \
        [x for grp in g.device_groups for x in grp]
    at = {d: d + i for i, d in enumerate(sorted(g.group_dims))}
    perm = [-1] * (len(tiling_dims) + len(g.group_dims))
    for i, d in enumerate(g.group_dims):
        perm[at[d]] = i
    rest = iter(range(len(g.group_dims), len(perm)))
    perm = [p if p >= 0 else next(rest) for p in perm]
    _, devices = _transpose(list(g.group_sizes) + tiling_dims, tuple(values), perm)
    for d, n in zip(g.group_dims, g.group_sizes):
        tiling_dims[d] *= n
    return _partial_tile(tiling_dims, devices) if rep else _tile(tiling_dims, devices)


def _align(g: _Grouped, ref: _Grouped) -> _Grouped:
    """AlignGroupsWith: `g` over `ref`'s device groups; when each of `g`'s groups is the same-numbered group of
    `ref`, its in-group sharding is renumbered to `ref`'s in-group ids (otherwise it is kept as is)."""
    if g.device_groups == ref.device_groups:
        return g
    owner = {d: k for k, grp in enumerate(ref.device_groups) for d in grp}
    matching = all({owner[d] for d in grp} == {k} for k, grp in enumerate(g.device_groups))
    tiling = g.tiling
    if matching and not tiling.replicated:
        pos = {d: i for i, d in enumerate(ref.device_groups[0])}
        perm = [pos[d] for d in g.device_groups[0]]
        tiling = _like(tiling, tiling.dims, tuple(perm[x] for x in tiling.devices))
    return dataclasses.replace(g, device_groups=ref.device_groups, tiling=tiling)


# ---------------------------------------------------------------------------------------------------------
# The partitioner: PartitionedHlo::ReshardNoCache and the routines it calls
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class _Value:
    """A PartitionedHlo: its sharding, its base (unsharded) shape, and the global device of each in-group id
    for each device group it is partitioned within (one group of every device at the top level)."""

    tiling: _Tiling
    shape: tuple[int, ...]
    groups: tuple[Devices, ...]
    bcast: frozenset[int] = frozenset()  # dims along which the instruction is a broadcast (SpmdBuilder's)

    def local(self) -> list[int]:
        if self.tiling.replicated:
            return list(self.shape)
        return [-(-n // k) for n, k in zip(self.shape, self.tiling.dims)]

    def elements(self) -> int:
        return math.prod(self.local())

    def at(self, tiling: _Tiling, keep: bool = True) -> "_Value":
        """The value in another sharding: a local slice or a copy (`keep`: it stays a broadcast along the
        same dims) or a collective's result (it does not)."""
        return _Value(tiling, self.shape, self.groups, self.bcast if keep else frozenset())


def _expand(groups: tuple[Devices, ...], inner: Sequence[Devices]) -> tuple[Devices, ...]:
    """Device groups inside device groups, in global ids."""
    return _expand_cached(groups, inner if type(inner) is tuple else tuple(tuple(dg) for dg in inner))


@functools.lru_cache(maxsize=1 << 14)
def _expand_cached(groups: tuple[Devices, ...], inner: tuple[Devices, ...]) -> tuple[Devices, ...]:
    return tuple(tuple(g[x] for x in dg) for g in groups for dg in inner)


# One collective: kind, mesh axes its groups span, group size when not the product of the axes' sizes, the
# spacing of a partial group's devices along its axis (`Collective.stride`), elements per device.
_Emitted = tuple[str, tuple[str, ...], int | None, int, int]


@functools.lru_cache(maxsize=1 << 14)
def _span(groups: tuple[Devices, ...], permute: bool, mesh: Mesh) -> tuple[tuple[str, ...], int | None, int]:
    """The mesh axes along which the devices of some group differ, the group size when it is not the product of
    their sizes (a collective-permute's is 2, as `shardc.cost.hlo` counts it), and for a group of part of one
    axis whose devices are evenly spaced along it, that spacing (`Collective.stride`; else 1)."""
    coords = _indices(tuple(n for _, n in mesh))
    varying: set[int] = set()
    for grp in groups:
        first = coords[grp[0]]
        for d in grp[1:]:
            varying.update(k for k, (a, b) in enumerate(zip(first, coords[d])) if a != b)
    axes = tuple(mesh[k][0] for k in sorted(varying))
    if permute:
        return axes, 2, 1
    size = len(groups[0])
    if size == math.prod(mesh[k][1] for k in varying):
        return axes, None, 1
    return axes, size, _stride(groups, coords, varying)


def _stride(groups: tuple[Devices, ...], coords: Sequence[tuple[int, ...]], varying: set[int]) -> int:
    """The spacing of the groups' devices along the one axis they differ on (XLA's all-gather among every 4th device
    of an axis: 4; `even_spacing`); 1 when they differ on several."""
    if len(varying) != 1:
        return 1
    (k,) = varying
    return even_spacing([coords[d][k] for d in grp] for grp in groups)


class _Partitioner:
    """Replays XLA's reshard of one value and records the collectives it creates (those of an attempt XLA
    abandons are dropped, as its dead-code elimination drops them) and whether it logged an involuntary
    full rematerialization."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.out: list[_Emitted] = []
        self.pairs: list[tuple[tuple[int, int], ...]] = []  # each collective-permute's (source, target) devices
        self.remat = False
        self.crash = False  # XLA's partitioner would divide by zero (`all_to_all`) and kill the process
        self.depth = 0  # nested ReshardNoCache calls
        # The first layout the value itself is taken to through PartitionedHlo::Reshard (cached per
        # instruction and layout) on the way, where XLA's reshard of it does so (`cached_intermediate`).
        self.cached: _Tiling | None = None

    def cache_point(self, inter: _Tiling) -> None:
        """XLA reshards the value (not a reshaped or grouped view of it) to `inter` with its cached Reshard."""
        if self.depth == 1 and self.cached is None:
            self.cached = inter

    # -- emitting ------------------------------------------------------------------------------------
    def emit(self, kind: str, v: _Value, in_group: tuple[Devices, ...], elements: int) -> None:
        groups = _expand(v.groups, in_group)
        axes, group, stride = _span(groups, kind == "collective-permute", self.mesh)
        self.out.append((kind, axes, group, elements, stride))
        if kind == "collective-permute":
            self.pairs.append(tuple((a, b) for a, b in groups))

    def attempt(self, fn: Callable[[_Value, _Tiling], _Value | None], v: _Value, t: _Tiling) -> _Value | None:
        """Run one of XLA's optional strategies; drop what it emitted if it gives up."""
        mark = len(self.out)
        pmark = len(self.pairs)
        cached = self.cached
        r = fn(v, t)
        if r is None:
            del self.out[mark:]
            del self.pairs[pmark:]
            self.cached = cached
        return r

    # -- ReshardNoCache ------------------------------------------------------------------------------
    def reshard(self, v: _Value, target: _Tiling, allow_full: bool = True) -> _Value:
        """PartitionedHlo::ReshardNoCache. With `allow_full=False` it returns `v` unchanged where XLA would
        replicate."""
        self.depth += 1
        try:
            return self._reshard(v, target, allow_full)
        finally:
            self.depth -= 1

    def _reshard(self, v: _Value, target: _Tiling, allow_full: bool) -> _Value:
        s = v.tiling
        if s == target:
            return v
        if _can_permute(s, target):
            return self.permute(v, target)
        pairs = _all_to_all_dims(s, target)
        if pairs:
            return self.all_to_all(v, target, pairs)
        tries = []
        if not target.replicated and s.rep:
            tries += [self.from_partial_by_slice, self.partial_by_all_to_all]
        if not s.replicated and target.rep:
            tries += [self.to_partial_by_all_gather, self.partial_by_all_to_all]
        for fn in tries:
            r = self.attempt(fn, v, target)
            if r is not None:
                return r
        if s.replicated:
            return v.at(target)  # a local slice
        if not target.replicated:
            r = self.attempt(self.complex, v, target)
            if r is not None:
                return r
            equal = [d for d in range(len(v.shape)) if s.dims[d] != 1 and target.dims[d] == s.dims[d]]
            if equal:
                return self.grouped(v, target, equal)
            if not allow_full:
                return v
            self.remat = True  # "[SPMD] Involuntary full rematerialization"
        return self.reshard(self.replicate(v), target)

    def permute(self, v: _Value, target: _Tiling) -> _Value:
        """ReshardWithCollectivePermute: each tile moves from its device under `v` to its device under target
        — unless the value is a broadcast along the dims on which the two differ: then every device already
        holds its target tile, and XLA copies it."""
        if v.bcast:
            dims = sorted(v.bcast)
            if _replicate_dims(v.tiling, dims) == _replicate_dims(target, dims):
                return v.at(target)
        self.emit("collective-permute", v, tuple(zip(v.tiling.devices, target.devices)), v.elements())
        return v.at(target, keep=False)

    def all_to_all(self, v: _Value, target: _Tiling, pairs: Sequence[tuple[int, int]],
                   multiple: bool = True) -> _Value:
        """ReshardWithAllToAll: one all-to-all per (source dim, target dim) pair, or one for several pairs
        (TryMultipleSourceTargetDims), then a collective-permute if the device order still differs."""
        if v.tiling == target:
            return v
        if not pairs:
            return self.permute(v, target)
        s = v.tiling
        if multiple:
            seen: set[int] = set()
            chosen, rest = [], []
            for sd, td in sorted(pairs, key=lambda p: p[1]):
                if seen.isdisjoint((sd, td)) and v.shape[sd] % s.dims[sd] == 0 and v.shape[td] % target.dims[td] == 0:
                    chosen.append((sd, td))
                    seen |= {sd, td}
                else:
                    rest.append((sd, td))
            # (the pairs are a sequence: a later one may only be valid after an earlier one, as in
            # [stage, data, -, -, model] -> [data, -, -, model, stage], where data's 2 tiles cannot take stage's 4
            # before stage moved. XLA does such a set at once, and its GetAllToAllSharding divides by the zero
            # that 2 // 4 makes: SIGFPE, the process dies (jax 0.10.2, 16 CPU devices; `crashes_xla`). The
            # replay goes on one pair at a time, and reshard paths never ask XLA for it.)
            divides = all(s.dims[sd] % s.dims[td] == 0 for sd, td in chosen)
            if len(chosen) >= 2 and not divides:
                self.crash = True
            if len(chosen) >= 2 and divides:
                sources, targets = [p[0] for p in chosen], [p[1] for p in chosen]
                temp = _all_to_all_tiling(s, sources, targets)
                sizes = [s.dims[sd] // s.dims[td] for sd, td in chosen]
                self.emit("all-to-all", v, _groups_across(temp, targets, sizes), v.elements())
                return self.all_to_all(v.at(temp, keep=False), target, rest, multiple=False)
        sd, td = pairs[0]
        temp = _all_to_all_tiling(s, [sd], [td])
        self.emit("all-to-all", v, _groups_across(temp, [td], [s.dims[sd] // s.dims[td]]), v.elements())
        return self.all_to_all(v.at(temp, keep=False), target, pairs[1:])

    def from_partial_by_slice(self, v: _Value, target: _Tiling) -> _Value | None:
        """ReshardFromPartialReplicateWithDynamicSlice: slice the replicated copies locally, then a
        collective-permute if the device order differs from the target's."""
        temp = _compatible(v.tiling, target)
        if temp is None:
            return None
        v = v.at(temp)
        return self.permute(v, target) if _can_permute(temp, target) else v

    def to_partial_by_all_gather(self, v: _Value, target: _Tiling) -> _Value | None:
        """ReshardToPartialReplicateWithAllGather: a collective-permute to a device order compatible with the
        target, then all-gathers of the dims the target splits less (last dim first)."""
        temp = _compatible(target, v.tiling)
        if temp is None:
            return None
        if _can_permute(v.tiling, temp):
            v = self.permute(v, temp)
        dims = [d for d in range(len(v.shape)) if temp.dims[d] > target.dims[d]]
        grouped = _group(temp, dims, [temp.dims[d] // target.dims[d] for d in dims])
        inner = _Value(grouped.tiling, v.shape, _expand(v.groups, grouped.device_groups))
        self.replicate_partial(inner, dims, v.local())
        return v.at(target, keep=not dims)

    def partial_by_all_to_all(self, v: _Value, target: _Tiling) -> _Value | None:
        """ReshardPartialReplicateWithAllToAll: [a, b] <-> [1, a, b(replicated)] through an all-to-all."""
        s = v.tiling
        from_partial = s.rep
        p, tile = (s, target) if from_partial else (target, s)
        if not p.rep or tile.rep or tile.replicated:
            return None
        if len(tile.dims) + 1 != len(p.dims) or p.dims[0] != 1:
            return None
        replicas = p.dims[-1]
        last = max((i for i, n in enumerate(tile.dims) if n > 1), default=-1)
        if last < 0 or tile.dims[last] != replicas or any(n != p.dims[i + 1] for i, n in enumerate(tile.dims)):
            return None
        if p.devices != tile.devices:
            return None
        tmp = _partial_tile([1 if i == last else n for i, n in enumerate(tile.dims)] + [replicas], tile.devices)
        if from_partial:
            pairs = _all_to_all_dims(s, tmp)
            return self.reshard(self.all_to_all(v, tmp, pairs), target) if pairs else None
        self.cache_point(tmp)
        w = self.reshard(v, tmp)
        pairs = _all_to_all_dims(w.tiling, target)
        return self.all_to_all(w, target, pairs) if pairs else None

    def complex(self, v: _Value, target: _Tiling) -> _Value | None:
        """TryComplexReshardHandling: split a dim whose tile count changes by a factor and reshard in the
        split shape; or replicate one dim first; or turn a partially replicated source into a tiled one."""
        s = v.tiling
        split = _merge_or_split(v.shape, s, target)
        if split is not None:
            split_s, split_t, i = split
            local = v.shape[i] // s.dims[i]
            minor = local * split_s.dims[i + 1]
            shape = v.shape[:i] + (v.shape[i] // minor, minor) + v.shape[i + 1:]
            r = self.reshard(_Value(split_s, shape, v.groups, _split_bcast(v.bcast, i)), split_t, allow_full=False)
            if r.tiling != split_t:
                return None
            merged = _Value(_merge_dim(r.tiling, i), v.shape, v.groups, _merge_bcast(r.bcast, i))
            if merged.tiling != target:
                merged = self.reshard(merged, target, allow_full=False)
            return merged if merged.tiling == target else None
        inter = _replicate_one_dim(s, target)
        if inter is not None:
            self.cache_point(inter)
            r = self.reshard(self.reshard(v, inter), target, allow_full=False)
            return r if r.tiling == target else None
        if s.rep and not target.rep:
            replicas = s.dims[-1]
            i = next((d for d, n in enumerate(target.dims) if n != s.dims[d] and s.dims[d] == 1
                      and n % replicas == 0), -1)
            if i < 0:
                return None
            perm = list(range(len(s.dims)))
            perm[i], perm[-1] = perm[-1], perm[i]
            inter = _like(s, *_transpose(s.dims, s.devices, perm))
            self.cache_point(inter)
            r = self.reshard(self.reshard(v, inter), target, allow_full=False)
            return r if r.tiling == target else None
        return None

    def grouped(self, v: _Value, target: _Tiling, equal: Sequence[int]) -> _Value:
        """ReshardNoCache's fallback for dims split alike in source and target: reshard inside the device
        groups those dims define, then from the ungrouped result to the target."""
        g = _group(v.tiling, equal)
        gt = _align(_group(target, equal), g)
        local = v.local()
        shape = tuple(local[d] if d in equal else n for d, n in enumerate(v.shape))
        r = self.reshard(_Value(g.tiling, shape, _expand(v.groups, g.device_groups), v.bcast), gt.tiling)
        return self.reshard(_Value(_ungroup(gt), v.shape, v.groups, r.bcast), target)

    def replicate(self, v: _Value) -> _Value:
        """PartitionedHlo::Replicate."""
        if v.tiling.replicated:
            return v
        self.replicate_partial(v, range(len(v.shape)))
        return v.at(REPLICATED, keep=False)

    def replicate_partial(self, v: _Value, dims: Iterable[int], local: list[int] | None = None) -> None:
        """ReplicatePartial / AllGatherShards: one all-gather per split dim, last dim first (`local`: the
        shard's shape when `v`'s sharding is an in-group one that does not give it)."""
        t = v.tiling
        local = v.local() if local is None else list(local)
        for d in reversed([d for d in dims if t.dims[d] > 1]):
            local[d] *= t.dims[d]
            self.emit("all-gather", v, _replication_groups(t, [d]), math.prod(local))


def _split_bcast(bcast: frozenset[int], i: int) -> frozenset[int]:
    """Broadcast dims after dim `i` is split in two (SetBroadcastDimsForReshape)."""
    return frozenset(x for d in bcast for x in ((d, d + 1) if d == i else (d if d < i else d + 1,)))


def _merge_bcast(bcast: frozenset[int], i: int) -> frozenset[int]:
    """Broadcast dims after dims `i` and `i + 1` are merged: the merged dim only if both were."""
    out = {d if d < i else d - 1 for d in bcast if d not in (i, i + 1)}
    if i in bcast and i + 1 in bcast:
        out.add(i)
    return frozenset(out)


def _merge_or_split(shape: Sequence[int], s: _Tiling, t: _Tiling) -> tuple[_Tiling, _Tiling, int] | None:
    """PatternMatchMergeOrSplitSharding: a dim whose tile count changes by a factor, split so that its major
    part stays (with a dim going between unsplit and split by the complementary factor, when one does)."""
    if s.replicated or t.replicated or len(s.data) != len(t.data) or s.rep != t.rep:
        return None
    if s.rep and s.dims[-1] != t.dims[-1]:
        return None
    ones, factors = [], []
    for i, (a, b) in enumerate(zip(s.data, t.data)):
        lo, hi = min(a, b), max(a, b)
        if a == b:
            continue
        if lo == 1:
            ones.append(i)
        elif hi % lo == 0 and -(-shape[i] // lo) * lo % hi == 0:
            factors.append(i)
    for i in factors:
        for j in ones:
            if s.dims[i] * s.dims[j] == t.dims[i] * t.dims[j]:
                size = min(s.dims[i], t.dims[i])
                return _split_dim(s, i, size), _split_dim(t, i, size), i
    for i in factors:
        if s.dims[i] > t.dims[i]:
            return _split_dim(s, i, t.dims[i]), _split_dim(t, i, t.dims[i]), i
    return None


def _replicate_one_dim(s: _Tiling, t: _Tiling) -> _Tiling | None:
    """PatternMatchPartiallyReplicateDim: the first split dim of `s` whose devices (with `s`'s replicas) are
    as many as `t`'s replicas, unsplit."""
    if not t.rep:
        return None
    replicas = s.dims[-1] if s.rep else 1
    for i, n in enumerate(s.data):
        if n != 1 and n * replicas == t.dims[-1]:
            return _replicate_dims(s, [i])
    return None


# ---------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1 << 16)
def _dims_reshard(src: Dims, dst: Dims, shape: tuple[int, ...], mesh: Mesh, bcast: frozenset[int] = frozenset()
                  ) -> tuple[tuple[_Emitted, ...], bool, frozenset[int], _Tiling | None, bool]:
    """The collectives (elements, not bytes) of XLA's reshard of dim shardings, whether it logs an
    involuntary full rematerialization, the dims along which the result is still a broadcast, the layout
    it first takes the value to through the cached Reshard (`_Partitioner.cached`), and whether XLA's
    partitioner would crash on it (`_Partitioner.crash`)."""
    p = _Partitioner(mesh)
    n = math.prod(size for _, size in mesh)
    r = p.reshard(_Value(_from_dims(src, mesh), shape, (tuple(range(n)),), bcast), _from_dims(dst, mesh))
    return tuple(p.out), p.remat, r.bcast, p.cached, p.crash


def cached_intermediate(src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mapping[str, int],
                        candidates: Iterable[Sharding]) -> Sharding | None:
    """The layout XLA takes the value to first, through its cached `PartitionedHlo::Reshard`, when it reshards
    it from `src` to `dst` (dims only) in two parts (TryComplexReshardHandling replicating one dim first or
    transposing the replication, ReshardPartialReplicateWithAllToAll from a tiled source): the first of
    `candidates` with that HloSharding, or None (no such part, or none of them is it). The cache is per
    instruction, so another reshard of the same value to that layout is not made again; the step that
    follows is XLA's own reshard from there."""
    if src.partial or dst.partial:
        return None
    key, mesh_key = _key(src, mesh)
    _, remat, _, tiling, _ = _dims_reshard(key, _key(dst, mesh)[0], tuple(int(n) for n in shape), mesh_key)
    if remat or tiling is None:
        return None
    return next((c for c in candidates if _from_dims(_key(c, mesh)[0], mesh_key) == tiling), None)


def _key(s: Sharding, mesh: Mapping[str, int]) -> tuple[Dims, Mesh]:
    return tuple(tuple(d) for d in s.dims), tuple(mesh.items())


def _ordered(axes: Iterable[str], mesh: Mapping[str, int]) -> tuple[str, ...]:
    order = list(mesh)
    return tuple(sorted(set(axes), key=order.index))


def _local(dims: Dims, shape: Sequence[int], mesh: Mapping[str, int]) -> int:
    return math.prod(-(-n // math.prod(mesh[a] for a in d)) for n, d in zip(shape, dims))


def _with_axes(cur: Dims, target: Dims, axes: frozenset[str]) -> Dims:
    """`cur` with each of `axes` appended to the dim where `target` has it."""
    return tuple(c + tuple(a for a in t if a in axes and a not in c) for c, t in zip(cur, target))


def _slices_only(cur: Dims, target: Dims) -> bool:
    return all(t[:len(c)] == c for c, t in zip(cur, target))


def reshard_collectives(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int,
                        mesh: Mapping[str, int], *, reduce_scatter: bool = True,
                        bcast: frozenset[int] = frozenset()) -> tuple[Collective, ...]:
    """Collectives (kind, mesh axes, payload bytes per device) that take a value from `src` to `dst`.

    `reduce_scatter=False` models backends that lower a reduce-scatter to an all-reduce followed by a
    local slice (XLA:CPU). `bcast`: the dims along which the value is a broadcast (`kept_broadcast`;
    `shardc.cost.program.broadcast_dims`): XLA's partitioner knows that a collective-permute that would
    only move data along them moves nothing, and copies instead."""
    out: list[Collective] = []
    cur, mesh_key = _key(src, mesh)
    target, _ = _key(dst, mesh)
    partial = frozenset(a for a in src.partial - dst.partial if mesh[a] > 1)  # (sums over one device are whole)
    if partial:
        payload = _local(cur, shape, mesh) * itemsize
        scatter = partial <= dst.axes() - src.axes() and _slices_only(_with_axes(cur, target, partial), target)
        if scatter and reduce_scatter:
            out.append(Collective("reduce-scatter", _ordered(partial, mesh), payload))
            cur = _with_axes(cur, target, partial)
        else:
            out.append(Collective("all-reduce", _ordered(partial, mesh), payload))
    emitted, *_ = _dims_reshard(cur, target, tuple(shape), mesh_key, frozenset() if partial else bcast)
    out.extend(Collective(kind, axes, n * itemsize, group, stride) for kind, axes, group, n, stride in emitted)
    return tuple(out)


def kept_broadcast(src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mapping[str, int],
                   bcast: frozenset[int]) -> frozenset[int]:
    """The dims along which a value that is a broadcast along `bcast` still is one once resharded from
    `src` to `dst` (local slices and copies keep them; a collective's result is a new value)."""
    if not bcast or src.partial - dst.partial:
        return frozenset()
    return _replayed(src, dst, shape, mesh, bcast)[2]


def is_involuntary_remat(src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mapping[str, int]) -> bool:
    """Whether XLA reshards `src` to `dst` by "involuntary full rematerialization" (it logs the warning and
    all-gathers the whole value before slicing it; `shardc.check` fails such programs)."""
    return _replayed(src, dst, shape, mesh)[1]


def crashes_xla(src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mapping[str, int]) -> bool:
    """Whether XLA's SPMD partitioner would crash the process (SIGFPE) resharding `src` to `dst` directly: an
    all-to-all of several dim pairs at once where a source dim has fewer tiles than its target's (e.g.
    [a, b, -, c] -> [b, -, c, a] on a={4}, b=c={2}; tests/cost/test_reshard_crash.py). Reshard paths go
    through an intermediate layout instead (`shardc.cost.reshard_path`)."""
    return _replayed(src, dst, shape, mesh)[4]


def _replayed(src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mapping[str, int],
              bcast: frozenset[int] = frozenset()) -> tuple:
    """`_dims_reshard` of the sharding change (its dims; cached)."""
    cur, mesh_key = _key(src, mesh)
    return _dims_reshard(cur, _key(dst, mesh)[0], tuple(shape), mesh_key, bcast)


@functools.lru_cache(maxsize=1 << 12)
def _pairs(src: Dims, dst: Dims, shape: tuple[int, ...], mesh: Mesh) -> tuple[tuple[int, int], ...] | None:
    p = _Partitioner(mesh)
    n = math.prod(size for _, size in mesh)
    p.reshard(_Value(_from_dims(src, mesh), shape, (tuple(range(n)),)), _from_dims(dst, mesh))
    if p.remat or [k for k, *_ in p.out] != ["collective-permute"]:
        return None
    return p.pairs[0]


def permute_pairs(src: Sharding, dst: Sharding, shape: Sequence[int], mesh: Mapping[str, int]
                  ) -> tuple[tuple[int, int], ...] | None:
    """When XLA reshards `src` to `dst` (dims only) by local slices and one collective-permute: the (source
    device, target device) pair of every tile, devices numbered row-major over the mesh's axes (self pairs
    included); otherwise None."""
    return _pairs(_key(src, mesh)[0], _key(dst, mesh)[0], tuple(shape), tuple(mesh.items()))
