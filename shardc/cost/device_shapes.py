"""What XLA sees of a plan: each device's shapes, where they change a decision `ProgramInfo` makes.

XLA partitions the program first and runs its fusion, library (YNNPACK) and scheduling passes on the program
of one device. `ProgramInfo` (`shardc.cost.program`) is computed from a graph's (global) shapes, and several of
its rules depend on sizes: a dim of one element is no dim to a matmul or a transpose; a reduction or an
elementwise op of fewer than 4096 elements is no library fusion; a reduction over dims of at most 32 elements is
no tree reduction; a concatenate along a short minor dim is fused.
A data-parallel plan of 8 sequences over 8 devices has a batch dim of one on each, and one of 16 sequences has
reductions of 2048 elements where the global ones have 16384.

`DeviceShapes` finds, per plan, the values whose per-device shape differs from their global shape in one of
those features (`_features`); the set of (value, per-device shape) pairs is the plan's signature. The
`ProgramInfo` of a signature is that of the graph with those values at their per-device shapes (the others
keep their global shapes, so that it depends on the signature only, not on which plan met it first); a plan
whose signature is empty uses the graph's own. Computed once per signature and backend, cached on the graph.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from shardc.cost.program import (_MINOR_CONCAT_BYTES, _MINOR_CONCAT_DIM_BYTES, _YNN_MIN_ELEMENTS,
                                 TREE_REDUCTION_WINDOW, ProgramInfo, broadcast_dims, cse, joined_values, liveness,
                                 program_info, read_values)
from shardc.cost.windows import read_windows
from shardc.ir.graph import Graph
from shardc.sharding import Sharding

__all__ = ["DeviceShapes", "Signature", "info_for", "queued_item"]

Signature = frozenset  # of (value id, per-device shape) pairs

# The fewest elements of a matmul dim YNNPACK takes (`program._ynn_dot`: max(m, k, n) < 8 is no library dot).
_SMALL_DOT_DIM = 8


def _features(shape: Sequence[int], itemsize: int) -> tuple:
    """What the size-dependent rules of `ProgramInfo` read of a value's shape."""
    n = math.prod(shape)
    return (tuple(d == 1 for d in shape), tuple(d > TREE_REDUCTION_WINDOW for d in shape),
            n >= _YNN_MIN_ELEMENTS, n >= _SMALL_DOT_DIM,
            n * itemsize >= _MINOR_CONCAT_BYTES, bool(shape) and shape[-1] * itemsize >= _MINOR_CONCAT_DIM_BYTES)


class DeviceShapes:
    """The per-device shapes of one graph's values on one mesh that cross a size rule (see the module doc)."""

    def __init__(self, graph: Graph, mesh_sizes: Mapping[str, int]) -> None:
        self.graph = graph
        self.mesh = dict(mesh_sizes)
        self._items = [int(v.dtype.itemsize) if v.dtype is not None else 4 for v in graph.values]
        self._memo: dict[tuple[int, Sharding], tuple[int, ...] | None] = {}

    def differing(self, v: int, sharding: Sharding | None) -> tuple[int, ...] | None:
        """Value `v`'s per-device shape under `sharding` when it crosses a size rule its global shape does not
        (or the other way round); None when the rules read both alike (a value split on no dim among them)."""
        if sharding is None or not any(sharding.dims):
            return None
        key = (v, sharding)
        hit = self._memo.get(key, False)
        if hit is not False:
            return hit
        shape = self.graph.values[v].shape
        local = sharding.local_shape(shape, self.mesh) if len(sharding.dims) == len(shape) else tuple(shape)
        out = None
        if local != tuple(shape) and _features(local, self._items[v]) != _features(shape, self._items[v]):
            out = local
        self._memo[key] = out
        return out

    def signature(self, shardings: Sequence[Sharding]) -> Signature:
        """The (value, per-device shape) pairs of a plan's values that cross a size rule (see `differing`)."""
        differing = self.differing
        return frozenset((v, local) for v, s in enumerate(shardings) if (local := differing(v, s)) is not None)


# The analyses of what XLA does before it partitions the program (CSE, constant folding, dead code, the simplifier's
# unread operands): a device's view shares the graph's (its collectives are placed on them).
_BEFORE_PARTITIONING = ("merged", "cse", "liveness", "read_values", "joined_values", "constant_arrays",
                        "broadcast_dims", "read_windows")


def before_partitioning(graph: Graph) -> None:
    """Compute (and cache on `graph`) the analyses of what XLA does before it partitions the program, which a
    device's view of `graph` shares (`device_view`), without the rest of the graph's own `ProgramInfo`."""
    liveness(graph)  # (and `merged`, which it reads)
    cse(graph)
    read_values(graph)
    joined_values(graph)
    broadcast_dims(graph)
    read_windows(graph)
    graph.analysis("constant_arrays", dict)  # (filled as the analyses ask; shared, so folded at global shapes)


def device_view(graph: Graph, shapes: Mapping[int, tuple[int, ...]],
                queued: frozenset[tuple[int, int]] = frozenset()) -> Graph:
    """`graph` with the values in `shapes` at those shapes (ops, regions and the rest shared), the graph's own
    analyses of what XLA does before partitioning, and a plan's queued reshards (`queued_reshards`)."""
    values = [dataclasses.replace(v, shape=tuple(shapes[v.id])) if v.id in shapes else v for v in graph.values]
    view = dataclasses.replace(graph, values=values)
    view.share_analyses(graph, _BEFORE_PARTITIONING)
    if queued:
        view.analysis("queued_reshards", lambda: queued)
    return view


def queued_item(op: int, value: int, instructions: int = 3) -> tuple[str, int, int, int]:
    """A signature's item for a queued reshard of canonical value `value` read by op `op` (`queued_reshards`), of
    `instructions` queued one after another, the collective second (3: copy, all-gather, copy back; 2: a local
    slice, then the collective reading it)."""
    return ("queued", op, value, instructions)


def info_for(graph: Graph, backend: str, signature: Signature) -> ProgramInfo:
    """The `ProgramInfo` XLA's passes on one device amount to, for plans of `signature` (see the module doc): its
    per-device shapes, and its queued reshards (`queued_item`)."""
    if not signature:
        return program_info(graph, backend)
    cache: dict = graph.analysis("device_infos", dict)
    key = (backend, signature)
    info = cache.get(key)
    if info is None:
        before_partitioning(graph)  # (the analyses the view shares)
        queued = frozenset(item[1:] for item in signature if item[0] == "queued")
        shapes = {item[0]: item[1] for item in signature if item[0] != "queued"}
        info = cache[key] = program_info(device_view(graph, shapes, queued), backend)
    return info
