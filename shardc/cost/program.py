"""What XLA keeps of a program: the plan-independent facts the cost model needs about a Graph.

* duplicate ops (same primitive, params and inputs as an earlier op) are merged by CSE — so are their
  reshards (`canon` maps every value to the one XLA keeps);
* dead ops (nothing they make reaches an output) are removed by XLA's DCE;
* constant ops (all inputs are compile-time constants) are folded;
* fused values: XLA fuses an elementwise-like op into its consumers when they are all elementwise-like
  or reductions — duplicating it into each when it is cheap, not when it is expensive (transcendentals,
  divides: those are fused only into a single consumer) — so its result is never written to memory.
  A value with several readers, some of them far away (`SAVED_DISTANCE` ops: saved for the backward
  pass), is materialised instead. A fused value read late keeps the values it is recomputed from alive
  (`kept`).
* loop regions run `trips` times (scan length; 1 when XLA cannot know it).

Computed once per Graph (`program_info(graph)`, cached on the graph object) and shared by every plan of it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from shardc.cost.estimator import params_key
from shardc.cost.flops import ELEMENTWISE, TRANSCENDENTAL
from shardc.ir.graph import Graph

__all__ = ["ProgramInfo", "program_info", "FUSIBLE", "FREE_PRIMITIVES"]

# Ops XLA fuses into their consumers (loop fusion): elementwise math and cheap data movement.
FUSIBLE = frozenset(ELEMENTWISE) | frozenset(TRANSCENDENTAL) | frozenset({
    "integer_pow", "broadcast_in_dim", "reshape", "convert_element_type", "iota", "squeeze", "expand_dims",
    "select_n", "stop_gradient", "slice", "transpose", "rev", "pad", "concatenate", "split"})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "argmax", "argmin"})
# Ops that are not computation at all: hints, constraints, region ties.
FREE_PRIMITIVES = frozenset({"shardc_hint", "sharding_constraint", "tie", "scan_slice", "scan_stack",
                             "stop_gradient", "optimization_barrier", "name"})
_NOT_MERGED = frozenset({"tie", "scan_slice", "scan_stack"})
# XLA duplicates cheap producers into each consumer, but not these (InstructionFusion::IsExpensive).
EXPENSIVE = frozenset(TRANSCENDENTAL) | {"div", "rem"}
# A value read both near its producer and this many ops later (saved for the backward pass) is kept in
# memory rather than recomputed there. Calibrated against XLA:CPU's memory_analysis() on 14 MLP,
# Transformer and GPT plans (docs/simulator.md).
SAVED_DISTANCE = 200


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    live: tuple[bool, ...]  # per op: reaches an output
    constant: tuple[bool, ...]  # per value: known at compile time
    canon: tuple[int, ...]  # per value: the value XLA's CSE keeps for it
    duplicate: tuple[bool, ...]  # per op: merged into an earlier identical op
    fused: tuple[bool, ...]  # per canonical value: never materialised (fused into its consumers)
    trips: tuple[int, ...]  # per op: how many times it runs per step
    last_use: tuple[int, ...]  # per canonical value: the last live op reading it (-1 if none)
    pkeys: tuple[Any, ...]  # per op: its params as a hashable key
    kept: tuple[int, ...]  # per canonical value: last op reading a fused value recomputed from it (-1: none)

    def counts(self, op_id: int) -> bool:
        """Whether an op does work in the compiled program."""
        return self.live[op_id] and not self.duplicate[op_id]


def program_info(graph: Graph) -> ProgramInfo:
    cached = getattr(graph, "_shardc_program_info", None)
    if cached is not None:
        return cached
    info = _analyse(graph)
    try:
        graph._shardc_program_info = info  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover - slotted graphs
        pass
    return info


def _analyse(graph: Graph) -> ProgramInfo:
    nv, no = len(graph.values), len(graph.ops)
    pkeys = tuple(params_key(op.params) for op in graph.ops)
    # CSE and constant folding, forwards.
    constant = [graph.values[v].is_const for v in range(nv)]
    canon = list(range(nv))
    duplicate = [False] * no
    seen: dict[Any, int] = {}
    for op in graph.ops:
        ins = tuple(canon[v] for v in op.inputs)
        if op.inputs and all(constant[v] for v in op.inputs) and not op.region and op.primitive not in _NOT_MERGED:
            for v in op.outputs:
                constant[v] = True
        if op.primitive in _NOT_MERGED or op.primitive in ("shardc_hint", "sharding_constraint"):
            continue
        lits = tuple((graph.values[v].shape, str(graph.values[v].dtype), graph.values[v].name)
                     if graph.values[v].is_const else None for v in op.inputs)
        key = (op.primitive, op.region, pkeys[op.id], ins, lits)
        first = seen.get(key)
        if first is None:
            seen[key] = op.id
            continue
        duplicate[op.id] = True
        for a, b in zip(op.outputs, graph.ops[first].outputs):
            canon[a] = canon[b]
    # Liveness (DCE) over the merged program, backwards from the outputs; loop and branch bodies stay whole.
    needed = [False] * nv
    for v in graph.outputs:
        needed[canon[v]] = True
    live = [False] * no
    for op in reversed(graph.ops):
        if duplicate[op.id]:
            continue
        if any(needed[canon[v]] for v in op.outputs) or op.region:
            live[op.id] = True
            for v in op.inputs:
                needed[canon[v]] = True
    live_regions = {op.region for op in graph.ops if live[op.id] and op.region and op.primitive != "tie"}
    for op in graph.ops:
        if op.region and not duplicate[op.id]:
            live[op.id] = op.region in live_regions or op.primitive == "tie"

    last_use = [-1] * nv
    consumers: list[list[int]] = [[] for _ in range(nv)]
    for op in graph.ops:
        if not live[op.id]:
            continue
        for v in op.inputs:
            last_use[canon[v]] = op.id
            consumers[canon[v]].append(op.id)
    fused = [False] * nv
    outputs = {canon[v] for v in graph.outputs}
    for op in graph.ops:
        # Hints, constraints, ties and scan slices have no buffer of their own (a constraint that moves data
        # is a collective, which makes one); a scan's stacked outputs do.
        if op.primitive in FREE_PRIMITIVES and op.primitive != "scan_stack" and live[op.id]:
            for v in op.outputs:
                if canon[v] not in outputs and not constant[canon[v]]:
                    fused[canon[v]] = True
    for op in graph.ops:
        if op.primitive not in FUSIBLE or not live[op.id]:
            continue
        for v in op.outputs:
            users = consumers[v]
            if v in outputs or not users:
                continue
            fused[v] = (all(graph.ops[u].primitive in FUSIBLE or graph.ops[u].primitive in REDUCTIONS for u in users)
                        and (op.primitive not in EXPENSIVE or len(users) == 1)
                        and not (len(users) > 1 and max(users) - op.id > SAVED_DISTANCE))
    # A fused value is recomputed where it is read, from the materialised values it is made of: those
    # stay alive until its last reader.
    kept = [-1] * nv
    frontier: dict[int, frozenset[int]] = {}

    def made_of(v: int) -> frozenset[int]:
        hit = frontier.get(v)
        if hit is None:
            p = graph.values[v].producer
            out: set[int] = set()
            if p is not None:
                for u in graph.ops[p].inputs:
                    c = canon[u]
                    if fused[c]:
                        out |= made_of(c)
                    elif not constant[c]:
                        out.add(c)
            hit = frontier[v] = frozenset(out)
        return hit

    for op in graph.ops:
        if not live[op.id]:
            continue
        for v in op.inputs:
            c = canon[v]
            if fused[c]:
                for m in made_of(c):
                    if kept[m] < op.id:
                        kept[m] = op.id

    trips = [1] * no
    lengths: dict[str, int] = {}
    for op in graph.ops:
        if op.primitive in ("scan_slice", "scan_stack") and op.rule.sizes:
            lengths.setdefault(op.region, int(op.rule.sizes[0]))
    if lengths:
        for op in graph.ops:
            if op.region:
                n = 1
                parts = op.region.split("/")
                for i in range(1, len(parts)):
                    n *= lengths.get("/".join(parts[: i + 1]), 1)
                trips[op.id] = n
    return ProgramInfo(tuple(live), tuple(constant), tuple(canon), tuple(duplicate), tuple(fused),
                       tuple(trips), tuple(last_use), pkeys, tuple(kept))
