"""The search's budget: a number of simulated plans, so that a run is reproducible on a quiet machine and
a busy one alike.

A time budget makes the result depend on how fast the machine is at that moment (a loaded machine
evaluates fewer candidates and may return another plan). So `budget_s` is turned into a *plan budget*
from the program's size — the number of candidates the reference machine evaluates in about that time —
and every decision of the search (how many meshes to score, whether the DP fits, how long MCMC runs, when
it gives up for lack of progress) counts plans, not seconds. The same program, options and seed then give
the same plan on every run and every process; a busy machine takes longer to reach it.

There is no wall-clock cap unless one is asked for (`cap_s`, `@shardc.auto(time_cap_s=...)`): a search it
stops is flagged (`Budget.capped`, `SearchReport.capped`) because a rerun may choose another plan.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

__all__ = ["Budget", "plans_for", "plan_seconds", "full_plan_units", "MESH_SETUP_UNITS", "SearchTimeCapWarning"]

class SearchTimeCapWarning(UserWarning):
    """The search stopped at the wall-clock cap the user asked for before spending its plan budget: a rerun
    may choose another plan."""


# Seconds one incremental evaluation (propagation + plan + simulation of a one-decision move) takes on the
# reference machine (2 cores): a fixed part and a part per graph op, both growing with the device count
# (more mesh axes, hierarchical collectives). Fitted to MLP and 1/4/12-layer GPT train steps on 8 and 64
# devices (bench/search_speed.py: 28 ms on 8 devices and 69 ms on 64 for the 12-layer GPT, ~6,400 ops).
_FIXED_S, _FIXED_S_PER_DEVICE = 2e-3, 4e-5
_PER_OP_S, _PER_OP_S_PER_DEVICE = 3.6e-6, 1.1e-7
# The plan budget aims at this fraction of `budget_s`, so that a machine up to twice as slow as the
# reference (or as busy: other jobs, parallel tests) still plans within about `budget_s`.
_TARGET_FRACTION = 0.5


def full_plan_units(num_devices: int) -> float:
    """What scoring a baseline on a fresh mesh (full propagation, plan and simulation) costs, in incremental
    evaluations: ~3.7 on 8 devices, ~1.5 on 64 (where the simulation dominates both)."""
    return max(1.5, 4.0 - 0.04 * num_devices)


# Setting up a mesh (its search space, and the user's hints propagated once) costs about this many.
MESH_SETUP_UNITS = 2.0


def plan_seconds(num_ops: int, num_devices: int) -> float:
    """Seconds the reference machine takes for one incremental evaluation of a `num_ops`-op program on
    `num_devices` devices."""
    return (_FIXED_S + _FIXED_S_PER_DEVICE * num_devices
            + max(num_ops, 1) * (_PER_OP_S + _PER_OP_S_PER_DEVICE * num_devices))


def plans_for(seconds: float, num_ops: int, num_devices: int) -> int:
    """How many candidate plans of a `num_ops`-op program on `num_devices` devices the reference machine
    evaluates in `_TARGET_FRACTION * seconds` (at least 20)."""
    return max(20, int(_TARGET_FRACTION * seconds / plan_seconds(num_ops, num_devices)))


@dataclasses.dataclass
class Budget:
    """`plans`: the deterministic allowance (None: unbounded, e.g. only `max_steps` bounds MCMC);
    `cap_s`: a wall-clock cap in seconds the caller asked for (None, the default: none, so the result does
    not depend on the machine's load)."""

    plans: int | None
    cap_s: float | None
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    spent: float = 0.0
    capped: bool = False

    @classmethod
    def for_search(cls, seconds: float | None, graph: Any, num_devices: int, *,
                   cap: bool | float | None = None) -> "Budget":
        """`cap`: None or False for no wall-clock cap (the default), True for a cap of `seconds`, or the
        cap in seconds."""
        if seconds is None:
            return cls(None, None)
        cap_s = None if cap is None or cap is False else seconds if cap is True else float(cap)
        return cls(plans_for(seconds, len(graph.ops), num_devices), cap_s)

    def charge(self, units: float) -> None:
        self.spent += units

    @property
    def left(self) -> float:
        """Plans left (inf when unbounded)."""
        return math.inf if self.plans is None else max(self.plans - self.spent, 0)

    @property
    def deadline(self) -> float | None:
        """The cap as a `time.perf_counter()` value."""
        return None if self.cap_s is None else self.t0 + self.cap_s

    def out_of_time(self) -> bool:
        """True (and remembered) once the wall-clock cap has passed."""
        if self.cap_s is not None and time.perf_counter() >= self.t0 + self.cap_s:
            self.capped = True
        return self.capped
