"""Rematerialization as a decision of the search: which policy the repeated layers use (`shardc.remat`),
chosen with the layouts, memory a hard limit.

The program is planned as traced first. Remat cannot make a plan faster by itself (it only adds work), so
the variants are planned only when memory decided something: no plan fits, or a candidate the search
scored was faster than the one it chose but did not fit. Then each policy of `POLICY_ORDER` (the same for
every layer group; "names" only when the program tags values with `checkpoint_name`) rewrites the program,
which is searched like the original (same budget, same seed, so the choice is reproducible), and the
fastest plan that fits wins. `RematChoice` says what was chosen and what it traded, for `plan.explain()`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jax.extend import core as jcore

from shardc.remat import inline_calls, layer_groups, rematerialize, uses_own_remat
from shardc.search.driver import NoPlanFits

__all__ = ["RematChoice", "choose_remat", "POLICY_ORDER", "apply_choice"]

POLICY_ORDER = ("dots", "names", "nothing")  # least recomputation first

PlanOf = Callable[[jcore.ClosedJaxpr], Any]  # program -> its searched Plan (raises NoPlanFits)


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """The remat policy per layer group and what it traded against the program as traced."""

    policies: dict[str, str]  # layer group (`Block_*`) -> policy
    layers: dict[str, tuple[str, ...]]  # layer group -> its layers
    peak: float  # simulated peak bytes per device with the policy
    time: float  # simulated step seconds with the policy
    base_peak: float  # ... and as traced (the smallest peak found when nothing fit)
    base_time: float | None  # None when nothing fit as traced
    tried: tuple[tuple[str, float, float, bool], ...]  # (policy, time, peak, fits) of each variant planned

    @property
    def active(self) -> bool:
        return any(p != "none" for p in self.policies.values())

    def summary(self) -> str:
        from shardc.sim.result import _fmt_bytes, _fmt_time

        lines = []
        for g, p in self.policies.items():
            n = len(self.layers.get(g, ()))
            what = {"none": "keep every activation", "dots": "keep matmul outputs, recompute the rest",
                    "dots_no_batch": "keep outputs of matmuls without batch dims, recompute the rest",
                    "names": "keep the values tagged with checkpoint_name, recompute the rest",
                    "nothing": "keep only the layer input, recompute the layer"}[p]
            lines.append(f"  {g} ({n} layers): {p} — {what}")
        saved = self.base_peak - self.peak
        cost = "" if self.base_time is None else f", {_fmt_time(self.time - self.base_time)} more per step"
        head = (f"rematerialization: peak {_fmt_bytes(self.peak)} per device, {_fmt_bytes(saved)} less than "
                f"as traced{cost}" + (" (nothing fits as traced)" if self.base_time is None else ""))
        tried = ", ".join(f"{p}: {_fmt_time(t)}, peak {_fmt_bytes(m)}" if ok else f"{p}: does not fit (peak {_fmt_bytes(m)})"
                          for p, t, m, ok in self.tried)
        return "\n".join([head] + lines + [f"  tried: {tried}"])


def _score(plan: Any) -> tuple[float, float, bool]:
    c = plan.search.chosen.score
    return c.time, c.peak, c.feasible


def _memory_decided(plan: Any) -> bool:
    """Whether a candidate the search scored was faster than the chosen plan but did not fit (a plan loaded
    from a file, with no search behind it, is kept as it is)."""
    rep = plan.search
    if rep is None:
        return False
    chosen = rep.chosen.score.time
    return any(not c.score.feasible and c.score.time < chosen for c in rep.baselines)


def _has_names(closed: jcore.ClosedJaxpr) -> bool:
    return any(e.primitive.name == "name" for e in closed.jaxpr.eqns)


def apply_choice(closed: jcore.ClosedJaxpr, choice: RematChoice | None) -> jcore.ClosedJaxpr:
    """The program as `choice` rewrites it (unchanged when there is no active choice)."""
    if choice is None or not choice.active:
        return closed
    return rematerialize(inline_calls(closed), choice.policies)


def choose_remat(closed: jcore.ClosedJaxpr, plan_of: PlanOf) -> tuple[jcore.ClosedJaxpr, Any, RematChoice | None]:
    """The program to run (as traced, or rewritten with a remat policy) and its plan. Raises NoPlanFits
    naming the smallest peak and its policy when no variant fits."""
    base_error: NoPlanFits | None = None
    try:
        base = plan_of(closed)
    except NoPlanFits as e:
        base, base_error = None, e
    if base is not None and not _memory_decided(base):
        return closed, base, None
    if uses_own_remat(closed):  # the user's jax.checkpoint / nn.remat stays as written
        if base_error is not None:
            raise base_error
        return closed, base, None
    flat = inline_calls(closed)
    groups = layer_groups(flat)
    if not groups:
        if base_error is not None:
            raise base_error
        return closed, base, None
    layers = {g: tuple(l.path for l in ls) for g, ls in groups.items()}
    policies = [p for p in POLICY_ORDER if p != "names" or _has_names(flat)]
    best: tuple[tuple, jcore.ClosedJaxpr, Any, str] | None = None
    if base is not None:
        t, m, ok = _score(base)
        best = ((t, 0), closed, base, "none")
    tried = []
    smallest = (base_error.smallest_peak, "none") if base_error is not None else None
    for k, policy in enumerate(policies, start=1):
        program = rematerialize(flat, {g: policy for g in groups})
        try:
            plan = plan_of(program)
        except NoPlanFits as e:
            tried.append((policy, float("inf"), e.smallest_peak, False))
            if smallest is None or e.smallest_peak < smallest[0]:
                smallest = (e.smallest_peak, policy)
            continue
        t, m, ok = _score(plan)
        tried.append((policy, t, m, ok))
        if ok and (best is None or (t, k) < best[0]):
            best = ((t, k), program, plan, policy)
    if best is None:
        peak, policy = smallest
        raise NoPlanFits(peak, base_error.limit, f" (with remat policy {policy!r} on {', '.join(groups)})")
    _, program, plan, policy = best
    base_time, base_peak = (_score(base)[0], _score(base)[1]) if base is not None else (None, base_error.smallest_peak)
    t, m, _ = _score(plan)
    choice = RematChoice({g: policy for g in groups}, layers, m, t, base_peak, base_time, tuple(tried))
    return program, plan, choice
