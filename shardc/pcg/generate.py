"""Rule generation (TASO's generator, extended to parallel ops).

1. Enumerate every term of up to `max_ops` ops over a vocabulary of parallel ops (degree 2, dims 0/1 of
   rank-2 tensors) and elementwise ops, on two global inputs `a`, `b` and two per-device inputs `p`, `q`
   (variables renamed in order of first use, so renamings are not counted twice).
2. Evaluate each on fixed random inputs with the per-device semantics; ill-typed terms are dropped.
   The fingerprint is the output's kind (global or per device), shapes and rounded values.
3. Terms with equal fingerprints are candidate rules: each term => the smallest term of its group
   (when it uses no variable the larger one lacks).
4. Candidates are taken smallest first. One whose two sides rewrite to the same term with the rules
   kept so far is redundant; the others go to Z3 (`verify_rule`, degrees 2 and 4); proved ones are kept.

`python -m shardc generate-rules` writes the kept rules to `shardc/pcg/data/generated.rules`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from shardc.pcg.lang import OPS, App, PVar, Rule, Term, Var, eval_param, format_term, term_size, term_vars
from shardc.pcg.semantics import D, G, IllTyped, Model, evaluate
from shardc.pcg.verify import verify_rule

__all__ = ["Vocabulary", "DEFAULT_VOCABULARY", "GenerationReport", "generate_rules", "enumerate_terms",
           "normalize", "ac_form", "format_rules_file"]


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """Ops (name, params) to enumerate with, and the input variables with their kinds."""

    ops: tuple[tuple[str, tuple], ...]
    inputs: tuple[tuple[str, str], ...] = (("a", "G"), ("b", "G"), ("p", "D"), ("q", "D"))
    degree: int = 2
    shape: tuple[int, ...] = (4, 4)


DEFAULT_VOCABULARY = Vocabulary(ops=(
    ("partition", (0,)), ("partition", (1,)), ("combine", (0,)), ("combine", (1,)), ("replicate", ()),
    ("reduce", ()), ("reduce_scatter", (0,)), ("reduce_scatter", (1,)), ("all_to_all", (0, 1)),
    ("all_to_all", (1, 0)), ("add", ()), ("mul", ()), ("neg", ()), ("ew1", (PVar("f"),)),
))

_COMMUTATIVE = {"add", "mul"}


def _numeric_model(n: int) -> Model:
    fns = {1: lambda x: np.sin(1.3 * x + 0.7) + 0.3 * x, 2: lambda x, y: np.sin(x - 0.4 * y) + x * y}
    return Model(n, lambda name, arity: fns[arity], lambda name: 1.7)


def _kind(term: Term, kinds: dict[str, str]) -> str:
    if isinstance(term, Var):
        return kinds[term.name]
    spec = OPS[term.op]
    if spec.parallel:
        return spec.out_kind
    return "D" if any(_kind(a, kinds) == "D" for a in term.args) else "G"


def _rename(term: Term, kinds: dict[str, str]) -> Term:
    """Rename variables in order of first use: globals a, b, ...; per-device p, q, ..."""
    names = {"G": iter("abcde"), "D": iter("pqrst")}
    mapping: dict[str, str] = {}
    for v in term_vars(term):
        mapping[v] = next(names[kinds[v]])
    return _subst(term, {k: Var(v) for k, v in mapping.items()})


def _subst(term: Term, env: dict[str, Term]) -> Term:
    if isinstance(term, Var):
        return env.get(term.name, term)
    return App(term.op, term.params, tuple(_subst(a, env) for a in term.args))


def enumerate_terms(vocab: Vocabulary, max_ops: int) -> Iterator[Term]:
    """Every term with at most `max_ops` ops, each once up to renaming of variables (unchecked types)."""
    kinds = dict(vocab.inputs)
    by_size: list[list[Term]] = [[Var(v) for v, _ in vocab.inputs]]
    seen: set[str] = set()
    for t in by_size[0]:
        key = format_term(_rename(t, kinds))
        if key not in seen:
            seen.add(key)
            yield t
    for size in range(1, max_ops + 1):
        level: list[Term] = []
        for name, params in vocab.ops:
            arity = OPS[name].arity
            if arity == 1:
                combos = ((a,) for a in by_size[size - 1])
            else:
                combos = (
                    (a, b) for k in range(size) for a in by_size[k] for b in by_size[size - 1 - k]
                    if not (name in _COMMUTATIVE and format_term(a) > format_term(b))
                )
            for args in combos:
                level.append(App(name, params, tuple(args)))
        by_size.append(level)
        for t in level:
            key = format_term(_rename(t, kinds))
            if key not in seen:
                seen.add(key)
                yield t


def _fingerprint(val: G | D) -> str:
    arrs = [val.arr] if isinstance(val, G) else list(val.pieces)
    h = hashlib.sha1(("G" if isinstance(val, G) else "D").encode())
    for a in arrs:
        h.update(repr(a.shape).encode())
        h.update(np.round(np.asarray(a, dtype=np.float64), 6).tobytes())
    return h.hexdigest()


# -- term rewriting with kept rules (to drop derivable candidates) ----------------------------------

def _match(pat: Term, term: Term, env: dict[str, Any], kinds: dict[str, str], var_kinds: dict[str, str]) -> dict | None:
    if isinstance(pat, Var):
        if pat.name in env:
            return env if env[pat.name] == term else None
        if var_kinds.get(pat.name) == "G" and _kind(term, kinds) != "G":
            return None
        return {**env, pat.name: term}
    if not isinstance(term, App) or term.op != pat.op or len(term.params) != len(pat.params):
        return None
    for pp, tp in zip(pat.params, term.params):
        if isinstance(pp, PVar):
            key = f"param:{pp.name}"
            if key in env and env[key] != tp:
                return None
            env = {**env, key: tp}
        elif pp != tp:
            return None
    for pa, ta in zip(pat.args, term.args):
        env = _match(pa, ta, env, kinds, var_kinds)
        if env is None:
            return None
    return env


def _instantiate(term: Term, env: dict[str, Any]) -> Term:
    if isinstance(term, Var):
        return env[term.name]
    params = {k[6:]: v for k, v in env.items() if k.startswith("param:")}
    ps = tuple(p if not isinstance(p, PVar) or p.name not in params else params[p.name] for p in term.params)
    ps = tuple(eval_param(p, params) if not isinstance(p, PVar) else p for p in ps)
    return App(term.op, ps, tuple(_instantiate(a, env) for a in term.args))


def _order(t: Term) -> tuple[int, str]:
    return term_size(t), format_term(t)


def _rewrite_once(term: Term, rules: Sequence[Rule], kinds: dict[str, str]) -> Term | None:
    if isinstance(term, App):
        for i, a in enumerate(term.args):
            new = _rewrite_once(a, rules, kinds)
            if new is not None:
                return App(term.op, term.params, term.args[:i] + (new,) + term.args[i + 1:])
    for r in rules:
        env = _match(r.lhs[0], term, {}, kinds, r.var_kinds())
        if env is not None:
            new = _instantiate(r.rhs[0], env)
            if _order(new) < _order(term):
                return new
    return None


def ac_form(term: Term) -> Term:
    """Canonical form modulo associativity and commutativity of add and mul: chains flattened, operands
    sorted, re-nested to the right."""
    if isinstance(term, Var):
        return term
    args = tuple(ac_form(a) for a in term.args)
    if term.op not in _COMMUTATIVE:
        return App(term.op, term.params, args)
    flat: list[Term] = []
    for a in args:
        if isinstance(a, App) and a.op == term.op:
            flat.extend(_chain(a, term.op))
        else:
            flat.append(a)
    flat.sort(key=format_term)
    out = flat[-1]
    for a in reversed(flat[:-1]):
        out = App(term.op, (), (a, out))
    return out


def _chain(t: Term, op: str) -> list[Term]:
    if isinstance(t, App) and t.op == op:
        return [x for a in t.args for x in _chain(a, op)]
    return [t]


def normalize(term: Term, rules: Sequence[Rule], kinds: dict[str, str], max_steps: int = 64) -> Term:
    """Rewrite innermost-first with `rules` (each making the term smaller) until none applies, modulo
    associativity and commutativity of add and mul."""
    term = ac_form(term)
    for _ in range(max_steps):
        new = _rewrite_once(term, rules, kinds)
        if new is None:
            return term
        term = ac_form(new)
    return term


# -- the generator ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GenerationReport:
    enumerated: int  # distinct terms tried
    well_typed: int  # defined on the inputs
    candidates: int  # term pairs with equal fingerprints
    redundant: int  # derivable from rules kept before them (or from add/mul being associative, commutative)
    verified: int  # sent to Z3 and proved
    refuted: int  # sent to Z3 and refuted (fingerprint collisions, degree-2-only identities)
    kept: tuple[Rule, ...]
    seconds: float

    def summary(self) -> str:
        return (f"enumerated {self.enumerated} terms ({self.well_typed} well-typed), {self.candidates} candidate "
                f"rules, {self.redundant} redundant, {self.verified} verified by Z3, {self.refuted} refuted, "
                f"kept {len(self.kept)} ({self.seconds:.1f} s)")


def generate_rules(vocab: Vocabulary = DEFAULT_VOCABULARY, max_ops: int = 3, *, seed: int = 0,
                   progress: Callable[[str], None] | None = None) -> GenerationReport:
    t0 = time.perf_counter()
    kinds = dict(vocab.inputs)
    rng = np.random.default_rng(seed)
    n = vocab.degree
    inputs = {v: (G(rng.standard_normal(vocab.shape)) if k == "G"
                  else D(tuple(rng.standard_normal(vocab.shape) for _ in range(n)))) for v, k in vocab.inputs}
    model = _numeric_model(n)
    groups: dict[str, list[Term]] = {}
    enumerated = typed = 0
    for term in enumerate_terms(vocab, max_ops):
        enumerated += 1
        try:
            val = evaluate(term, inputs, {"n": n, "f": "f"}, model)
        except IllTyped:
            continue
        typed += 1
        groups.setdefault(_fingerprint(val), []).append(_rename(term, kinds))
    if progress:
        progress(f"{enumerated} terms enumerated, {typed} well-typed, {len(groups)} fingerprints")
    cands: list[tuple[Term, Term]] = []
    for terms in groups.values():
        terms = sorted({format_term(t): t for t in terms}.values(), key=_order)
        rep = terms[0]
        for t in terms[1:]:
            if set(term_vars(rep)) <= set(term_vars(t)):
                cands.append((t, rep))
    cands.sort(key=lambda c: (_order(c[0]), _order(c[1])))
    kept: list[Rule] = []
    redundant = verified = refuted = 0
    for lhs, rhs in cands:
        if normalize(lhs, kept, kinds) == normalize(rhs, kept, kinds):
            redundant += 1
            continue
        globs = frozenset(v for v in term_vars(lhs) if kinds[v] == "G")
        rule = Rule(f"gen_{len(kept) + 1:03d}", (lhs,), (rhs,), (), globs)
        if verify_rule(rule).proved:
            verified += 1
            kept.append(rule)
        else:
            refuted += 1
    return GenerationReport(enumerated, typed, len(cands), redundant, verified, refuted, tuple(kept),
                            time.perf_counter() - t0)


def format_rules_file(report: GenerationReport, max_ops: int) -> str:
    head = [
        "# Generated by `python -m shardc generate-rules` (shardc.pcg.generate); do not edit by hand.",
        f"# {report.summary()}",
        f"# vocabulary: degree-2 parallel ops on dims 0/1 of rank-2 tensors, add, mul, neg, ew1; up to {max_ops} ops.",
        "# Variables a, b are global (replicated over the group), p, q per device. Every rule was proved by Z3",
        "# at degrees 2 and 4 before it was written here.",
    ]
    return "\n".join(head + [str(r) for r in report.kept]) + "\n"
