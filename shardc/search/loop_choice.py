"""Loop restructuring as a decision of the search (under `shardc.auto(pcg=True)`): the program as traced and
the program with its scans' per-trip matmuls moved out of the loops (`shardc.loops`) are both searched, with
the same budget and seed, and the faster plan that fits is the one that runs. `LoopChoice` says what was
chosen and what it gained, for `plan.explain()`."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jax.extend import core as jcore

from annotations.errors import ShardingError
from shardc.loops import LoopRewrite, restructure_loops
from shardc.search.driver import NoPlanFits
from shardc.search.remat_choice import _score

__all__ = ["LoopChoice", "choose_loops"]

# program -> (the program it runs, its searched plan, whatever else the planner decided with it)
PlanProgram = Callable[[jcore.ClosedJaxpr], tuple[jcore.ClosedJaxpr, Any, Any]]


@dataclasses.dataclass(frozen=True)
class LoopChoice:
    """Whether the restructured loops run, and the simulated steps of both programs' plans."""

    rewrites: tuple[LoopRewrite, ...]
    chosen: bool  # the restructured program runs
    time: float  # simulated step seconds of the restructured program's plan (inf: none fits)
    base_time: float  # ... and of the program as traced (inf: none fits)
    failed: str = ""  # why the restructured program could not be planned (it is then not run)

    def summary(self) -> str:
        from shardc.sim.result import _fmt_time

        fmt = lambda t: _fmt_time(t) if t != float("inf") else "no plan fits"  # noqa: E731
        if self.chosen:
            head = (f"loops restructured (shardc.loops): step {fmt(self.time)}, as traced {fmt(self.base_time)}"
                    + (f" ({self.base_time / self.time:.2f}x)" if self.base_time != float("inf") else ""))
        elif self.failed:
            head = f"loops as traced: step {fmt(self.base_time)}; restructured not planned ({self.failed})"
        else:
            head = (f"loops as traced: step {fmt(self.base_time)}; restructured {fmt(self.time)} "
                    "(slower, not run)")
        return "\n".join([head] + [f"  {r.describe()}" for r in self.rewrites])


def _time(plan: Any) -> float:
    """The searched plan's simulated step, inf when it does not fit."""
    t, _, fits = _score(plan)
    return t if fits else float("inf")


def choose_loops(closed: jcore.ClosedJaxpr, plan_program: PlanProgram
                 ) -> tuple[jcore.ClosedJaxpr, Any, Any, LoopChoice | None]:
    """(program, plan, the planner's extra decision, LoopChoice): the program as traced or restructured,
    whichever plan is faster (the traced one on a tie). The choice is None when no loop has a matmul to
    move. Raises the traced program's NoPlanFits when neither fits."""
    rewritten = restructure_loops(closed)
    base_error: NoPlanFits | None = None
    try:
        base = plan_program(closed)
    except NoPlanFits as e:
        base, base_error = None, e
    if rewritten is None:
        if base is None:
            raise base_error
        return (*base, None)
    program, rewrites = rewritten
    failed = ""
    try:
        other = plan_program(program)
    except NoPlanFits:
        other = None
    except ShardingError as e:  # (a rewrite the planner cannot take: the program as traced runs, and says why)
        other, failed = None, str(e).splitlines()[0][:200]
    base_t = _time(base[1]) if base is not None else float("inf")
    other_t = _time(other[1]) if other is not None else float("inf")
    if other is None and base is None:
        raise base_error
    chosen = other_t < base_t
    choice = LoopChoice(tuple(rewrites), chosen, other_t, base_t, failed)
    return (*(other if chosen else base), choice)
