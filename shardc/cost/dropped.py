"""Per plan, what XLA's simplifier drops because two operands of an op are one buffer, and the work that
dies with it.

`select_n(p, a, b)`, `max(a, b)` and `min(a, b)` whose operands `a` and `b` are one buffer after partitioning
are that buffer (`SAME_OPERAND_RULES`): statically when they are one value (`unread_operands`), per plan when
one is a hint of the other made in the layout the op reads both in (`where(p, hint(x), x)` computed in the
hint's layout: the hint is no instruction after partitioning). The operands dropped are not read, so a value
only they read is dead in the compiled program, and so is every op computing only it: XLA's DCE removes them
with their reshards. The plan (`shardc.plan.PlanBuilder`, its reshards) and the simulator (`shardc.sim.tasks`,
its slots) both ask this module, so they agree on which reshards and which ops run.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from shardc.cost.program import ALIASES, SAME_OPERAND_RULES, liveness, merged, unread_if_same
from shardc.ir.graph import Graph
from shardc.sharding import Sharding

__all__ = ["BranchScopes", "branch_scopes", "candidates", "plan_drops", "dead_ops", "HOME"]

HOME = 0  # the origin of a value key read in its planned layout or resharded from it (`shardc.sim.tasks.Key`)
_BRANCH = re.compile(r"/cond\d+\.\d+")


class BranchScopes:
    """Per op, the innermost cond branch it runs in, as a key origin (3 + the branch's index; HOME outside
    every branch), and per value, the branch its producer runs in."""

    def __init__(self, graph: Any) -> None:
        index: dict[str, int] = {}
        self.op_scope: list[int] = []
        for op in graph.ops:
            found = list(_BRANCH.finditer(op.region))
            scope = op.region[:found[-1].end()] if found else ""
            self.op_scope.append(HOME if not scope else 3 + index.setdefault(scope, len(index)))
        self.value_scope = [self.op_scope[v.producer] if v.producer is not None else HOME for v in graph.values]

    def origin(self, op_id: int, c: int) -> int:
        """The origin of a key op `op_id` reads value `c` from in a layout other than `c`'s planned one: the op's
        branch when `c` is made outside it (the branch reshards it itself), else HOME."""
        scope = self.op_scope[op_id]
        return scope if scope != self.value_scope[c] else HOME


def branch_scopes(graph: Graph) -> BranchScopes:
    """The graph's `BranchScopes` (cached on the graph: every mesh's simulator and plan share it)."""
    return graph.analysis("branch_scopes", lambda: BranchScopes(graph))


def _root(graph: Graph, canon: Sequence[int], v: int) -> int:
    """The canonical value `v` is through a chain of hints (`ALIASES`)."""
    c = canon[v]
    for _ in range(64):
        p = graph.values[c].producer
        if p is None or graph.ops[p].primitive not in ALIASES or not graph.ops[p].inputs:
            return c
        c = canon[graph.ops[p].inputs[0]]
    return c


def candidates(graph: Graph) -> tuple[int, ...]:
    """Live ops of `SAME_OPERAND_RULES` that some plan may make read one buffer twice: two of their operands
    are one value through hints (plan-independent; cached on the graph)."""
    def compute() -> tuple[int, ...]:
        cse, live = merged(graph), liveness(graph)
        out = []
        for op in graph.ops:
            if op.primitive in SAME_OPERAND_RULES and live[op.id] and not cse.duplicate[op.id]:
                roots = [_root(graph, cse.canon, v) for v in op.inputs]
                if unread_if_same(op, lambda i, j: roots[i] == roots[j]):
                    out.append(op.id)
        return tuple(out)
    return graph.analysis("same_operand_candidates", compute)


def plan_drops(graph: Graph, shardings: Sequence[Sharding], strategies: Sequence[Any],
               needs: Mapping[tuple[int, int], Sharding], sizes: Mapping[str, int]) -> dict[int, tuple[int, ...]]:
    """Per op whose operands this plan makes one buffer, the operands XLA's simplifier drops. Two operands are
    one buffer when they are read as one value in one layout (mesh axes of size 1 aside) from one origin, or
    one of them is a hint that makes, in place, the layout of the value it hints as the op reads it (no reshard
    before it, after it or for the op: the hint is no instruction then). `needs`: (op, operand) -> the layout
    the op reads it in, where that is not its planned one."""
    ops = candidates(graph)
    if not ops:
        return {}
    canon, live = merged(graph).canon, liveness(graph)
    scopes = branch_scopes(graph)
    one = frozenset(a for a, n in sizes.items() if n == 1)

    def layout(s: Sharding) -> tuple:
        return tuple(tuple(a for a in d if a not in one) for d in s.dims) if one else s.dims

    def origin(op_id: int, c: int, need: Sharding) -> int:
        return HOME if need == shardings[c] else scopes.origin(op_id, c)

    def need(op_id: int, i: int) -> Sharding:
        """The layout op `op_id` reads operand i in: its reshard's (those of dropped operands included), else
        its planned one (the strategy's when that differs by more than mesh axes of size 1)."""
        s = needs.get((op_id, i))
        if s is None:
            op, v = graph.ops[op_id], graph.ops[op_id].inputs[i]
            s = strategies[op_id].tensor_sharding(op.rule, op.rule.operands[i], sizes)
            if layout(s) == layout(shardings[v]):
                s = shardings[v]
        return s

    def buffer(op_id: int, i: int) -> tuple:
        c, s = canon[graph.ops[op_id].inputs[i]], need(op_id, i)
        o = origin(op_id, c, s)
        for _ in range(64):
            p = graph.values[c].producer
            if o != HOME or p is None or not live[p] or graph.ops[p].primitive not in ALIASES:
                break
            hint = graph.ops[p]
            made = strategies[p].tensor_sharding(hint.rule, hint.rule.results[0], sizes)
            into = need(p, 0)
            if made != shardings[c] or not layout(s) == layout(made) == layout(into):
                break
            c, s = canon[hint.inputs[0]], into
            o = origin(p, c, s)
        return c, layout(s), o

    out = {}
    for op_id in ops:
        op = graph.ops[op_id]
        bufs = [buffer(op_id, i) for i in range(len(op.inputs))]
        drop = unread_if_same(op, lambda i, j: bufs[i] == bufs[j])
        if drop:
            out[op_id] = drop
    return out


def dead_ops(graph: Graph, drops: Mapping[int, tuple[int, ...]]) -> frozenset[int]:
    """The ops XLA's DCE removes once `drops`' operands are not read (besides those it removes whatever the
    plan): what only they read, transitively (cached on the graph per set of drops)."""
    extra = frozenset((op, i) for op, ds in drops.items() for i in ds) - merged(graph).unread
    if not extra:
        return frozenset()
    memo: dict = graph.analysis("dead_ops", dict)
    hit = memo.get(extra)
    if hit is None:
        if len(memo) >= 16:
            memo.clear()
        before, after = liveness(graph), liveness(graph, extra)
        hit = memo[extra] = frozenset(i for i, (a, b) in enumerate(zip(before, after)) if a and not b)
    return hit
