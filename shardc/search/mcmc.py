"""Metropolis-Hastings over assignments (FlexFlow §6), scored by the simulator.

Each step re-draws one group's choice (a symmetric proposal given the group; groups are picked in
proportion to the bytes their members touch, so the heavy ops are revisited most). A better proposal is always taken; a worse
one with probability exp(-beta * (cost_new - cost_cur) / cost_ref), where cost_ref is the best time so
far, so beta is relative to the cost's magnitude (beta=20: a 5% slower plan is taken with p = 1/e).
The chain restarts from the best state every `restart_every` steps and stops when the budget (steps or
seconds) is spent or nothing improved for half of it. Deterministic for a seed when bounded by steps (a
`deadline` is a safety cap only: the chain reports `stopped == "time cap"` when it hit it).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Any, Callable, Sequence

from shardc.search.evaluate import Evaluator, Score
from shardc.search.space import Assignment

__all__ = ["MCMCStats", "mcmc", "group_weight"]


@dataclasses.dataclass
class MCMCStats:
    steps: int = 0
    accepted: int = 0
    restarts: int = 0
    improvements: int = 0
    stopped: str = ""


def _accept(new: Score, cur: Score, ref: float, beta: float, rng: random.Random) -> bool:
    if new.key <= cur.key:
        return True
    if not new.feasible:
        return False  # never walk into infeasible plans from a feasible one (nor to a worse infeasible one)
    if not cur.feasible:
        return True
    return rng.random() < math.exp(-beta * (new.time - cur.time) / max(ref, 1e-30))


def group_weight(ev: Evaluator, gi: int) -> float:
    """Proposal weight of a group: the bytes its members touch (heavy ops are re-drawn more often)."""
    g = ev.space.graph
    grp = ev.space.groups[gi]
    if grp.kind == "input":
        return float(sum(g.values[v].nbytes for v in grp.members))
    return float(sum(g.values[v].nbytes for m in grp.members for v in g.ops[m].inputs + g.ops[m].outputs))


def mcmc(ev: Evaluator, starts: Sequence[Assignment], *, seed: int = 0, max_steps: int = 2000,
         budget_s: float | None = None, deadline: float | None = None, beta: float = 20.0,
         restart_every: int | None = None,
         on_step: Callable[[int, Score], Any] | None = None,
         prefer: Sequence[Sequence[int]] | None = None) -> tuple[Assignment, Score, MCMCStats]:
    """Search from the best of `starts`; returns the best assignment, its score and statistics. With `prefer`
    (per group, choices such as the baselines' `mixing_domains`), half of the proposals of a group draw from
    its preferred choices (when it has another one than the current). The proposal is then symmetric among
    preferred choices and among the others, but favours moves into the preferred set (on purpose: the chain
    spends more time near mixes of the baselines). `budget_s`: a time budget (the result then depends on
    the machine's speed); `deadline`: a `time.perf_counter()` value at which the chain stops regardless."""
    rng = random.Random(seed)
    stats = MCMCStats()
    scored = [(ev.score(s), i, s) for i, s in enumerate(starts)]
    best_score, _, best = min(scored, key=lambda t: (t[0].key, t[1]))
    cur, cur_score = best, best_score
    groups = [i for i, g in enumerate(ev.space.groups) if g.size > 1]
    if not groups:
        stats.stopped = "no decisions"
        return best, best_score, stats
    weights = [group_weight(ev, i) for i in groups]
    restart_every = restart_every or max(10, max_steps // 10)
    t0 = time.perf_counter()
    last_gain_step, last_gain_t = 0, t0
    for step in range(1, max_steps + 1):
        now = time.perf_counter()
        if budget_s is not None and now - t0 >= budget_s:
            stats.stopped = "time budget"
            break
        if deadline is not None and now >= deadline:
            stats.stopped = "time cap"
            break
        if step - last_gain_step > max_steps // 2 or (budget_s is not None and now - last_gain_t > budget_s / 2):
            stats.stopped = "no improvement for half the budget"
            break
        gi = rng.choices(groups, weights)[0]
        pool = [c for c in prefer[gi] if c != cur[gi]] if prefer is not None else []
        if pool and rng.random() < 0.5:
            k = rng.choice(pool)
        else:
            k = rng.randrange(ev.space.groups[gi].size - 1)
            k = k + 1 if k >= cur[gi] else k
        prop = cur[:gi] + (k,) + cur[gi + 1:]
        s = ev.score(prop)
        stats.steps = step
        if _accept(s, cur_score, best_score.time if best_score.feasible else s.time, beta, rng):
            cur, cur_score = prop, s
            stats.accepted += 1
            if s.key < best_score.key:
                best, best_score = prop, s
                stats.improvements += 1
                last_gain_step, last_gain_t = step, time.perf_counter()
        if step % restart_every == 0 and cur != best:
            cur, cur_score = best, best_score
            stats.restarts += 1
        if on_step is not None:
            on_step(step, best_score)
    else:
        stats.stopped = "step budget"
    return best, best_score, stats
