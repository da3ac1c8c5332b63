"""The reshard shardc asks XLA for: a change of sharding, through intermediate layouts when XLA would
otherwise do it by "involuntary full rematerialization" (all-gather the whole value, slice it again).

`reshard_steps(src, dst, ...)` is the one answer every pass uses — the planner's `Reshard`s, the
simulator's collectives, the lowering's constraints: the layouts the value goes through (the last is
`dst`) with the collectives XLA emits for each step (`reshard_collectives`). A reshard XLA does well is one
step. One it would rematerialize goes through the intermediate layout that sends the fewest bytes with
no step rematerialized (e.g. [-, data+model] -> [data, -] as [-, data+model] -> [data, model] ->
[data, -]: an all-to-all then an all-gather of a quarter, where XLA's fallback gathers the whole
value); the lowering constrains the value to each layout in turn, so the compiled program has exactly
these collectives and no rematerialization warning. A reshard XLA makes in two parts, the first through
its cached `PartitionedHlo::Reshard` of the value (`shardc.cost.reshard.cached_intermediate`: e.g. [-, y, x]
-> [-, -, y] all-gathers x to [-, y, -], then all-to-alls), is two steps too: another reshard of the same
value to that first layout is the same one (XLA's cache; the simulator's and the lowering's keys).
A reshard XLA's partitioner would crash on (`shardc.cost.reshard.crashes_xla`: SIGFPE, the process dies)
goes through an intermediate layout the same way.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Iterator, Mapping, Sequence

from shardc.cost.collectives import Collective
from shardc.cost.reshard import (cached_intermediate, crashes_xla, is_involuntary_remat, kept_broadcast,
                                 reshard_collectives)
from shardc.sharding import Sharding

__all__ = ["reshard_steps", "kept_after", "sent_bytes", "ReshardStep"]

ReshardStep = tuple[Sharding, tuple[Collective, ...]]  # (the layout after the step, its collectives)


def sent_bytes(c: Collective, mesh: Mapping[str, int]) -> int:
    """Bytes each device sends for a collective (ring algorithms), what reshard paths are compared by."""
    n = c.group_size(mesh)
    if c.kind == "collective-permute":
        return c.bytes
    share = c.bytes * (n - 1) // max(n, 1)
    return 2 * share if c.kind == "all-reduce" else share


def reshard_steps(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, mesh: Mapping[str, int],
                  reduce_scatter: bool = True, groups: Sequence[Sequence[str]] = (),
                  bcast: frozenset[int] = frozenset()) -> tuple[ReshardStep, ...]:
    """The layouts a value goes through from `src` to `dst` (the last is `dst`), each with its collectives;
    none of the steps is a full rematerialization when another way exists (memoised).

    `groups`: when `src`'s partial sums come from an op that reduces several sharded dims, the axes of each
    (in the order XLA reduces them: `shardc.plan.OpStrategy.partial_groups`). XLA all-reduces them one dim
    at a time — an all-reduce per group, each of the whole result — before the rest of the reshard.
    `bcast`: the dims along which the value is a broadcast (`shardc.cost.reshard.reshard_collectives`)."""
    shape_t, items = tuple(int(n) for n in shape), tuple(mesh.items())
    lead: list[ReshardStep] = []
    for g in groups[:-1] if len(groups) > 1 else ():
        left = Sharding(src.dims, src.partial - frozenset(g))
        lead.append((left, reshard_collectives(src, left, shape_t, itemsize, mesh, reduce_scatter=reduce_scatter)))
        src, bcast = left, frozenset()
    return tuple(lead) + _steps(src, dst, shape_t, int(itemsize), items, reduce_scatter, frozenset(bcast))


def kept_after(steps: Sequence[ReshardStep], src: Sharding, shape: Sequence[int], mesh: Mapping[str, int],
               bcast: frozenset[int]) -> frozenset[int]:
    """The dims along which a value that is a broadcast along `bcast` still is one after `steps` from `src`."""
    for layout, _ in steps:
        if not bcast:
            break
        bcast, src = kept_broadcast(src, layout, shape, mesh, bcast), layout
    return bcast


@functools.lru_cache(maxsize=1 << 16)
def _steps(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int,
           mesh_items: tuple[tuple[str, int], ...], reduce_scatter: bool,
           bcast: frozenset[int]) -> tuple[ReshardStep, ...]:
    """The path's layouts are chosen as for a value that is no broadcast: the lowering constrains the value
    to them (`shardc.lower.Lowering.reshard`), and it does not know which values XLA's partitioner sees as
    broadcasts. Only the collectives of each step know it (a collective-permute along broadcast dims is a
    copy; a collective's result is no broadcast): a path chosen for the broadcast is not the one that runs
    (seed 95004: [-, -, y] -> [-, y+x, -] of a broadcast along dims 1, 2 priced through [-, x+y, z], a copy
    and an all-gather over z, where the lowering constrained it through [-, -, y+x], an all-to-all)."""
    layouts = _path(src, dst, shape, itemsize, mesh_items, reduce_scatter)
    if not bcast:
        return layouts
    mesh = dict(mesh_items)
    out: list[ReshardStep] = []
    for layout, _ in layouts:
        out.append((layout, reshard_collectives(src, layout, shape, itemsize, mesh, reduce_scatter=reduce_scatter,
                                                bcast=bcast)))
        bcast, src = kept_broadcast(src, layout, shape, mesh, bcast), layout
    return tuple(out)


@functools.lru_cache(maxsize=1 << 16)
def _path(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int,
          mesh_items: tuple[tuple[str, int], ...], reduce_scatter: bool) -> tuple[ReshardStep, ...]:
    """The steps from `src` to `dst` of a value that is no broadcast, with their collectives."""
    mesh = dict(mesh_items)

    def colls(a: Sharding, b: Sharding) -> tuple[Collective, ...]:
        return reshard_collectives(a, b, shape, itemsize, mesh, reduce_scatter=reduce_scatter)

    def avoided(a: Sharding, b: Sharding) -> bool:
        """A reshard XLA does by full rematerialization, or one its partitioner crashes on (`crashes_xla`)."""
        return is_involuntary_remat(a, b, shape, mesh) or crashes_xla(a, b, shape, mesh)

    direct = colls(src, dst)
    if not avoided(src, dst):
        inter = cached_intermediate(src, dst, shape, mesh, _layouts(len(shape), shape, mesh))
        if inter is not None and inter not in (src, dst):
            first, rest = colls(src, inter), colls(inter, dst)
            if first and first + rest == direct:  # (two steps: another reshard of the value to `inter` reuses it)
                return ((inter, first), (dst, rest))
        return ((dst, direct),)
    steps: list[ReshardStep] = []
    start = src
    if src.partial - dst.partial:  # the partial sums are reduced first, in the source's dims
        start = Sharding(src.dims, src.partial & dst.partial)
        steps.append((start, colls(src, start)))
    best: tuple[int, int, tuple[ReshardStep, ...]] | None = None
    for mid in _layouts(len(shape), shape, mesh):
        if mid in (start, dst) or avoided(start, mid) or avoided(mid, dst):
            continue
        a, b = colls(start, mid), colls(mid, dst)
        cost = (sum(sent_bytes(c, mesh) for c in a + b), len(a) + len(b))
        if best is None or cost < best[:2]:
            best = (*cost, ((mid, a), (dst, b)))
    if best is None:  # (XLA's own fallback, as it would do it: gather everything, then slice)
        return ((dst, direct),)
    return tuple(steps) + best[2]


def _layouts(rank: int, shape: Sequence[int], mesh: Mapping[str, int]) -> Iterator[Sharding]:
    """Every dims-only sharding of a rank-`rank` value of `shape` on `mesh` that splits its dims evenly, in
    a fixed order (lazily: `cached_intermediate` looks no further than the layout it wants, and only when
    there is one)."""
    axes = list(mesh)
    for where in itertools.product(range(rank + 1), repeat=len(axes)):  # 0: unused, d + 1: dim d
        per_dim = [[a for a, w in zip(axes, where) if w == d + 1] for d in range(rank)]
        for orders in itertools.product(*(itertools.permutations(p) for p in per_dim)):
            if all(n % math.prod(mesh[a] for a in o) == 0 for n, o in zip(shape, orders)):
                yield Sharding(tuple(tuple(o) for o in orders))
