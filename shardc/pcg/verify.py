"""Z3 verification of rules with per-device semantics.

A rule is a template over the degree `n` of its axes group, its dims, permutations and other
parameters. It is proved by a bounded symbolic check: for n = 2 and 4, tensors of rank 2 (and rank 3
at n = 2), every instance of its dim/permutation/shift parameters that satisfies its conditions and on
which the left-hand side is defined, with every input entry a distinct `z3.Real`, every elementwise
function variable an uninterpreted function and every scalar variable a `z3.Real`, each device's
piece of each output must be equal on both sides. Entries whose difference does not simplify to 0 go
to the solver as one disjunction of disequalities: unsat proves them, a model is a counterexample.
A right-hand side that is undefined or of another shape where the left is defined is a counterexample
too (the shapes are the witness).

Verdicts are cached by the rule's text (its name does not matter); `is_proved` is what the rewrite
engine checks before it applies anything. A rule whose exact text is in the proof record
(`shardc.pcg.proofs`, written by `python -m shardc verify-rules --record` under this same verifier)
is accepted without running Z3 again.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import z3

from shardc.pcg.lang import OPS, Rule, term_ops
from shardc.pcg.proofs import recorded
from shardc.pcg.grid import Grid, evaluate_grid
from shardc.pcg.semantics import D, G, IllTyped, Model, evaluate, flat_pairs

__all__ = ["Verdict", "verify_rule", "verify_rules", "is_proved", "CHECKS", "clear_cache"]

# (degree, rank) pairs every rule is checked at
CHECKS: tuple[tuple[int, int], ...] = ((2, 2), (2, 3), (4, 2))
TIMEOUT_MS = 20_000


@dataclasses.dataclass(frozen=True)
class Verdict:
    rule: Rule
    proved: bool
    instances: int
    seconds: float
    counterexample: str | None = None
    recorded: bool = False  # proved by an earlier Z3 run of this verifier, read from the proof record

    def __str__(self) -> str:
        if self.recorded:
            return f"{self.rule.name}: proved (proof record)"
        if self.proved:
            return f"{self.rule.name}: proved ({self.instances} instances, {self.seconds * 1e3:.0f} ms)"
        return f"{self.rule.name}: REFUTED\n    {self.rule.text}\n    {self.counterexample}"


_CACHE: dict[str, Verdict] = {}


def clear_cache() -> None:
    _CACHE.clear()


def is_proved(rule: Rule) -> bool:
    """True only if `verify_rule` proved this rule (by its text) in this process, by Z3 or the record."""
    v = _CACHE.get(rule.text)
    return v is not None and v.proved


def _z3_model(n: int) -> Model:
    fns: dict[tuple[str, int], Any] = {}

    def fn(name: str, arity: int) -> Any:
        key = (name, arity)
        if key not in fns:
            fns[key] = z3.Function(f"{name}", *([z3.RealSort()] * (arity + 1)))
        return fns[key]

    return Model(n, fn, lambda name: z3.Real(name))


def _ranks(rule: Rule) -> set[int] | None:
    """Ranks fixed by literal permutations in the rule, if any."""
    out = set()
    for t in rule.lhs + rule.rhs:
        for app in term_ops(t):
            for kind, p in zip(OPS[app.op].params, app.params):
                if kind == "perm" and isinstance(p, tuple):
                    out.add(len(p))
    return out or None


def _domain(kind: str, name: str, n: int, rank: int) -> list[Any]:
    if kind == "dim":
        return list(range(rank))
    if kind == "perm":
        return [tuple(p) for p in itertools.permutations(range(rank))]
    if kind == "index":
        return list(range(4))
    if kind == "int":
        return [1, 2, 4]
    if kind == "shift":
        return list(range(n))
    if kind == "fn":
        return [name]
    if kind == "scalar":
        return [z3.Real(name)]
    raise ValueError(kind)  # pragma: no cover


def instances(rule: Rule, n: int, rank: int) -> Iterator[dict[str, Any]]:
    """Parameter bindings of a rule at degree n and rank `rank` that satisfy its conditions."""
    kinds = rule.param_kinds()
    names = sorted(kinds)
    for values in itertools.product(*[_domain(kinds[k], k, n, rank) for k in names]):
        env = dict(zip(names, values), n=n)
        try:
            if all(c.holds(env) for c in rule.conds):
                yield env
        except KeyError:  # depends on a tensor rank: decided per shape
            yield env
        except (ValueError, IndexError, TypeError):
            continue


def _shapes(n: int, rank: int) -> list[tuple[int, ...]]:
    """Shapes tried for every input: all dims distinct where possible, then all equal."""
    return [tuple(n * (1 + i % 2) + (i // 2) * n for i in range(rank)), (n,) * rank]


@functools.lru_cache(maxsize=4096)
def _symbols(name: str, kind: str, shape: tuple[int, ...], n: int) -> G | D:
    def arr(tag: str) -> np.ndarray:
        a = np.empty(shape, dtype=object)
        for idx in np.ndindex(*shape):
            a[idx] = z3.Real(f"{name}{tag}{list(idx)}")
        return a

    if kind == "G":
        return G(arr(""))
    return D(tuple(arr(f"@{i}") for i in range(n)))


def _describe_inputs(inputs: dict[str, G | D], model: z3.ModelRef | None, limit: int = 1200) -> str:
    def show(a: np.ndarray) -> str:
        if model is None:
            return f"shape {a.shape}"
        vals = np.vectorize(lambda e: _num(model.eval(e, model_completion=True)), otypes=[object])(a)
        return np.array2string(vals, separator=",", max_line_width=200).replace("\n", "")

    parts = []
    for k, v in inputs.items():
        if isinstance(v, G):
            parts.append(f"{k} (global) = {show(v.arr)}")
        else:
            parts.append(f"{k} (per device) = " + "; ".join(f"dev{i}: {show(p)}" for i, p in enumerate(v.pieces)))
    text = "; ".join(parts)
    return text if len(text) <= limit else text[:limit] + " ..."


def _num(v: Any) -> Any:
    if z3.is_rational_value(v):
        f = v.as_fraction()
        return int(f) if f.denominator == 1 else float(f)
    if z3.is_algebraic_value(v):
        return float(v.approx(6).as_fraction())
    return str(v)


def _assignments(names: Sequence[str], n: int, rank: int) -> Iterator[tuple[bool, dict[str, tuple[int, ...]]]]:
    """Input shapes to try: (is_base, var -> shape). First every input with the same shape (distinct
    dims, then all equal); then each input alone with another shape, the rest all-equal, so that rules
    whose inputs must differ in shape (a weight with n times the rows) are exercised too."""
    base = _shapes(n, rank)
    for s in base:
        yield True, {v: s for v in names}
    if n > 2:  # shape relations between inputs do not depend on the degree: explored at degree 2
        return
    alts = [(n * n,) + (n,) * (rank - 1), (n,) * (rank - 1) + (n * n,), (2 * n,) + (n,) * (rank - 1), base[0]]
    alts = list(dict.fromkeys(a for a in alts if a != base[1]))
    for v in names:
        for a in alts:
            yield False, {w: (a if w == v else base[1]) for w in names}


def _check_instance(rule: Rule, env: dict[str, Any], n: int, rank: int, kinds: dict[str, str]) -> tuple[str, str | None]:
    """("skip", None) if the LHS is undefined at every shape tried, ("ok", None), or ("fail", why)."""
    model = _z3_model(n)
    where = f"degree {n}, rank {rank}" + "".join(f", {k}={v}" for k, v in env.items() if k != "n")
    checked = False
    base_done = False
    shape_fail: str | None = None
    seen: set[tuple] = set()
    for is_base, shapes in _assignments(rule.vars(), n, rank):
        if is_base and base_done and not shape_fail:  # another base shape only to find a wrong value
            continue
        key = tuple(sorted(shapes.items()))
        if key in seen:
            continue
        seen.add(key)
        inputs = {v: _symbols(v, kinds[v], shapes[v], n) for v in rule.vars()}
        ienv = {**env, **{f"rank:{v}": len(shapes[v]) for v in inputs}, **{f"shape:{v}": shapes[v] for v in inputs}}
        try:
            if not all(c.holds(ienv) for c in rule.conds):
                continue
        except (KeyError, ValueError, IndexError, TypeError):
            continue
        try:
            memo: dict = {}
            lhs = [evaluate(t, inputs, ienv, model, memo) for t in rule.lhs]
        except IllTyped:
            continue
        base_done = base_done or is_base
        status, why = _compare(rule, lhs, inputs, ienv, model, n, where)
        if status == "fail":
            return status, why
        if status == "shape":
            shape_fail = shape_fail or why
            continue
        checked = True
    if shape_fail:
        return "shape", shape_fail
    return ("ok", None) if checked else ("skip", None)


def _compare(rule: Rule, lhs: list, inputs: dict, env: dict, model: Model, n: int, where: str) -> tuple[str, str | None]:
    try:
        memo: dict = {}
        rhs = [evaluate(t, inputs, env, model, memo) for t in rule.rhs]
        pairs = []
        for i, (a, b) in enumerate(zip(lhs, rhs)):
            pairs += [(x, y, f"output {i} {w}") for x, y, w in flat_pairs(a, b, n)]
    except IllTyped as e:
        return "shape", f"{where}: with inputs {_describe_inputs(inputs, None)} the left side is defined but the right is not: {e}"
    why = _solve(pairs, where, inputs)
    return ("ok", None) if why is None else ("fail", why)


def _real(x: Any) -> Any:
    return x if isinstance(x, z3.ExprRef) else z3.RealVal(x)


def verify_rule(rule: Rule, checks: Sequence[tuple[int, int]] = CHECKS, *, use_cache: bool = True,
                use_record: bool = True) -> Verdict:
    """Prove `rule` at every (degree, rank) of `checks`, or find a counterexample.

    With `use_record`, a rule the proof record lists under this verifier is proved without Z3;
    `python -m shardc verify-rules` passes False (it is what writes the record)."""
    key = rule.text
    hit = _CACHE.get(key) if use_cache and tuple(checks) == CHECKS else None
    if hit is not None and (use_record or not hit.recorded):
        return dataclasses.replace(hit, rule=rule)
    if use_record and tuple(checks) == CHECKS and recorded(key):
        verdict = Verdict(rule, True, 0, 0.0, recorded=True)
        _CACHE[key] = verdict
        return verdict
    t0 = time.perf_counter()
    if rule.two_groups:
        verdict = _verify_grid(rule, t0)
        if tuple(checks) == CHECKS:
            _CACHE[key] = verdict
        return verdict
    kinds = rule.var_kinds()
    fixed = _ranks(rule)
    count = 0
    per_degree: dict[int, int] = {}
    verdict: Verdict | None = None

    def run(n: int, r: int) -> Verdict | None:
        """A refutation at degree n, rank r (a wrong value is preferred over a wrong shape), or None."""
        nonlocal count
        shape_fail = None
        for env in instances(rule, n, r):
            status, why = _check_instance(rule, env, n, r, kinds)
            if status == "fail":
                return Verdict(rule, False, count, time.perf_counter() - t0, why)
            if status == "shape":
                shape_fail = shape_fail or why
            if status == "ok":
                count += 1
                per_degree[n] = per_degree.get(n, 0) + 1
        if shape_fail:
            return Verdict(rule, False, count, time.perf_counter() - t0, shape_fail)
        return None

    plan = [(n, r) for n, rank in checks for r in (sorted(fixed) if fixed else [rank])]
    plan = list(dict.fromkeys(plan))
    for n, r in plan:
        verdict = run(n, r)
        if verdict:
            break
    degrees = sorted({n for n, _ in checks})
    for n in degrees:  # rules needing more dims than the default rank get one more try
        if verdict is None and n not in per_degree and not fixed:
            verdict = run(n, max(r for _, r in checks) + (0 if any(m == n and r == 3 for m, r in checks) else 1))
    if verdict is None:
        missing = [n for n in degrees if n not in per_degree]
        if missing:
            verdict = Verdict(rule, False, count, time.perf_counter() - t0,
                              f"the left side is not defined on any instance at degree {missing[0]}")
        else:
            verdict = Verdict(rule, True, count, time.perf_counter() - t0)
    if tuple(checks) == CHECKS:
        _CACHE[key] = verdict
    return verdict


# (na, nb, rank) every two-group rule is checked at: each group of degree 2 and 4 against the other's 2
GRID_CHECKS: tuple[tuple[int, int, int], ...] = ((2, 2, 2), (2, 2, 3), (2, 4, 2), (4, 2, 2))


def _verify_grid(rule: Rule, t0: float) -> Verdict:
    """Prove a two-group rule on the device grids of `GRID_CHECKS` (`shardc.pcg.grid`): every input a
    distinct `z3.Real` per entry and per device, each device's piece of each output equal on both sides for
    every parameter instance whose left side is defined, and at least one such instance per grid."""
    count = 0
    for na, nb, rank in GRID_CHECKS:
        grid = Grid(na, nb, _z3_model(na))
        k = na * nb
        shapes = [tuple(k * (1 + i) for i in range(rank)), (k,) * rank]
        where0 = f"grid {na}x{nb}, rank {rank}"
        defined = 0
        for env in instances(rule, na, rank):
            where = where0 + "".join(f", {p}={v}" for p, v in env.items() if p != "n")
            for shape in shapes:
                inputs = {v: D(tuple(_grid_symbols(v, shape, d) for d in range(k))) for v in rule.vars()}
                ienv = {**env, **{f"rank:{v}": rank for v in inputs}, **{f"shape:{v}": shape for v in inputs}}
                try:
                    if not all(c.holds(ienv) for c in rule.conds):
                        continue
                    memo: dict = {}
                    lhs = [evaluate_grid(t, inputs, ienv, grid, memo) for t in rule.lhs]
                except IllTyped:
                    continue
                except (KeyError, ValueError, IndexError, TypeError):
                    continue
                try:
                    memo = {}
                    rhs = [evaluate_grid(t, inputs, ienv, grid, memo) for t in rule.rhs]
                    pairs = [(x, y, f"output {i} {w}") for i, (a, b) in enumerate(zip(lhs, rhs))
                             for x, y, w in flat_pairs(a, b, k)]
                except IllTyped as e:
                    return Verdict(rule, False, count, time.perf_counter() - t0,
                                   f"{where}: shape {shape}: the left side is defined but the right is not: {e}")
                why = _solve(pairs, where, inputs)
                if why is not None:
                    return Verdict(rule, False, count, time.perf_counter() - t0, why)
                defined += 1
                count += 1
                break
        if not defined:
            return Verdict(rule, False, count, time.perf_counter() - t0,
                           f"the left side is not defined on any instance of the {where0}")
    return Verdict(rule, True, count, time.perf_counter() - t0)


@functools.lru_cache(maxsize=4096)
def _grid_symbols(name: str, shape: tuple[int, ...], device: int) -> np.ndarray:
    a = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        a[idx] = z3.Real(f"{name}@{device}{list(idx)}")
    return a


def _solve(pairs: list[tuple[Any, Any, str]], where: str, inputs: dict) -> str | None:
    """None if every pair is equal for all inputs, else why not (a counterexample, or z3 undecided)."""
    open_pairs = []
    for x, y, w in pairs:
        if x is y or (isinstance(x, z3.ExprRef) and isinstance(y, z3.ExprRef) and x.eq(y)):
            continue
        diff = z3.simplify(_real(x) - _real(y))
        if not (z3.is_rational_value(diff) and diff.as_fraction() == 0):
            open_pairs.append((x, y, w))
    if not open_pairs:
        return None
    s = z3.Solver()
    s.set("timeout", TIMEOUT_MS)
    s.add(z3.Or([_real(x) != _real(y) for x, y, _ in open_pairs]))
    res = s.check()
    if res == z3.unsat:
        return None
    if res == z3.unknown:
        return f"{where}: z3 could not decide ({s.reason_unknown()})"
    m = s.model()
    for x, y, w in open_pairs:
        lv, rv = m.eval(_real(x), model_completion=True), m.eval(_real(y), model_completion=True)
        if not z3.is_true(z3.simplify(lv == rv)):
            fns = [f"{d.name()} = " + " ".join(str(m[d]).split()) for d in m.decls() if d.arity() > 0]
            return (f"{where}: {w}: left {_num(lv)}, right {_num(rv)}; "
                    f"inputs {_describe_inputs(inputs, m)}" + ("; " + "; ".join(fns) if fns else ""))
    return f"{where}: the solver found a difference"  # pragma: no cover


def verify_rules(rules: Iterable[Rule]) -> list[Verdict]:
    return [verify_rule(r) for r in rules]
