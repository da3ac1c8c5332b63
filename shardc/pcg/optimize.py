"""Rewriting a PCG with proved rules, keeping a rewrite only when the cost says it pays.

Greedy steepest descent: at each step every match of every usable rule is applied, the cheapest result
is kept if it is cheaper than the current PCG, and the search stops when no rewrite pays (or after
`max_steps`). A rule is verified with Z3 the first time it matches; an unproved one is dropped, never
applied.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterable, Iterator, Sequence

from shardc.pcg.costs import CostFn, bytes_moved
from shardc.pcg.generate import ac_form
from shardc.pcg.graph import PCG
from shardc.pcg.lang import OPS, Rule, term_ops
from shardc.pcg.library import all_rules
from shardc.pcg.match import Match, RewriteError, apply_match, find_matches
from shardc.pcg.verify import verify_rule

__all__ = ["Step", "Optimized", "optimize", "usable_rules"]


@dataclasses.dataclass(frozen=True)
class Step:
    rule: str
    where: str
    cost_before: float
    cost_after: float

    def __str__(self) -> str:
        return f"{self.where}: {self.cost_before:.1f} -> {self.cost_after:.1f}"


@dataclasses.dataclass(frozen=True)
class Optimized:
    pcg: PCG
    initial_cost: float
    cost: float
    steps: tuple[Step, ...]
    candidates: int
    seconds: float

    def __str__(self) -> str:
        lines = [f"{len(self.steps)} rewrites, cost {self.initial_cost:.1f} -> {self.cost:.1f} "
                 f"({self.candidates} candidates, {self.seconds:.2f} s)"]
        lines += [f"  {s}" for s in self.steps]
        return "\n".join(lines)


def usable_rules(rules: Sequence[Rule]) -> list[Rule]:
    """Rules whose right-hand side can be built on a PCG: its parallel ops act on the group the left-hand
    side binds (so the left has a parallel op too), it has no device-shift permute, and it does more
    than reorder adds/muls. (Whether they are proved is checked when they first match.)"""
    out = []
    for r in rules:
        lhs_par = any(OPS[a.op].parallel for t in r.lhs for a in term_ops(t))
        rhs_ops = [a.op for t in r.rhs for a in term_ops(t)]
        if any(OPS[o].parallel for o in rhs_ops) and not lhs_par:
            continue
        if "permute" in rhs_ops:
            continue
        if len(r.lhs) == len(r.rhs) == 1 and ac_form(r.lhs[0]) == ac_form(r.rhs[0]):
            continue  # a pure reordering of adds/muls
        out.append(r)
    return out


def _applied(pcg: PCG, matches: Iterable[Match]) -> Iterator[tuple[Match, PCG]]:
    for m in matches:
        try:
            yield m, apply_match(pcg, m)
        except RewriteError:
            continue


def optimize(pcg: PCG, rules: Sequence[Rule] | None = None, *, cost_fn: CostFn = bytes_moved,
             max_steps: int = 200) -> Optimized:
    """Rewrite `pcg` with proved rules while the cost goes down. Rules are verified when they first
    match (`verify_rule` caches verdicts); a refuted rule is dropped."""
    t0 = time.perf_counter()
    rules = usable_rules(all_rules() if rules is None else rules)
    refuted: set[str] = set()
    current, cost = pcg, cost_fn(pcg)
    initial = cost
    steps: list[Step] = []
    candidates = 0
    seen = {pcg.key()}
    for _ in range(max_steps):
        best: tuple[float, PCG, str, str] | None = None
        for rule in rules:
            if rule.text in refuted:
                continue
            matches = find_matches(current, rule)
            first = next(matches, None)
            if first is None:
                continue
            if not verify_rule(rule).proved:  # an unproved rule is never applied
                refuted.add(rule.text)
                continue
            for m, new in _applied(current, itertools.chain([first], matches)):
                candidates += 1
                k = new.key()
                if k in seen:
                    continue
                seen.add(k)
                c = cost_fn(new)
                if c < cost - 1e-9 and (best is None or c < best[0]):
                    best = (c, new, rule.name, str(m))
        if best is None:
            break
        steps.append(Step(best[2], best[3], cost, best[0]))
        cost, current = best[0], best[1]
    return Optimized(current, initial, cost, tuple(steps), candidates, time.perf_counter() - t0)
