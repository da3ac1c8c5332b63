"""Dynamic programming over the chain of decision groups (in program order), with the simulator as oracle.

The cost of an assignment is modelled around a base assignment b as
    f(x) ~ f(b) + sum_g U_g(x_g) + sum_g P'_g(x_g, x_{g+1})
where U_g(s) = f(b with x_g=s) - f(b) and the pair term is measured as P_g(s,t) = f(b with x_g=s,
x_{g+1}=t) - f(b) (which contains both unary terms and the resharding between the neighbours). Minimising
sum_g P_g(x_g, x_{g+1}) - sum_{interior g} U_g(x_g) is a shortest path (Viterbi); it is exact whenever the
simulated cost decomposes over neighbouring decisions (a chain of layers with resharding on the edges).
The result is checked with a full simulation and, in the driver, refined by MCMC.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from shardc.search.evaluate import Evaluator, Score
from shardc.search.space import Assignment

__all__ = ["chain_dp"]


def _cost(s: Score) -> float:
    return s.time if s.feasible else math.inf


class _OutOfTime(Exception):
    pass


def chain_dp(ev: Evaluator, base: Assignment, *, max_evals: int = 4000, deadline: float | None = None,
             on_eval: Callable[[], None] | None = None) -> tuple[Assignment, Score]:
    """The chain DP around `base`; returns the assignment found and its simulated score (`base` itself when
    the deadline, a `time.perf_counter()` value, passes first)."""
    try:
        return _chain_dp(ev, base, max_evals, deadline, on_eval)
    except _OutOfTime:
        return base, ev.score(base)


def _chain_dp(ev: Evaluator, base: Assignment, max_evals: int, deadline: float | None,
              on_eval: Callable[[], None] | None) -> tuple[Assignment, Score]:
    groups = ev.space.groups
    n = len(groups)
    if n == 0:
        return base, ev.score(base)

    def f(a: Assignment) -> float:
        if deadline is not None and time.perf_counter() > deadline:
            raise _OutOfTime
        if on_eval is not None:
            on_eval()
        return _cost(ev.score(a))

    f0 = f(base)
    if math.isinf(f0):
        f0 = 0.0

    def with_(pairs: dict[int, int]) -> Assignment:
        return tuple(pairs.get(i, c) for i, c in enumerate(base))

    unary = [[f(with_({g: s})) - f0 for s in range(groups[g].size)] for g in range(n)]
    # Keep the best k choices per group so that the pair tables fit the budget.
    budget = max(max_evals - sum(g.size for g in groups), 4 * n)
    k = max(2, int(math.sqrt(budget / max(n - 1, 1))))
    keep = [sorted(range(groups[g].size), key=lambda s: (unary[g][s], s))[:k] for g in range(n)]
    for g in range(n):
        if base[g] not in keep[g]:
            keep[g].append(base[g])
    # Viterbi: best[g][s] = min cost of groups 0..g with x_g = s.
    best = {s: 0.0 for s in keep[0]} if n > 1 else {s: unary[0][s] for s in keep[0]}
    back: list[dict[int, int]] = []
    for g in range(n - 1):
        nxt: dict[int, float] = {}
        arg: dict[int, int] = {}
        for t in keep[g + 1]:
            for s in keep[g]:
                c = best[s] + f(with_({g: s, g + 1: t})) - f0 - (unary[g][s] if g > 0 else 0.0)
                if t not in nxt or c < nxt[t]:
                    nxt[t], arg[t] = c, s
        back.append(arg)
        best = nxt
    last = min(best, key=lambda s: (best[s], s))
    choice = [0] * n
    choice[-1] = last
    for g in range(n - 2, -1, -1):
        choice[g] = back[g][choice[g + 1]]
    a = tuple(choice)
    return a, ev.score(a)
