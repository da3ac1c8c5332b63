"""The collectives XLA's SPMD partitioner emits for one change of sharding.

Modelled on `PartitionedHlo::ReshardNoCache` and checked against compiled programs
(tests/cost/test_reshard_vs_xla.py). Partial sums are reduced first (an all-reduce over the partial axes,
or a reduce-scatter when every partial axis becomes a new split of the result and nothing else moves);
then the dims change, in XLA's order of preference:

1. only new splits (each dim's axes extend the old ones): a local slice, free;
2. the same number of shards on every dim, axes permuted: one collective-permute;
3. one group of axes moves from the end of one dim to the end of another: one all-to-all (plus a
   collective-permute when the device order then differs from the target's);
4. every dim keeps or coarsens its split: one all-gather per coarsened dim, last dim first, each preceded
   by a collective-permute when the kept axes are not a prefix of the old ones;
5. every dim keeps or refines its split but not by extension: one collective-permute, then slices;
6. otherwise a chain of single moves when one exists (each an all-to-all), else the full replication
   XLA falls back to (one all-gather per sharded dim, last first) followed by a free slice.

Payloads are per device, as `shardc.cost.hlo` reads them from compiled programs.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from shardc.cost.collectives import Collective
from shardc.sharding import Sharding

__all__ = ["reshard_collectives"]

Dims = tuple[tuple[str, ...], ...]


def _local(dims: Dims, shape: Sequence[int], itemsize: int, mesh: Mapping[str, int]) -> int:
    n = itemsize
    for size, axes in zip(shape, dims):
        k = math.prod(mesh[a] for a in axes)
        n *= -(-size // k)
    return int(n)


def _tiles(dims: Dims, mesh: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(math.prod(mesh[a] for a in d) for d in dims)


def _ordered(axes, mesh: Mapping[str, int]) -> tuple[str, ...]:
    order = list(mesh)
    return tuple(sorted(set(axes), key=order.index))


def _is_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    return b[: len(a)] == a


def reshard_collectives(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int,
                        mesh: Mapping[str, int], *, reduce_scatter: bool = True) -> tuple[Collective, ...]:
    """Collectives (kind, mesh axes, payload bytes per device) that take a value from `src` to `dst`.

    `reduce_scatter=False` models backends that lower a reduce-scatter to an all-reduce followed by a
    local slice (XLA:CPU)."""
    out: list[Collective] = []
    cur: Dims = tuple(tuple(d) for d in src.dims)
    target: Dims = tuple(tuple(d) for d in dst.dims)
    partial = src.partial - dst.partial
    if partial:
        payload = _local(cur, shape, itemsize, mesh)
        new_axes = dst.axes() - src.axes()
        scatter = partial <= new_axes and _slices_only(_with_axes(cur, target, partial), target)
        if scatter and reduce_scatter:
            out.append(Collective("reduce-scatter", _ordered(partial, mesh), payload))
            cur = _with_axes(cur, target, partial)
        else:
            out.append(Collective("all-reduce", _ordered(partial, mesh), payload))
    out.extend(_dims_reshard(cur, target, shape, itemsize, mesh))
    return tuple(out)


def _with_axes(cur: Dims, target: Dims, axes: frozenset[str]) -> Dims:
    """`cur` with each of `axes` appended to the dim where `target` has it."""
    return tuple(c + tuple(a for a in t if a in axes and a not in c) for c, t in zip(cur, target))


def _slices_only(cur: Dims, target: Dims) -> bool:
    return all(_is_prefix(c, t) for c, t in zip(cur, target))


def _dims_reshard(cur: Dims, dst: Dims, shape: Sequence[int], itemsize: int,
                  mesh: Mapping[str, int]) -> list[Collective]:
    if cur == dst or _slices_only(cur, dst):
        return []
    n, m = _tiles(cur, mesh), _tiles(dst, mesh)
    local = _local(cur, shape, itemsize, mesh)
    changed = _ordered([a for c, t in zip(cur, dst) if c != t for a in c + t], mesh)
    if n == m:
        return [Collective("collective-permute", changed, local, group=2)]
    move = _all_to_all(cur, dst, n, m)
    if move is not None:
        d, e, group = move
        out = [Collective("all-to-all", _ordered(group, mesh), local)]
        if not (cur[d] == dst[d] + group and dst[e] == cur[e] + group and
                all(c == t for i, (c, t) in enumerate(zip(cur, dst)) if i not in (d, e))):
            out.append(Collective("collective-permute", changed, _local(dst, shape, itemsize, mesh), group=2))
        return out
    if all(a % b == 0 for a, b in zip(n, m)):
        return _gather(cur, dst, shape, itemsize, mesh)
    if all(b % a == 0 for a, b in zip(n, m)):
        return [Collective("collective-permute", changed, _local(dst, shape, itemsize, mesh), group=2)]
    chain = _move_chain(cur, dst, mesh)
    if chain is not None:
        out: list[Collective] = []
        state = cur
        for d, e, group in chain:
            out.append(Collective("all-to-all", _ordered(group, mesh), _local(state, shape, itemsize, mesh)))
            state = tuple(s[: len(s) - len(group)] if i == d else (s + group if i == e else s)
                          for i, s in enumerate(state))
        return out
    replicated: Dims = tuple(() for _ in cur)
    return _gather(cur, replicated, shape, itemsize, mesh)


def _all_to_all(cur: Dims, dst: Dims, n: tuple[int, ...],
                m: tuple[int, ...]) -> tuple[int, int, tuple[str, ...]] | None:
    """XLA's all-to-all pattern: exactly two dims change shard counts, one down by k and one up by k."""
    diff = [i for i in range(len(n)) if n[i] != m[i]]
    if len(diff) != 2:
        return None
    a, b = diff
    if n[a] > m[a] and m[b] > n[b] and n[a] * n[b] == m[a] * m[b]:
        d, e = a, b
    elif n[b] > m[b] and m[a] > n[a] and n[a] * n[b] == m[a] * m[b]:
        d, e = b, a
    else:
        return None
    group = cur[d][len(dst[d]):] if _is_prefix(dst[d], cur[d]) else tuple(a for a in cur[d] if a not in dst[d])
    return d, e, group


def _gather(cur: Dims, dst: Dims, shape: Sequence[int], itemsize: int, mesh: Mapping[str, int]) -> list[Collective]:
    """Coarsen dim by dim, last dim first: an all-gather of the dropped axes (a permute first when the kept
    axes are not a prefix of the current ones)."""
    out: list[Collective] = []
    state = list(cur)
    for d in reversed(range(len(cur))):
        if state[d] == dst[d]:
            continue
        keep = dst[d]
        if not _is_prefix(keep, state[d]):
            if math.prod(mesh[a] for a in keep) == math.prod(mesh[a] for a in state[d]):
                out.append(Collective("collective-permute", _ordered(state[d] + keep, mesh),
                                      _local(tuple(state), shape, itemsize, mesh), group=2))
                state[d] = keep
                continue
            out.append(Collective("collective-permute", _ordered(state[d] + keep, mesh),
                                  _local(tuple(state), shape, itemsize, mesh), group=2))
        dropped = tuple(a for a in state[d] if a not in keep)
        group = math.prod(mesh[a] for a in state[d]) // max(math.prod(mesh[a] for a in keep), 1)
        state[d] = keep
        out.append(Collective("all-gather", _ordered(dropped, mesh), _local(tuple(state), shape, itemsize, mesh),
                              group=group))
    return out


def _move_chain(cur: Dims, dst: Dims, mesh: Mapping[str, int]) -> list[tuple[int, int, tuple[str, ...]]] | None:
    """Single-axis moves (the last axis of one dim onto an unsplit dim that the target splits by it first)
    that reach `dst` — the all-to-all chains XLA finds for three-dim changes."""
    chain = []
    state = list(cur)
    for _ in range(2 * len(cur) + 2):
        if tuple(state) == dst:
            return chain
        found = False
        for d in range(len(state)):
            if not state[d] or _is_prefix(state[d], dst[d]):
                continue
            axis = state[d][-1]
            for e in range(len(state)):
                if e == d:
                    continue
                if not state[e] and _is_prefix((axis,), dst[e]):
                    chain.append((d, e, (axis,)))
                    state[d] = state[d][:-1]
                    state[e] = state[e] + (axis,)
                    found = True
                    break
            if found:
                break
        if not found:
            return None
    return chain if tuple(state) == dst else None
