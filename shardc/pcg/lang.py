"""The rule language: pattern => replacement over PCG terms.

A rule is one line:

    name: LHS => RHS [if COND, ...] [global x, ...]

`LHS` and `RHS` are comma-separated terms (several terms = several outputs, matched and replaced
together). A term is a tensor variable (`x`) or an op applied to terms, with parameters in brackets:

    rs_fuse:      partition[d](reduce(x)) => reduce_scatter[d](x)
    a2a_fuse:     partition[e](combine[d](x)) => all_to_all[d, e](x) if d != e
    fuse_matmul:  dot(x, w), dot(y, w) => ...

Parallel ops (`partition`, `combine`, `replicate`, `reduce`, `reduce_scatter`, `all_to_all`, `permute`)
all work on the rule's one axes group, of degree `n`. Parameters are integers, parameter variables
(bound by matching the LHS; a dim, a permutation, a scalar, an elementwise function), the degree `n`,
and expressions over them (`d + 1`, `pos(p, d)`, `inv(p)`, `rank(x)`, `at(shape(x), d)` — the size of dim d of one device's piece of
x). `<=>` states both directions.
`global x` says x must be replicated over the group (the default is per-device: any layout).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator, Mapping, Sequence

__all__ = [
    "Var", "App", "PVar", "PCall", "PBin", "Cond", "Rule", "RuleSyntaxError", "OpSpec", "OPS",
    "parse_rule", "parse_rules", "eval_param", "term_vars", "term_ops", "term_size", "format_term",
    "param_vars",
]


class RuleSyntaxError(ValueError):
    """A rule that does not parse or does not make sense (unknown op, unbound parameter...)."""


# -- parameter expressions -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class PVar:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True, slots=True)
class PCall:
    fn: str
    args: tuple[Any, ...]

    def __str__(self) -> str:
        return f"{self.fn}({', '.join(_pstr(a) for a in self.args)})"


@dataclasses.dataclass(frozen=True, slots=True)
class PBin:
    op: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return f"{_pstr(self.a)} {self.op} {_pstr(self.b)}"


def _pstr(p: Any) -> str:
    if isinstance(p, tuple):
        return "(" + ", ".join(_pstr(x) for x in p) + ("," if len(p) == 1 else "") + ")"
    if isinstance(p, PBin):
        return f"({p})"
    return str(p)


def _inv(p: Sequence[int]) -> tuple[int, ...]:
    out = [0] * len(p)
    for i, q in enumerate(p):
        out[q] = i
    return tuple(out)


PARAM_FUNCTIONS = {
    "pos": lambda p, d: tuple(p).index(d),  # where dim d went under transpose p
    "inv": _inv,
    "at": lambda p, i: tuple(p)[i],
    "rank": len,  # rank(x) of a tensor variable x
    "shape": tuple,  # shape(x): the shape of one device's piece of tensor variable x
}


def eval_param(p: Any, env: Mapping[str, Any]) -> Any:
    """Value of a parameter expression; KeyError for an unbound variable."""
    if isinstance(p, PVar):
        return env[p.name]
    if isinstance(p, tuple):
        return tuple(eval_param(x, env) for x in p)
    if isinstance(p, PCall):
        if p.fn in ("rank", "shape"):  # of a tensor variable (shape: of one device's piece)
            return env[f"{p.fn}:{p.args[0]}"]
        return PARAM_FUNCTIONS[p.fn](*[eval_param(a, env) for a in p.args])
    if isinstance(p, PBin):
        a, b = eval_param(p.a, env), eval_param(p.b, env)
        return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "//": lambda: a // b,
                "%": lambda: a % b}[p.op]()
    return p


def param_vars(p: Any) -> set[str]:
    if isinstance(p, PVar):
        return {p.name}
    if isinstance(p, tuple):
        return set().union(*[param_vars(x) for x in p]) if p else set()
    if isinstance(p, PCall):
        if p.fn in ("rank", "shape"):
            return set()
        return set().union(*[param_vars(x) for x in p.args]) if p.args else set()
    if isinstance(p, PBin):
        return param_vars(p.a) | param_vars(p.b)
    return set()


# -- ops --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class OpSpec:
    """A rule-language op: arity, parameter kinds, and (for parallel ops) input/output value kinds:
    "G" = one global value, "D" = one piece per device, "*" = either (compute ops run per device)."""

    name: str
    arity: int
    params: tuple[str, ...]  # kinds: dim, perm, index, int, scalar, fn, shift
    parallel: bool = False
    in_kind: str = "*"
    out_kind: str = "*"
    linear: bool = False  # compute op linear in each argument


OPS: dict[str, OpSpec] = {s.name: s for s in [
    OpSpec("partition", 1, ("dim",), True, "G", "D"),
    OpSpec("combine", 1, ("dim",), True, "D", "G"),
    OpSpec("replicate", 1, (), True, "G", "D"),
    OpSpec("reduce", 1, (), True, "D", "G"),
    OpSpec("reduce_scatter", 1, ("dim",), True, "D", "D"),
    OpSpec("all_to_all", 1, ("dim", "dim"), True, "D", "D"),
    OpSpec("permute", 1, ("shift",), True, "D", "D"),
    OpSpec("add", 2, (), linear=True),
    OpSpec("sub", 2, (), linear=True),
    OpSpec("mul", 2, ()),
    OpSpec("neg", 1, (), linear=True),
    OpSpec("scale", 1, ("scalar",), linear=True),
    OpSpec("ew1", 1, ("fn",)),
    OpSpec("ew2", 2, ("fn",)),
    OpSpec("dot", 2, ()),
    OpSpec("dotc", 2, ("dim", "dim")),  # contract dim a of x with dim b of w (one contracting dim, no batch dims)
    OpSpec("transpose", 1, ("perm",), linear=True),
    OpSpec("concat", 2, ("dim",)),
    OpSpec("chunk", 1, ("dim", "index", "int")),
    OpSpec("sum", 1, ("dim",), linear=True),
    OpSpec("merge", 1, ("dim",), linear=True),  # reshape merging dims d and d+1
    OpSpec("unmerge", 1, ("dim", "int"), linear=True),  # reshape splitting dim d into (size/m, m)
]}


# -- terms and rules --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Var:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True, slots=True)
class App:
    op: str
    params: tuple[Any, ...]
    args: tuple["Term", ...]
    group: str = ""  # a parallel op's axes group: "" (the rule's group A), "B" (a second, disjoint one), "AB" (both)

    def __str__(self) -> str:
        return format_term(self)


Term = Var | App


def format_term(t: Term) -> str:
    if isinstance(t, Var):
        return t.name
    ps = f"[{', '.join(_pstr(p) for p in t.params)}]" if t.params else ""
    at = f"@{t.group}" if t.group else ""
    return f"{t.op}{ps}{at}({', '.join(format_term(a) for a in t.args)})"


def term_vars(t: Term) -> list[str]:
    """Tensor variables in first-occurrence order."""
    if isinstance(t, Var):
        return [t.name]
    out: list[str] = []
    for a in t.args:
        out += [v for v in term_vars(a) if v not in out]
    return out


def term_ops(t: Term) -> Iterator[App]:
    if isinstance(t, App):
        yield t
        for a in t.args:
            yield from term_ops(a)


def term_size(t: Term) -> int:
    return sum(1 for _ in term_ops(t))


@dataclasses.dataclass(frozen=True, slots=True)
class Cond:
    op: str
    a: Any
    b: Any

    def holds(self, env: Mapping[str, Any]) -> bool:
        a, b = eval_param(self.a, env), eval_param(self.b, env)
        return {"!=": a != b, "==": a == b, "<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b}[self.op]

    def __str__(self) -> str:
        return f"{_pstr(self.a)} {self.op} {_pstr(self.b)}"


def _visit_kinds(rule: str, t: Term, expect: str, kinds: dict[str, str]) -> None:
    """`Rule.var_kinds`'s walk: record in `kinds` what each variable under `t` must be ("G", "D"; "*": either).
    (A module function: a recursive closure would be a reference cycle, garbage only a cyclic collection frees.)"""
    if isinstance(t, Var):
        if expect != "*":
            if kinds.get(t.name) and kinds[t.name] != expect:
                raise RuleSyntaxError(f"{rule}: {t.name} is used both as a global value and per device")
            kinds[t.name] = expect
        return
    spec = OPS[t.op]
    for a in t.args:
        _visit_kinds(rule, a, spec.in_kind if spec.parallel else ("G" if expect == "G" else "*"), kinds)


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """A directed rewrite. `text` is its canonical one-line form (the key proofs are stored under)."""

    name: str
    lhs: tuple[Term, ...]
    rhs: tuple[Term, ...]
    conds: tuple[Cond, ...] = ()
    globals: frozenset[str] = frozenset()

    @property
    def text(self) -> str:
        s = f"{', '.join(map(format_term, self.lhs))} => {', '.join(map(format_term, self.rhs))}"
        if self.conds:
            s += " if " + ", ".join(map(str, self.conds))
        if self.globals:
            s += " global " + ", ".join(sorted(self.globals))
        return s

    def __str__(self) -> str:
        return f"{self.name}: {self.text}"

    def vars(self) -> list[str]:
        out: list[str] = []
        for t in self.lhs:
            out += [v for v in term_vars(t) if v not in out]
        return out

    def param_kinds(self) -> dict[str, str]:
        """Kind of every parameter variable bound by the LHS (dim, perm, scalar, fn, ...)."""
        kinds: dict[str, str] = {}
        for t in self.lhs:
            for app in term_ops(t):
                for kind, p in zip(OPS[app.op].params, app.params):
                    if isinstance(p, PVar) and p.name != "n":
                        kinds.setdefault(p.name, kind)
        return kinds

    def var_kinds(self) -> dict[str, str]:
        """For each tensor variable: "G" (a global value: it feeds partition/replicate, directly or
        through compute ops, or is declared global) or "D" (one piece per device, the default)."""
        if self.two_groups:  # (per-device pieces on a grid of two groups: no global values, see shardc.pcg.grid)
            return {v: "D" for v in self.vars()}
        kinds: dict[str, str] = {v: ("G" if v in self.globals else "") for v in self.vars()}
        for t in self.lhs + self.rhs:
            _visit_kinds(self.name, t, "*", kinds)
        return {v: k or "D" for v, k in kinds.items()}

    def reversed(self, name: str | None = None) -> "Rule":
        return Rule(name or f"{self.name}~rev", self.rhs, self.lhs, self.conds, self.globals)

    def groups(self) -> frozenset[str]:
        """The axes groups its parallel ops name ("" is the default group A)."""
        return frozenset(a.group for t in self.lhs + self.rhs for a in term_ops(t) if OPS[a.op].parallel)

    @property
    def two_groups(self) -> bool:
        """Does the rule relate collectives on two disjoint axes groups (proved by `shardc.pcg.grid`)?"""
        return bool(self.groups() - {""})

    def has_parallel(self) -> bool:
        return any(OPS[a.op].parallel for t in self.lhs + self.rhs for a in term_ops(t))


# -- parser -----------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(<=>|=>|!=|==|<=|>=|//|[-+*%<>()\[\],:@])|(\d+\.\d*|\d*\.\d+|\d+)|([A-Za-z_][A-Za-z_0-9~.']*))")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise RuleSyntaxError(f"cannot read {text[pos:pos + 20]!r} in {text!r}")
        out.append(m.group(m.lastindex))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise RuleSyntaxError(f"expected {want or 'more'} at token {self.i} of {self.text!r}, got {tok!r}")
        self.i += 1
        return tok

    def rule(self) -> list[Rule]:
        name = self.take()
        self.take(":")
        lhs = self.terms()
        arrow = self.take()
        if arrow not in ("=>", "<=>"):
            raise RuleSyntaxError(f"expected => or <=> in {self.text!r}, got {arrow!r}")
        rhs = self.terms()
        conds: list[Cond] = []
        globs: set[str] = set()
        while self.peek() is not None:
            kw = self.take()
            if kw == "if":
                conds.append(self.cond())
                while self.peek() == ",":
                    self.take(",")
                    conds.append(self.cond())
            elif kw == "global":
                globs.add(self.take())
                while self.peek() == ",":
                    self.take(",")
                    globs.add(self.take())
            else:
                raise RuleSyntaxError(f"unexpected {kw!r} in {self.text!r}")
        rule = Rule(name, tuple(lhs), tuple(rhs), tuple(conds), frozenset(globs))
        _check(rule)
        if arrow == "<=>":
            back = rule.reversed()
            _check(back)
            return [rule, back]
        return [rule]

    def terms(self) -> list[Term]:
        out = [self.term()]
        while self.peek() == ",":
            self.take(",")
            out.append(self.term())
        return out

    def term(self) -> Term:
        name = self.take()
        if not re.match(r"[A-Za-z_]", name):
            raise RuleSyntaxError(f"expected a term in {self.text!r}, got {name!r}")
        if self.peek() not in ("[", "(", "@"):
            return Var(name)
        if name not in OPS:
            raise RuleSyntaxError(f"unknown op {name!r} in {self.text!r}; ops: {', '.join(OPS)}")
        params: list[Any] = []
        if self.peek() == "[":
            self.take("[")
            params = self.pexprs("]")
            self.take("]")
        group = ""
        if self.peek() == "@":
            self.take("@")
            group = self.take()
            if group not in GROUPS or not OPS[name].parallel:
                raise RuleSyntaxError(f"{name}@{group}: a group is one of {GROUPS} on a parallel op, in {self.text!r}")
        self.take("(")
        args = self.terms()
        self.take(")")
        spec = OPS[name]
        if len(args) != spec.arity or len(params) != len(spec.params):
            raise RuleSyntaxError(f"{name} takes {spec.arity} argument(s) and {len(spec.params)} parameter(s) "
                                  f"{list(spec.params)}, got {len(args)} and {len(params)} in {self.text!r}")
        return App(name, tuple(params), tuple(args), "" if group == "A" else group)

    def pexprs(self, close: str) -> list[Any]:
        out: list[Any] = []
        if self.peek() == close:
            return out
        out.append(self.pexpr())
        while self.peek() == ",":
            self.take(",")
            out.append(self.pexpr())
        return out

    def pexpr(self) -> Any:
        a = self.pterm()
        while self.peek() in ("+", "-"):
            op = self.take()
            a = PBin(op, a, self.pterm())
        return a

    def pterm(self) -> Any:
        a = self.patom()
        while self.peek() in ("*", "//", "%"):
            op = self.take()
            a = PBin(op, a, self.patom())
        return a

    def patom(self) -> Any:
        tok = self.take()
        if tok == "-":
            v = self.patom()
            return -v if isinstance(v, (int, float)) else PBin("-", 0, v)
        if tok == "(":
            items = self.pexprs(")")
            self.take(")")
            return items[0] if len(items) == 1 else tuple(items)
        if re.fullmatch(r"\d+", tok):
            return int(tok)
        if re.fullmatch(r"[\d.]+", tok):
            return float(tok)
        if self.peek() == "(" and tok in PARAM_FUNCTIONS:
            self.take("(")
            args = self.pexprs(")")
            self.take(")")
            return PCall(tok, tuple(args))
        return PVar(tok)

    def cond(self) -> Cond:
        a = self.pexpr()
        op = self.take()
        if op not in ("!=", "==", "<", ">", "<=", ">="):
            raise RuleSyntaxError(f"expected a comparison in {self.text!r}, got {op!r}")
        return Cond(op, a, self.pexpr())


def _check(rule: Rule) -> None:
    """Every RHS variable and parameter must be bound by the LHS."""
    lhs_vars = set(rule.vars())
    for t in rule.rhs:
        extra = set(term_vars(t)) - lhs_vars
        if extra:
            raise RuleSyntaxError(f"{rule.name}: {sorted(extra)} appear only on the right-hand side")
    bound = set(rule.param_kinds()) | {"n"}
    used = set()
    for t in rule.lhs:  # expressions on the left are checked after matching, so their variables must be bound
        for app in term_ops(t):
            for p in app.params:
                if not isinstance(p, (PVar, int, float, tuple)):
                    used |= param_vars(p)
    for t in rule.rhs:
        for app in term_ops(t):
            for p in app.params:
                used |= param_vars(p)
    for c in rule.conds:
        used |= param_vars(c.a) | param_vars(c.b)
    if used - bound:
        raise RuleSyntaxError(f"{rule.name}: parameters {sorted(used - bound)} are not bound by the left-hand side")
    if all(isinstance(t, Var) for t in rule.lhs):
        raise RuleSyntaxError(f"{rule.name}: the left-hand side must contain an op")
    if rule.two_groups:
        _check_two_groups(rule, used)
    rule.var_kinds()


GROUPS = ("A", "B", "AB")
GRID_OPS = ("partition", "combine", "reduce", "reduce_scatter", "all_to_all")  # what shardc.pcg.grid evaluates


def _check_two_groups(rule: Rule, used: set[str]) -> None:
    """A two-group rule: parallel ops of `GRID_OPS` only, `@AB` (both groups at once) only on `reduce` (the one
    collective whose result does not depend on how the two groups order their devices), the left side names
    both groups, no global variables and no degree `n` (each group has its own)."""
    for t in rule.lhs + rule.rhs:
        for a in term_ops(t):
            if OPS[a.op].parallel and a.op not in GRID_OPS:
                raise RuleSyntaxError(f"{rule.name}: {a.op} is not defined on two groups")
            if a.group == "AB" and a.op != "reduce":
                raise RuleSyntaxError(f"{rule.name}: only reduce acts on both groups at once (@AB)")
    lhs = {a.group for t in rule.lhs for a in term_ops(t) if OPS[a.op].parallel}
    if not ({"", "B"} <= lhs or "AB" in lhs and lhs & {"", "B"}):
        raise RuleSyntaxError(f"{rule.name}: the left-hand side must bind both groups")
    if rule.globals or "n" in used:
        raise RuleSyntaxError(f"{rule.name}: a two-group rule has no global variables and no degree n")


def parse_rule(text: str) -> list[Rule]:
    """One rule line -> one rule (or two for `<=>`)."""
    return _Parser(text.strip()).rule()


def parse_rules(text: str) -> list[Rule]:
    """Rules from a text: one per line, `#` starts a comment, blank lines ignored."""
    out: list[Rule] = []
    names: set[str] = set()
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            rules = parse_rule(line)
        except RuleSyntaxError as e:
            raise RuleSyntaxError(f"line {line_no}: {e}") from None
        for r in rules:
            if r.name in names:
                raise RuleSyntaxError(f"line {line_no}: rule name {r.name!r} is used twice")
            names.add(r.name)
        out += rules
    return out
