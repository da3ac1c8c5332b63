"""How XLA's partitioner regroups a gather or scatter whose operand is split on a dim it indexes one row at a time.

The factor rules (`shardc.rules.indexing`) plan such a gather as each device looking up the rows it holds
(zeros for the others) and an all-reduce of the partial results over the operand's axes; a scatter as each
device applying the updates that land in its rows. XLA's SPMD partitioner (gather_scatter_handler.cc) does
that by *grouping devices*: it partitions the op once per group of devices that hold one piece of the
operand, with the other tensors regrouped to match. Two of its methods apply when the indices are split too:

* trivially sliced operand (TS): the operand is grouped by its pieces on the indexed dims (mesh axes `A`);
  the indices (and the gather's result, the scatter's updates) are grouped on their replicated devices —
  their replicated mesh axes in mesh order, the major part making the groups (GroupShardingOnReplicatedDim)
  — and aligned with the operand's groups (AlignGroupsWith). When the two groupings differ, a tensor keeps
  its tiling *inside* its group but on the operand group's devices in the operand's in-group order: if that
  moves a tile, XLA collective-permutes the tensor there (and a gather's result back after the all-reduce);
* index passthrough (IP): the result (updates) are grouped by the indices' pieces; the operand is grouped on
  its replicated devices and aligned with them; a move is a collective-permute of the operand (not of a
  broadcast: XLA's partitioner copies that), and a scatter's result goes back to the operand's layout.

XLA picks the method by a dry run of each (without recursing into the groups), ordered by the largest buffer
any one instruction of it touches (operands plus result; a scatter's result is its operand's buffer), then by
the bytes its all-gathers make and its all-reduces move (`_ts_cost`, `_ip_cost`). The all-reduce of the partial
results is the plan's reshard either way (same bytes); this module adds the permutes, as the op's own
collectives (`shardc.cost.op_collectives`). Layouts outside this case (an operand also split on a dim the
op passes through or on an explicit batch dim, indices split on the index vector or an explicit batch dim)
are left to the plan as it is.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Mapping, Sequence

from shardc.cost.collectives import Collective
from shardc.cost.op_collectives import NONE, OperandPermute, OwnCollectives, register_op_collectives
from shardc.sharding import Sharding

__all__ = ["Grouping", "Move", "on_dims", "ts_moves", "ip_moves", "gather_collectives", "scatter_collectives"]

Coord = Mapping[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Grouping:
    """Devices grouped as XLA groups one tensor: per device (in `devices` order) its group and its position
    inside the group."""

    group: tuple[int, ...]
    position: tuple[int, ...]


def _devices(mesh: Mapping[str, int]) -> list[dict[str, int]]:
    """Every device as its mesh coordinates, in mesh order."""
    return _devices_of(tuple(mesh.items()))


@functools.lru_cache(maxsize=64)
def _devices_of(items: tuple[tuple[str, int], ...]) -> list[dict[str, int]]:
    names = [a for a, _ in items]
    return [dict(zip(names, c)) for c in itertools.product(*(range(n) for _, n in items))]


def _index(coord: Coord, axes: Sequence[str], mesh: Mapping[str, int]) -> int:
    """The mixed-radix index of a device along `axes` (major first)."""
    i = 0
    for a in axes:
        i = i * mesh[a] + coord[a]
    return i


def _replicated(sh: Sharding, mesh: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes a layout does not split, in mesh order (partial sums are not XLA's sharding: replicated)."""
    used = sh.axes()
    return tuple(a for a in mesh if a not in used and mesh[a] > 1)


def _tile(sh: Sharding, coord: Coord, mesh: Mapping[str, int], dims: Sequence[int] | None = None) -> int:
    """The row-major index of the tile a device holds, over `dims` (all dims by default)."""
    i = 0
    for d in range(len(sh.dims)) if dims is None else dims:
        i = i * math.prod(mesh[a] for a in sh.dims[d]) + _index(coord, sh.dims[d], mesh)
    return i


def _count(axes: Sequence[str], mesh: Mapping[str, int]) -> int:
    return math.prod(mesh[a] for a in axes)


def on_dims(sh: Sharding, dims: Sequence[int], mesh: Mapping[str, int]) -> Grouping:
    """XLA's GroupShardingOnDims: groups by the tiles of `dims` (in that order); inside a group the devices
    are ordered by the tiles of the other dims, then by their replicated axes."""
    rest = [d for d in range(len(sh.dims)) if d not in dims]
    rep = _replicated(sh, mesh)
    devs = _devices(mesh)
    group = tuple(_tile(sh, c, mesh, dims) for c in devs)
    position = tuple(_tile(sh, c, mesh, rest) * _count(rep, mesh) + _index(c, rep, mesh) for c in devs)
    return Grouping(group, position)


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """How XLA's collective-permute regroups one tensor: the mesh axes it crosses and its (source, target) device
    pairs (devices in mesh order; none when no tile moves)."""

    axes: tuple[str, ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()


STAY = Move()


def _move(sh: Sharding, groups: int, ref: Grouping, mesh: Mapping[str, int]) -> Move:
    """How XLA permutes layout `sh` when it groups it on its replicated devices into `groups` groups
    (GroupShardingOnReplicatedDim: the major part of its replicated axes) and aligns them with `ref`
    (AlignGroupsWith); `STAY` when no tile moves. The same groups keep every tile in place; other groups put the
    tile of in-group position p on the device at position p of the reference's group. The permute pairs the old
    and the new holders of each tile in device order (XLA sorts a tile's replicas)."""
    rep = _replicated(sh, mesh)
    inner = _count(rep, mesh) // groups  # replicated devices per tile inside one group
    if inner * groups != _count(rep, mesh) or not sh.axes():
        return STAY  # (nothing split: every device holds the whole tensor)
    devs = _devices(mesh)
    if all(_index(c, rep, mesh) // inner == g for c, g in zip(devs, ref.group)):
        return STAY
    old = [_tile(sh, c, mesh) for c in devs]
    new = [p // inner for p in ref.position]
    pairs = sorted((src, dst) for t in set(old)
                   for src, dst in zip((d for d, u in enumerate(old) if u == t), (d for d, u in enumerate(new) if u == t)))
    crossed = {a for src, dst in pairs for a in mesh if devs[src][a] != devs[dst][a]}
    if not crossed:
        return STAY
    return Move(tuple(a for a in mesh if a in crossed), tuple(pairs))


def ts_moves(operand: Sharding, indexed: Sequence[int], others: Sequence[Sharding], mesh: Mapping[str, int]
             ) -> tuple[tuple[str, ...], ...]:
    """Trivially sliced operand: per tensor of `others` (indices, a gather's result, a scatter's updates),
    the mesh axes XLA permutes it across to align it with the operand's groups on its `indexed` dims."""
    return tuple(m.axes for m in _ts_moves(operand, tuple(indexed), tuple(others), tuple(mesh.items())))


@functools.lru_cache(maxsize=4096)
def _ts_moves(operand: Sharding, indexed: tuple[int, ...], others: tuple[Sharding, ...],
              items: tuple[tuple[str, int], ...]) -> tuple[Move, ...]:
    mesh = dict(items)
    ref = on_dims(operand, indexed, mesh)
    groups = math.prod(_count(operand.dims[d], mesh) for d in indexed)
    return tuple(_move(t, groups, ref, mesh) for t in others)


def ip_moves(operand: Sharding, indices: Sharding, batch: Sequence[int], mesh: Mapping[str, int]
             ) -> tuple[str, ...]:
    """Index passthrough: the mesh axes XLA permutes the operand across to align it with the groups of the
    indices' pieces on their `batch` dims."""
    return _ip_moves(operand, indices, tuple(batch), tuple(mesh.items())).axes


@functools.lru_cache(maxsize=4096)
def _ip_moves(operand: Sharding, indices: Sharding, batch: tuple[int, ...], items: tuple[tuple[str, int], ...]
              ) -> Move:
    mesh = dict(items)
    ref = on_dims(indices, batch, mesh)
    return _move(operand, math.prod(_count(indices.dims[d], mesh) for d in batch), ref, mesh)


@dataclasses.dataclass(frozen=True, slots=True)
class _Case:
    """One gather/scatter in the regrouping case: total bytes of operand `o`, indices `i`, result or updates
    `r`; `a` the operand's pieces on its indexed dims, `b` the indices' pieces on `batch`, their dims other
    than the index vector; `scatter` whether it is a scatter."""

    o: int
    i: int
    r: int
    a: int
    b: int
    batch: tuple[int, ...]
    scatter: bool


# XLA's dry-run communication cost of an all-reduce, per byte (what its logged costs of these methods show on 8
# devices, all-reduces of groups of 2). Only a tie in the largest buffer reads it.
ALL_REDUCE_COST = 3


def _ts_cost(k: _Case) -> tuple[int, int]:
    """(largest buffer, communication) of XLA's dry run of the TS method: each group gathers (scatters) from its
    operand piece with the whole indices and result (updates), all-gathered inside the group (a gather's
    partial results all-reduced)."""
    if k.scatter:
        return k.o // k.a + k.i + k.r, k.i + k.r
    return k.o // k.a + k.i + k.r, k.i + ALL_REDUCE_COST * k.r // k.b


def _ip_cost(k: _Case) -> tuple[int, int]:
    """(largest buffer, communication) of XLA's dry run of the IP method: each group all-gathers the operand and
    gathers (scatters) with its piece of the indices; a scatter's result is all-reduced over the indices' axes."""
    mem = max(k.o + k.i // k.b + k.r // k.b, k.o + k.o // k.a)
    return mem, k.o + (ALL_REDUCE_COST * k.o // k.a if k.scatter else 0)


def _case(shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int], ins: Sequence[Sharding], r_shape: Sequence[int],
          r_item: int, indexed: Sequence[int], scatter: bool, mesh: Mapping[str, int]) -> _Case | None:
    """The regrouping case of one op, or None when its layouts are outside it (see the module docstring)."""
    operand, indices = ins[0], ins[1]
    nd = len(shapes[1])
    batch = tuple(range(nd - 1)) if nd else ()
    if any(operand.dims[d] for d in range(len(operand.dims)) if d not in indexed) or (nd and indices.dims[nd - 1]):
        return None
    a = math.prod(_count(operand.dims[d], mesh) for d in indexed)
    b = math.prod(_count(indices.dims[d], mesh) for d in batch)
    if a <= 1 or b <= 1:
        return None  # (one group, or indices every group holds whole: nothing to regroup)
    total = [math.prod(s) * n for s, n in zip(shapes, itemsizes)]
    return _Case(total[0], total[1], math.prod(r_shape) * r_item, a, b, batch, scatter)


def _permute(sh: Sharding, shape: Sequence[int], itemsize: int, move: Move, mesh: Mapping[str, int]
             ) -> tuple[Collective, ...]:
    """A collective-permute across `move`'s axes of one device's piece of a tensor laid out as `sh` (none without
    axes: nothing moves)."""
    if not move.axes:
        return ()
    return (Collective("collective-permute", move.axes, math.prod(sh.local_shape(shape, mesh)) * itemsize),)


def _permute_operands(moves: Mapping[int, Move], ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]],
                      itemsizes: Sequence[int], mesh: Mapping[str, int], after: tuple[Collective, ...] = ()
                      ) -> OwnCollectives:
    """The op's collectives when it permutes operand i by `moves[i]` (in operand order) before it computes, each
    an `OperandPermute` another op permuting that operand alike shares, and `after` on its results."""
    before: list[Collective] = []
    shared: list[OperandPermute] = []
    for i, move in sorted(moves.items()):
        for c in _permute(ins[i], shapes[i], itemsizes[i], move, mesh):
            before.append(c)
            shared.append(OperandPermute(i, move.pairs))
    return OwnCollectives(before=tuple(before), after=after, shared=tuple(shared))


def _copied(sh: Sharding, bcast: frozenset[int]) -> bool:
    """A tensor that is a broadcast along every dim it is split on: XLA's partitioner makes it in place."""
    return all(d in bcast for d, axes in enumerate(sh.dims) if axes)


def _batch_split(indices: Sharding, batching_dims: Sequence[int]) -> bool:
    """Whether the indices are split on an explicit batch dim (XLA's explicit-batch method, not modelled; the
    operand split on one is outside the case too: `_case`)."""
    return any(indices.dims[int(d)] for d in batching_dims or ())


def _indexed_dims(start_index_map: Sequence[int], slice_sizes: Sequence[int]) -> tuple[int, ...]:
    """The operand dims the op indexes with slices of one row, in start_index_map order."""
    return tuple(int(d) for d in start_index_map if slice_sizes[int(d)] == 1)


def _result_layout(op: Any, ins: Sequence[Sharding]) -> Sharding:
    """A gather's result as its strategy makes it, without the partial sums (XLA's sharding of the gather): each
    result dim split like the operand or indices dim that shares its factor."""
    rule = op.rule
    axes: dict[int, tuple[str, ...]] = {}
    for tensor, sh in zip(rule.operands, ins):
        for factors, dim_axes in zip(tensor, sh.dims):
            if len(factors) == 1:
                axes.setdefault(factors[0], dim_axes)
    return Sharding(tuple(tuple(a for f in factors for a in axes.get(f, ())) for factors in rule.results[0]))


@register_op_collectives("gather")
def gather_collectives(op: Any, ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]],
                       itemsizes: Sequence[int], mesh: Mapping[str, int], bcast: Sequence[frozenset[int]]
                       ) -> OwnCollectives:
    """A gather's regrouping permutes: TS permutes the indices before and the result after; IP the operand."""
    dn = op.params["dimension_numbers"]
    if _batch_split(ins[1], getattr(dn, "start_indices_batching_dims", ())):
        return NONE
    indexed = _indexed_dims(dn.start_index_map, op.params["slice_sizes"])
    out = _result_layout(op, ins)
    r_shape = tuple(math.prod(op.rule.sizes[f] for f in fs) for fs in op.rule.results[0])
    k = _case(shapes, itemsizes, ins, r_shape, itemsizes[0], indexed, False, mesh)
    if k is None:
        return NONE
    if _ip_cost(k) < _ts_cost(k):
        moved = STAY if _copied(ins[0], bcast[0]) else _ip_moves(ins[0], ins[1], k.batch, tuple(mesh.items()))
        return _permute_operands({0: moved}, ins, shapes, itemsizes, mesh)
    idx, res = _ts_moves(ins[0], indexed, (ins[1], out), tuple(mesh.items()))
    return _permute_operands({1: STAY if _copied(ins[1], bcast[1]) else idx}, ins, shapes, itemsizes, mesh,
                             after=_permute(out, r_shape, itemsizes[0], res, mesh))


def _scatter_slice_sizes(dn: Any, operand: Sequence[int], updates: Sequence[int]) -> tuple[int, ...]:
    """Per operand dim, the rows one update covers: 1 where inserted, else its update window dim's size."""
    window = iter(int(d) for d in dn.update_window_dims)
    skipped = set(int(d) for d in dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()) or ())
    return tuple(1 if d in skipped else updates[next(window)] for d in range(len(operand)))


@register_op_collectives("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
                         "scatter_min", "scatter-max", "scatter_max")
def scatter_collectives(op: Any, ins: Sequence[Sharding], shapes: Sequence[tuple[int, ...]],
                        itemsizes: Sequence[int], mesh: Mapping[str, int], bcast: Sequence[frozenset[int]]
                        ) -> OwnCollectives:
    """A scatter's regrouping permutes: TS permutes the indices and updates before; IP the operand before and
    the result after (back to the operand's layout)."""
    dn = op.params["dimension_numbers"]
    if len(ins) != 3 or _batch_split(ins[1], getattr(dn, "scatter_indices_batching_dims", ())):
        return NONE
    sizes = _scatter_slice_sizes(dn, shapes[0], shapes[2])
    indexed = _indexed_dims(dn.scatter_dims_to_operand_dims, sizes)
    k = _case(shapes, itemsizes, ins, shapes[2], itemsizes[2], indexed, True, mesh)
    if k is None:
        return NONE
    if _ip_cost(k) < _ts_cost(k):
        move = _ip_moves(ins[0], ins[1], k.batch, tuple(mesh.items()))
        back = _permute(ins[0], shapes[0], itemsizes[0], move, mesh)
        return _permute_operands({0: STAY if _copied(ins[0], bcast[0]) else move}, ins, shapes, itemsizes, mesh,
                                 after=back)
    moved = _ts_moves(ins[0], indexed, (ins[1], ins[2]), tuple(mesh.items()))
    return _permute_operands({i: STAY if _copied(ins[i], bcast[i]) else m for i, m in zip((1, 2), moved)},
                             ins, shapes, itemsizes, mesh)
