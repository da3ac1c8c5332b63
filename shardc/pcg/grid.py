"""Per-device semantics of rules on two disjoint axes groups A and B (`op@B`, `reduce@AB` in a rule).

Devices form an `na` x `nb` grid: device (i, j) has index i in group A and j in group B (on a mesh, A and B
are disjoint sets of mesh axes; the devices that share their other coordinates form such a grid). Every value
is one piece per device, and every op does what the lowered SPMD program does on each device:

* `partition[d]@g`: slices its own piece into deg(g) chunks along d and keeps the one of its index in g;
* `combine[d]@g`: concatenates along d the pieces of the devices of its g-group, in their g order;
* `reduce@g`: sums the pieces of its g-group (`@AB`: of the whole grid);
* `reduce_scatter[d]@g`: that sum, partitioned along d by its index in g;
* `all_to_all[s, t]@g`: chunk k along t of its piece goes to the group's device k, concatenated along s;
* compute ops run on each device's piece.

No op needs a global value here (a partition slices whatever the device holds), so a two-group rule has no
global variables, and it holds only if every device ends up with the same piece on both sides — whatever
its inputs' pieces are. The one-group semantics (`shardc.pcg.semantics`) is the grid with `nb` = 1, except
that it also tracks which values are global; two-group rules are evaluated here instead.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from shardc.pcg.lang import PVar, Term, Var, eval_param
from shardc.pcg.semantics import COMPUTE, D, IllTyped, Model, _dim, _split, _same_shapes, _sum

__all__ = ["Grid", "evaluate_grid"]


class Grid:
    """The `na` x `nb` device grid; device k is (k // nb, k % nb)."""

    def __init__(self, na: int, nb: int, model: Model) -> None:
        self.na, self.nb, self.model = na, nb, model

    @property
    def n(self) -> int:
        return self.na * self.nb

    def members(self, k: int, group: str) -> list[int]:
        """The devices of device k's group, in their order within the group."""
        i, j = divmod(k, self.nb)
        if group == "":
            return [a * self.nb + j for a in range(self.na)]
        if group == "B":
            return [i * self.nb + b for b in range(self.nb)]
        return list(range(self.n))

    def index(self, k: int, group: str) -> int:
        i, j = divmod(k, self.nb)
        return {"": i, "B": j, "AB": k}[group]

    def degree(self, group: str) -> int:
        return {"": self.na, "B": self.nb, "AB": self.n}[group]


def _parallel(g: Grid, op: str, group: str, p: tuple, xs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    n = g.degree(group)
    out = []
    for k in range(g.n):
        mine = [xs[m] for m in g.members(k, group)]
        me = g.index(k, group)
        if op == "partition":
            out.append(_split(xs[k], n, p[0])[me])
        elif op == "combine":
            d = _dim(xs[k], p[0])
            _need_same_rank(mine)
            try:
                out.append(np.concatenate(mine, axis=d))
            except ValueError as e:
                raise IllTyped(f"combine: {e}") from None
        elif op == "reduce":
            _same_shapes(mine, "reduce")
            out.append(_sum(mine))
        elif op == "reduce_scatter":
            _same_shapes(mine, "reduce_scatter")
            out.append(_split(_sum(mine), n, p[0])[me])
        elif op == "all_to_all":
            s, t = p
            if s == t:
                raise IllTyped("all_to_all: source and target dims are the same")
            _same_shapes(mine, "all_to_all")
            _dim(xs[k], s)
            out.append(np.concatenate([_split(x, n, t)[me] for x in mine], axis=s))
        else:
            raise IllTyped(f"{op} is not defined on two groups")
    return tuple(out)


def _need_same_rank(xs: Sequence[np.ndarray]) -> None:
    if any(x.ndim != xs[0].ndim for x in xs):
        raise IllTyped("combine: ranks differ")


def evaluate_grid(term: Term, inputs: Mapping[str, D], params: Mapping[str, Any], grid: Grid,
                  memo: dict | None = None) -> D:
    """The pieces of `term` on every device of the grid, its variables bound to `inputs` (one piece per
    device, `grid.n` of them)."""
    memo = {} if memo is None else memo
    if isinstance(term, Var):
        return inputs[term.name]
    if id(term) in memo:
        return memo[id(term)]
    args = [evaluate_grid(a, inputs, params, grid, memo) for a in term.args]
    try:
        ps = tuple(eval_param(p, params) if not (isinstance(p, PVar) and p.name not in params) else _missing(p)
                   for p in term.params)
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise IllTyped(f"{term.op}: parameter {e}") from None
    try:
        if term.group or term.op in ("partition", "combine", "reduce", "reduce_scatter", "all_to_all"):
            out = D(_parallel(grid, term.op, term.group, ps, args[0].pieces))
        else:
            fn = COMPUTE[term.op]
            out = D(tuple(fn(grid.model, ps, *[a.pieces[k] for a in args]) for k in range(grid.n)))
    except (ValueError, IndexError) as e:
        raise IllTyped(f"{term.op}: {e}") from None
    memo[id(term)] = out
    return out


def _missing(p: PVar) -> Any:
    raise KeyError(p.name)
