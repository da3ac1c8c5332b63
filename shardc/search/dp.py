"""Dynamic programming over the decision graph, with the simulator as oracle.

Both DPs model the simulated cost around a base assignment b as a pairwise function of the decisions,

    f(x) ~ f(b) + sum_g U_g(x_g) + sum_{(g,h) in E} W_gh(x_g, x_h),

where U_g(s) = f(b with x_g=s) - f(b) and W_gh(s,t) = f(b with x_g=s, x_h=t) - f(b) - U_g(s) - U_h(t)
is the interaction of two neighbouring decisions (the resharding between them), and minimise it exactly.

* `chain_dp`: E links the groups in program order (a chain; Viterbi).
* `sp_dp`: E is the *decision graph* — groups whose member ops are joined by a dataflow path through
  non-decision ops (`decision_graph`) — and the minimisation eliminates groups by series-parallel
  reductions (Unity's series-parallel decomposition; flexflow-train's memoised machine-mapping recursion):
  a group of degree <= 1 is folded into its neighbour, a group of degree 2 is replaced by an edge between its
  two neighbours (series), and parallel edges are summed. This is exact on series-parallel graphs
  (treewidth <= 2: chains, diamonds, residual branches). A graph that does not reduce is conditioned on its
  lowest-degree group (fixed at its best choice given its neighbours' best), which is an approximation.

The result is checked with a full simulation, polished by single-group moves, and refined by MCMC in the
driver.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Callable, Mapping, Sequence

from shardc.search.evaluate import Evaluator, Score
from shardc.search.space import DECISION_PRIMITIVES, Assignment, Space

__all__ = ["chain_dp", "sp_dp", "decision_graph", "solve_pairwise"]


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


def _oracle(ev: Evaluator, deadline: float | None, on_eval: Callable[[], None] | None) -> Callable[[Assignment], float]:
    def f(a: Assignment) -> float:
        if deadline is not None and time.perf_counter() > deadline:
            raise _OutOfTime
        if on_eval is not None and a not in ev.cache:
            on_eval()
        return _cost(ev.score(a))

    return f


def _chain_dp(ev: Evaluator, base: Assignment, max_evals: int, deadline: float | None,
              on_eval: Callable[[], None] | None) -> tuple[Assignment, Score]:
    groups = ev.space.groups
    n = len(groups)
    if n == 0:
        return base, ev.score(base)
    f = _oracle(ev, deadline, on_eval)
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


# -- the decision graph ------------------------------------------------------------------------------------
def decision_graph(space: Space, *, members_per_group: int = 3, max_visits: int = 400) -> set[tuple[int, int]]:
    """Edges (g, h), g < h, between groups joined by a dataflow path (either direction) that passes only
    through non-decision ops. Structurally identical members give the same neighbourhood, so only the first
    `members_per_group` members are explored, each up to `max_visits` ops."""
    g = space.graph
    group_of_op: dict[int, int] = {}
    group_of_input: dict[int, int] = {}
    for gi, grp in enumerate(space.groups):
        for m in grp.members:
            (group_of_input if grp.kind == "input" else group_of_op)[m] = gi
    decision = {op.id for op in g.ops if op.primitive in DECISION_PRIMITIVES}
    # Ties of carried state join a step's end to its beginning (a loop-back, not dataflow within the step).
    decision |= {op.id for op in g.ops if op.primitive == "tie" and op.region == "io"}
    edges: set[tuple[int, int]] = set()
    for gi, grp in enumerate(space.groups):
        for m in grp.members[:members_per_group]:
            start = [m] if grp.kind == "input" else list(g.ops[m].inputs) + list(g.ops[m].outputs)
            for h in _reach(g, start, decision, group_of_op, group_of_input, max_visits):
                if h != gi:
                    edges.add((min(gi, h), max(gi, h)))
    return edges


def _reach(g, start_values: Sequence[int], decision: set[int], group_of_op: Mapping[int, int],
           group_of_input: Mapping[int, int], max_visits: int) -> set[int]:
    """Groups met by an undirected walk over values from `start_values` that crosses non-decision ops only."""
    found: set[int] = set()
    seen_v: set[int] = set(start_values)
    seen_op: set[int] = set()
    queue = deque(start_values)
    while queue and len(seen_op) < max_visits:
        v = queue.popleft()
        if v in group_of_input:
            found.add(group_of_input[v])
        ops = list(g.users[v])
        if g.values[v].producer is not None:
            ops.append(g.values[v].producer)
        for o in ops:
            if o in seen_op:
                continue
            seen_op.add(o)
            if o in decision:
                if o in group_of_op:
                    found.add(group_of_op[o])
                continue
            for w in list(g.ops[o].inputs) + list(g.ops[o].outputs):
                if w not in seen_v:
                    seen_v.add(w)
                    queue.append(w)
    return found


# -- exact minimisation of a pairwise cost by series-parallel elimination --------------------------------
def solve_pairwise(domains: Sequence[Sequence[int]], unary: Sequence[Mapping[int, float]],
                   pair: Mapping[tuple[int, int], Mapping[tuple[int, int], float]]) -> tuple[dict[int, int], bool]:
    """Minimise sum_g unary[g][x_g] + sum_(g,h) pair[g,h][x_g, x_h] over x_g in domains[g].

    Eliminates variables by series-parallel reductions (degree 0, 1, 2; parallel edges summed); exact when
    the graph reduces completely (treewidth <= 2). Otherwise the lowest-degree variable is fixed at its best
    choice given its neighbours' best, and the second result is False (approximate)."""
    n = len(domains)
    un = [dict(unary[v]) for v in range(n)]
    adj: dict[int, dict[int, dict[tuple[int, int], float]]] = {v: {} for v in range(n)}  # adj[a][b][(xa, xb)]

    def add_edge(a: int, b: int, table: Mapping[tuple[int, int], float]) -> None:
        cur = adj[a].get(b)
        if cur is None:
            adj[a][b] = dict(table)
        else:  # parallel reduction
            for k, c in table.items():
                cur[k] += c
        adj[b][a] = {(y, x): c for (x, y), c in adj[a][b].items()}

    for (a, b), table in pair.items():
        if a != b:
            add_edge(a, b, table)
    alive = set(range(n))
    steps: list[tuple] = []  # elimination records, replayed backwards
    exact = True

    def drop(v: int) -> None:
        for u in list(adj[v]):
            del adj[u][v]
        adj[v] = {}
        alive.discard(v)

    while alive:
        v = min(alive, key=lambda u: (len(adj[u]), u))
        nb = sorted(adj[v])
        if len(nb) == 0:
            best = min(domains[v], key=lambda x: (un[v][x], x))
            steps.append(("fix", v, best))
        elif len(nb) == 1:
            (a,) = nb
            t = adj[v][a]
            arg = {}
            for xa in domains[a]:
                xv = min(domains[v], key=lambda x: (un[v][x] + t[(x, xa)], x))
                arg[xa] = xv
                un[a][xa] += un[v][xv] + t[(xv, xa)]
            steps.append(("leaf", v, a, arg))
        elif len(nb) == 2:
            a, b = nb
            ta, tb = adj[v][a], adj[v][b]
            table, arg = {}, {}
            for xa in domains[a]:
                for xb in domains[b]:
                    xv = min(domains[v], key=lambda x: (un[v][x] + ta[(x, xa)] + tb[(x, xb)], x))
                    arg[(xa, xb)] = xv
                    table[(xa, xb)] = un[v][xv] + ta[(xv, xa)] + tb[(xv, xb)]
            drop(v)
            add_edge(a, b, table)
            steps.append(("series", v, a, b, arg))
            continue
        else:  # not series-parallel here: condition on v
            exact = False
            xv = min(domains[v], key=lambda x: (un[v][x] + sum(min(adj[v][u][(x, y)] for y in domains[u])
                                                                for u in nb), x))
            for u in nb:
                for y in domains[u]:
                    un[u][y] += adj[v][u][(xv, y)]
            steps.append(("fix", v, xv))
        drop(v)
    x: dict[int, int] = {}
    for rec in reversed(steps):
        if rec[0] == "fix":
            x[rec[1]] = rec[2]
        elif rec[0] == "leaf":
            x[rec[1]] = rec[3][x[rec[2]]]
        else:
            x[rec[1]] = rec[4][(x[rec[2]], x[rec[3]])]
    return x, exact


def sp_dp(ev: Evaluator, base: Assignment, *, max_evals: int = 4000, deadline: float | None = None,
          on_eval: Callable[[], None] | None = None, edges: set[tuple[int, int]] | None = None,
          polish: bool = True, domains: Sequence[Sequence[int]] | None = None) -> tuple[Assignment, Score]:
    """The series-parallel DP around `base` over the decision graph (`edges`: default `decision_graph`).
    Unary terms are measured for every choice (at most max_evals/2 per group); pair terms for the best k
    choices of each group by unary cost, most promising pairs first, until `max_evals` simulations are
    spent. The minimiser is then simulated and, with `polish`, improved by single-group moves until none
    helps (these come on top of `max_evals`). `domains` restricts each group's candidates (e.g. to the
    choices the baselines make: the DP then mixes baselines per layer kind). When the deadline (a
    `time.perf_counter()` value) passes first, returns the best point simulated so far."""
    n0 = len(ev.cache)
    try:
        return _sp_dp(ev, base, max_evals, deadline, on_eval, edges, polish, domains)
    except _OutOfTime:  # the best point simulated so far (the base, a single move, the greedy combination)
        seen = list(ev.cache)[n0:] + [base]
        best = min(seen, key=lambda a: (ev.score(a).key, a))
        return best, ev.score(best)


def _sp_dp(ev: Evaluator, base: Assignment, max_evals: int, deadline: float | None,
           on_eval: Callable[[], None] | None, edges: set[tuple[int, int]] | None,
           polish: bool, only: Sequence[Sequence[int]] | None) -> tuple[Assignment, Score]:
    groups = ev.space.groups
    n = len(groups)
    if n == 0:
        return base, ev.score(base)
    f = _oracle(ev, deadline, on_eval)
    edges = decision_graph(ev.space) if edges is None else edges
    f0 = f(base)
    ref = 0.0 if math.isinf(f0) else f0

    def with_(pairs: Mapping[int, int]) -> Assignment:
        return tuple(pairs.get(i, c) for i, c in enumerate(base))

    per_group = max(2, max_evals // (2 * n))
    unary: list[dict[int, float]] = []
    for gi, grp in enumerate(groups):
        first = range(min(grp.size, per_group)) if only is None else only[gi]
        cand = sorted(set(first) | {base[gi]})
        unary.append({s: f(with_({gi: s})) - ref for s in cand})
    # Every improving single move at once (exact if the cost were additive): a cheap strong candidate.
    greedy = with_({gi: min(u, key=lambda s: (u[s], s)) for gi, u in enumerate(unary) if min(u.values()) < 0})
    f(greedy)
    budget = max(max_evals - sum(len(u) for u in unary) - 1, 0)
    k = max(2, int(math.sqrt(budget / max(len(edges), 1))))
    domains = []
    for gi in range(n):
        finite = [s for s in unary[gi] if math.isfinite(unary[gi][s])] or [base[gi]]
        keep = sorted(finite, key=lambda s: (unary[gi][s], s))[:k]
        domains.append(sorted(set(keep) | {base[gi]}))
    big = 1e3 * (abs(ref) + 1.0)  # stands in for an infeasible combination (finite, so sums stay ordered)

    def fin(c: float) -> float:
        return c if math.isfinite(c) else big

    # Pair terms, most promising first (lowest sum of the two unary terms), as many as the budget allows;
    # an unmeasured interaction counts as zero. One of the two at its base: no interaction by definition.
    pair: dict[tuple[int, int], dict[tuple[int, int], float]] = {
        (a, b): {(xa, xb): 0.0 for xa in domains[a] for xb in domains[b]} for a, b in edges}
    entries = [(fin(unary[a][xa]) + fin(unary[b][xb]), a, b, xa, xb) for a, b in sorted(edges)
               for xa in domains[a] for xb in domains[b] if xa != base[a] and xb != base[b]]
    for _, a, b, xa, xb in sorted(entries)[:budget]:
        pair[(a, b)][(xa, xb)] = fin(f(with_({a: xa, b: xb})) - ref) - fin(unary[a][xa]) - fin(unary[b][xb])
    x, _ = solve_pairwise(domains, [{s: fin(unary[g][s]) for s in domains[g]} for g in range(n)], pair)
    a = tuple(x[g] for g in range(n))
    # The model is exact only for pairwise costs on series-parallel graphs: also consider the best single move.
    g1, s1 = min(((gi, s) for gi in range(n) for s in unary[gi]), key=lambda t: (unary[t[0]][t[1]], t))
    single = with_({g1: s1})
    a = min((a, single, greedy), key=lambda t: (ev.score(t).key, t))
    if polish:
        a = _polish(ev, a, f, domains)
    best = min((a, base), key=lambda t: (ev.score(t).key, t))
    return best, ev.score(best)


def _polish(ev: Evaluator, a: Assignment, f: Callable[[Assignment], float],
            domains: Sequence[Sequence[int]]) -> Assignment:
    """Single-group moves (within each group's kept choices) while one lowers the simulated cost."""
    cur = f(a)
    improved = True
    while improved:
        improved = False
        for gi, dom in enumerate(domains):
            for s in dom:
                if s == a[gi]:
                    continue
                b = a[:gi] + (s,) + a[gi + 1:]
                c = f(b)
                if c < cur:
                    a, cur, improved = b, c, True
    return a


def brute_force(domains: Sequence[Sequence[int]], unary: Sequence[Mapping[int, float]],
                pair: Mapping[tuple[int, int], Mapping[tuple[int, int], float]]) -> tuple[tuple[int, ...], float]:
    """Exhaustive minimum of the pairwise cost (for tests)."""
    best, best_c = None, math.inf
    for x in itertools.product(*domains):
        c = sum(unary[v][x[v]] for v in range(len(domains))) + sum(t[(x[a], x[b])] for (a, b), t in pair.items())
        if c < best_c:
            best, best_c = x, c
    return best, best_c
