"""Greedy descent from each start of the search (the baselines, the role mixes), one group at a time.

The DP and MCMC work around the *best* start. A start that is slower as it stands may be one move away from
the best plan of all: expert parallelism on an unhinted MoE layer computes the experts split over the expert
axis, but propagation leaves one combine einsum of the backward pass split by expert too (its largest operand
is), and moving that op back to the token groups gives GShard's layout, faster than every baseline. `polish`
takes such moves: each pass tries every single-group move within the groups' mixing domains (the choices the
baselines make, `space.mixing_domains`) and keeps the best, until none improves or its plan allowance is spent.
"""
from __future__ import annotations

from typing import Callable, Sequence

from shardc.search.evaluate import Evaluator
from shardc.search.space import Assignment

__all__ = ["polish"]


def polish(ev: Evaluator, start: Assignment, domains: Sequence[Sequence[int]], *, max_evals: int,
           on_eval: Callable[[], None] | None = None) -> Assignment:
    """Best-improvement descent from `start` over single-group moves within `domains` (per group, its
    choices); stops at a local optimum or after `max_evals` new evaluations (the pass it is in stops there).
    Deterministic: groups and choices in index order, ties kept by the first found."""
    cur, cur_score = tuple(start), ev.score(tuple(start))
    spent = 0
    while spent < max_evals:
        best, best_score = None, cur_score
        for gi, dom in enumerate(domains):
            for k in dom:
                if k == cur[gi]:
                    continue
                cand = cur[:gi] + (k,) + cur[gi + 1:]
                if cand not in ev.cache:
                    if spent >= max_evals:
                        break
                    spent += 1
                    if on_eval is not None:
                        on_eval()
                s = ev.score(cand)
                if s.key < best_score.key:
                    best, best_score = cand, s
        if best is None:
            break
        cur, cur_score = best, best_score
    return cur
