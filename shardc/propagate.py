"""Shardy-style sharding propagation over the Graph.

Seeds (user hints, Flax metadata) fix some dims of some values. Propagation then walks ops with a
worklist and moves shardings along *factors* (see shardc.rules): for each op, each factor gets the
longest axis list some tensor of the op already has for it, and every open dim that has a prefix of it
is extended. Closed dims (what a user pinned) never change; open dims only grow, so it terminates.

Schedule (Shardy's op priorities, simplified): seeds are applied by priority level (lower first); at
each level propagation runs to a fixed point over pass-through ops only (elementwise, reshape,
transpose, ties, hints), then over all ops but broadcasts, then over all ops.

Conflicts: when tensors of one op disagree on a factor, the sharding of the largest tensor wins
(resharding the smaller one moves fewer bytes); when two factors want the same axis, the factor whose
source tensor is largest keeps it. Dims nobody decided end replicated.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Mapping, Sequence

from annotations.errors import ShardingError, SourceLine
from shardc.ir.graph import Graph, Op
from shardc.rules.core import FactorKind, FactorRule
from shardc.sharding import Sharding

__all__ = ["Cause", "Seed", "Propagation", "propagate", "project_dim"]

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Cause:
    """Why a value is sharded as it is: a user hint, Flax metadata, a loop carry, ..."""

    kind: str
    description: str
    source: SourceLine | None = None

    def __str__(self) -> str:
        return f"{self.description} at {self.source}" if self.source else self.description


@dataclasses.dataclass(frozen=True, slots=True)
class Seed:
    """A pinned sharding for some dims of one value. `dims[d]` is None for a dim the seed leaves open."""

    value: int
    dims: tuple[Axes | None, ...]
    cause: Cause
    priority: int = 0


@dataclasses.dataclass
class Propagation:
    """The result: per value, per dim, its axes, whether it was pinned, and where it came from."""

    axes: list[list[Axes]]
    closed: list[list[bool]]
    origin: list[list[Cause | None]]
    visits: int = 0

    def sharding(self, vid: int) -> Sharding:
        return Sharding(tuple(self.axes[vid]))


def project_dim(axes: Axes, factors: Sequence[int], sizes: Sequence[int], mesh: Mapping[str, int]) -> tuple[dict[int, Axes], bool]:
    """Split a dim's axes among its factors (major first). Returns (factor -> axes, whether all fit).

    An axis can go to a factor only if it divides what remains of the factor; a minor factor gets axes
    only once the major ones are fully split.
    """
    out: dict[int, Axes] = {}
    i = 0
    for f in factors:
        remaining = sizes[f]
        taken: list[str] = []
        while i < len(axes) and remaining > 1 and remaining % mesh[axes[i]] == 0:
            taken.append(axes[i])
            remaining //= mesh[axes[i]]
            i += 1
        out[f] = tuple(taken)
        if remaining != 1:
            break
    return out, i == len(axes)


def _divisible_prefix(axes: Axes, size: int, mesh: Mapping[str, int]) -> Axes:
    n = 1
    for k, a in enumerate(axes):
        n *= mesh[a]
        if size % n:
            return axes[:k]
    return axes


def _pass_through_op(rule: FactorRule) -> bool:
    """Elementwise-like: every factor pass-through and every tensor has all of them."""
    if any(k is not FactorKind.PASS_THROUGH for k in rule.kinds):
        return False
    want = set(range(rule.num_factors))
    return all({f for d in t for f in d} == want for t in rule.tensors())


class _Propagator:
    def __init__(self, graph: Graph, mesh: Mapping[str, int]) -> None:
        self.g = graph
        self.mesh = dict(mesh)
        n = len(graph.values)
        self.axes: list[list[Axes]] = [[() for _ in v.shape] for v in graph.values]
        self.closed: list[list[bool]] = [[False for _ in v.shape] for v in graph.values]
        self.origin: list[list[Cause | None]] = [[None for _ in v.shape] for v in graph.values]
        self.nbytes = [v.nbytes for v in graph.values]
        self.visits = 0
        self._sizes: dict[Axes, int] = {}
        # Visit memo: an op's visit depends only on its rule, its tensors' sizes, their axes and closed
        # flags (and the mesh), so structurally identical ops in the same state (the layers of a model,
        # the candidates of a search) share one computation. Ops reading one value twice are not memoised.
        self._memo: dict[tuple, list] = {}
        self._class = _op_classes(graph)
        # Copy-on-write (see `fork`): shared[v] means the per-dim lists of v belong to another state.
        self._shared: list[bool] | None = None
        self.touched: list[int] = []
        self.phase_of = []
        for op in graph.ops:
            if _pass_through_op(op.rule):
                self.phase_of.append(0)
            elif op.primitive == "broadcast_in_dim":
                self.phase_of.append(2)
            else:
                self.phase_of.append(1)
        del n

    def size_of(self, axes: Axes) -> int:
        """Number of devices along `axes` (memoised)."""
        n = self._sizes.get(axes)
        if n is None:
            n = self._sizes[axes] = math.prod(self.mesh[a] for a in axes)
        return n

    def fork(self, axes: list, closed: list, origin: list, visits: int) -> None:
        """Continue from a saved state (outer lists are copied; per-value lists are copied on first
        write, and the values written are listed in `touched`)."""
        self.axes, self.closed, self.origin, self.visits = list(axes), list(closed), list(origin), visits
        self._shared = [True] * len(axes)
        self.touched = []

    def _own(self, v: int) -> None:
        sh = self._shared
        if sh is not None and sh[v]:
            sh[v] = False
            self.axes[v] = list(self.axes[v])
            self.closed[v] = list(self.closed[v])
            self.origin[v] = list(self.origin[v])
            self.touched.append(v)

    # -- seeds ------------------------------------------------------------------------------------
    def apply_seed(self, seed: Seed) -> None:
        v = self.g.values[seed.value]
        self._own(seed.value)
        for d, want in enumerate(seed.dims):
            if want is None:
                continue
            if self.closed[seed.value][d] and self.axes[seed.value][d] != want:
                prev = self.origin[seed.value][d]
                raise ShardingError(
                    f"conflicting hints on {v.name} {v.shape} dim {d}: {_fmt(self.axes[seed.value][d])} "
                    f"from {prev} and {_fmt(want)} from {seed.cause}"
                )
            want = self._free_axes_for(seed, d, want)
            self.axes[seed.value][d] = want
            self.closed[seed.value][d] = True
            self.origin[seed.value][d] = seed.cause

    def _free_axes_for(self, seed: Seed, d: int, want: Axes) -> Axes:
        """The axes a seed pins on dim d, once no other dim of the value holds them: an open dim that got
        one by propagation gives it up (from that axis on); a dim pinned by another seed keeps it — a user's
        seed that wants it too is a conflict, a search seed stops short of it."""
        v = seed.value
        axes, closed = self.axes[v], self.closed[v]
        for dd, have in enumerate(axes):
            if dd == d or not set(have) & set(want):
                continue
            if not closed[dd]:
                cut = next(k for k, a in enumerate(have) if a in want)
                axes[dd] = tuple(have[:cut])
                continue
            if seed.priority == 0:
                val = self.g.values[v]
                raise ShardingError(
                    f"conflicting hints on {val.name} {val.shape}: dim {d} {_fmt(want)} from {seed.cause} and dim "
                    f"{dd} {_fmt(have)} from {self.origin[v][dd]} use the same mesh axis")
            want = tuple(want[:next(k for k, a in enumerate(want) if a in have)])
        return want

    # -- one op -----------------------------------------------------------------------------------
    def visit(self, op: Op) -> list[int]:
        """Move shardings along the factors of `op`; returns the values whose axes grew."""
        cls = self._class[op.id]
        if cls < 0 or op.rule.num_factors == 0:
            return self._visit_direct(op)
        self.visits += 1
        tensors = op.inputs + op.outputs
        axes, closed = self.axes, self.closed
        key = (cls, tuple([tuple(axes[v]) for v in tensors]), tuple([tuple(closed[v]) for v in tensors]))
        writes = self._memo.get(key)
        if writes is None:
            writes = self._memo[key] = self._writes(op, tensors)
        return self._apply(op, tensors, writes)

    def _apply(self, op: Op, tensors: list[int], writes: list[tuple[int, int, Axes, tuple[tuple[int, int], ...]]]) -> list[int]:
        """Write what `_writes` computed, in order; returns the values written."""
        changed: list[int] = []
        for ti, d, new_t, refs in writes:
            v = tensors[ti]
            origin = None
            for src, f in refs:
                origin = self._origin_of_factor(op, src, f)
                if origin is not None:
                    break
            self._own(v)
            self.axes[v][d] = new_t
            self.origin[v][d] = origin
            changed.append(v)
        return changed

    def _writes(self, op: Op, tensors: list[int], share_values: bool = False) -> list[tuple[int, int, Axes, tuple[tuple[int, int], ...]]]:
        """What visiting `op` writes, without writing it: (tensor index, dim, new axes, where its origin
        comes from: (source tensor index, factor) candidates, the first with an origin wins).
        share_values: tensors that are one value share one working copy, so a write through one of them
        is seen through the others (an op reading a value twice)."""
        rule = op.rule
        tfs = rule.operands + rule.results
        nf = rule.num_factors
        sizes = rule.sizes
        if share_values:
            copies = {v: list(self.axes[v]) for v in tensors}
            local = [copies[v] for v in tensors]
        else:
            local = [list(self.axes[v]) for v in tensors]
        cands: list[list[tuple[Axes, int]]] = [[] for _ in range(nf)]
        projections: list[list[dict[int, Axes] | None]] = []
        for ti, dims in enumerate(tfs):
            per_dim: list[dict[int, Axes] | None] = []
            vaxes = local[ti]
            for d, factors in enumerate(dims):
                if not factors:
                    per_dim.append(None)
                    continue
                proj, complete = project_dim(vaxes[d], factors, sizes, self.mesh)
                per_dim.append(proj if complete else None)
                if complete:
                    for f in factors:
                        cands[f].append((proj.get(f, ()), ti))
            projections.append(per_dim)
        best, source = self._best(rule, tensors, cands)
        writes = []
        for ti, dims in enumerate(tfs):
            vaxes = local[ti]
            vclosed = self.closed[tensors[ti]]
            for d, factors in enumerate(dims):
                if not factors or vclosed[d]:
                    continue
                proj = projections[ti][d]
                if proj is None:
                    continue
                if not any(len(best[f]) > len(proj.get(f, ())) for f in factors):
                    continue
                new: list[str] = []
                refs: list[tuple[int, int]] = []
                for f in factors:
                    cur = proj.get(f, ())
                    want = cur
                    if best[f] and len(best[f]) > len(cur) and best[f][: len(cur)] == cur:
                        want = best[f]
                        if source[f] >= 0:
                            refs.append((source[f], f))
                    new.extend(want)
                    if self.size_of(want) != sizes[f]:
                        break
                if len(new) <= len(vaxes[d]):
                    continue
                others = {a for dd, ax in enumerate(vaxes) if dd != d for a in ax}
                cut = len(new)
                for k, a in enumerate(new):
                    if a in others or a in new[:k]:
                        cut = k
                        break
                new_t = tuple(new[:cut])
                if len(new_t) > len(vaxes[d]) and new_t[: len(vaxes[d])] == vaxes[d]:
                    vaxes[d] = new_t
                    writes.append((ti, d, new_t, tuple(refs)))
        return writes

    def _best(self, rule: FactorRule, tensors: list[int], cands: list[list[tuple[Axes, int]]]) -> tuple[list[Axes], list[int]]:
        """Per factor: the axes it gets and the tensor they come from (-1: none)."""
        nf = rule.num_factors
        sizes = rule.sizes
        best: list[Axes] = [()] * nf
        source: list[int] = [-1] * nf
        for f in range(nf):
            if not rule.propagatable(f) or not cands[f]:
                continue
            nonempty = [(a, ti) for a, ti in cands[f] if a]
            if not nonempty:
                continue
            winner, wti = max(nonempty, key=lambda c: (self.nbytes[tensors[c[1]]], len(c[0]), -c[1]))
            longest = winner
            for a, ti in nonempty:
                if len(a) > len(longest) and a[: len(winner)] == winner:
                    longest = a
            best[f] = _divisible_prefix(longest, sizes[f], self.mesh)
            source[f] = wti
        # An axis may shard only one factor of the op (of each group of linked factors: rule.components): the
        # factor with the largest source tensor keeps it.
        group = rule.components
        used: dict[int, set[str]] = {}
        for f in sorted((f for f in range(nf) if best[f]), key=lambda f: (-self.nbytes[tensors[source[f]]], f)):
            here = used.setdefault(group[f], set())
            keep = []
            for a in best[f]:
                if a in here:
                    break
                keep.append(a)
            best[f] = tuple(keep)
            here.update(keep)
        return best, source

    def _visit_direct(self, op: Op) -> list[int]:
        """`visit` without the memo (ops that read one value twice, or have no factor class)."""
        self.visits += 1
        if op.rule.num_factors == 0:
            return []
        tensors = op.inputs + op.outputs
        return self._apply(op, tensors, self._writes(op, tensors, share_values=True))

    def _origin_of_factor(self, op: Op, ti: int, f: int) -> Cause | None:
        tensors = op.inputs + op.outputs
        dims = (op.rule.operands + op.rule.results)[ti]
        for d, factors in enumerate(dims):
            if f in factors:
                return self.origin[tensors[ti]][d]
        return None

    # -- driver -----------------------------------------------------------------------------------
    def run_to_fixed_point(self, max_phase: int, only_new: bool = False) -> None:
        ops = self.g.ops
        users = self.g.users
        allowed = [self.phase_of[op.id] <= max_phase for op in ops]
        start = (lambda i: self.phase_of[i] == max_phase) if only_new else (lambda i: allowed[i])
        queue = deque(op.id for op in ops if start(op.id))
        queued = [False] * len(ops)
        for i in queue:
            queued[i] = True
        while queue:
            oid = queue.popleft()
            queued[oid] = False
            for v in self.visit(ops[oid]):
                neighbours = list(users[v])
                p = self.g.values[v].producer
                if p is not None:
                    neighbours.append(p)
                for n in neighbours:
                    if allowed[n] and not queued[n]:
                        queued[n] = True
                        queue.append(n)


def _op_classes(graph: Graph) -> list[int]:
    """Per op: the class of ops with the same rule and tensor sizes (-1: an op reading one value twice);
    computed once per graph."""
    return graph.analysis("visit_classes", lambda: _compute_op_classes(graph))


def _compute_op_classes(graph: Graph) -> list[int]:
    classes: dict[tuple, int] = {}
    out: list[int] = []
    for op in graph.ops:
        tensors = op.inputs + op.outputs
        if len(set(tensors)) < len(tensors):
            out.append(-1)
        else:
            out.append(classes.setdefault((op.rule, tuple(graph.values[v].nbytes for v in tensors)), len(classes)))
    return out


def _fmt(axes: Axes) -> str:
    return "+".join(axes) if axes else "replicated"


def propagate(graph: Graph, mesh: Mapping[str, int], seeds: Sequence[Seed]) -> Propagation:
    """Propagate `seeds` through `graph` on a mesh with the given axis sizes."""
    p = _Propagator(graph, mesh)
    levels = sorted({s.priority for s in seeds}) or [0]
    for level in levels:
        for s in seeds:
            if s.priority == level:
                p.apply_seed(s)
        for phase in (0, 1, 2):
            # Ops of earlier phases are at their fixed point already; only newly allowed ops start
            # queued (the first phase of a level starts with every op, as new seeds may touch any).
            p.run_to_fixed_point(phase, only_new=phase > 0)
    return Propagation(p.axes, p.closed, p.origin, p.visits)
