"""The Parallel Computation Graph: compute ops of the program plus explicit parallel ops.

Every tensor carries its `Sharding`; a compute node runs on each device's local pieces of its inputs
(SPMD), and every change of sharding between a producer and a consumer is a chain of parallel-op nodes
(`shardc.pcg.ops`). PCGs are immutable; rewrites build new ones with `GraphBuilder`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
import weakref
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from jax.sharding import Mesh

from annotations.errors import SourceLine
from shardc.cost.program import SAME_OPERAND_RULES
from shardc.pcg.ops import ParallelOp, comm_bytes, group_size
from shardc.sharding import Sharding, mesh_shape

__all__ = ["Tensor", "Compute", "Region", "Node", "PCG", "CommTask", "GraphBuilder"]


@dataclasses.dataclass(frozen=True, slots=True)
class Tensor:
    """A value of the PCG: global shape, dtype, and how it is laid out over the mesh."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Sharding
    name: str = ""
    reduce_op: str = "sum"  # how its partial values combine, when `sharding.partial` is not empty

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    def local_shape(self, mesh: Mapping[str, int]) -> tuple[int, ...]:
        return self.sharding.local_shape(self.shape, mesh)

    def local_bytes(self, mesh: Mapping[str, int]) -> int:
        return self.itemsize * math.prod(self.local_shape(mesh))


def _dtype(dtype: Any) -> Any:
    """A numpy dtype, or JAX's extended dtype as it is (a typed PRNG key `key<fry>` is no numpy dtype)."""
    import jax

    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return np.dtype(dtype)


# JAX's sharding-in-types annotations of an op's result: the lowering drops them (a PCG's ops run on local
# pieces inside `shard_map`), so two ops that differ only there are one op (to the PCG's key and XLA's CSE alike)
SHARDING_PARAMS = ("sharding", "out_sharding")


def _param_key(params: Mapping[str, Any]) -> str:
    try:
        text = repr(sorted(((k, v) for k, v in params.items() if k not in SHARDING_PARAMS), key=lambda kv: kv[0]))
    except Exception:  # pragma: no cover - exotic params
        text = str(id(params))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True, slots=True)
class Compute:
    """A primitive of the program, run on every device's local pieces (SPMD).

    `prim` is the jax Primitive and `params` its global-shape params (lowering localises them);
    `reduce_op` combines the partial results a sharded reduction factor leaves.
    """

    primitive: str
    prim: Any = dataclasses.field(compare=False, repr=False)
    params: Mapping[str, Any] = dataclasses.field(compare=False, repr=False)
    pkey: str = ""
    source: SourceLine | None = dataclasses.field(default=None, compare=False)
    kind = "compute"

    @classmethod
    def of(cls, prim: Any, params: Mapping[str, Any], source: SourceLine | None = None) -> "Compute":
        return cls(prim.name, prim, dict(params), _param_key(params), source)

    def short(self) -> str:
        return self.primitive

    def __str__(self) -> str:
        return self.primitive


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """A loop or branch of the program (`scan`, `while`, `cond`) whose bodies are PCGs of their own.

    The node's inputs and outputs are the region's operands and results in the eqn's order, in fixed
    *boundary* layouts: each body PCG takes its inputs and gives its outputs in exactly those layouts
    (a scan's stacked operands/results have the scanned dim 0 unsharded and the body sees one slice).
    `bodies`: scan -> (body,), while -> (cond, body), cond -> one per branch. `params` are the eqn's
    params other than its jaxprs (length, reverse, num_consts, num_carry, ...). `trips`: how many times
    a body runs per step (scan length; 1 for while, which XLA cannot count, and cond).
    """

    primitive: str
    params: Mapping[str, Any] = dataclasses.field(compare=False, repr=False)
    bodies: tuple["PCG", ...] = dataclasses.field(compare=False, repr=False)
    bkey: str = ""
    trips: int = 1
    source: SourceLine | None = dataclasses.field(default=None, compare=False)
    kind = "region"

    @classmethod
    def of(cls, primitive: str, params: Mapping[str, Any], bodies: Sequence["PCG"], trips: int,
           source: SourceLine | None = None) -> "Region":
        key = hashlib.sha1(repr((primitive, _param_key(params), [b.key() for b in bodies])).encode()).hexdigest()[:12]
        return cls(primitive, dict(params), tuple(bodies), key, int(trips), source)

    def with_bodies(self, bodies: Sequence["PCG"]) -> "Region":
        return Region.of(self.primitive, self.params, bodies, self.trips, self.source)

    def short(self) -> str:
        return f"{self.primitive}[{len(self.bodies)} bodies, {self.trips} trips]"

    def __str__(self) -> str:
        return self.short()


Operator = ParallelOp | Compute | Region


@dataclasses.dataclass(frozen=True, slots=True)
class Node:
    """One operator application; `cause` says why a parallel op is there."""

    id: int
    op: Operator
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    cause: str = dataclasses.field(default="", compare=False)

    @property
    def is_parallel(self) -> bool:
        return isinstance(self.op, ParallelOp)

    @property
    def is_region(self) -> bool:
        return isinstance(self.op, Region)


@dataclasses.dataclass(frozen=True, slots=True)
class CommTask:
    """A collective of the PCG as a simulator sees it: kind, mesh axes, bytes per device."""

    node: int
    collective: str
    axes: tuple[str, ...]
    in_bytes: int
    out_bytes: int
    sent_bytes: float
    cause: str = ""


def _physical(s: Sharding, mesh: Mapping[str, int]) -> Sharding:
    """`s` without the mesh axes of size 1 (the same pieces on the same devices)."""
    return Sharding(tuple(tuple(a for a in d if mesh[a] > 1) for d in s.dims),
                    frozenset(a for a in s.partial if mesh[a] > 1))


_COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})
_REARRANGING = frozenset({"reshape", "transpose"})  # (the same elements, in another order)
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or"})


def _loop_invariant_operands(region: "Region", body: int) -> list[tuple[int, int]]:
    """(body input index, region operand index) of the operands a loop's body `body` reads unchanged on every
    iteration: a scan's constants, a while loop's condition or body constants (a cond: none); and a scan of one
    trip's carries too, which its body reads as they entered: XLA's while-loop simplifier inlines a loop of one
    trip, so a collective of a carry there is the same collective of the value outside (CSE)."""
    p = region.params
    if region.primitive == "scan":
        reads_as_entered = p["num_consts"] + (p["num_carry"] if p.get("length") == 1 else 0)
        return [(i, i) for i in range(reads_as_entered)]
    if region.primitive == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        return [(i, i) for i in range(cn)] if body == 0 else [(i, cn + i) for i in range(bn)]
    return []


def _region_reads(region: "Region", outs: Sequence[int], operands: int) -> tuple[set[int], list[set[int]]]:
    """When results `outs` (positions) of a region are read: the positions of its operands it reads, and per body
    the positions of the body's results needed (a loop's carries to a fixpoint: a carry the body or the condition
    reads is needed on every trip). Conservative (everything) for a region of another primitive."""
    p, bodies = region.params, region.bodies
    if region.primitive == "scan":
        consts, carries = p["num_consts"], p["num_carry"]
        give = set(outs)
        while True:
            _, reads, _ = bodies[0].live(give)
            more = {i - consts for i in reads if consts <= i < consts + carries} - give
            if not more:
                return reads, [give]
            give |= more
    if region.primitive == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        _, cond_reads, _ = bodies[0].live([0])
        give = set(outs) | {i - cn for i in cond_reads if i >= cn}
        while True:
            _, body_reads, _ = bodies[1].live(give)
            more = {i - bn for i in body_reads if i >= bn} - give
            if not more:
                break
            give |= more
        reads = {i for i in cond_reads if i < cn} | {cn + i for i in body_reads if i < bn} | {cn + bn + k for k in give}
        return reads, [{0}, give]
    if region.primitive == "cond":
        reads = {0}  # (the branch index)
        for body in bodies:
            reads |= {1 + i for i in body.live(outs)[1]}
        return reads, [set(outs) for _ in bodies]
    return set(range(operands)), [set(range(len(b.outputs))) for b in bodies]


def _without_unit_axes(op: Any, mesh: Mapping[str, int]) -> Any:
    """Parallel op `op` over its axes of size > 1 only (what it does on the devices)."""
    return dataclasses.replace(op, axes=tuple(a for a in op.axes if mesh[a] > 1))


def _one_of_same(primitive: str, ins: Sequence[int]) -> int | None:
    """The operand an op is to XLA's simplifier when some of its operands are one value
    (`shardc.cost.program.SAME_OPERAND_RULES`: a select of one case, max/min of one value), else None."""
    rule = SAME_OPERAND_RULES.get(primitive)
    dropped = rule(len(ins), lambda i, j: ins[i] == ins[j]) if rule is not None else ()
    return next((t for i, t in enumerate(ins) if i not in dropped), None) if dropped else None


def _reduced_root(t: int, primitive: str, rearranged: Mapping[int, int],
                  partial: Mapping[int, tuple[str, int]]) -> int:
    """What a reduction `primitive` over every dim of tensor `t` reduces, to XLA's simplifier: through reshapes
    and transposes (the same elements) and earlier reductions of the same kind over some dims (a sum of partial
    sums is one sum)."""
    while True:
        t = rearranged.get(t, t)
        p = partial.get(t)
        if p is None or p[0] != primitive:
            return t
        t = p[1]


def _trailing_reduction(n: Node, t: int, reshaped: Mapping[int, int], tensors: Sequence[Tensor]
                        ) -> tuple[int, int] | None:
    """(root, k) when reduction node `n` reduces every dim of tensor `t` but its first k, and `t` is (through reshapes
    keeping those k dims) tensor `root`: the same sums of the same elements as reducing `root` over all but its first
    k dims, to XLA's simplifier; else None."""
    axes = n.op.params.get("axes")
    rank = tensors[t].rank
    if axes is None or rank == 0:
        return None
    k = rank - len(axes)
    if sorted(int(a) for a in axes) != list(range(k, rank)):
        return None
    head = tensors[t].shape[:k]
    while t in reshaped and tensors[reshaped[t]].shape[:k] == head and tensors[reshaped[t]].rank > k:
        t = reshaped[t]
    return t, k


def _dot_of_broadcast_key(op: Compute, operands: Sequence[Tensor], constant: Sequence[frozenset[int] | None]
                          ) -> tuple[Any, ...]:
    """A `dot_general`'s key to XLA's simplifier when an operand is a broadcast: along a dim it was broadcast on, that
    operand is constant, so which of its broadcast dims of one size is contracted, and which is kept, makes the same
    values (XLA rewrites such a dot as a product and a sum, where the broadcast dims are gone)."""
    (contracting, batch) = op.params["dimension_numbers"]
    out: list[Any] = ["dot_general", tuple(map(tuple, batch)), str(op.params.get("preferred_element_type")),
                      str(op.params.get("precision"))]
    for x, dims, batched, const in zip(operands, contracting, batch, constant):
        name = lambda d: ("broadcast", x.shape[d]) if const is not None and d in const else d  # noqa: E731
        free = [d for d in range(x.rank) if d not in dims and d not in batched]
        out += [tuple(name(int(d)) for d in dims), tuple(name(d) for d in free)]
    return tuple(out)


def _is_identity(op: Compute, a: Tensor, r: Tensor) -> bool:
    """Whether `op` (reading `a` first, making `r`) hands its operand on unchanged."""
    if (a.shape, a.dtype, a.sharding) != (r.shape, r.dtype, r.sharding):
        return False
    if op.primitive == "pad":
        return all(tuple(c) == (0, 0, 0) for c in op.params.get("padding_config", ()))
    return op.primitive in ("reshape", "convert_element_type", "copy", "copy_p")


@dataclasses.dataclass(frozen=True, eq=False)
class PCG:
    """Tensors (by id), nodes in topological order, inputs/outputs, constants (tensor id -> array)."""

    mesh: Mesh
    tensors: tuple[Tensor, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    consts: Mapping[int, Any] = dataclasses.field(default_factory=dict)

    # -- structure ----------------------------------------------------------------------------------
    @functools.cached_property
    def mesh_sizes(self) -> dict[str, int]:
        return mesh_shape(self.mesh)

    @functools.cached_property
    def _producers(self) -> dict[int, tuple[Node, int]]:
        return {t: (n, i) for n in self.nodes for i, t in enumerate(n.outputs)}

    @functools.cached_property
    def _users(self) -> dict[int, list[Node]]:
        users: dict[int, list[Node]] = collections.defaultdict(list)
        for n in self.nodes:
            for t in dict.fromkeys(n.inputs):
                users[t].append(n)
        return users

    def producer(self, tid: int) -> tuple[Node, int] | None:
        """The node making tensor `tid` and the output index, or None for inputs and constants."""
        return self._producers.get(tid)

    def users(self, tid: int) -> list[Node]:
        return self._users.get(tid, [])

    def tensor(self, tid: int) -> Tensor:
        return self.tensors[tid]

    def parallel_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.is_parallel]

    def region_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.is_region]

    def uneven(self, since: int = 0, nodes: Sequence[Node] | None = None) -> str | None:
        """A tensor some node reads or makes that is split into unequal pieces (XLA pads the last; a
        `shard_map` has equal ones), described; None when there is none (in region bodies neither).
        `since`: only tensors numbered from there on (those a rewrite of an even PCG added; its bodies too);
        `nodes`: only those of the nodes (in order), when they are all that read or make such tensors."""
        m = self.mesh_sizes
        for n in self.nodes if nodes is None else nodes:
            for tid in (*n.inputs, *n.outputs):
                if tid < since:
                    continue
                t = self.tensors[tid]
                for d, axes in enumerate(t.sharding.dims):
                    k = math.prod(m[a] for a in axes)
                    if d < len(t.shape) and t.shape[d] % k:
                        return (f"{t.name or f'%{tid}'} dim {d} (size {t.shape[d]}) split {k} ways over "
                                f"{tuple(axes)}")
            for body in (n.op.bodies if n.is_region and not since else ()):
                if (inner := body.uneven()) is not None:
                    return inner
        return None

    # -- summaries ----------------------------------------------------------------------------------
    def collectives(self) -> collections.Counter:
        """How many of each HLO collective the lowered program has (local slices not counted); a loop or
        branch body counts once, as its HLO computation holds it once. Two nodes of one parallel op on one
        value (a rewrite pushing a combine into both operands of `x + x`) are one: XLA's CSE merges them; and
        so are a collective of a loop-invariant value (a loop's constant operand, or made from such operands
        only) and the same collective of that value anywhere else, loops' bodies included: XLA's loop-invariant
        code motion takes it out of its loops first."""
        c: collections.Counter = collections.Counter()
        self._count_collectives(c, set(), {}, (), range(len(self.outputs)))
        return c

    def live(self, read: Iterable[int]) -> tuple[set[int], set[int], dict[int, list[set[int]]]]:
        """What the program computes when only outputs `read` (positions) are read: the ids of the nodes it runs,
        the positions of the inputs it reads, and per region node run the results each body must give. A loop none
        of whose results is read is not run (JAX's dead-code elimination drops it from the lowering, and XLA what
        only dead results need); a loop's carry is needed where a needed result or the loop itself reads it."""
        same = self._same_values
        needed = {self.outputs[i] for i in read}
        run: set[int] = set()
        bodies_give: dict[int, list[set[int]]] = {}
        for n in reversed(self.nodes):
            outs = [k for k, t in enumerate(n.outputs) if t in needed]
            if not outs:
                continue
            if n.is_region and self.duplicate(n):  # (the lowering reads the earlier region's results instead)
                needed.update(same.get(n.outputs[k], n.outputs[k]) for k in outs)
                continue
            run.add(n.id)
            if n.is_region:
                reads, bodies_give[n.id] = _region_reads(n.op, outs, len(n.inputs))
                needed.update(n.inputs[i] for i in reads)
            else:
                needed.update(n.inputs)
        return run, {i for i, t in enumerate(self.inputs) if t in needed}, bodies_give

    def _count_collectives(self, c: collections.Counter, seen: set, hoisted: Mapping[int, Any],
                           scope: tuple[int, ...], read: Iterable[int]) -> None:
        """`collectives()` of this PCG, into `c`; `seen`: the keys of the collectives counted anywhere;
        `hoisted`: per input of this (body) PCG that is loop-invariant, the key of the value outside the loops;
        `scope`: where this PCG is (region node ids and body indices from the top); `read`: the positions of the
        outputs read (what no read output needs is not run, `live`)."""
        run, _, bodies_give = self.live(read)
        m = self.mesh_sizes
        same = self._same_values
        key_of = dict(hoisted)  # tensor -> what XLA computes it as outside the loops (invariant tensors only)
        for n in self.nodes:  # (what only invariant tensors make is invariant too)
            ins = [same.get(t, t) for t in n.inputs]
            if not n.is_region and ins and all(t in key_of for t in ins):
                op = _without_unit_axes(n.op, m) if n.is_parallel else n.op
                for k, t in enumerate(n.outputs):
                    key_of.setdefault(same.get(t, t), (op, tuple(key_of[u] for u in ins), k))
        here = lambda t: key_of.get(same.get(t, t), (scope, same.get(t, t)))  # noqa: E731
        for n in self.parallel_nodes():
            key = (_without_unit_axes(n.op, m), here(n.inputs[0]))
            if n.id in run and n.op.collective not in ("none", "slice") and self._moves(n) and key not in seen:
                seen.add(key)
                c[n.op.collective] += 1
        for n in self.region_nodes():
            if self.duplicate(n) or n.id not in run:
                continue
            for b, body in enumerate(n.op.bodies):
                body._count_collectives(c, seen, {body.inputs[i]: here(n.inputs[j])
                                                  for i, j in _loop_invariant_operands(n.op, b)}, scope + (n.id, b),
                                        bodies_give[n.id][b])

    def same_values(self) -> dict[int, int]:
        """Per tensor XLA computes as an earlier one, that one (see `_same_values`)."""
        return self._same_values

    def physical_op(self, n: Node) -> Any:
        """Parallel node `n`'s op over its mesh axes of size > 1 only (what it does on the devices)."""
        return _without_unit_axes(n.op, self.mesh_sizes)

    def duplicate(self, n: Node) -> bool:
        """Whether region node `n` computes what an earlier one does (`_same_values`): XLA keeps only that one,
        and the lowering runs only that one."""
        return n.id in self._duplicate_regions

    @functools.cached_property
    def _duplicate_regions(self) -> frozenset[int]:
        regions = self.region_nodes()
        if len(regions) < 2:  # (no region to be a copy of: `_same_values` need not run)
            return frozenset()
        same = self._same_values
        return frozenset(n.id for n in regions if n.outputs and all(t in same for t in n.outputs))

    @functools.cached_property
    def _same_values(self) -> dict[int, int]:
        """Per tensor, the first tensor XLA computes it as (its CSE: the same op on the same values, operands of
        a commutative op in any order; and through what its simplifier removes: a pad of nothing, a reshape,
        convert or copy changing neither shape nor dtype, a select of one value, a collective over axes of size
        1); a reduction over every dim of a reshape or transpose of x, or of the same reduction of x over some
        dims, is that reduction of x; one over all but the first k dims of a reshape of x keeping those is that
        reduction of x; dots of a broadcast operand contracting or keeping different dims it was broadcast along
        are one); a constant of the value and layout of an earlier one; and a loop or branch with the same bodies
        (`structure`) as an earlier one, on the same values."""
        same: dict[int, int] = {}
        first: dict[tuple[Any, ...], Node] = {}
        rearranged: dict[int, int] = {}  # tensor -> what a chain of reshapes/transposes makes it of
        partial: dict[int, tuple[str, int]] = {}  # tensor -> (the reduction over some dims making it, of what)
        reshaped: dict[int, int] = {}  # tensor -> the tensor a reshape made it of
        broadcast: dict[int, frozenset[int]] = {}  # tensor -> the dims a broadcast made it constant along
        m = self.mesh_sizes
        equal: dict[tuple[Any, ...], int] = {}  # (constants of one value and layout are one to XLA's CSE)
        for t, value in self.consts.items():
            a = np.asarray(value)
            u = equal.setdefault((a.dtype.str, a.shape, a.tobytes(), _physical(self.tensors[t].sharding, m)), t)
            if u != t:
                same[t] = u
        for n in self.nodes:
            ins = tuple(same.get(t, t) for t in n.inputs)
            if not n.is_parallel and n.op.primitive in _REARRANGING and len(ins) == 1:
                rearranged[n.outputs[0]] = rearranged.get(ins[0], ins[0])
            reduction = not n.is_parallel and n.op.primitive in _REDUCTIONS and len(ins) == 1 and len(n.outputs) == 1
            if not n.is_parallel and n.op.primitive == "reshape" and len(ins) == 1:
                reshaped[n.outputs[0]] = ins[0]
            if not n.is_parallel and n.op.primitive == "broadcast_in_dim" and len(n.outputs) == 1:
                kept_dims = {int(d) for d in n.op.params.get("broadcast_dimensions", ())}
                broadcast[n.outputs[0]] = frozenset(range(self.tensors[n.outputs[0]].rank)) - kept_dims
            if reduction and self.tensors[n.outputs[0]].shape:  # (a reduction over some dims: see below)
                partial[n.outputs[0]] = (n.op.primitive, _reduced_root(ins[0], n.op.primitive, rearranged, partial))
                trailing = _trailing_reduction(n, ins[0], reshaped, self.tensors)
                if trailing is not None:  # (XLA's simplifier: reduce(reshape(x)) -> reduce(x) over the same elements)
                    key = ((n.op.primitive, "trailing dims"), trailing,
                           _physical(self.tensors[n.outputs[0]].sharding, m))
                    m1 = first.setdefault(key, n)
                    if m1.outputs[0] != n.outputs[0]:
                        same[n.outputs[0]] = same.get(m1.outputs[0], m1.outputs[0])
                        continue
            if reduction and not self.tensors[n.outputs[0]].shape:
                # (XLA's simplifier: reduce(reshape(x)) -> reduce(x), and reduce(reduce(x)) -> one reduce of x)
                key = ((n.op.primitive, "every dim"), (_reduced_root(ins[0], n.op.primitive, rearranged, partial),),
                       _physical(self.tensors[n.outputs[0]].sharding, m))
                m1 = first.setdefault(key, n)
                if m1.outputs[0] != n.outputs[0]:
                    same[n.outputs[0]] = same.get(m1.outputs[0], m1.outputs[0])
                continue
            if n.is_parallel and not self._moves(n) \
                    or not n.is_parallel and len(n.inputs) >= 1 and len(n.outputs) == 1 \
                    and _is_identity(n.op, self.tensors[n.inputs[0]], self.tensors[n.outputs[0]]):
                same[n.outputs[0]] = ins[0]  # (a collective over axes of size 1 moves nothing)
                continue
            if not n.is_parallel and (kept := _one_of_same(n.op.primitive, ins)) is not None:
                same[n.outputs[0]] = kept  # (`select(p, x, x)`, `max(x, x)`: x, to XLA's simplifier)
                continue
            made = tuple((self.tensors[t].shape, str(self.tensors[t].dtype), _physical(self.tensors[t].sharding, m))
                         for t in n.outputs)
            op = _without_unit_axes(n.op, m) if n.is_parallel else n.op
            if n.is_region:  # (two loops of the same bodies on the same values: XLA's CSE keeps one)
                op = (n.op.primitive, n.op.bkey, tuple(b.structure for b in n.op.bodies))
            if not n.is_parallel and n.op.primitive == "dot_general" and len(ins) == 2 \
                    and (ins[0] in broadcast or ins[1] in broadcast):
                op = _dot_of_broadcast_key(n.op, [self.tensors[t] for t in ins], [broadcast.get(t) for t in ins])
            if not n.is_parallel and n.op.primitive in _COMMUTATIVE:
                ins = tuple(sorted(ins))  # (XLA's CSE takes b * a for a * b)
            m1 = first.setdefault((op, ins, made), n)
            for t, u in zip(n.outputs, m1.outputs):
                if t != u:
                    same[t] = same.get(u, u)
        return same

    def _moves(self, n: Node) -> bool:
        return group_size(n.op.axes, self.mesh_sizes) > 1

    def communication(self) -> list["CommTask"]:
        """One task per parallel op that moves data: what a simulator schedules on the links of the
        op's mesh axes."""
        m = self.mesh_sizes
        out = []
        for n in self.parallel_nodes():
            if n.op.collective in ("none", "slice") or not self._moves(n):
                continue
            t_in, t_out = self.tensors[n.inputs[0]], self.tensors[n.outputs[0]]
            out.append(CommTask(n.id, n.op.collective, n.op.axes, t_in.local_bytes(m), t_out.local_bytes(m),
                                comm_bytes(n.op, t_in.local_bytes(m), m), n.cause))
        return out

    def comm_bytes(self) -> float:
        """Bytes each device sends over all parallel ops per step (loop bodies times their trips)."""
        m = self.mesh_sizes
        own = sum(comm_bytes(n.op, self.tensors[n.inputs[0]].local_bytes(m), m) for n in self.parallel_nodes())
        return own + sum(n.op.trips * sum(b.comm_bytes() for b in n.op.bodies) for n in self.region_nodes())

    @functools.cached_property
    def structure(self) -> str:
        """`key` with the constants' values, nested bodies' included: two PCGs of one `structure` compute the
        same function of their inputs (`key` names a constant by its position only)."""
        h = hashlib.sha1(self.key().encode())
        for value in self.consts.values():
            a = np.asarray(value)
            h.update(repr((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
        for n in self.region_nodes():
            for body in n.op.bodies:
                h.update(body.structure.encode())
        return h.hexdigest()

    def key(self) -> str:
        """A structural hash (same nodes on same tensors -> same key), for deduplicating rewrites (computed
        once per PCG: the rewriting asks for it to skip a PCG it has seen and again to memoise its cost)."""
        return self._key

    @functools.cached_property
    def _key(self) -> str:
        names: dict[int, int] = {}
        for t in self.inputs:
            names[t] = len(names)
        for t in self.consts:
            names.setdefault(t, len(names))
        parts: list[str] = []
        text, name, tensors = _TEXTS.get, names.get, self.tensors
        for n in self.nodes:
            parts.append(text(n.op, repr))
            parts.append(",".join([str(name(t, -1)) for t in n.inputs]))
            for t in n.outputs:
                names[t] = len(names)
                parts.append(text(tensors[t].sharding, str))
        parts.append(",".join([str(name(t, -1)) for t in self.outputs]))
        return hashlib.sha1("\n".join(parts).encode()).hexdigest()

    def __str__(self) -> str:
        lines = [f"PCG on mesh {self.mesh_sizes}: {len(self.nodes)} nodes, "
                 f"{len(self.parallel_nodes())} parallel ops, {self.comm_bytes():.0f} B sent per device"]
        for n in self.nodes:
            outs = ", ".join(f"%{t}:{self.tensors[t].sharding}" for t in n.outputs)
            ins = ", ".join(f"%{t}" for t in n.inputs)
            lines.append(f"  {outs} = {n.op.short()}({ins})")
            for i, body in enumerate(n.op.bodies if n.is_region else ()):
                lines.extend("    " + ln for ln in [f"body {i}:"] + str(body).splitlines())
        lines.append("  return " + ", ".join(f"%{t}" for t in self.outputs))
        return "\n".join(lines)


class ObjectMemo:
    """Values computed from objects, memoised per object (by identity; the object is kept alive so that its id
    is not reused): a rewrite's PCG shares all but a few operators and layouts with the PCG it came from, so
    what is derived from each (its text for a key, the rule ops it can be) is computed once for all of them."""

    def __init__(self, kept: int = 200_000) -> None:
        self._table: dict[int, tuple[Any, Any]] = {}
        self._kept = kept

    def get(self, x: Any, compute: Any) -> Any:
        """`compute(x)`, memoised for object `x`."""
        hit = self._table.get(id(x))
        if hit is None or hit[0] is not x:
            if len(self._table) >= self._kept:
                self._table.clear()
            hit = self._table[id(x)] = (x, compute(x))
        return hit[1]


_TEXTS = ObjectMemo()  # operator and layout texts of PCG keys
_CLEAN: "weakref.WeakSet[PCG]" = weakref.WeakSet()  # PCGs in topological order with no dead node (`finish`'s)


def is_clean(pcg: PCG) -> bool:
    """Whether `pcg` is known to be in topological order with no dead node (made by `GraphBuilder.finish` or
    `shardc.pcg.splice`): a rewrite of it may be spliced into its node list."""
    return pcg in _CLEAN


def mark_clean(pcg: PCG) -> PCG:
    """Record that `pcg` is in topological order with no dead node."""
    _CLEAN.add(pcg)
    return pcg


class GraphBuilder:
    """Mutable construction of a PCG: add tensors and nodes, then `finish()` (topological order and
    dead-node removal)."""

    def __init__(self, mesh: Mesh, tensors: Iterable[Tensor] = (), consts: Mapping[int, Any] | None = None, *,
                 first_node_id: int = 0) -> None:
        self.mesh = mesh
        self.tensors: list[Tensor] = list(tensors)
        self.nodes: list[tuple[float, Node]] = []
        self.consts: dict[int, Any] = dict(consts or {})
        self._next_node = first_node_id  # (new nodes' ids; `keep_node` nodes keep theirs, below it)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return mesh_shape(self.mesh)

    def add_tensor(self, shape: Sequence[int], dtype: Any, sharding: Sharding, name: str = "",
                   reduce_op: str = "sum") -> int:
        tid = len(self.tensors)
        self.tensors.append(Tensor(tid, tuple(int(s) for s in shape), _dtype(dtype), sharding, name, reduce_op))
        return tid

    def add_const(self, value: Any, sharding: Sharding | None = None, name: str = "constant") -> int:
        arr = np.asarray(value)
        tid = self.add_tensor(arr.shape, arr.dtype, sharding or Sharding(((),) * arr.ndim), name)
        self.consts[tid] = value
        return tid

    def add_node(self, op: Operator, inputs: Sequence[int], outputs: Sequence[int], *, cause: str = "",
                 order: float | None = None) -> Node:
        node = Node(self._next_node, op, tuple(inputs), tuple(outputs), cause)
        self._next_node += 1
        self.nodes.append((float(len(self.nodes)) if order is None else order, node))
        return node

    def keep_node(self, node: Node, order: float) -> None:
        """Add a node of another PCG of these tensors as it is, id included (its id must be below
        `first_node_id`)."""
        self.nodes.append((order, node))

    def parallel(self, op: ParallelOp, tid: int, *, cause: str = "", order: float | None = None) -> int:
        """Apply a parallel op to tensor `tid`; returns the new tensor."""
        t = self.tensors[tid]
        out = self.add_tensor(t.shape, t.dtype, op.apply(t.sharding), t.name, t.reduce_op)
        self.add_node(op, [tid], [out], cause=cause, order=order)
        return out

    def finish(self, inputs: Sequence[int], outputs: Sequence[int]) -> PCG:
        nodes = _toposort([n for _, n in sorted(self.nodes, key=lambda p: p[0])], set(inputs) | set(self.consts))
        nodes = _dead_code(nodes, set(outputs))
        live = {t for n in nodes for t in n.inputs} | set(outputs)
        consts = {t: v for t, v in self.consts.items() if t in live}
        pcg = PCG(self.mesh, tuple(self.tensors), tuple(nodes), tuple(inputs), tuple(outputs), consts)
        return mark_clean(pcg)  # (a rewrite of it may be spliced into its node list: shardc.pcg.splice)


def _toposort(nodes: list[Node], available: set[int]) -> list[Node]:
    """Stable topological order: keep the given order where the data dependencies allow."""
    ready = set(available)
    out: list[Node] = []
    pending = list(nodes)
    while pending:
        rest = []
        progressed = False
        for n in pending:
            if all(t in ready for t in n.inputs):
                out.append(n)
                ready.update(n.outputs)
                progressed = True
            else:
                rest.append(n)
        if not progressed:
            missing = sorted({t for n in rest for t in n.inputs if t not in ready})
            raise ValueError(f"PCG has a cycle or undefined tensors {missing[:8]}")
        pending = rest
    return out


def _dead_code(nodes: list[Node], outputs: set[int]) -> list[Node]:
    needed = set(outputs)
    keep: list[Node] = []
    for n in reversed(nodes):
        if any(t in needed for t in n.outputs):
            keep.append(n)
            needed.update(n.inputs)
    return keep[::-1]
