"""XLA's globally unfusible producers (InstructionFusion::ComputeGloballyUnfusible, read in openxla/xla).

An elementwise op that reads more than it writes — more than one operand of the result's rank, and more operand
elements than result elements (`program.duplicable` is false) — is fused into its readers only if it can be fused
into each of them *along every path* from it: every value on a path from it to a reader must be fusible into the
op reading it on that path. Otherwise XLA never fuses it (not even into a single fusion holding all its readers):
its result is a buffer. The case that shows it is a SiLU-gated MLP: `silu = s * sigmoid(s)` is read by the gate
product `silu * g` and by the gradient `silu * dh`, and `dh` is computed from the SiLU through the output
projection's matmul — no fusion takes a matmul in, so the SiLU is materialised (measured on XLA:CPU: a
`multiply` fusion of its own, in every Flax GLU train step).

The walk is XLA's: producers from the last to the first, so a value found unfusible here is unfusible on the paths
of the values before it; reachability is a bitset per value over the candidates only.
"""
from __future__ import annotations

from typing import Callable, Collection, Sequence

from shardc.ir.graph import Graph

Readers = Callable[[int], Sequence[int]]  # canonical value -> the ops reading it
Edge = Callable[[int, int], bool]  # (canonical value, op reading it) -> whether fusion takes the value into the op
_MAX_DEPTH = 256  # (a path longer than this is taken as fusible: the model's answer without the rule)


def globally_unfusible(graph: Graph, live: Sequence[bool], canon: Sequence[int], candidates: Collection[int],
                       readers: Readers, edge: Edge, transparent: Collection[str]) -> frozenset[int]:
    """The candidates (canonical values of elementwise ops that are not effectively unary and read more than they
    write, each read by more than one op) that some reader cannot take in along every path from the value.
    `edge(w, u)`: whether fusion takes value w into op u (XLA's ShouldFuse); `transparent`: primitives that are
    no instruction to XLA (hints), looked through to their operand."""
    if not candidates:
        return frozenset()
    bit = {c: 1 << k for k, c in enumerate(sorted(candidates))}
    # per value, at the op producing it (not per canonical value, nor at a loop's back edge: those would link a
    # loop's body to values after it): the candidates it is computed from, and its own if it is one (or a copy)
    ancestors = [0] * len(graph.values)
    for op in graph.ops:
        if not live[op.id]:
            continue
        reach = 0
        for v in op.inputs:
            reach |= ancestors[v]
        for v in op.outputs:
            if graph.values[v].producer == op.id:  # (not a loop's back edge: a carry tie names the state it feeds)
                ancestors[v] = reach | bit.get(canon[v], 0)
    unfusible: set[int] = set()
    memo: dict[tuple[int, int], bool] = {}
    walk = _Walk(graph, canon, ancestors, unfusible, edge, memo, frozenset(transparent))
    for c in sorted(candidates, key=lambda c: graph.values[c].producer, reverse=True):
        if not all(walk.all_paths(c, bit[c], u) for u in readers(c)):
            unfusible.add(c)
    return frozenset(unfusible)


class _Walk:
    """CanFuseOnAllPaths over a graph (a class, not a recursive closure: no reference cycle keeps the graph)."""

    def __init__(self, graph: Graph, canon: Sequence[int], ancestors: Sequence[int], unfusible: Collection[int],
                 edge: Edge, memo: dict[tuple[int, int], bool], transparent: frozenset[str]) -> None:
        self.graph, self.canon, self.ancestors, self.unfusible = graph, canon, ancestors, unfusible
        self.edge, self.memo, self.transparent = edge, memo, transparent

    def source(self, v: int) -> int:
        """The value `v` stands for, looking through transparent ops (hints)."""
        while (p := self.graph.values[v].producer) is not None and self.graph.ops[p].primitive in self.transparent:
            v = self.graph.ops[p].inputs[0]
        return v

    def all_paths(self, c: int, b: int, op_id: int, depth: int = 0) -> bool:
        """Whether value `c` (bit `b`) can be fused into op `op_id` along every path: each operand of the op computed
        from `c` (but `c` itself) is fusible into the op, is not unfusible, and `c` fuses along every path into it."""
        key = (c, op_id)
        known = self.memo.get(key)
        if known is not None:
            return known
        if depth > _MAX_DEPTH:
            return True
        ok = True
        for v in self.graph.ops[op_id].inputs:
            r = self.source(v)
            w = self.canon[r]
            if w == c or not self.ancestors[r] & b:
                continue
            p = self.graph.values[r].producer
            if w in self.unfusible or p is None or not self.edge(w, op_id) or not self.all_paths(c, b, p, depth + 1):
                ok = False
                break
        self.memo[key] = ok
        return ok
