"""Plans that differ from a plan in one op or one value — what a search proposes, and what delta
simulation is for. The reshards of the touched ops are recomputed the way `shardc.plan.build_plan`
computes them."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from shardc.plan import (OpStrategy, Plan, Reshard, lowers_backend, lowers_reduce_scatter, op_reshard_specs,
                         split_unrun)
from shardc.rules.core import FactorKind
from shardc.sharding import Sharding

__all__ = ["with_strategy", "with_sharding", "legal_strategies"]


def _op_reshards(plan: Plan, op_id: int, strategies: Sequence[OpStrategy],
                 shardings: Sequence[Sharding]) -> list[Reshard]:
    g = plan.graph
    op = g.ops[op_id]
    if op.primitive == "tie" and op.region == "io":
        return []
    out: list[Reshard] = []
    specs = op_reshard_specs(op, g, strategies[op_id], shardings, plan.mesh_sizes, lowers_reduce_scatter(plan.mesh),
                             lowers_backend(plan.mesh))
    for operand, i, src, dst, cost in specs:
        if operand:
            v = op.inputs[i]
            out.append(Reshard(v, src, dst, cost.kind, cost.payload, f"{op.primitive} needs {g.values[v].name} as {dst}",
                               op.source, op_id, cost.collectives, i))
        else:
            out.append(Reshard(op.outputs[i], src, dst, cost.kind, cost.payload, f"{op.primitive} makes {src}",
                               op.source, None, cost.collectives))
    return out


def _rebuild(plan: Plan, ops: set[int], strategies: list[OpStrategy], shardings: list[Sharding]) -> Plan:
    kept = [r for r in plan.constrained
            if not ((r.consumer is not None and r.consumer in ops) or
                    (r.consumer is None and plan.graph.values[r.value].producer in ops))]
    for i in sorted(ops):
        kept.extend(_op_reshards(plan, i, strategies, shardings))
    run, unrun = split_unrun(plan.graph, shardings, strategies, kept, plan.mesh_sizes)
    return dataclasses.replace(plan, shardings=tuple(shardings), strategies=tuple(strategies), reshards=run,
                               unrun=unrun)


def with_strategy(plan: Plan, op_id: int, factor_axes: Sequence[Sequence[str]]) -> Plan:
    """The plan with op `op_id` run under another strategy (its values keep their shardings)."""
    strategies = list(plan.strategies)
    strategies[op_id] = OpStrategy(tuple(tuple(a) for a in factor_axes))
    return _rebuild(plan, {op_id}, strategies, list(plan.shardings))


def with_sharding(plan: Plan, value: int, sharding: Sharding) -> Plan:
    """The plan with one value in another layout (its producer and consumers reshard as needed)."""
    g = plan.graph
    shardings = list(plan.shardings)
    shardings[value] = sharding
    ops = set(g.users[value])
    if g.values[value].producer is not None:
        ops.add(g.values[value].producer)
    return _rebuild(plan, ops, list(plan.strategies), shardings)


def legal_strategies(plan: Plan, op_id: int, limit: int = 64) -> list[tuple[tuple[str, ...], ...]]:
    """Some legal strategies of an op: each mesh axis on at most one factor, dividing it, never on a
    need-replication or permutation factor (one axis per factor here; enough to propose changes)."""
    op = plan.graph.ops[op_id]
    rule = op.rule
    sizes = plan.mesh_sizes
    axes = list(sizes)
    nf = rule.num_factors
    out: list[tuple[tuple[str, ...], ...]] = [tuple(() for _ in range(nf))]

    def ok(f: int, a: str) -> bool:
        return rule.kinds[f] in (FactorKind.PASS_THROUGH, FactorKind.REDUCTION) and rule.sizes[f] % sizes[a] == 0

    def rec(i: int, used: frozenset[str], cur: list[tuple[str, ...]]) -> None:
        if len(out) >= limit:
            return
        if i == len(axes):
            t = tuple(cur)
            if t not in out:
                out.append(t)
            return
        rec(i + 1, used, cur)
        a = axes[i]
        for f in range(nf):
            if ok(f, a) and not cur[f]:
                cur[f] = (a,)
                rec(i + 1, used | {a}, cur)
                cur[f] = ()

    rec(0, frozenset(), [() for _ in range(nf)])
    return out
