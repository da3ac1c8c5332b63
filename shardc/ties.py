"""Checks of a propagation result that the passes after it rely on: a value tied to another (a loop carry,
a branch result, train-step state carried to the next step) is not pinned two ways, and the branches of a
cond that hint a result hint it alike. Used by `@shardc.auto` and by the search's evaluator alike."""
from __future__ import annotations

from typing import Any

from annotations.errors import ShardingError
from shardc.ir.graph import Graph

__all__ = ["check_ties"]


def check_ties(graph: Graph, prop: Any) -> None:
    """A loop carry or carried state pinned two different ways is a conflict the user must resolve."""
    for op in graph.ops:
        if op.primitive != "tie":
            continue
        a, b = op.inputs[0], op.outputs[0]
        for d in range(graph.values[a].rank):
            if prop.closed[a][d] and prop.closed[b][d] and prop.axes[a][d] != prop.axes[b][d]:
                what = "a value carried to the next step" if op.region == "io" else "a loop/branch value"
                raise ShardingError(
                    f"conflicting hints on {what}: {graph.values[a].name} {graph.values[a].shape} dim {d} is "
                    f"{prop.axes[a][d] or 'replicated'} ({prop.origin[a][d]}) but "
                    f"{graph.values[b].name} dim {d} is {prop.axes[b][d] or 'replicated'} ({prop.origin[b][d]})")
    _check_branch_results(graph, prop)


def _check_branch_results(graph: Graph, prop: Any) -> None:
    """Branches of one lax.cond/switch that hint a result must hint it alike: XLA rejects (an internal
    RET_CHECK) a conditional whose branches return a value with different shardings — one dim split
    over different axes, or split in one branch and left open in another — so name the hints."""
    sources: dict[int, list[int]] = {}
    for op in graph.ops:
        if op.primitive == "tie" and "/cond" in op.region:
            sources.setdefault(op.outputs[0], []).append(op.inputs[0])  # branch result -> cond result
    for out, srcs in sources.items():
        hinted = [s for s in srcs if any(prop.closed[s])]  # operand ties have one source: skipped here
        if len(hinted) < 2:
            continue
        val = graph.values[out]
        for d in range(val.rank):
            seen = {prop.axes[s][d] if prop.closed[s][d] else None: s for s in hinted}
            split_ways = [a for a in seen if a]
            if len(split_ways) > 1 or (split_ways and None in seen):
                a = split_ways[0]
                b = split_ways[1] if len(split_ways) > 1 else None
                why_a = prop.origin[seen[a]][d]
                why_b = prop.origin[seen[b]][d] if b is not None else \
                    next(o for o, c in zip(prop.origin[seen[None]], prop.closed[seen[None]]) if c)
                raise ShardingError(
                    f"conflicting hints on a result of lax.cond/switch: {val.dtype}{list(val.shape)} dim {d} is "
                    f"split over {'+'.join(a)} in one branch ({why_a}) but "
                    + (f"over {'+'.join(b)}" if b is not None else "left open") + f" in another ({why_b}); "
                    f"every branch that hints it must give it the same sharding — hint it the same way in "
                    f"each branch, or hint the result of the cond instead")
