"""Devices that repeat work: how many times a plan duplicates each op's compute, the mesh axes no tensor
is split over, and the one warning `@shardc.auto` gives when a plan wastes devices (never silently).

An op's compute is duplicated over every mesh axis its strategy does not use: each device of such an
axis computes the same values. A plan that splits no tensor over an axis makes all of its work
duplicated over that axis; on a mesh where nothing is split, every device repeats the whole step.
"""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

from annotations.errors import is_library_file

if TYPE_CHECKING:
    from shardc.plan import Plan

__all__ = ["IdleDevicesWarning", "duplication", "duplicated_flops", "unused_axes", "waste_warning",
           "describe_duplication", "user_stacklevel"]


class IdleDevicesWarning(UserWarning):
    """A plan leaves devices repeating the same work: nothing is split (search=False), or a mesh axis splits
    no tensor."""


def duplication(plan: "Plan", op_id: int) -> int:
    """How many devices compute the same values of op `op_id` (1: its work is split over the whole mesh)."""
    sizes = plan.mesh_sizes
    used = {a for axes in plan.strategies[op_id].factor_axes for a in axes}
    return math.prod(n for a, n in sizes.items() if a not in used)


def duplicated_flops(plan: "Plan") -> dict[int, float]:
    """FLOPs per step of the ops XLA keeps, by how many times they are duplicated (the program's FLOPs,
    counted at global shapes; loop bodies times their trips)."""
    from shardc.cost.flops import count_op
    from shardc.cost.program import program_info

    g = plan.graph
    info = program_info(g)
    out: dict[int, float] = {}
    for op in g.ops:
        if not info.counts(op.id):
            continue
        shapes = [g.values[v].shape for v in op.inputs], [g.values[v].shape for v in op.outputs]
        flops = count_op(op.primitive, *shapes, op.params).flops * info.trips[op.id]
        if flops:
            k = duplication(plan, op.id)
            out[k] = out.get(k, 0.0) + flops
    return out


def unused_axes(plan: "Plan") -> list[str]:
    """Mesh axes of size > 1 over which no tensor is split (nor holds partial sums)."""
    used: set[str] = set()
    for s in plan.shardings:
        used.update(a for axes in s.dims for a in axes)
        used.update(s.partial)
    return [a for a, n in plan.mesh_sizes.items() if n > 1 and a not in used]


def describe_duplication(plan: "Plan") -> str:
    """One line: how much of the step's compute is duplicated, and how many times."""
    n = math.prod(plan.mesh_sizes.values())
    by = duplicated_flops(plan)
    total = sum(by.values())
    if n == 1 or not total:
        return "compute: one device" if n == 1 else "compute: no FLOPs counted"
    if set(by) == {n}:
        return f"compute duplicated {n} times: every device repeats the whole step (nothing is split)"
    dup = sorted((k for k in by if k > 1), reverse=True)
    if not dup:
        return "compute: split over every device (no FLOPs duplicated)"
    parts = ", ".join(f"{k} times on {_share(by[k] / total)}" for k in dup)
    return f"compute duplicated {parts} of the FLOPs (ops split over fewer than the {n} devices)"


def _share(f: float) -> str:
    return "<1%" if 0 < f < 0.005 else f"{100 * f:.0f}%"


def waste_warning(plan: "Plan", *, search: bool, topology: str = "") -> str | None:
    """The warning for a plan that wastes devices, or None."""
    sizes = plan.mesh_sizes
    n = math.prod(sizes.values())
    mesh = ", ".join(f"{a}={k}" for a, k in sizes.items())
    if n == 1:
        return None
    idle = unused_axes(plan)
    if not search and len(idle) == sum(1 for k in sizes.values() if k > 1):
        return (f"shardc: with search=False nothing is split on mesh ({mesh}): every one of the {n} devices repeats "
                f"the whole step (compute duplicated {n} times). Add hints (split/shard, Flax partitioning metadata) "
                f"or let the search plan the step (search=True)")
    if not idle:
        return None
    k = math.prod(sizes[a] for a in idle)
    it = "it" if len(idle) == 1 else "them"
    if search:
        on = f" on {topology}" if topology else ""
        advice = (f"The search priced this plan fastest{on}: splitting over {it} would cost more than it saves. "
                  f"Use fewer devices (mesh=...), give each step more work, or hint a split over {it}")
    else:
        advice = f"Add hints that split over {it}, or pass a mesh without {it}"
    return (f"shardc: the plan on mesh ({mesh}) splits no tensor over mesh axis {', '.join(map(repr, idle))}: "
            f"{'its' if len(idle) == 1 else 'their'} devices repeat the same work (compute duplicated {k} times). "
            f"{advice}")


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning point at the innermost frame outside shardc, jax and flax."""
    f, level = sys._getframe(1), 1
    while f is not None and is_library_file(f.f_code.co_filename):
        f, level = f.f_back, level + 1
    return level
