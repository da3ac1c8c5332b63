"""The PCG's parallel ops for a change of sharding, from the one reshard model (`shardc.cost.reshard_path`).

`reshard_steps(src, dst, ...)` says which layouts a value goes through and which collectives XLA emits for
each step; the planner's Reshards, the simulator and the `jax.jit` lowering use it. `xla_ops` gives the
same change as PCG parallel ops: each collective of each step becomes one parallel op (Reduce,
ReduceScatter, Combine, AllToAll, CollectivePermute) and local slices become Partitions, so the PCG,
its simulated cost and its `shard_map` lowering move exactly what the planner and XLA do.

The ops of a step are found by a small breadth-first search over shardings: every op must be one XLA would
do with exactly one collective of that kind, mesh axes and payload (or, for a Partition, none), and
together they must make the step's collectives, in XLA's order when possible. A collective no parallel op
can make (XLA gathers or exchanges among part of an axis, or moves tiles to devices no named layout has) makes
the step the ops moving the fewest bytes, each still one XLA collective (`_cheapest_ops`; 6 pairs on the 2x4
mesh, `tests/pcg/test_pcg_reshard.py`); only where none reach the step's layout is it left to `naive`, the
caller's per-axes-group decomposition.
"""
from __future__ import annotations

import collections
import functools
import heapq
import itertools
from typing import Callable, Iterator, Mapping, Sequence

from shardc.cost.collectives import Collective
from shardc.cost.reshard_path import reshard_steps
from shardc.pcg.ops import AllToAll, Combine, ParallelOp, Partition, Reduce, ReduceScatter, ReduceScatterDims, Shuffle
from shardc.sharding import Sharding

__all__ = ["xla_ops", "op_collective"]

Naive = Callable[[Sharding, Sharding], list[ParallelOp]]
_KIND = {Reduce: "all-reduce", ReduceScatter: "reduce-scatter", Combine: "all-gather", AllToAll: "all-to-all",
         Shuffle: "collective-permute", ReduceScatterDims: "reduce-scatter"}


def op_collective(op: ParallelOp, src: Sharding, shape: Sequence[int], itemsize: int,
                  mesh: Mapping[str, int]) -> Collective | None:
    """The collective a parallel op is on a value of `shape` laid out as `src` (None for a local slice),
    with XLA's payload convention: the gathered result of an all-gather, the slice a collective-permute
    sends, the operand otherwise."""
    kind = _KIND.get(type(op))
    if kind is None or all(mesh[a] == 1 for a in op.axes):
        return None
    out = op.apply(src)
    local = out.local_shape(shape, mesh) if kind in ("all-gather", "collective-permute") else src.local_shape(shape, mesh)
    n = itemsize
    for d in local:
        n *= d
    if isinstance(op, Shuffle):
        return Collective(kind, op.pair_axes(mesh, shape), n, 2)  # (XLA's group of a permute: a pair)
    return Collective(kind, tuple(a for a in mesh if a in op.axes), n)


def _moves(s: Sharding, mesh: Mapping[str, int]) -> Iterator[ParallelOp]:
    """Every parallel op applicable to `s` on one axes group (mesh axes of size 1 left out), and every
    Shuffle to another layout."""
    axes = tuple(a for a in mesh if mesh[a] > 1)
    used = s.axes() | s.partial
    free = [a for a in axes if a not in used]
    partial = [a for a in axes if a in s.partial]
    for r in range(1, len(partial) + 1):
        for group in itertools.permutations(partial, r):
            if list(group) == sorted(group, key=axes.index):
                yield Reduce(group)
            for d in range(s.rank):
                yield ReduceScatter(group, d)
            if 1 < r <= 3:
                for dims in itertools.product(range(s.rank), repeat=r):
                    if len(set(dims)) > 1:
                        yield ReduceScatterDims(group, dims)
    if s.partial:
        return  # (a value holding partial sums is reduced before it moves)
    for d, have in enumerate(s.dims):
        for k in range(1, len(have) + 1):
            group = have[len(have) - k:]
            yield Combine(group, d)
            for e in range(s.rank):
                if e != d:
                    yield AllToAll(group, d, e)
    if s.axes():
        for t in _layouts(s.rank, axes):
            if t != s.dims:
                yield Shuffle(tuple(mesh), s.dims, t)
    for d in range(s.rank):
        for r in range(1, len(free) + 1):
            for group in itertools.permutations(free, r):
                yield Partition(group, d)


@functools.lru_cache(maxsize=256)
def _layouts(rank: int, axes: tuple[str, ...]) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """Every dims-only layout of a rank-`rank` value over `axes` (each axis on at most one dim, any order)."""
    out = []
    for where in itertools.product(range(rank + 1), repeat=len(axes)):
        per = [[a for a, w in zip(axes, where) if w == d + 1] for d in range(rank)]
        for orders in itertools.product(*(itertools.permutations(p) for p in per)):
            out.append(tuple(tuple(o) for o in orders))
    return tuple(out)


def _degree(group: Sequence[str], mesh: Mapping[str, int]) -> int:
    n = 1
    for a in group:
        n *= mesh[a]
    return n


def _divides(s: Sharding, shape: Sequence[int], mesh: Mapping[str, int]) -> bool:
    return all(n % _degree(d, mesh) == 0 for n, d in zip(shape, s.dims))


def _same(a: Collective, b: Collective, exact: bool) -> bool:
    return a == b if exact else (a.kind, a.bytes) == (b.kind, b.bytes)


def _applied_moves(s: Sharding, shape: tuple[int, ...], itemsize: int, mesh: Mapping[str, int]
                   ) -> Iterator[tuple[ParallelOp, Sharding, Collective | None]]:
    """Each parallel op `_moves` offers on `s` that admits it and leaves pieces that divide `shape`, with the
    layout it makes and its collective (None for a local slice)."""
    for op in _moves(s, mesh):
        try:
            t = op.apply(s)
        except Exception:  # noqa: BLE001 - an op this layout does not admit
            continue
        if _divides(t, shape, mesh):
            yield op, t, op_collective(op, s, shape, itemsize, mesh)


def _step_ops(src: Sharding, dst: Sharding, colls: tuple[Collective, ...], shape: tuple[int, ...], itemsize: int,
              mesh: Mapping[str, int], reduce_scatter: bool, ordered: bool, exact: bool) -> list[ParallelOp] | None:
    """The fewest parallel ops from `src` to `dst` whose collectives are `colls` (in their order when
    `ordered`; with their mesh axes and group sizes when `exact`, else kinds and payloads), each op exactly
    one XLA collective of its kind (or a local slice); None if there are none."""
    start = (src, tuple(range(len(colls))))
    seen = {start}
    queue: collections.deque = collections.deque([(start, [])])
    while queue:
        (s, left), path = queue.popleft()
        if s == dst and not left:
            return path
        for op, t, c in _applied_moves(s, shape, itemsize, mesh):
            if c is None:
                if reshard_steps(s, t, shape, itemsize, mesh, reduce_scatter) != ((t, ()),):
                    continue  # XLA would not do this by a local slice
                rest = left
            else:
                pick = [i for i in left if _same(colls[i], c, exact)]
                if not pick or (ordered and pick[0] != left[0]):
                    continue  # (before asking for XLA's path to `t`: most moves make no collective wanted)
                if reshard_steps(s, t, shape, itemsize, mesh, reduce_scatter) != ((t, (c,)),):
                    continue  # XLA would not do this change as this one collective
                rest = tuple(i for i in left if i != pick[0])
            state = (t, rest)
            if state not in seen:
                seen.add(state)
                queue.append((state, path + [op]))
    return None


def _cheapest_ops(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, mesh: Mapping[str, int],
                  reduce_scatter: bool, max_ops: int = 5) -> list[ParallelOp] | None:
    """The parallel ops from `src` to `dst` moving the fewest bytes per device (then the fewest collectives), each
    one XLA collective of its kind or a local slice; None if none of at most `max_ops` ops do. For a step XLA makes
    with collectives among part of an axis (an all-to-all within pairs of a 4-device axis, then a permute), which
    no op on named axes is: its cost stays near XLA's, where gathering the value whole and slicing it again
    (`naive`) moves all of it."""
    heap: list = [((0, 0, 0), 0, src, [])]
    best = {src: (0, 0, 0)}
    tie = itertools.count(1)
    while heap:
        cost, _, s, path = heapq.heappop(heap)
        if s == dst:
            return path
        if cost > best.get(s, cost) or len(path) >= max_ops:
            continue
        for op, t, c in _applied_moves(s, shape, itemsize, mesh):
            if reshard_steps(s, t, shape, itemsize, mesh, reduce_scatter) != ((t, () if c is None else (c,)),):
                continue  # XLA would not make this change as this op
            new = (cost[0] + (c.bytes if c is not None else 0), cost[1] + (c is not None), cost[2] + 1)
            if new < best.get(t, (float("inf"),)):
                best[t] = new
                heapq.heappush(heap, (new, next(tie), t, path + [op]))
    return None


@functools.lru_cache(maxsize=1 << 14)
def _xla_ops(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int,
             mesh_items: tuple[tuple[str, int], ...], reduce_scatter: bool, groups: tuple[tuple[str, ...], ...] = ()
             ) -> tuple[tuple[Sharding, Sharding, tuple[ParallelOp, ...] | None], ...]:
    mesh = dict(mesh_items)
    out = []
    cur = src
    for layout, colls in reshard_steps(src, dst, shape, itemsize, mesh, reduce_scatter, groups):
        ops = None
        for exact, ordered in ((True, True), (True, False), (False, True), (False, False)):
            ops = _step_ops(cur, layout, colls, shape, itemsize, mesh, reduce_scatter, ordered, exact)
            if ops is not None:
                break
        if ops is None:  # (XLA's collectives are among part of an axis: the fewest bytes named ops move)
            ops = _cheapest_ops(cur, layout, shape, itemsize, mesh, reduce_scatter)
        out.append((cur, layout, None if ops is None else tuple(ops)))
        cur = layout
    return tuple(out)


def xla_ops(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, mesh: Mapping[str, int],
            naive: Naive, *, reduce_scatter: bool = True, groups: Sequence[Sequence[str]] = ()) -> list[ParallelOp]:
    """Parallel ops taking a value of `shape` from `src` to `dst` as XLA does it (`reshard_steps`): one op per
    collective, Partitions for local slices; a step no ops make exactly is decomposed by `naive`. `groups`: the
    axes of each sharded dim an op reduced to make `src`'s partial sums (XLA all-reduces them one dim at a time)."""
    mesh = {a: int(n) for a, n in mesh.items()}
    ops: list[ParallelOp] = []
    for cur, layout, step in _xla_ops(src, dst, tuple(int(n) for n in shape), int(itemsize), tuple(mesh.items()),
                                      reduce_scatter, tuple(tuple(g) for g in groups)):
        ops.extend(step if step is not None else naive(cur, layout))
    return ops
