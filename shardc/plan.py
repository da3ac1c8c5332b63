"""Plan: a sharding for every value, a strategy for every op, and the reshards between them.

`build_plan` turns a propagation result into a Plan: each op takes its factors' axes from its results
(reduction factors from its largest operand), which fixes the layout it needs on each operand; where a
value's sharding differs from what a consumer needs, or an op leaves partial sums, a Reshard is recorded
with its kind, its bytes per device and its cause.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from jax.sharding import Mesh

from annotations.errors import SourceLine
from shardc.ir.graph import Graph, Op
from shardc.propagate import Cause, Propagation, project_dim
from shardc.rules.core import FactorKind, FactorRule
from shardc.sharding import Sharding, mesh_shape

__all__ = ["OpStrategy", "Reshard", "Plan", "build_plan", "classify_reshard", "reshard_bytes"]

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class OpStrategy:
    """Mesh axes assigned to each factor of an op."""

    factor_axes: tuple[Axes, ...]

    def tensor_sharding(self, rule: FactorRule, dims: Sequence[Sequence[int]], mesh: Mapping[str, int]) -> Sharding:
        out: list[Axes] = []
        for factors in dims:
            axes: list[str] = []
            for f in factors:
                fa = self.factor_axes[f]
                axes.extend(fa)
                n = 1
                for a in fa:
                    n *= mesh[a]
                if n != rule.sizes[f]:
                    break
            out.append(tuple(axes))
        return Sharding(tuple(out))

    def partial_axes(self, rule: FactorRule) -> frozenset[str]:
        return frozenset(a for f, axes in enumerate(self.factor_axes) if rule.kinds[f] is FactorKind.REDUCTION for a in axes)


@dataclasses.dataclass(frozen=True, slots=True)
class Reshard:
    """A change of sharding on one value: before op `consumer` (or after op `producer` for partial sums)."""

    value: int
    src: Sharding
    dst: Sharding
    kind: str
    bytes: int
    cause: str
    source: SourceLine | None
    consumer: int | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A sharding per value, a strategy per op, the reshards, on one mesh."""

    graph: Graph
    mesh: Mesh
    shardings: tuple[Sharding, ...]
    strategies: tuple[OpStrategy, ...]
    reshards: tuple[Reshard, ...]
    origins: tuple[tuple[Cause | None, ...], ...]
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # Set by @shardc.auto: the traced program and donated flat inputs (so shardc.check can compile the
    # plan), and the simulated cost when a topology was given (shardc.simulate's SimResult).
    program: Any = None
    donated: tuple[int, ...] = ()
    cost: Any = None
    search: Any = None  # set by the strategy search: its SearchReport (baselines beside the chosen plan)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return mesh_shape(self.mesh)

    def sharding_of(self, vid: int) -> Sharding:
        return self.shardings[vid]

    def input_shardings(self) -> list[Sharding]:
        return [self.shardings[v] for v in self.graph.inputs]

    def output_shardings(self) -> list[Sharding]:
        return [self.shardings[v] for v in self.graph.outputs]

    def local_bytes(self, vid: int) -> int:
        v = self.graph.values[vid]
        n = int(v.dtype.itemsize) if v.dtype is not None else 4
        return n * math.prod(self.shardings[vid].local_shape(v.shape, self.mesh_sizes))

    def total_reshard_bytes(self) -> int:
        return sum(r.bytes for r in self.reshards)

    def explain(self, *, max_rows: int = 60) -> str:
        from shardc.report import explain

        return explain(self, max_rows=max_rows)

    def fingerprint(self) -> str:
        """A stable hash of the plan (mesh, shardings), equal on every process of a multi-host job."""
        import hashlib

        h = hashlib.sha256()
        h.update(repr(sorted(self.mesh_sizes.items())).encode())
        for s in self.shardings:
            h.update(str(s).encode())
        return h.hexdigest()[:16]


def classify_reshard(src: Sharding, dst: Sharding) -> str:
    """Collective kind needed to go from src to dst (the most expensive part if several)."""
    kinds = []
    if src.partial - dst.partial:
        kinds.append("reduce-scatter" if (src.partial & dst.axes()) else "all-reduce")
    where_src = {a: i for i, d in enumerate(src.dims) for a in d}
    where_dst = {a: i for i, d in enumerate(dst.dims) for a in d}
    for a, i in where_src.items():
        if a in src.partial:
            continue
        j = where_dst.get(a)
        if j is None:
            kinds.append("all-gather")
        elif j != i:
            kinds.append("all-to-all")
        elif src.dims[i] != dst.dims[j]:
            kinds.append("collective-permute")
    for a in where_dst:
        if a not in where_src and a not in src.partial:
            kinds.append("slice")
    order = ["all-reduce", "reduce-scatter", "all-to-all", "all-gather", "collective-permute", "slice"]
    for k in order:
        if k in kinds:
            return k
    return "none"


def reshard_bytes(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, mesh: Mapping[str, int]) -> int:
    """Bytes each device sends for the reshard (ring algorithms; a slice is free)."""
    src_local = itemsize * math.prod(src.local_shape(shape, mesh))
    dst_local = itemsize * math.prod(dst.local_shape(shape, mesh))
    total = 0
    if src.partial - dst.partial:
        n = math.prod(mesh[a] for a in src.partial - dst.partial)
        total += 2 * src_local * (n - 1) // n
    kind = classify_reshard(Sharding(src.dims), Sharding(dst.dims))
    if kind == "all-gather":
        total += max(dst_local - src_local, 0)
    elif kind in ("all-to-all", "collective-permute"):
        n = math.prod(mesh[a] for d in src.dims for a in d)
        total += src_local * (n - 1) // max(n, 1)
    return int(total)


def _strategy(op: Op, axes_of, nbytes, mesh: Mapping[str, int]) -> OpStrategy:
    """Factor axes taken from the op's tensors, largest first (results first among equals), each axis
    used by one factor only: the layout of the biggest tensor is kept and the smaller ones move — as in
    propagation's conflict resolution."""
    rule = op.rule
    nf = rule.num_factors
    chosen: list[Axes | None] = [None] * nf
    tensors = [(v, dims, 0) for v, dims in zip(op.outputs, rule.results)]
    tensors += [(v, dims, 1) for v, dims in zip(op.inputs, rule.operands)]
    tensors.sort(key=lambda t: (-nbytes[t[0]], t[2]))
    taken: set[str] = set()
    for v, dims, _ in tensors:
        for d, factors in enumerate(dims):
            if not factors:
                continue
            proj, _complete = project_dim(axes_of(v)[d], factors, rule.sizes, mesh)
            for f in factors:
                if chosen[f] is None and f in proj and proj[f] and not (taken & set(proj[f])) \
                        and rule.kinds[f] not in (FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION):
                    chosen[f] = proj[f]
                    taken.update(proj[f])
    used: set[str] = set()
    out: list[Axes] = []
    for f in range(nf):
        axes = chosen[f] or ()
        if rule.kinds[f] in (FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION):
            axes = ()
        keep = []
        for a in axes:
            if a in used:
                break
            keep.append(a)
        used.update(keep)
        out.append(tuple(keep))
    return OpStrategy(tuple(out))


def _describe_origin(origins: Sequence[Cause | None]) -> str:
    causes = [str(c) for c in dict.fromkeys(c for c in origins if c is not None)]
    return f" (from {'; '.join(causes)})" if causes else ""


def build_plan(graph: Graph, mesh: Mesh, prop: Propagation, *, input_names: Sequence[str] = (),
               output_names: Sequence[str] = (), warnings: Sequence[str] = ()) -> Plan:
    sizes = mesh_shape(mesh)
    shardings = tuple(Sharding(tuple(a)) for a in prop.axes)
    nbytes = [v.nbytes for v in graph.values]
    strategies: list[OpStrategy] = []
    reshards: list[Reshard] = []

    def axes_of(v: int):
        return shardings[v].dims

    for op in graph.ops:
        rule = op.rule
        strat = _strategy(op, axes_of, nbytes, sizes)
        strategies.append(strat)
        if op.primitive == "tie" and op.region == "io":
            continue
        for v, dims in zip(op.inputs, rule.operands):
            val = graph.values[v]
            if val.is_const and val.rank == 0:
                continue
            need = strat.tensor_sharding(rule, dims, sizes)
            have = shardings[v]
            if need != have:
                kind = classify_reshard(have, need)
                if kind == "none":
                    continue
                cause = (f"{op.primitive} needs {val.name} {list(val.shape)} as {need}, it is {have}"
                         f"{_describe_origin(prop.origin[v])}")
                reshards.append(Reshard(v, have, need, kind,
                                        reshard_bytes(have, need, val.shape, val.dtype.itemsize, sizes),
                                        cause, op.source, consumer=op.id))
        partial = strat.partial_axes(rule)
        for v, dims in zip(op.outputs, rule.results):
            val = graph.values[v]
            made = strat.tensor_sharding(rule, dims, sizes)
            made = Sharding(made.dims, partial)
            want = shardings[v]
            if made != want:
                kind = classify_reshard(made, want)
                if kind in ("none", "slice"):
                    continue
                what = (f"partial {rule.reduce_op}s over {','.join(sorted(partial))} from {op.primitive}"
                        if partial else f"{op.primitive} makes {made}")
                cause = f"{what}; {val.name} {list(val.shape)} is {want}"
                reshards.append(Reshard(v, made, want, kind,
                                        reshard_bytes(made, want, val.shape, val.dtype.itemsize, sizes),
                                        cause, op.source, consumer=None))
    return Plan(graph, mesh, shardings, tuple(strategies), tuple(reshards),
                tuple(tuple(o) for o in prop.origin), tuple(input_names), tuple(output_names), tuple(warnings))
