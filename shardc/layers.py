"""Which layer an op belongs to, for reports: the decision groups of a plan (repeated ops that share one
choice, as the search groups them) and a label for each from the module path JAX records in the ops'
name stacks (`Block_0-11/MlpBlock/Dense_1`, forward or backward), or the user's source line."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

__all__ = ["OpGroup", "decision_groups", "module_path", "group_label"]

_TRANSFORM = re.compile(r"^(?:[a-z_]+\()+([^()]*)\)+$")  # jvp(M), transpose(jvp(M)), vmap(...)
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


@dataclasses.dataclass(frozen=True)
class OpGroup:
    """Decision ops of one signature (primitive, shapes, dtypes, params), in program order."""

    members: tuple[int, ...]
    flops: float  # per step, all members (global shapes)


def decision_groups(graph: Any) -> list[OpGroup]:
    """The graph's decision ops grouped as the search groups them, heaviest (FLOPs) first."""
    from shardc.cost.flops import count_op
    from shardc.search.space import DECISION_PRIMITIVES, op_signature

    by_sig: dict[str, list[int]] = {}
    for op in graph.ops:
        if op.primitive in DECISION_PRIMITIVES and op.rule.num_factors:
            by_sig.setdefault(op_signature(graph, op), []).append(op.id)
    out = []
    for members in by_sig.values():
        op = graph.ops[members[0]]
        ins, outs = [graph.values[v].shape for v in op.inputs], [graph.values[v].shape for v in op.outputs]
        out.append(OpGroup(tuple(members), count_op(op.primitive, ins, outs, op.params).flops * len(members)))
    return sorted(out, key=lambda g: (-g.flops, g.members[0]))


def module_path(op: Any) -> tuple[tuple[str, ...], bool]:
    """The op's module path (name-stack components without JAX transforms) and whether it is backward
    (under `transpose`: the gradient)."""
    stack = str(getattr(getattr(op, "source_info", None), "name_stack", "") or "")
    parts, backward = [], "transpose(" in stack
    for comp in stack.split("/"):
        m = _TRANSFORM.match(comp)
        comp = m.group(1) if m else comp
        if comp:
            parts.append(comp)
    return tuple(parts), backward


def _merge(components: Sequence[str]) -> str | None:
    """One component for several (`Block_0`, `Block_1`, `Block_2` -> `Block_0-2`), or None."""
    uniq = list(dict.fromkeys(components))
    if len(uniq) == 1:
        return uniq[0]
    matches = [_NUMBERED.match(c) for c in uniq]
    if all(matches) and len({m.group(1) for m in matches}) == 1:
        nums = sorted(int(m.group(2)) for m in matches)
        span = f"{nums[0]}-{nums[-1]}" if nums == list(range(nums[0], nums[-1] + 1)) else ",".join(map(str, nums))
        return f"{matches[0].group(1)}{span}"
    return None


def _backward_regions(graph: Any) -> frozenset[str]:
    """Loop and branch bodies that run in the backward pass: their scan/while/cond is under `transpose` (the
    body's own ops carry only the body's name stack; the `tie`s joining a body to the outside carry its
    loop's)."""

    def compute() -> frozenset[str]:
        return frozenset(op.region for op in graph.ops
                         if op.primitive == "tie" and op.region not in ("", "io") and module_path(op)[1])

    return graph.analysis("backward_regions", compute)


def is_backward(graph: Any, op: Any) -> bool:
    """Whether `op` computes a gradient: under `transpose` itself, or in a body (or a body of a body) of a
    loop or branch that is."""
    if module_path(op)[1]:
        return True
    regions, region = _backward_regions(graph), op.region
    while region:
        if region in regions:
            return True
        region = region.rpartition("/")[0]
    return False


def group_label(graph: Any, members: Sequence[int]) -> str:
    """`Block_0-2/Dense_1 (backward)`; without module paths, the first member's source line."""
    paths = [module_path(graph.ops[m]) for m in members]
    comps = [p for p, _ in paths]
    direction = " (backward)" if all(is_backward(graph, graph.ops[m]) for m in members) else ""
    if comps and all(comps) and len({len(c) for c in comps}) == 1:
        merged = [_merge(col) for col in zip(*comps)]
        if all(m is not None for m in merged):
            if len(merged) > 1:
                merged = merged[1:]  # the model's own name adds nothing
            return "/".join(merged) + direction  # type: ignore[arg-type]
    src = graph.ops[members[0]].source
    return (str(src) if src else graph.ops[members[0]].primitive) + direction
