"""Rewriting a PCG with proved rules, keeping a rewrite only when the simulator says it pays.

Greedy steepest descent: at each step every match of every usable rule is applied, the cheapest result
is kept if it is cheaper than the current PCG, then each other rewrite that paid is applied too where it
still matches, if the cost still goes down (rewrites of distant parts of a big program are found in one
pass); the search stops when no rewrite pays, even after a lookahead (`Lookahead`), or after
`max_steps`. The cost is the simulated step time on a topology (`shardc.pcg.simcost.SimCost`, default
`h100-sxm-8`) unless another `cost_fn` is given. Loop and branch bodies are optimized first, each as a
PCG of its own (their boundary layouts are fixed), and a new body is kept when the whole PCG's cost
goes down. A rule is verified with Z3 the first time it matches; an unproved one is dropped, never
applied. A candidate's cost needs to be exact only where it is below the current cost (`priced`: a cost
function may skip the rest of its work above that bound, as `SimCost` skips the memory model). A cost function
with a `local_gain` (`SimCost` on a large PCG) screens candidates by their neighbourhood alone
(`shardc.pcg.local_screen`): only those whose neighbourhood gets faster are priced in full, the largest gain
first, and a rewrite is kept only on its full price (`_verified`; a lookahead sequence's steps are priced in full
once it pays, `_priced_steps`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Iterator, Sequence

from shardc.pcg.costs import CostFn
from shardc.pcg.generate import ac_form
from shardc.pcg.graph import PCG, Compute, Region
from shardc.pcg.lang import OPS, Rule, term_ops
from shardc.pcg.library import LOOP_RULES, all_rules
from shardc.pcg.local_screen import rewired
from shardc.pcg.match import (Match, RewriteError, apply_match, apply_matches, find_matches, independent, lhs_ops,
                              node_kinds, roots_near, term_depth)
from shardc.pcg.simcost import DEFAULT_TOPOLOGY, SimCost
from shardc.pcg.verify import verify_rule

__all__ = ["Step", "Optimized", "Lookahead", "optimize", "usable_rules", "describe_match"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One kept rewrite; for a rewrite inside a loop/branch body (`where` names the region), the costs
    are the body's own."""

    rule: str
    where: str
    cost_before: float
    cost_after: float
    ops: str = ""  # the matched nodes: compute ops with their user source lines, parallel ops with their cause

    def __str__(self) -> str:
        return f"{self.where}: {_fmt(self.cost_before)} -> {_fmt(self.cost_after)}"


def describe_match(pcg: PCG, m: Match) -> str:
    """The nodes a match rewrites, as a user reads them: each compute op with the source line it came
    from, each parallel op with why it is there (its reshard's cause)."""
    parts = []
    for n in pcg.nodes:
        if n.id not in m.nodes:
            continue
        if n.is_parallel:
            parts.append(f"{n.op}" + (f" ({n.cause})" if n.cause else ""))
        else:
            src = getattr(n.op, "source", None)
            parts.append(f"{n.op}" + (f" at {src}" if src is not None else ""))
    return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Optimized:
    pcg: PCG
    initial_cost: float
    cost: float
    steps: tuple[Step, ...]
    candidates: int
    seconds: float

    def __str__(self) -> str:
        lines = [f"{len(self.steps)} rewrites, cost {_fmt(self.initial_cost)} -> {_fmt(self.cost)} "
                 f"({self.candidates} candidates, {self.seconds:.2f} s)"]
        lines += [f"  {s}" for s in self.steps]
        return "\n".join(lines)


def _fmt(c: float) -> str:
    """Seconds (simulated step times) in us, other costs as they are."""
    return f"{c * 1e6:.2f} us" if 0 < c < 1 else f"{c:.1f}"


def usable_rules(rules: Sequence[Rule]) -> list[Rule]:
    """Rules whose right-hand side can be built on a PCG: its parallel ops act on the group the left-hand
    side binds (so the left has a parallel op too), it has no device-shift permute, and it does more
    than reorder adds/muls. (Whether they are proved is checked when they first match.)"""
    out = []
    for r in rules:
        if r.name.split("~")[0] in LOOP_RULES:
            continue  # (shardc.loops' justification, not a PCG rewrite)
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


def _with_region(pcg: PCG, node_id: int, op: Region) -> PCG:
    nodes = tuple(dataclasses.replace(n, op=op) if n.id == node_id else n for n in pcg.nodes)
    return dataclasses.replace(pcg, nodes=nodes)


def _optimize_bodies(state: dict, rules: list[Rule], cost_fn: CostFn, max_steps: int, refuted: set[str],
                     search: "Lookahead") -> None:
    """Optimize every loop/branch body as a PCG of its own; keep a region's new bodies when the whole
    PCG's cost goes down. Progress is kept in `state` region by region (a budget running out in a later
    region keeps the earlier regions' rewrites)."""
    for node in state["current"].region_nodes():
        op: Region = node.op
        bodies, inner = [], []
        for i, body in enumerate(op.bodies):
            res = _descend(body, rules, cost_fn, max_steps, refuted, search)
            state["candidates"] += res.candidates
            bodies.append(res.pcg)
            inner += [dataclasses.replace(s, where=f"{op.primitive} %{node.outputs[0] if node.outputs else ''} "
                                                     f"body {i}: {s.where}") for s in res.steps]
        if not inner:
            continue
        new = _with_region(state["current"], node.id, op.with_bodies(bodies))
        c = priced(cost_fn, new, state["cost"])
        if c < state["cost"] - 1e-15:
            # (the steps' costs are the body's own simulated time)
            state.update(current=new, cost=c, steps=state["steps"] + inner)


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """When no single rewrite pays: follow up to `beam` rewrites that cost at most `alpha` times the
    current cost with rewrites of the nodes they made, up to `depth` rewrites in all, and take the
    first sequence that pays (a Combine moved across an elementwise op loses a fusion before moving on
    across a dot pays)."""

    depth: int = 3
    beam: int = 8
    alpha: float = 1.5


def _candidates(pcg: PCG, rules: list[Rule], refuted: set[str], new_from: int | None = None
                ) -> Iterator[tuple[Rule, Match, PCG]]:
    """Every applicable rewrite of `pcg` by a proved rule (with `new_from`: only matches near the last
    rewrite, see `_near`)."""
    fresh = None if new_from is None else _near(pcg, new_from)
    kinds = None if fresh is None else node_kinds(pcg, fresh)
    roots: dict[int, frozenset[int]] = {}  # (per left-hand depth: the tensors a match of a fresh node roots at)
    for rule in rules:
        if kinds is not None and not lhs_ops(rule) & kinds:
            continue  # (no left-hand op can be a fresh node)
        matches = _proved_matches(pcg, rule, refuted, fresh, roots)
        for m, new in _applied(pcg, matches):
            yield rule, m, new


def _proved_matches(pcg: PCG, rule: Rule, refuted: set[str], near: set[int] | None = None,
                    roots: dict[int, frozenset[int]] | None = None) -> Iterator[Match]:
    """The matches of `rule` on `pcg` (touching nodes `near` when given: only roots that can reach them are
    tried, `roots_near`, memoised in `roots` per left-hand depth), if the rule is proved: it is verified with
    Z3 when it first matches (`verify_rule` caches verdicts), and an unproved rule joins `refuted` and is
    never applied."""
    if rule.text in refuted:
        return
    if near is None:
        matches = find_matches(pcg, rule)
    else:
        depth = max(term_depth(t) for t in rule.lhs)
        if roots is None:
            roots = {}
        if depth not in roots:
            roots[depth] = roots_near(pcg, near, depth)
        matches = (m for m in find_matches(pcg, rule, roots[depth]) if m.nodes & near)
    first = next(matches, None)
    if first is None:
        return
    if not verify_rule(rule).proved:
        refuted.add(rule.text)
        return
    yield first
    yield from matches


def _fewer_collectives_first(rule: Rule) -> tuple[int, int]:
    """A rule's screening key: the parallel ops its right side has beyond its left (fusing rules first),
    then rules with parallel ops before those that only rearrange compute ops."""
    count = lambda ts: sum(OPS[a.op].parallel for t in ts for a in term_ops(t))  # noqa: E731
    lhs, rhs = count(rule.lhs), count(rule.rhs)
    return rhs - lhs, 0 if lhs or rhs else 1


def _screened(pcg: PCG, rules: list[Rule], refuted: set[str], idle: tuple[frozenset[int], PCG] | None = None,
              unmatched: set[int] | None = None) -> Iterator[tuple[tuple[int, int], Rule, Match]]:
    """The matches of every usable proved rule, not yet applied: rules that leave fewer collectives first
    (`_fewer_collectives_first`, a static key: no candidate is built or simulated to order them), each with
    its position in rule order (rule index, match index). A tie between equal simulated costs goes to the
    first in rule order; under a simulation budget the rewrites that can remove collectives are simulated
    before, say, a hundred reorderings of compute ops.

    `idle`: (the rules that matched nothing on an earlier PCG, that PCG). Matching reads no node's readers,
    so a match of such a rule here involves a node the rewrites since then built or rewired (`_rewired`): it is
    looked for only there, and found in the same order as a search of the whole PCG would.
    `unmatched` collects the indices of the rules that match nothing here (for the next pass's `idle`)."""
    order = sorted(range(len(rules)), key=lambda i: (_fewer_collectives_first(rules[i]), i))
    near: set[int] | None = None
    kinds: frozenset[str] = frozenset()
    roots: dict[int, frozenset[int]] = {}
    for i in order:
        if idle is not None and i in idle[0]:
            if near is None:
                near = _rewired(idle[1], pcg)
                kinds = node_kinds(pcg, near)
            if not lhs_ops(rules[i]) & kinds:  # (no left-hand op can be a rewired node: it matches nothing still)
                if unmatched is not None:
                    unmatched.add(i)
                continue
            matches = _proved_matches(pcg, rules[i], refuted, near, roots)
        else:
            matches = _proved_matches(pcg, rules[i], refuted)
        j = -1
        for j, m in enumerate(matches):
            yield (i, j), rules[i], m
        if j < 0 and unmatched is not None:
            unmatched.add(i)


def local_form(pcg: PCG, m: Match) -> tuple[Any, ...]:
    """What a rewrite of match `m` changes, up to where in the program it is: its rule, and the matched nodes'
    operators with their operands' and results' shapes and layouts, in program order. The matches of one
    rule at the same place of each of a model's repeated layers have one local form."""
    def tensors(ts: Sequence[int]) -> tuple[Any, ...]:
        return tuple((pcg.tensors[t].shape, str(pcg.tensors[t].dtype), pcg.tensors[t].sharding) for t in ts)

    nodes = tuple((_operator_form(n.op), tensors(n.inputs), tensors(n.outputs))
                  for n in pcg.nodes if n.id in m.nodes)
    return (m.rule.name, tuple(sorted(m.params.items(), key=lambda kv: kv[0])) if m.params else (), m.axes,
            m.axes_b, nodes)


def _operator_form(op: Any) -> Any:
    """An operator up to the source line it came from (a parallel op or region is its own form)."""
    if not isinstance(op, Compute):
        return op
    return op.primitive, op.pkey


def _same_match(pcg: PCG, rule: Rule, m: Match) -> Match | None:
    """The match of `rule` on `pcg` binding the same tensors at the same roots as `m` (made on an earlier
    PCG), if it is still there."""
    for again in find_matches(pcg, rule, frozenset(m.roots)):
        if again.roots == m.roots and again.tensors == m.tensors and again.params == m.params:
            return again
    return None


def _by_form(pcg: PCG, matches: Sequence[tuple[float, Any, Rule, Match]]
             ) -> dict[tuple[Any, ...], list[tuple[Rule, Match]]]:
    """`matches` (on `pcg`) grouped by local form (`local_form`), in order of each form's first match."""
    groups: dict[tuple[Any, ...], list[tuple[Rule, Match]]] = {}
    for _, _, rule, m in matches:
        groups.setdefault(local_form(pcg, m), []).append((rule, m))
    return groups


def _apply_alike(pcg: PCG, cost: float, alike: list[tuple[Rule, Match]], cost_fn: CostFn
                 ) -> Iterator[tuple[Step, PCG] | None]:
    """The rewrites `alike` (matches made on an earlier PCG, of one local form) applied to `pcg` where they
    still match: all of them, simulated once, if that makes the cost go down; else one at a time, each kept
    if the cost goes down, stopping at the first that does not pay. Yields each kept step with the PCG after
    it as soon as it is kept (a simulation budget running out keeps those), and None for each simulation."""
    if len(alike) > 1:
        found = [again for rule, m in alike if (again := _same_match(pcg, rule, m)) is not None]
        trial, done = _together(pcg, found) if found else (pcg, [])
        if done:
            yield None
            c = priced(cost_fn, trial, cost)
            if c < cost * (1 - 1e-12):
                more = f" (and {len(done) - 1} more alike)" if len(done) > 1 else ""
                yield Step(done[0].rule.name, str(done[0]) + more, cost, c, describe_match(pcg, done[0]) + more), trial
                return
    for rule, m in alike:
        if (hit := _reapplied(pcg, rule, m)) is None:
            continue
        again, new = hit
        yield None
        c = priced(cost_fn, new, cost)
        if not c < cost * (1 - 1e-12):
            return
        yield Step(rule.name, str(again), cost, c, describe_match(pcg, again)), new
        pcg, cost = new, c


def _together(pcg: PCG, matches: list[Match]) -> tuple[PCG, list[Match]]:
    """`pcg` with `matches` (made on it) applied, and the matches applied: in one pass over the nodes where they are
    `independent` (a repeated layer's), else one after another where each still applies."""
    if len(matches) > 1 and independent(matches):
        try:
            return apply_matches(pcg, matches), list(matches)
        except RewriteError:
            pass
    trial, applied = pcg, []
    for m in matches:
        if (hit := _reapplied(trial, m.rule, m)) is not None:
            applied.append(hit[0])
            trial = hit[1]
    return trial, applied


def _reapplied(pcg: PCG, rule: Rule, m: Match) -> tuple[Match, PCG] | None:
    """Match `m` (made on an earlier PCG) found again on `pcg` and applied, or None where it no longer applies."""
    again = _same_match(pcg, rule, m)
    if again is None:
        return None
    try:
        return again, apply_match(pcg, again)
    except RewriteError:
        return None


def _rewired(before: PCG, after: PCG) -> set[int]:
    """The ids of the nodes of `after` that `before` has not with the same operator and operands (`rewired`)."""
    return {n.id for n in rewired(before, after)}


def _near(pcg: PCG, new_from: int) -> set[int]:
    """Nodes near the last rewrite: those making tensors numbered `new_from` or above (what it built),
    their readers, and the producers of the readers' other operands (a sibling chain that can now be
    merged, as in Reduce(x) + Reduce(y))."""
    made = {n.id for n in pcg.nodes if any(t >= new_from for t in n.outputs)}
    readers = {u.id: u for n in pcg.nodes if n.id in made for t in n.outputs for u in pcg.users(t)}
    near = made | set(readers)
    for u in readers.values():
        for t in u.inputs:
            p = pcg.producer(t)
            if p is not None:
                near.add(p[0].id)
    return near


def _lookahead(base: PCG, cost: float, near: list[tuple[float, PCG, Step, bool]], rules: list[Rule], cost_fn: CostFn,
               search: Lookahead, refuted: set[str], seen: set[str]) -> tuple[tuple[list[Step], PCG] | None, int]:
    """The first sequence of rewrites from `near` (each within `search.alpha` of `cost`) that pays, as steps with
    their PCG at the end; a step screened by its neighbourhood alone (`_estimated`) is priced in full where the
    sequence would pay, and the steps of a sequence found are priced in full. Also the count of candidates."""
    # (cost, PCG, steps, the PCG's first new tensor, per step its PCG and whether its cost is a simulation's)
    frontier = [(c, p, [s], len(base.tensors), [(p, exact)])
                for c, p, s, exact in sorted(near, key=lambda e: e[0])[:search.beam]]
    n = 0
    for _ in range(search.depth - 1):
        nxt = []
        for _, p, path, new_from, trail in frontier:
            for rule, m, new in _candidates(p, rules, refuted, new_from):
                n += 1
                k = new.key()
                if k in seen:
                    continue
                seen.add(k)
                c = _estimated(cost_fn, p, new, m, path[-1].cost_after)
                exact = c is None or c < cost * (1 - SCREEN_MARGIN)
                if exact:  # (exact where it pays; a step of a sequence need not fit in memory)
                    c = priced(cost_fn, new, cost)
                step = Step(rule.name, str(m), path[-1].cost_after, c, describe_match(p, m))
                if exact and c < cost * (1 - 1e-12):
                    return (_priced_steps(path + [step], trail, cost_fn), new), n
                if c <= cost * search.alpha:
                    nxt.append((c, new, path + [step], len(p.tensors), trail + [(new, exact)]))
        frontier = sorted(nxt, key=lambda e: e[0])[:search.beam]
    return None, n


def _priced_steps(path: list[Step], trail: list[tuple[PCG, bool]], cost_fn: CostFn) -> list[Step]:
    """`path`'s steps with the costs of those screened by their neighbourhood alone simulated in full, as every
    kept step's is (`trail`: per step but the last, its PCG and whether its cost is a simulation's; the last's is)."""
    out: list[Step] = []
    for i, step in enumerate(path):
        exact = i == len(trail) or trail[i][1]
        after = step.cost_after if exact else cost_fn(trail[i][0])
        out.append(dataclasses.replace(step, cost_before=out[-1].cost_after if out else step.cost_before,
                                       cost_after=after))
    return out


def priced(cost_fn: CostFn, pcg: PCG, bound: float) -> float:
    """`cost_fn`'s cost of `pcg`, exact where it is below `bound`, else at least `bound`: a cost function with a
    `below(pcg, bound)` method may skip what it needs only for cheaper PCGs (`SimCost`: the memory model)."""
    below = getattr(cost_fn, "below", None)
    return below(pcg, bound) if below is not None else cost_fn(pcg)


# A pass's best rewrite: (cost, position in rule order, the PCG after it, rule, match, the matches applied: the
# match's own first, then those of its local form applied with it, `_form_trials`).
Best = tuple[float, tuple[int, int], PCG, Rule, Match, list[Match]]

SCREEN_MARGIN = 1e-4  # a lookahead step's neighbourhood must gain this fraction of the step to be priced in full
VERIFIED_PER_PASS = 3  # rewrites whose neighbourhood gains, priced in full per pass (the largest gains) at most


def _estimated(cost_fn: CostFn, before: PCG, after: PCG, m: Match, cost: float) -> float | None:
    """The cost of `after` (rewritten from `before`, of cost `cost`, at match `m`) as its neighbourhood's gain
    says (`shardc.pcg.local_screen`, through the cost function's `local_gain`), or None where the cost function
    does not screen (a small PCG, a match on a loop: priced in full)."""
    local_gain = getattr(cost_fn, "local_gain", None)
    gain = None if local_gain is None else local_gain(before, after, m.nodes)
    return None if gain is None else cost - gain


def _verified(estimated: list[tuple[float, int, PCG, Rule, Match]], best: Best | None,
              better: list[tuple[float, int, Rule, Match]], pcg: PCG, cost: float, cost_fn: CostFn
              ) -> tuple[Best | None, list[tuple[float, int, Rule, Match]]]:
    """The pass's best rewrite and the rewrites that pay, once those that pay by their neighbourhood alone
    (`estimated`) are priced in full, the largest local gain first, until one pays (at most `VERIFIED_PER_PASS`):
    it is the best unless one priced in full from the start is cheaper. A rewrite whose local form other matches
    share (a repeated layer's) is priced first with all of them applied (`_form_trials`: one simulation where one
    per form and then one for the rest would be spent), alone if that does not pay. The local forms of those that
    do not pay leave `better`; when none does, every estimated one does (the later ones gain less where they are)."""
    if not estimated:
        return best, better
    failed: set[tuple[Any, ...]] = set()
    found = None
    form_of = {id(e[3]): local_form(pcg, e[3]) for e in better}  # (each match's local form, computed once)
    for _, i, new, rule, m in sorted(estimated, key=lambda e: e[:2])[:VERIFIED_PER_PASS]:
        form = form_of[id(m)]
        for trial, applied in _form_trials(pcg, new, m, [e for e in better if form_of[id(e[3])] == form]):
            c = priced(cost_fn, trial, cost)
            if c < cost * (1 - 1e-12):
                found = (c, i, trial, rule, m, applied)
                break
        if found is not None:
            break
        failed.add(form)
    if found is None:
        guessed = {form_of[id(e[4])] for e in estimated}
        return best, [e for e in better if form_of[id(e[3])] not in guessed]
    if best is None or found[:2] < best[:2]:
        best = found
    kept = [e for e in better if form_of[id(e[3])] not in failed]
    return best, [(found[0], *e[1:]) if e[3] is found[4] else e for e in kept]


def _form_trials(pcg: PCG, new: PCG, m: Match, alike: list[tuple[float, int, Rule, Match]]
                 ) -> Iterator[tuple[PCG, list[Match]]]:
    """What `_verified` prices of rewrite `m` (`new`: `pcg` rewritten there), whose local form the matches `alike`
    (`better`'s, in order; `m`'s own among them) share: `pcg` with `m` and the others applied (`_together`), when
    some of the others apply, then `new` alone; each with the matches applied."""
    others = [other for _, _, _, other in sorted(alike, key=lambda e: e[:2]) if other is not m]
    if others:
        trial, applied = _together(pcg, [m] + others)
        if len(applied) > 1:
            yield trial, applied
    yield new, [m]


class _OutOfBudget(Exception):
    """The cost function was called `max_evaluations` times."""


class _Budgeted:
    """A cost function that stops the rewriting after `limit` evaluations (a count, not a clock, so the
    result is the same however busy the machine)."""

    def __init__(self, cost_fn: CostFn, limit: int) -> None:
        self.cost_fn, self.limit, self.calls = cost_fn, limit, 0

    def __call__(self, pcg: PCG) -> float:
        self._count()
        return self.cost_fn(pcg)

    def below(self, pcg: PCG, bound: float) -> float:
        self._count()
        return priced(self.cost_fn, pcg, bound)

    def local_gain(self, before: PCG, after: PCG, match_nodes: Any) -> float | None:
        """The wrapped cost function's screening (`_estimated`), not counted: a neighbourhood is no simulation
        of the program."""
        local_gain = getattr(self.cost_fn, "local_gain", None)
        return None if local_gain is None else local_gain(before, after, match_nodes)

    def _count(self) -> None:
        if self.calls >= self.limit:
            raise _OutOfBudget
        self.calls += 1


def _best_step(pcg: PCG, cost: float, best: Best) -> Step:
    """The step of a pass's best rewrite (`Best`) of `pcg`, of cost `cost` before it."""
    c, _, _, rule, m, applied = best
    more = f" (and {len(applied) - 1} more alike)" if len(applied) > 1 else ""
    return Step(rule.name, str(m) + more, cost, c, describe_match(pcg, m) + more)


def _descend(pcg: PCG, rules: list[Rule], cost_fn: CostFn, max_steps: int, refuted: set[str],
             search: Lookahead = Lookahead()) -> Optimized:
    t0 = time.perf_counter()
    current, cost = pcg, cost_fn(pcg)
    initial = cost
    state = {"current": current, "cost": cost, "steps": [], "candidates": 0}
    try:
        _rewrite(state, rules, cost_fn, max_steps, refuted, search)
    except _OutOfBudget:  # the rewrites kept so far stand: each made the cost go down
        pass
    return Optimized(state["current"], initial, state["cost"], tuple(state["steps"]), state["candidates"],
                     time.perf_counter() - t0)


def _rewrite(state: dict, rules: list[Rule], cost_fn: CostFn, max_steps: int, refuted: set[str],
             search: Lookahead) -> None:
    """The descent of `_descend`, keeping its progress in `state` (current PCG, cost, steps, candidates)
    so that a budget running out mid-way keeps what was found."""
    _optimize_bodies(state, rules, cost_fn, max_steps, refuted, search)
    current, cost, steps, candidates = state["current"], state["cost"], state["steps"], state["candidates"]
    seen = {current.key()}
    idle: tuple[frozenset[int], PCG] | None = None  # (`_screened`: rules that matched nothing on the last pass)
    for _ in range(max_steps):
        better: list[tuple[float, int, Rule, Match]] = []  # rewrites that pay (the others are applied again below)
        best: Best | None = None  # the cheapest, first on a tie: its PCG alone is kept
        estimated: list[tuple[float, int, PCG, Rule, Match]] = []  # those that pay by their neighbourhood alone
        near: list[tuple[float, int, PCG, Step, bool]] = []  # rewrites within alpha of the cost (the beam cheapest),
        # each with whether its cost is a simulation's
        tried: dict[tuple[Any, ...], float] = {}  # local form -> its first match's cost (simulated or estimated)
        unmatched: set[int] = set()
        screened = current
        try:
            for i, rule, m in _screened(current, rules, refuted, idle, unmatched):
                form = local_form(current, m)
                if form in tried:  # (another repeated layer's match: the first stands for it)
                    c = tried[form]
                    if c < cost * (1 - 1e-12):
                        better.append((c, i, rule, m))  # (applied and simulated below if it still matches)
                    continue
                try:
                    new = apply_match(current, m)
                except RewriteError:
                    continue
                candidates += 1
                k = new.key()
                if k in seen:
                    continue
                seen.add(k)
                estimate = _estimated(cost_fn, current, new, m, cost)  # (a large PCG: its neighbourhood's gain)
                c = tried[form] = estimate if estimate is not None else priced(cost_fn, new, cost)
                if c < cost * (1 - 1e-12):
                    better.append((c, i, rule, m))
                    if estimate is not None:  # (priced in full below, `_verified`)
                        estimated.append((c, i, new, rule, m))
                    elif best is None or (c, i) < best[:2]:
                        best = (c, i, new, rule, m, [m])
                elif c <= cost * search.alpha:
                    near.append((c, i, new, Step(rule.name, str(m), cost, c, describe_match(current, m)),
                                 estimate is None))
                    if len(near) > 2 * search.beam:  # (what `_lookahead` reads: ties in rule order)
                        near = sorted(near, key=lambda e: e[:2])[:search.beam]
            best, better = _verified(estimated, best, better, current, cost, cost_fn)
        except _OutOfBudget:  # the budget ran out mid-pass: the best rewrite that paid so far stands
            if best is not None:
                steps.append(_best_step(current, cost, best))
                state.update(current=best[2], cost=best[0], candidates=candidates)
            raise
        idle = (frozenset(unmatched), screened)
        if best is not None:
            better.sort(key=lambda e: e[:2])
            base = current
            steps.append(_best_step(current, cost, best))
            cost, current = best[0], best[2]
            state.update(current=current, cost=cost, candidates=candidates)
            # the other rewrites that paid, where they still apply: those of one local form (a repeated
            # layer's) together, then one at a time; each kept if the cost still goes down (those of the best's
            # form were applied with it when it was priced so, `_form_trials`)
            done = local_form(base, best[4]) if len(best[5]) > 1 else None
            for form, alike in _by_form(base, [e for e in better if e[3] is not best[4]]).items():
                if form == done:
                    continue
                for kept in _apply_alike(current, cost, alike, cost_fn):
                    if kept is None:  # (a simulation)
                        candidates += 1
                        continue
                    steps.append(kept[0])
                    cost, current = kept[0].cost_after, kept[1]
                    state.update(current=current, cost=cost, candidates=candidates)
                    seen.add(current.key())
            continue
        near = [(c, p, st, exact) for c, _, p, st, exact in sorted(near, key=lambda e: e[:2])]
        found, n = _lookahead(current, cost, near, rules, cost_fn, search, refuted, seen)
        candidates += n
        if found is None:
            break
        path, current = found
        cost = path[-1].cost_after
        steps += path
        state.update(current=current, cost=cost, candidates=candidates)
    state["candidates"] = candidates


def optimize(pcg: PCG, rules: Sequence[Rule] | None = None, *, cost_fn: CostFn | None = None,
             topology: Any = DEFAULT_TOPOLOGY, max_steps: int = 200,
             lookahead: Lookahead | None = Lookahead(), max_evaluations: int | None = None) -> Optimized:
    """Rewrite `pcg` with proved rules while the cost goes down: by default the step time shardc's
    simulator gives the PCG on `topology` (`SimCost`); `cost_fn` replaces it (e.g. `bytes_moved`).
    Rules are verified when they first match (`verify_rule` caches verdicts); a refuted rule is
    dropped. `lookahead=None` makes it purely greedy (one rewrite at a time must pay).
    `max_evaluations` caps the calls of the cost function (simulations); the rewrites kept before the
    cap are the result."""
    usable = usable_rules(all_rules() if rules is None else rules)
    search = lookahead if lookahead is not None else Lookahead(depth=1)
    cost = cost_fn if cost_fn is not None else SimCost(topology)
    if max_evaluations is not None:
        cost = _Budgeted(cost, max(1, int(max_evaluations)))
    return _descend(pcg, usable, cost, max_steps, set(), search)
