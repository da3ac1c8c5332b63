"""Partial-sum loop carries: a scan's accumulators carried unreduced and reduced once after the loop.

A backward pass's scan adds each trip's weight gradient into a carry (`c = c + g`). When `g` comes from a
dot contracting a sharded dim, the body reduces it every trip (an all-reduce or reduce-scatter of `g`) before
the add, because a loop carry of a plan is a whole value: `jax.jit` cannot carry partial sums. A PCG can (a
`shard_map` carries whatever each device holds). `partial_carries` rewrites such a scan so that the carry holds
each device's own share of the sum: the body adds the unreduced `g` (the ops between the reduction and the add
run on the partial value), the carry starts as zeros on every device, and the loop's result is reduced to the
carry's old layout once, after the last trip.

Correctness is an induction over proved rules: the invariant `c = R(c_partial)` (R: the reshard from the
partial layout to the old one) holds for the zeros it starts from, and one trip keeps it because `R` moves past
the add (`reduce_add`, `reduce_scatter_add`) and past each op between the reduction and the add (`reduce_transpose`,
`reduce_chunk`, `reduce_merge`/`reduce_unmerge`, `reduce_slice_other`). The rewrite runs only when every rule it
rests on is in the library and proved (`carry_rules_proved`).

What it covers: scans at the top level of the PCG; a carry that starts as zeros (a constant, or a broadcast of a
zero scalar), whose body input feeds only one `add`/`add_any` (through casts to its own dtype) whose result is the
carry's output, and whose other addend is reached from partial sums through reductions (dropped), slices (kept where
the partial axes allow, else dropped: the carry is then larger) and the rearranging ops of `REARRANGING`. With a
cost, a scan's carries are kept all but the smallest while leaving those out is cheaper (`_best_subset`). Not
covered: `while` loops (`fori_loop`), scans inside loop bodies, reductions other than sums.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from annotations.errors import ShardingError
from shardc.pcg.build import reshard_ops
from shardc.pcg.graph import PCG, Compute, GraphBuilder, Node, Region, Tensor
from shardc.pcg.ops import ParallelOp, Partition, Reduce, ReduceScatter, ReduceScatterDims
from shardc.sharding import Sharding

__all__ = ["CarryRewrite", "partial_carries", "carry_rules_proved", "CARRY_RULES", "REARRANGING"]

ADDS = frozenset({"add", "add_any"})
REDUCTIONS = (Reduce, ReduceScatter, ReduceScatterDims)

# the library rules a rewrite rests on: R past the carry's add, and past each op it crosses
CARRY_RULES = ("reduce_add", "reduce_scatter_add", "reduce_transpose", "reduce_chunk", "reduce_merge",
               "reduce_unmerge", "reduce_slice_other")

MAX_LEFT_OUT = 8  # (carries `_best_subset` may leave out of a scan's rewrite, smallest first)

Transfer = Callable[[Compute, Sharding, Tensor, Sequence[Tensor]], "list[Sharding] | None"]


def _same_dims(op: Compute, s: Sharding, old_in: Tensor, old_outs: Sequence[Tensor]) -> list[Sharding] | None:
    """The op's local program is unchanged when only partial axes were added to its operand."""
    if s.dims != old_in.sharding.dims:
        return None
    return [Sharding(t.sharding.dims, t.sharding.partial | s.partial) for t in old_outs]


def _transpose(op: Compute, s: Sharding, old_in: Tensor, old_outs: Sequence[Tensor]) -> list[Sharding] | None:
    perm = tuple(op.params["permutation"])
    return [Sharding(tuple(s.dims[p] for p in perm), s.partial)]


def _split(op: Compute, s: Sharding, old_in: Tensor, old_outs: Sequence[Tensor]) -> list[Sharding] | None:
    if s.dims[int(op.params["axis"])]:  # (the pieces' sizes are global: the split dim must be whole)
        return _same_dims(op, s, old_in, old_outs)
    return [Sharding(s.dims, s.partial) for _ in old_outs]


def _reshape(op: Compute, s: Sharding, old_in: Tensor, old_outs: Sequence[Tensor]) -> list[Sharding] | None:
    if any(s.dims):
        return _same_dims(op, s, old_in, old_outs)
    return [Sharding(((),) * len(t.shape), s.partial) for t in old_outs]


# ops between a reduction and the carry's add that run on partial sums (all linear): the layouts of their results
REARRANGING: dict[str, Transfer] = {
    "transpose": _transpose,
    "split": _split,
    "reshape": _reshape,
    "squeeze": _reshape,
    "expand_dims": _reshape,
    "copy": _same_dims,
}


@dataclasses.dataclass(frozen=True)
class CarryRewrite:
    """One scan whose carries now hold partial sums: `carries` (carry indices), their layouts in the loop."""

    region_node: int
    where: str
    carries: tuple[int, ...]
    layouts: tuple[Sharding, ...]
    cost_before: float = 0.0
    cost_after: float = 0.0

    def __str__(self) -> str:
        by_layout: dict[str, list[int]] = {}
        for k, s in zip(self.carries, self.layouts):
            by_layout.setdefault(str(s), []).append(k)
        lays = "; ".join(f"{'carry' if len(ks) == 1 else 'carries'} {_ranges(ks)} as {s}" for s, ks in by_layout.items())
        return f"partial-sum carries of the scan {self.where}: {lays}; reduced once after the loop"


def _ranges(ks: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` as "0-2, 5"."""
    runs: list[list[int]] = []
    for k in ks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def carry_rules_proved() -> bool:
    """Whether every rule the rewrite rests on is in the library and proved (`verify_rule`: the proof record)."""
    from shardc.pcg.library import rules_proved

    return rules_proved(CARRY_RULES)


ZerosMaker = Callable[[GraphBuilder, Tensor, Sharding, float], int]


def _zeros_maker(pcg: PCG, tid: int) -> ZerosMaker | None:
    """How to make tensor `tid` again in another layout, when it is zeros: a constant of zeros (a literal `0.0` a
    loop starts from), or a broadcast of a zero scalar (`jnp.zeros_like`) reached through parallel ops (zeros stay
    zeros); None for anything else."""
    while True:
        made = pcg.producer(tid)
        if made is None:
            const = pcg.consts.get(tid)
            if const is None or np.any(np.asarray(const)):
                return None
            return lambda b, like, s, order: b.add_const(np.asarray(const, dtype=like.dtype), s, like.name)
        node = made[0]
        if node.is_parallel:
            tid = node.inputs[0]
            continue
        if not isinstance(node.op, Compute) or node.op.primitive != "broadcast_in_dim" or len(node.inputs) != 1:
            return None
        const = pcg.consts.get(node.inputs[0])  # (a scalar: broadcast to any piece's shape alike)
        if const is None or np.ndim(const) != 0 or np.any(np.asarray(const)):
            return None
        return lambda b, like, s, order: _broadcast_again(b, node, like, s, order)


def _broadcast_again(b: GraphBuilder, node: Node, like: Tensor, s: Sharding, order: float) -> int:
    out = b.add_tensor(like.shape, like.dtype, s, like.name)
    b.add_node(node.op, node.inputs, [out], cause="zeros as partial sums (loop carry)", order=order)
    return out


def _no_op_cast(body: PCG, node: Node) -> bool:
    """A `convert_element_type` to the dtype it has (a weakly typed `0.0` a loop starts from is cast so)."""
    if not isinstance(node.op, Compute) or node.op.primitive != "convert_element_type":
        return False
    a, r = body.tensors[node.inputs[0]], body.tensors[node.outputs[0]]
    return a.dtype == r.dtype and a.sharding == r.sharding


def _addend_path(body: PCG, carry_in: int, carry_out: int) -> tuple[tuple[Node, ...], int, list[Node]] | None:
    """(the nodes reading the carry: casts to its own dtype, then its add; the add's other addend; the nodes from a
    reduction to that addend) or None."""
    reads: list[Node] = []
    read = carry_in
    while len(users := body.users(read)) == 1 and _no_op_cast(body, users[0]):
        reads.append(users[0])
        read = users[0].outputs[0]
    if len(users) != 1 or body.outputs.count(carry_out) != 1 or body.users(carry_out):
        return None
    add = users[0]
    reads.append(add)
    if not isinstance(add.op, Compute) or add.op.primitive not in ADDS or add.outputs != (carry_out,):
        return None
    others = [t for t in add.inputs if t != read]
    layout = body.tensors[read].sharding
    if len(others) != 1 or layout.partial or body.tensors[others[0]].sharding != layout:
        return None
    path: list[Node] = []
    tid = others[0]
    while True:
        made = body.producer(tid)
        if made is None:
            return None
        node = made[0]
        path.append(node)
        if isinstance(node.op, REDUCTIONS):
            sums = body.tensors[node.inputs[0]].reduce_op == "sum" and getattr(node.op, "op", "sum") == "sum"
            return (tuple(reads), others[0], path[::-1]) if sums else None
        if isinstance(node.op, Partition) or (isinstance(node.op, Compute) and node.op.primitive in REARRANGING
                                              and len(node.inputs) == 1):
            tid = node.inputs[0]
            continue
        return None


class _Replay:
    """The body's nodes on a path, run again on partial sums: reductions dropped, other ops given new results."""

    def __init__(self, body: PCG, b: GraphBuilder) -> None:
        self.body, self.b = body, b
        self.new: dict[int, int] = {}  # old tensor -> its partial-sum twin
        self.order = {n.id: i for i, n in enumerate(body.nodes)}

    def run(self, path: Sequence[Node]) -> bool:
        for node in path:
            if node.outputs[0] in self.new:
                continue
            src = self.new.get(node.inputs[0], node.inputs[0])
            s = self.b.tensors[src].sharding
            if isinstance(node.op, REDUCTIONS):
                self.new[node.outputs[0]] = src
                continue
            if isinstance(node.op, Partition):
                try:
                    out = node.op.apply(s)
                except ShardingError:  # (its axes hold the partial sums: carry the whole piece)
                    self.new[node.outputs[0]] = src
                    continue
                self.new[node.outputs[0]] = self._add(node, node.op, [src], [out])[0]
                continue
            old_in = self.body.tensors[node.inputs[0]]
            outs = REARRANGING[node.op.primitive](node.op, s, old_in, [self.body.tensors[t] for t in node.outputs])
            if outs is None:
                return False
            self.new.update(zip(node.outputs, self._add(node, node.op, [src], outs)))
        return True

    def _add(self, node: Node, op: object, ins: list[int], layouts: Sequence[Sharding]) -> list[int]:
        outs = []
        for t, s in zip(node.outputs, layouts):
            old = self.body.tensors[t]
            outs.append(self.b.add_tensor(old.shape, old.dtype, s, old.name, old.reduce_op))
        self.b.add_node(op, ins, outs, cause=f"{node.cause or node.op} on partial sums (loop carry)",
                        order=self.order[node.id] + 0.5)
        return outs


def _rewrite_body(body: PCG, nc: int, carries: Sequence[int],
                  paths: dict[int, tuple[tuple[Node, ...], int, list[Node]]]
                  ) -> tuple[PCG, dict[int, Sharding]] | None:
    b = GraphBuilder(body.mesh, body.tensors, body.consts, first_node_id=1 + max((n.id for n in body.nodes),
                                                                                 default=0))
    reads = {n.id for k in carries for n in paths[k][0]}
    for i, n in enumerate(body.nodes):
        if n.id not in reads:
            b.keep_node(n, float(i))
    replay = _Replay(body, b)
    inputs, outputs = list(body.inputs), list(body.outputs)
    layouts: dict[int, Sharding] = {}
    for k in carries:
        carry_reads, addend, path = paths[k]
        add = carry_reads[-1]
        if not replay.run(path):
            return None
        part = replay.new[addend]
        s = b.tensors[part].sharding
        old_in = body.tensors[body.inputs[nc + k]]
        new_in = b.add_tensor(old_in.shape, old_in.dtype, s, old_in.name)
        old_out = body.tensors[body.outputs[k]]
        new_out = b.add_tensor(old_out.shape, old_out.dtype, s, old_out.name)
        b.add_node(add.op, [new_in, part], [new_out], cause="the carry adds partial sums",
                   order=replay.order[add.id] + 0.75)
        inputs[nc + k], outputs[k] = new_in, new_out
        layouts[k] = s
    return b.finish(inputs, outputs), layouts


def _applied(ops: Sequence[ParallelOp], s: Sharding) -> Sharding:
    for op in ops:
        s = op.apply(s)
    return s


Convertible = dict[int, tuple[tuple[tuple[Node, ...], int, list[Node]], ZerosMaker]]


def _convertible(pcg: PCG, node: Node) -> Convertible:
    """The carries of scan `node` that can hold partial sums: carry index -> (its path in the body, its zeros)."""
    region: Region = node.op
    if region.primitive != "scan" or len(region.bodies) != 1:
        return {}
    body = region.bodies[0]
    nc, nk = int(region.params["num_consts"]), int(region.params["num_carry"])
    out: Convertible = {}
    for k in range(nk):
        zero = _zeros_maker(pcg, node.inputs[nc + k])
        found = _addend_path(body, body.inputs[nc + k], body.outputs[k]) if zero is not None else None
        if found is not None:
            out[k] = (found, zero)
    return out


def _rewrite_scan(pcg: PCG, node: Node, chosen: Convertible, reduce_scatter: bool
                  ) -> tuple[PCG, CarryRewrite] | None:
    """`pcg` with the `chosen` carries of scan `node` made partial-sum carries, or None if that cannot be done."""
    region: Region = node.op
    body = region.bodies[0]
    nc = int(region.params["num_consts"])
    paths = {k: path for k, (path, _) in chosen.items()}
    zeros = {k: zero for k, (_, zero) in chosen.items()}
    rewritten = _rewrite_body(body, nc, sorted(paths), paths)
    if rewritten is None:
        return None
    new_body, layouts = rewritten
    mesh = pcg.mesh_sizes
    b = GraphBuilder(pcg.mesh, pcg.tensors, pcg.consts, first_node_id=1 + max(n.id for n in pcg.nodes))
    at = next(i for i, n in enumerate(pcg.nodes) if n.id == node.id)
    for i, n in enumerate(pcg.nodes):
        if n.id != node.id:
            b.keep_node(n, float(i))
    reductions = {}
    for k, s in layouts.items():  # (the reshard after the loop, to each carry's old layout)
        old = pcg.tensors[node.outputs[k]]
        ops = reshard_ops(s, old.sharding, mesh, fuse=True, shape=old.shape, itemsize=old.itemsize,
                          reduce_scatter=reduce_scatter)
        if not ops or _applied(ops, s) != old.sharding:
            return None
        reductions[k] = ops
    ins, outs = list(node.inputs), list(node.outputs)
    for k, s in layouts.items():
        ins[nc + k] = zeros[k](b, pcg.tensors[node.inputs[nc + k]], s, at - 0.5)
        old_res = pcg.tensors[node.outputs[k]]
        outs[k] = b.add_tensor(old_res.shape, old_res.dtype, s, old_res.name)
    b.add_node(region.with_bodies([new_body]), ins, outs, order=float(at))
    for j, (k, ops) in enumerate(reductions.items()):  # (the last op makes the loop's old result tensor)
        cause = f"the loop's partial-sum carry {pcg.tensors[node.outputs[k]].name or k} reduced once"
        cur, order = outs[k], at + 0.5 + 0.001 * j
        for op in ops[:-1]:
            cur = b.parallel(op, cur, cause=cause, order=order)
        b.add_node(ops[-1], [cur], [node.outputs[k]], cause=cause, order=order)
    where = str(region.source) if region.source is not None else f"node {node.id}"
    done = CarryRewrite(node.id, where, tuple(layouts), tuple(layouts.values()))
    return b.finish(pcg.inputs, pcg.outputs), done


def partial_carries(pcg: PCG, *, reduce_scatter: bool = True, cost_fn: Callable[[PCG], float] | None = None
                    ) -> tuple[PCG, list[CarryRewrite]]:
    """`pcg` with its top-level scans' accumulating carries holding partial sums (see the module docstring), and
    what was rewritten; with `cost_fn`, a scan's rewrite is kept only when it makes the cost lower (its
    `CarryRewrite` has both costs). `pcg` itself when nothing applies or the rules it rests on are not all proved.
    `reduce_scatter`: whether the backend has reduce-scatters (for the reductions after the loop)."""
    if not any(n.is_region for n in pcg.nodes) or not carry_rules_proved():
        return pcg, []
    done: list[CarryRewrite] = []
    cost = cost_fn(pcg) if cost_fn is not None else 0.0
    for node_id in [n.id for n in pcg.nodes if n.is_region]:
        node = next((n for n in pcg.nodes if n.id == node_id), None)
        convertible = _convertible(pcg, node) if node is not None else {}
        if not convertible:
            continue
        out = _best_subset(pcg, node, convertible, reduce_scatter, cost_fn, cost) if cost_fn is not None else \
            _rewrite_scan(pcg, node, convertible, reduce_scatter)
        if out is not None:
            pcg, step = out
            cost = step.cost_after
            done.append(step)
    return pcg, done


def _best_subset(pcg: PCG, node: Node, convertible: Convertible, reduce_scatter: bool,
                 cost_fn: Callable[[PCG], float], cost: float) -> tuple[PCG, CarryRewrite] | None:
    """The fastest of the scan rewritten with all its convertible carries and without the smallest of them, one
    more left out at a time (at most `MAX_LEFT_OUT`), until leaving one more out stops paying (a small value's
    reduction in the loop hides behind the next trip's work; after the loop it may be all that is left to wait
    for); None when no such rewrite is faster than `cost`."""
    mesh = pcg.mesh_sizes
    by_size = sorted(convertible, key=lambda k: pcg.tensors[node.inputs[k + node.op.params["num_consts"]]]
                     .local_bytes(mesh))
    best: tuple[PCG, CarryRewrite] | None = None
    best_cost = cost
    for _ in range(min(len(by_size), 1 + MAX_LEFT_OUT)):  # (simulations: at most 1 + MAX_LEFT_OUT per scan)
        out = _rewrite_scan(pcg, node, {k: convertible[k] for k in by_size}, reduce_scatter)
        after = cost_fn(out[0]) if out is not None else math.inf
        if after < best_cost * (1 - 1e-9):
            best, best_cost = out, after
        elif best is not None:  # (leaving the next one out too stopped paying)
            break
        by_size = by_size[1:]
    if best is None:
        return None
    return best[0], dataclasses.replace(best[1], cost_before=cost, cost_after=best_cost)
