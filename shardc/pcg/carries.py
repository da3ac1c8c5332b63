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

What it covers: scans at the top level of the PCG; a carry whose body input feeds only one `add`/`add_any` whose
result is the carry's output, whose initial value is a broadcast of zero, and whose other addend is reached from
partial sums through reductions (dropped), slices (kept where the partial axes allow, else dropped: the carry
is then larger) and the rearranging ops of `REARRANGING`. Not covered: `while` loops (no zero-start proof of
their trip count is needed, but their carries also feed the condition), nested loops, reductions other than sums.
"""
from __future__ import annotations

import dataclasses
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
        lays = ", ".join(f"carry {k} as {s}" for k, s in zip(self.carries, self.layouts))
        return f"partial-sum carries of the scan {self.where}: {lays}, reduced once after the loop"


def carry_rules_proved() -> bool:
    """Whether every rule the rewrite rests on is in the library and proved (`verify_rule`: the proof record)."""
    from shardc.pcg.library import library_rules
    from shardc.pcg.verify import verify_rule

    by_name = {r.name: r for r in library_rules()}
    return all(n in by_name and verify_rule(by_name[n]).proved for n in CARRY_RULES)


def _zero_broadcast(pcg: PCG, tid: int) -> Node | None:
    """The broadcast of a zero scalar `tid` is made from (through parallel ops: zeros stay zeros), or None."""
    while True:
        made = pcg.producer(tid)
        if made is None:
            return None
        node = made[0]
        if node.is_parallel:
            tid = node.inputs[0]
            continue
        if not isinstance(node.op, Compute) or node.op.primitive != "broadcast_in_dim" or len(node.inputs) != 1:
            return None
        const = pcg.consts.get(node.inputs[0])  # (a scalar: broadcast to any piece's shape alike)
        return node if const is not None and np.ndim(const) == 0 and not np.any(np.asarray(const)) else None


def _addend_path(body: PCG, carry_in: int, carry_out: int) -> tuple[Node, int, list[Node]] | None:
    """(the carry's add, its other addend, the nodes from a reduction to that addend) or None."""
    users = body.users(carry_in)
    if len(users) != 1 or body.outputs.count(carry_out) != 1 or body.users(carry_out):
        return None
    add = users[0]
    if not isinstance(add.op, Compute) or add.op.primitive not in ADDS or add.outputs != (carry_out,):
        return None
    others = [t for t in add.inputs if t != carry_in]
    layout = body.tensors[carry_in].sharding
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
            return (add, others[0], path[::-1]) if sums else None
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


def _rewrite_body(body: PCG, nc: int, carries: Sequence[int], paths: dict[int, tuple[Node, int, list[Node]]]
                  ) -> tuple[PCG, dict[int, Sharding]] | None:
    b = GraphBuilder(body.mesh, body.tensors, body.consts, first_node_id=1 + max((n.id for n in body.nodes),
                                                                                 default=0))
    adds = {paths[k][0].id for k in carries}
    for i, n in enumerate(body.nodes):
        if n.id not in adds:
            b.keep_node(n, float(i))
    replay = _Replay(body, b)
    inputs, outputs = list(body.inputs), list(body.outputs)
    layouts: dict[int, Sharding] = {}
    for k in carries:
        add, addend, path = paths[k]
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


def _rewrite_scan(pcg: PCG, node: Node, reduce_scatter: bool) -> tuple[PCG, CarryRewrite] | None:
    """`pcg` with scan `node`'s convertible carries made partial-sum carries, or None if it has none."""
    region: Region = node.op
    if region.primitive != "scan" or len(region.bodies) != 1:
        return None
    body = region.bodies[0]
    nc, nk = int(region.params["num_consts"]), int(region.params["num_carry"])
    paths: dict[int, tuple[Node, int, list[Node]]] = {}
    zeros: dict[int, Node] = {}
    for k in range(nk):
        zero = _zero_broadcast(pcg, node.inputs[nc + k])
        found = _addend_path(body, body.inputs[nc + k], body.outputs[k]) if zero is not None else None
        if found is not None:
            paths[k], zeros[k] = found, zero
    if not paths:
        return None
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
        old_init = pcg.tensors[node.inputs[nc + k]]
        init = b.add_tensor(old_init.shape, old_init.dtype, s, old_init.name)
        b.add_node(zeros[k].op, zeros[k].inputs, [init], cause="zeros as partial sums (loop carry)", order=at - 0.5)
        ins[nc + k] = init
        old_res = pcg.tensors[node.outputs[k]]
        outs[k] = b.add_tensor(old_res.shape, old_res.dtype, s, old_res.name)
    b.add_node(region.with_bodies([new_body]), ins, outs, order=float(at))
    for j, (k, ops) in enumerate(reductions.items()):
        cur, t = outs[k], pcg.tensors[node.outputs[k]]
        for i, op in enumerate(ops):
            out = node.outputs[k] if i == len(ops) - 1 else \
                b.add_tensor(t.shape, t.dtype, op.apply(b.tensors[cur].sharding), t.name)
            b.add_node(op, [cur], [out], cause=f"the loop's partial-sum carry {t.name or k} reduced once",
                       order=at + 0.5 + 0.001 * j)
            cur = out
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
        out = _rewrite_scan(pcg, node, reduce_scatter) if node is not None else None
        if out is None:
            continue
        new, step = out
        if cost_fn is not None:
            after = cost_fn(new)
            if not after < cost * (1 - 1e-9):
                continue
            step = dataclasses.replace(step, cost_before=cost, cost_after=after)
            cost = after
        pcg = new
        done.append(step)
    return pcg, done
