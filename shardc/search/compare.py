"""What each decision group of the chosen plan beat: for the heaviest groups of repeated ops, the baselines
that make the same choice for the group, and how much slower the chosen plan gets with only that group
switched to another baseline's choice ("1.3 ms faster than FSDP's here"). `plan.explain()` shows them.

The comparisons are simulated after the search, a fixed number of them (at most `MAX_GROUPS` groups times
the baselines' distinct choices), so they do not change the plan and cost the same on every run.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from shardc.search.evaluate import Evaluator
from shardc.search.mcmc import group_weight
from shardc.search.space import Assignment, plan_choices

__all__ = ["GroupNote", "compare_groups", "MAX_GROUPS"]

MAX_GROUPS = 6


@dataclasses.dataclass(frozen=True)
class GroupNote:
    """One decision group of the chosen plan: its ops, the baselines choosing alike, and what it beat."""

    members: tuple[int, ...]  # op ids
    same_as: tuple[str, ...]  # baselines whose plans make the chosen choice for this group
    beats: tuple[tuple[str, float], ...]  # (baselines making another choice, "/"-joined; seconds slower with it)


def compare_groups(ev: Evaluator, point: Assignment, chosen: Any, time: float,
                   baselines: Mapping[str, Assignment]) -> tuple[GroupNote, ...]:
    """Notes for the heaviest op groups of `ev`'s space. `point` reproduces the `chosen` plan (simulated
    `time` seconds); `baselines` maps each baseline's name to its `plan_choices` on this mesh."""
    ref = ev.score(point)
    if not ref.feasible or not math.isclose(ref.time, time, rel_tol=1e-9):
        return ()  # the point does not give the chosen plan back: no honest comparison
    space = ev.space
    made = plan_choices(space, chosen)
    ops = sorted((gi for gi, g in enumerate(space.groups) if g.kind == "op"), key=lambda gi: -group_weight(ev, gi))
    notes = []
    for gi in ops[:MAX_GROUPS]:
        same = tuple(n for n, c in baselines.items() if c[gi] == made[gi] and made[gi] != 0)
        others: dict[int, list[str]] = {}
        for n, c in baselines.items():
            if c[gi] != made[gi] and c[gi] != 0:
                others.setdefault(c[gi], []).append(n)
        beats = []
        for k, names in others.items():
            s = ev.score(point[:gi] + (k,) + point[gi + 1:])
            if s.feasible:
                beats.append(("/".join(names), s.time - ref.time))
        notes.append(GroupNote(space.groups[gi].members, same, tuple(sorted(beats, key=lambda b: b[1]))))
    return tuple(notes)
