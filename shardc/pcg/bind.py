"""How rule-language ops meet PCG nodes: recognising a node as a rule op (matching), making a node for a
rule op (building), and the sharding of what it makes (transfer). One table entry per rule op.

The per-device meaning of a compute node is the primitive applied to each device's pieces, which is
exactly the rule op's semantics (`shardc.pcg.semantics`) — so a proved rule holds on every PCG it
matches. Shardings of new tensors only need to give the right local shapes and to never claim that a
tensor is replicated over the group when its pieces may differ (that claim is what `global` variables
of later matches rely on).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from shardc.pcg.graph import PCG, Compute, GraphBuilder, Node, Tensor
from shardc.pcg.ops import (AllToAll, Axes, Combine, CollectivePermute, ParallelOp, Partition, Reduce, ReduceScatter,
                            Replicate, group_size)
from shardc.rules.elementwise import BINARY_ELEMENTWISE, NARY_ELEMENTWISE, UNARY_ELEMENTWISE
from shardc.sharding import Sharding

__all__ = ["RewriteError", "FnRef", "match_node", "build_parallel", "build_compute", "op_kinds"]


class RewriteError(Exception):
    """A match whose replacement cannot be built on this PCG (shapes, layouts)."""


ELEMENTWISE = frozenset(UNARY_ELEMENTWISE + BINARY_ELEMENTWISE + NARY_ELEMENTWISE + ("add_any",)) - {
    "random_seed", "random_clone", "random_fold_in", "iota_2x32_shape", "platform_index", "threefry2x32",
}


@dataclasses.dataclass(frozen=True)
class FnRef:
    """An elementwise node bound to a function variable: its operator and, per input position, the
    rank-0 tensor it captures (or None where a rule argument goes)."""

    op: Compute
    slots: tuple[int | None, ...]

    def key(self) -> tuple:
        return (self.op.primitive, self.op.pkey, self.slots)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FnRef) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())


# -- matching ---------------------------------------------------------------------------------------

Matched = tuple[tuple[Any, ...], list[int]]  # (param values, argument tensors)


def _shift_of(op: CollectivePermute, mesh: dict[str, int]) -> int | None:
    sizes = [mesh[a] for a in op.axes]

    def lin(c):
        v = 0
        for ci, n in zip(c, sizes):
            v = v * n + ci
        return v

    n = group_size(op.axes, mesh)
    shifts = {(lin(dst) - lin(src)) % n for dst, src in op.source_of(mesh).items()}
    return shifts.pop() if len(shifts) == 1 else None


def _parallel(pcg: PCG, node: Node, name: str) -> Matched | None:
    op = node.op
    arg = [node.inputs[0]]
    if name == "partition" and type(op) is Partition:
        return (op.dim,), arg
    if name == "combine" and type(op) is Combine:
        return (op.dim,), arg
    if name == "replicate" and type(op) is Replicate:
        return (), arg
    if name == "reduce" and type(op) is Reduce and op.op == "sum":
        return (), arg
    if name == "reduce_scatter" and type(op) is ReduceScatter:
        return (op.dim,), arg
    if name == "all_to_all" and type(op) is AllToAll:
        return (op.src, op.dst), arg
    if name == "permute" and type(op) is CollectivePermute:
        k = _shift_of(op, pcg.mesh_sizes)
        return ((k,), arg) if k is not None else None
    return None


def _split_args(pcg: PCG, node: Node, arity: int) -> tuple[list[int], tuple[int | None, ...]] | None:
    """The `arity` inputs shaped like the output, and the captured rank-0 inputs."""
    shape = pcg.tensors[node.outputs[0]].shape
    args: list[int] = []
    slots: list[int | None] = []
    for t in node.inputs:
        tt = pcg.tensors[t]
        if tt.shape == shape and tt.rank > 0:
            args.append(t)
            slots.append(None)
        elif tt.rank == 0 and not tt.sharding.partial:
            slots.append(t)
        else:
            return None
    if len(args) != arity:
        return None
    return args, tuple(slots)


def _compute(pcg: PCG, node: Node, name: str) -> Matched | None:
    op = node.op
    if not isinstance(op, Compute) or len(node.outputs) != 1:
        return None
    p = op.primitive
    ins = [pcg.tensors[t] for t in node.inputs]
    out = pcg.tensors[node.outputs[0]]
    if name in ("ew1", "ew2"):
        if p not in ELEMENTWISE:
            return None
        split = _split_args(pcg, node, 1 if name == "ew1" else 2)
        if split is None:
            return None
        return (FnRef(op, split[1]),), split[0]
    if name in ("add", "sub", "mul"):
        want = {"add": ("add", "add_any"), "sub": ("sub",), "mul": ("mul",)}[name]
        if p in want and len(ins) == 2 and ins[0].shape == ins[1].shape == out.shape:
            return (), list(node.inputs)
        return None
    if name == "neg":
        return ((), list(node.inputs)) if p == "neg" else None
    if name == "scale":
        if p != "mul" or len(ins) != 2:
            return None
        for i, j in ((0, 1), (1, 0)):
            if ins[j].rank == 0 and node.inputs[j] in pcg.consts and ins[i].shape == out.shape:
                return (float(np.asarray(pcg.consts[node.inputs[j]])),), [node.inputs[i]]
        return None
    if name == "dot":
        if p != "dot_general" or len(ins) != 2:
            return None
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        if tuple(lc) == (ins[0].rank - 1,) and tuple(rc) == (0,) and not lb and not rb:
            return (), list(node.inputs)
        return None
    if name == "dotc":
        if p != "dot_general" or len(ins) != 2:
            return None
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        plain = tuple(lc) == (ins[0].rank - 1,) and tuple(rc) == (0,)  # (the `dot` rules take `x @ w`)
        if len(lc) == len(rc) == 1 and not lb and not rb and not plain:
            return (int(lc[0]), int(rc[0])), list(node.inputs)
        return None
    if name == "transpose":
        return ((tuple(op.params["permutation"]),), list(node.inputs)) if p == "transpose" else None
    if name == "concat":
        if p == "concatenate" and len(ins) == 2:
            return (op.params["dimension"],), list(node.inputs)
        return None
    if name == "chunk":
        if p != "slice" or (op.params["strides"] and any(s != 1 for s in op.params["strides"])):
            return None
        x = ins[0]
        cut = [d for d in range(x.rank) if (op.params["start_indices"][d], op.params["limit_indices"][d]) != (0, x.shape[d])]
        if len(cut) != 1:
            return None
        d = cut[0]
        start, stop = op.params["start_indices"][d], op.params["limit_indices"][d]
        size = stop - start
        if size <= 0 or x.shape[d] % size or start % size:
            return None
        return (d, start // size, x.shape[d] // size), list(node.inputs)
    if name == "sum":
        if p == "reduce_sum" and len(op.params["axes"]) == 1:
            return (op.params["axes"][0],), list(node.inputs)
        return None
    if name in ("merge", "unmerge"):
        if p != "reshape" or op.params.get("dimensions") is not None:
            return None
        return _reshape_kind(ins[0].shape, out.shape, name, list(node.inputs))
    return None


def _reshape_kind(a: tuple[int, ...], b: tuple[int, ...], name: str, args: list[int]) -> Matched | None:
    """A reshape that merges dims d, d+1 (merge[d]) or splits dim d into (size/m, m) (unmerge[d, m])."""
    if name == "merge" and len(b) == len(a) - 1:
        for d in range(len(b)):
            if a[:d] == b[:d] and a[d + 2:] == b[d + 1:] and a[d] * a[d + 1] == b[d]:
                return (d,), args
    if name == "unmerge" and len(b) == len(a) + 1:
        for d in range(len(a)):
            if a[:d] == b[:d] and a[d + 1:] == b[d + 2:] and b[d] * b[d + 1] == a[d]:
                return (d, b[d + 1]), args
    return None


def match_node(pcg: PCG, node: Node, name: str, parallel: bool) -> Matched | None:
    """Is `node` an instance of rule op `name`? Its parameter values and argument tensors if so."""
    if parallel:
        return _parallel(pcg, node, name) if isinstance(node.op, ParallelOp) else None
    return _compute(pcg, node, name)


def op_kinds(op: Any) -> set[str]:
    """Rule ops a node of operator `op` could be (a cheap prefilter for matching)."""
    if isinstance(op, ParallelOp):
        return {op.kind}
    p = op.primitive
    kinds = set()
    if p in ELEMENTWISE:
        kinds |= {"ew1", "ew2"}
    kinds |= {"add": {"add"}, "add_any": {"add"}, "sub": {"sub"}, "mul": {"mul", "scale"}, "neg": {"neg"},
              "dot_general": {"dot", "dotc"}, "transpose": {"transpose"}, "concatenate": {"concat"}, "slice": {"chunk"},
              "reduce_sum": {"sum"}, "reshape": {"merge", "unmerge"}}.get(p, set())
    return kinds


# -- building ---------------------------------------------------------------------------------------

def build_parallel(name: str, params: Sequence[Any], axes: Axes) -> ParallelOp:
    if name == "partition":
        return Partition(axes, params[0])
    if name == "combine":
        return Combine(axes, params[0])
    if name == "replicate":
        return Replicate(axes)
    if name == "reduce":
        return Reduce(axes)
    if name == "reduce_scatter":
        return ReduceScatter(axes, params[0])
    if name == "all_to_all":
        return AllToAll(axes, params[0], params[1])
    raise RewriteError(f"{name} cannot be built on a PCG (it has no mesh-axes form)")


def _valid(s: Sharding, shape: Sequence[int], mesh: dict[str, int]) -> Sharding:
    seen: list[str] = [a for d in s.dims for a in d] + sorted(s.partial)
    if len(seen) != len(set(seen)):
        raise RewriteError(f"layout {s} uses an axis twice")
    for size, n in zip(shape, s.shards_per_dim(mesh)):
        if size % n:
            raise RewriteError(f"layout {s} does not divide shape {tuple(shape)}")
    return s


def _same_layout(ss: Sequence[Sharding], what: str) -> Sharding:
    if any(s.dims != ss[0].dims for s in ss):
        raise RewriteError(f"{what}: operands are laid out differently ({', '.join(map(str, ss))})")
    return Sharding(ss[0].dims, frozenset().union(*[s.partial for s in ss]))


def _transfer(name: str, params: Sequence[Any], ins: Sequence[Tensor]) -> Sharding:
    ss = [t.sharding for t in ins if t.rank > 0]
    if not ss:  # (scalars only: a scalar, partial where they are)
        return Sharding((), frozenset().union(*[t.sharding.partial for t in ins]))
    if name in ("add", "sub", "mul", "neg", "scale", "ew1", "ew2"):
        return _same_layout(ss, name)
    if name == "transpose":
        s = ss[0]
        return Sharding(tuple(s.dims[i] for i in params[0]), s.partial)
    if name == "concat":
        return _same_layout(ss, name)
    if name == "chunk":
        return ss[0]
    if name == "sum":
        s, d = ss[0], params[0]
        return Sharding(s.dims[:d] + s.dims[d + 1:], s.partial | set(s.dims[d]))
    if name == "merge":
        s, d = ss[0], params[0]
        if s.dims[d + 1]:
            raise RewriteError(f"merge: dim {d + 1} of {s} is sharded")
        return Sharding(s.dims[:d] + (s.dims[d],) + s.dims[d + 2:], s.partial)
    if name == "unmerge":
        s, d = ss[0], params[0]
        return Sharding(s.dims[:d] + (s.dims[d], ()) + s.dims[d + 1:], s.partial)
    if name == "dot":
        x, w = ss
        if x.dims[-1] != w.dims[0]:
            raise RewriteError(f"dot: contracting dims laid out differently ({x}, {w})")
        return Sharding(x.dims[:-1] + w.dims[1:], x.partial | w.partial | set(x.dims[-1]))
    if name == "dotc":
        (x, w), (a, b) = ss, params
        if x.dims[a] != w.dims[b]:
            raise RewriteError(f"dotc: contracting dims laid out differently ({x}, {w})")
        return Sharding(x.dims[:a] + x.dims[a + 1:] + w.dims[:b] + w.dims[b + 1:],
                        x.partial | w.partial | set(x.dims[a]))
    raise RewriteError(f"no layout rule for {name}")  # pragma: no cover


def _jaxpr_eqn(fn: Callable[..., Any], ins: Sequence[Tensor]) -> Any:
    avals = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in ins]
    try:
        closed = jax.make_jaxpr(fn)(*avals)
    except (TypeError, ValueError) as e:
        raise RewriteError(str(e)) from None
    eqns = closed.jaxpr.eqns
    if len(eqns) != 1:
        raise RewriteError(f"expected one primitive, got {[e.primitive.name for e in eqns]}")
    return closed.jaxpr, eqns[0]


def build_compute(b: GraphBuilder, name: str, params: Sequence[Any], args: Sequence[int], *,
                  order: float | None = None, cause: str = "") -> int:
    """Add a compute node for rule op `name` on tensors `args`; returns its output tensor."""
    ins = [b.tensors[t] for t in args]
    if name == "ew1" or name == "ew2":
        ref: FnRef = params[0]
        it = iter(args)
        operands = [next(it) if s is None else s for s in ref.slots]
        tensors = [b.tensors[t] for t in operands]
        out = jax.eval_shape(lambda *a: ref.op.prim.bind(*a, **ref.op.params),
                             *[jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tensors])
        sharding = _valid(_transfer(name, params, ins), out.shape, b.mesh_sizes)
        tid = b.add_tensor(out.shape, out.dtype, sharding, ins[0].name)
        b.add_node(ref.op, operands, [tid], order=order, cause=cause)
        return tid
    fns: dict[str, Callable[..., Any]] = {
        "add": jax.lax.add, "sub": jax.lax.sub, "mul": jax.lax.mul, "neg": jax.lax.neg,
        "scale": lambda x: jax.lax.mul(x, np.asarray(params[0], dtype=x.dtype)),
        "dot": lambda x, w: jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ()))),
        "dotc": lambda x, w: jax.lax.dot_general(x, w, (((params[0],), (params[1],)), ((), ()))),
        "transpose": lambda x: jax.lax.transpose(x, tuple(params[0])),
        "concat": lambda x, y: jax.lax.concatenate([x, y], params[0]),
        "chunk": lambda x: jax.lax.slice_in_dim(x, params[1] * (x.shape[params[0]] // params[2]),
                                                (params[1] + 1) * (x.shape[params[0]] // params[2]), axis=params[0]),
        "sum": lambda x: jax.lax.reduce_sum_p.bind(x, axes=(params[0],), out_sharding=None),
        "merge": lambda x: jax.lax.reshape(x, x.shape[:params[0]] + (x.shape[params[0]] * x.shape[params[0] + 1],)
                                          + x.shape[params[0] + 2:]),
        "unmerge": lambda x: jax.lax.reshape(x, x.shape[:params[0]] + (x.shape[params[0]] // params[1], params[1])
                                            + x.shape[params[0] + 1:]),
    }
    if name not in fns:
        raise RewriteError(f"cannot build {name}")  # pragma: no cover
    if name == "merge" and params[0] + 1 >= ins[0].rank:
        raise RewriteError("merge: no dim to merge with")
    if name == "unmerge" and (params[1] <= 0 or ins[0].shape[params[0]] % params[1]):
        raise RewriteError(f"unmerge: dim {params[0]} of {ins[0].shape} by {params[1]}")
    if name == "chunk" and (params[2] <= 0 or ins[0].shape[params[0]] % params[2]):
        raise RewriteError(f"chunk: dim {params[0]} of {ins[0].shape} does not split {params[2]} ways")
    jaxpr, eqn = _jaxpr_eqn(fns[name], ins)
    pos = {v: i for i, v in enumerate(jaxpr.invars)}
    operands = []
    for a in eqn.invars:
        if isinstance(a, jcore.Literal):
            operands.append(b.add_const(np.asarray(a.val, dtype=a.aval.dtype)))
        else:
            operands.append(args[pos[a]])
    aval = eqn.outvars[0].aval
    sharding = _valid(_transfer(name, params, ins), aval.shape, b.mesh_sizes)
    tid = b.add_tensor(aval.shape, aval.dtype, sharding, ins[0].name)
    b.add_node(Compute.of(eqn.primitive, eqn.params), operands, [tid], order=order, cause=cause)
    return tid
