"""Matching rules against a PCG and applying them.

`find_matches(pcg, rule)` yields every place the rule's left-hand side occurs: each LHS op matched to
a node (`shardc.pcg.bind.match_node`), each tensor variable to a tensor, parameter variables to
values, and all parallel ops to one axes group. `apply_match` builds the right-hand side, checks that
every replaced output keeps its shape, dtype and layout, reroutes the consumers and drops the dead
nodes. Only rules proved by `shardc.pcg.verify` are applied.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Iterator, Sequence

from annotations.errors import ShardingError
from shardc.pcg.bind import RewriteError, build_compute, build_parallel, match_node, op_kinds
from shardc.pcg.graph import PCG, GraphBuilder, ObjectMemo, is_clean
from shardc.pcg.lang import OPS, PVar, Rule, Term, Var, eval_param, term_ops
from shardc.pcg.ops import Axes, group_size
from shardc.pcg.splice import splice
from shardc.pcg.verify import is_proved

__all__ = ["Match", "find_matches", "apply_match", "apply_matches", "independent", "node_kinds", "lhs_ops",
           "UnprovedRuleError", "RewriteError", "rewrites"]


class UnprovedRuleError(RuntimeError):
    """A rule was about to be applied without a proof."""


@dataclasses.dataclass(frozen=True)
class Match:
    rule: Rule
    tensors: dict[str, int]
    params: dict[str, Any]
    axes: Axes | None
    roots: tuple[int, ...]
    nodes: frozenset[int]
    axes_b: Axes | None = None  # a two-group rule's second group (`op@B`)

    def group_axes(self, group: str, mesh: dict[str, int]) -> Axes | None:
        """The mesh axes of a rule op's group ("" = A, "B", "AB" = both, in mesh order)."""
        if group == "":
            return self.axes
        if group == "B":
            return self.axes_b
        if self.axes is None or self.axes_b is None:
            return None
        return tuple(a for a in mesh if a in self.axes or a in self.axes_b)

    def __str__(self) -> str:
        where = ", ".join(f"{k}=%{v}" for k, v in self.tensors.items())
        return f"{self.rule.name} at {', '.join(f'%{r}' for r in self.roots)} ({where})"


@dataclasses.dataclass(frozen=True)
class _State:
    tensors: dict[str, int]
    params: dict[str, Any]
    axes: Axes | None
    nodes: frozenset[int]
    deferred: tuple[tuple[Any, Any], ...] = ()
    axes_b: Axes | None = None

    def bind_tensor(self, name: str, tid: int) -> "_State | None":
        have = self.tensors.get(name)
        if have is not None:
            return self if have == tid else None
        if tid in self.tensors.values():  # distinct variables are distinct tensors
            return None
        return dataclasses.replace(self, tensors={**self.tensors, name: tid})

    def bind_params(self, exprs: tuple[Any, ...], values: tuple[Any, ...]) -> "_State | None":
        params = dict(self.params)
        deferred = list(self.deferred)
        for e, v in zip(exprs, values):
            if isinstance(e, PVar) and e.name != "n":
                if e.name in params:
                    if params[e.name] != v:
                        return None
                else:
                    params[e.name] = v
            elif isinstance(e, (int, float)) and not isinstance(v, (int, float)):
                return None
            elif isinstance(e, (int, float, tuple)) and not _has_vars(e):
                if e != v:
                    return None
            else:
                deferred.append((e, v))
        return dataclasses.replace(self, params=params, deferred=tuple(deferred))

    def bind_axes(self, axes: Axes, group: str = "") -> "_State | None":
        """Bind the rule's group A (""), B, or check/complete both against a node over A and B ("AB"); the
        two groups are disjoint sets of mesh axes."""
        if group == "AB":
            a, b = self.axes, self.axes_b
            if a is not None and b is not None:
                return self if set(axes) == set(a) | set(b) else None
            known = a if a is not None else b
            if known is None or not set(known) < set(axes):  # (neither bound yet: not decidable here)
                return None
            rest = tuple(x for x in axes if x not in known)
            return dataclasses.replace(self, axes_b=rest) if a is not None else dataclasses.replace(self, axes=rest)
        mine, other = (self.axes, self.axes_b) if group == "" else (self.axes_b, self.axes)
        if mine is not None:
            return self if mine == axes else None
        if other is not None and set(other) & set(axes):
            return None
        return dataclasses.replace(self, **{"axes" if group == "" else "axes_b": axes})


def _has_vars(e: Any) -> bool:
    return isinstance(e, tuple) and any(isinstance(x, PVar) or _has_vars(x) for x in e)


def _match(pcg: PCG, term: Term, tid: int, st: _State) -> Iterator[_State]:
    if isinstance(term, Var):
        nxt = st.bind_tensor(term.name, tid)
        if nxt is not None:
            yield nxt
        return
    prod = pcg.producer(tid)
    if prod is None:
        return
    node, _ = prod
    if len(node.outputs) != 1:
        return
    spec = OPS[term.op]
    orders = [None]
    if term.op in ("add", "mul", "ew2"):
        orders.append((1, 0))
    for order in orders:
        got = match_node(pcg, node, term.op, spec.parallel)
        if got is None:
            return
        values, args = got
        if order is not None:
            if term.op == "ew2" and (values[0].op.primitive not in ("add", "add_any", "mul", "max", "min", "and", "or")):
                continue
            args = [args[i] for i in order]
        nxt = st.bind_params(term.params, values)
        if nxt is not None and spec.parallel:
            nxt = nxt.bind_axes(node.op.axes, term.group)
        if nxt is None:
            continue
        nxt = dataclasses.replace(nxt, nodes=nxt.nodes | {node.id})
        yield from _match_args(pcg, term.args, args, nxt)


def _match_args(pcg: PCG, terms: tuple[Term, ...], tids: list[int], st: _State) -> Iterator[_State]:
    if not terms:
        yield st
        return
    for nxt in _match(pcg, terms[0], tids[0], st):
        yield from _match_args(pcg, terms[1:], tids[1:], nxt)


_KIND_INDEX: "weakref.WeakKeyDictionary[PCG, _KindIndex]" = weakref.WeakKeyDictionary()
_TERM_ROOTS: "weakref.WeakKeyDictionary[PCG, dict[Term, list[int]]]" = weakref.WeakKeyDictionary()
_OP_KINDS = ObjectMemo()


@dataclasses.dataclass(frozen=True)
class _KindIndex:
    """Per rule op, the tensors made by a one-output node that could be it, in program order (`by_kind`); per such
    tensor, its position in that order and the rule ops its node could be (`of_tensor`)."""

    by_kind: dict[str, list[int]]
    of_tensor: dict[int, tuple[int, set[str]]]


def _kinds(pcg: PCG) -> _KindIndex:
    index = _KIND_INDEX.get(pcg)
    if index is None:
        by_kind: dict[str, list[int]] = {}
        of_tensor: dict[int, tuple[int, set[str]]] = {}
        for pos, n in enumerate(pcg.nodes):
            if len(n.outputs) == 1:
                kinds = _OP_KINDS.get(n.op, op_kinds)
                of_tensor[n.outputs[0]] = (pos, kinds)
                for k in kinds:
                    by_kind.setdefault(k, []).append(n.outputs[0])
        index = _KIND_INDEX[pcg] = _KindIndex(by_kind, of_tensor)
    return index


def node_kinds(pcg: PCG, ids: set[int]) -> frozenset[str]:
    """The rule ops the one-output nodes `ids` could be (`op_kinds`: a node `match_node` matches as an op is one of
    them): a rule none of whose left-hand ops is among them has no match touching those nodes."""
    kinds: set[str] = set()
    for n in pcg.nodes:
        if n.id in ids and len(n.outputs) == 1:
            kinds |= _OP_KINDS.get(n.op, op_kinds)
    return frozenset(kinds)


def lhs_ops(rule: Rule) -> frozenset[str]:
    """The ops of `rule`'s left-hand side (memoised per rule)."""
    hit = _LHS_OPS.get(rule.text)
    if hit is None:
        hit = _LHS_OPS[rule.text] = frozenset(a.op for t in rule.lhs for a in term_ops(t))
    return hit


_LHS_OPS: dict[str, frozenset[str]] = {}


def _kind_index(pcg: PCG) -> dict[str, list[int]]:
    """Per rule op, the tensors made by a one-output node that could be it, in program order."""
    return _kinds(pcg).by_kind


def _candidates_in(pcg: PCG, term: Term, allowed: frozenset[int]) -> list[int]:
    """Those of the tensors `allowed` made by a node that could be `term`'s op, in program order: where a match's
    root must be one of a few tensors (near the last rewrite), those are tried as they are, unanchored."""
    if isinstance(term, Var):
        return []
    of = _kinds(pcg).of_tensor
    found = [(hit[0], t) for t in allowed if (hit := of.get(t)) is not None and term.op in hit[1]]
    return [t for _, t in sorted(found)]


def _candidates(pcg: PCG, term: Term) -> list[int]:
    """Tensors at which `term` can match, in program order: made by a node that could be its op and, when
    an argument is itself an op, reading a tensor where that argument can match (anchored at the argument
    with the fewest: `ew1(combine(x))` is looked for at the readers of combines, not at every elementwise op).
    A matched node's arguments are among its inputs, so this drops no match."""
    if isinstance(term, Var):
        return []
    memo = _TERM_ROOTS.setdefault(pcg, {})
    if term in memo:
        return memo[term]
    own = _kind_index(pcg).get(term.op, [])
    for below in sorted((_candidates(pcg, a) for a in term.args if not isinstance(a, Var)), key=len):
        if len(below) >= len(own):
            break
        own = _read_from(pcg, below, own)
    memo[term] = own
    return own


def _read_from(pcg: PCG, tensors: list[int], tids: list[int]) -> list[int]:
    """Those of `tids` (in their order) made by a node reading one of `tensors`."""
    read = {u.outputs[0] for t in tensors for u in pcg.users(t) if len(u.outputs) == 1}
    return [t for t in tids if t in read]


def _final(pcg: PCG, rule: Rule, st: _State) -> dict[str, Any] | None:
    env = dict(st.params)
    for name, t in st.tensors.items():
        env[f"rank:{name}"] = pcg.tensors[t].rank
        env[f"shape:{name}"] = pcg.tensors[t].local_shape(pcg.mesh_sizes)
    if st.axes is not None:
        env["n"] = group_size(st.axes, pcg.mesh_sizes)
        if env["n"] == 1:
            return None
    if st.axes_b is not None and group_size(st.axes_b, pcg.mesh_sizes) == 1:
        return None
    if rule.two_groups and (st.axes is None or st.axes_b is None):
        return None
    try:
        for e, v in st.deferred:
            if eval_param(e, env) != v:
                return None
        if not all(c.holds(env) for c in rule.conds):
            return None
    except (KeyError, ValueError, IndexError, TypeError):
        return None
    kinds = rule.var_kinds()
    for name, t in st.tensors.items():
        if kinds.get(name) == "G":
            if st.axes is None:
                return None
            s = pcg.tensors[t].sharding
            if set(st.axes) & (s.axes() | s.partial):
                return None
    return env


def _roots(pcg: PCG, rule: Rule, i: int, st: _State, chosen: tuple[int, ...], allowed: frozenset[int] | None
           ) -> Iterator[tuple[_State, tuple[int, ...]]]:
    """Bindings of the rule's left-hand terms i, i+1, ... at distinct root tensors, extending `st`; with
    `allowed`, at least one root is in it (the last term's root when no earlier one is). (A module function,
    not a recursive closure: that would be a reference cycle keeping `pcg` alive until a cyclic collection,
    which the search pauses.)"""
    if i == len(rule.lhs):
        yield st, chosen
        return
    term = rule.lhs[i]
    if allowed is not None and i == len(rule.lhs) - 1 and not allowed.intersection(chosen):
        tids = _candidates_in(pcg, term, allowed)  # (the root must be one of `allowed`)
    else:
        tids = _candidates(pcg, term)
    bound = [st.tensors[a.name] for a in getattr(term, "args", ()) if isinstance(a, Var) and a.name in st.tensors]
    if bound:  # (a later root reading a tensor an earlier one bound: only that tensor's readers)
        tids = _read_from(pcg, bound[:1], tids)
    for tid in tids:
        if tid in chosen:
            continue
        for nxt in _match(pcg, rule.lhs[i], tid, st):
            yield from _roots(pcg, rule, i + 1, nxt, chosen + (tid,), allowed)


def term_depth(term: Term) -> int:
    """Operators on the longest path from `term`'s root to a variable."""
    return 0 if isinstance(term, Var) else 1 + max((term_depth(a) for a in term.args), default=0)


def roots_near(pcg: PCG, nodes: set[int], depth: int) -> frozenset[int]:
    """The tensors at which a left-hand term of at most `depth` operators can match a node of `nodes`: the
    results of those nodes and of their readers, and theirs, up to `depth - 1` readers on."""
    by_id = {n.id: n for n in pcg.nodes}
    frontier = [by_id[i] for i in nodes if i in by_id]
    seen = {n.id for n in frontier}
    out: set[int] = set()
    for step in range(depth):
        nxt = []
        for n in frontier:
            out.update(n.outputs)
            if step + 1 < depth:
                for t in n.outputs:
                    for u in pcg.users(t):
                        if u.id not in seen:
                            seen.add(u.id)
                            nxt.append(u)
        frontier = nxt
    return frozenset(out)


def find_matches(pcg: PCG, rule: Rule, near: frozenset[int] | None = None) -> Iterator[Match]:
    """Every occurrence of the rule's left-hand side in the PCG; with `near` (`roots_near` of some nodes, at
    least the rule's depth): those with a root in it, a superset of those matching one of the nodes."""
    seen: set[tuple] = set()
    for st, chosen in _roots(pcg, rule, 0, _State({}, {}, None, frozenset()), (), near):
        env = _final(pcg, rule, st)
        if env is None:
            continue
        key = (chosen, tuple(sorted(st.tensors.items())))
        if key in seen:
            continue
        seen.add(key)
        yield Match(rule, st.tensors, env, st.axes, chosen, st.nodes, st.axes_b)


@dataclasses.dataclass
class _RhsBuilder:
    """Adds a rule's right-hand terms to `b`, each equal subterm once. (An object, not a recursive closure:
    that would be a reference cycle keeping the builder's nodes alive until a cyclic collection, which the
    search pauses.)"""

    pcg: PCG
    m: Match
    b: GraphBuilder
    anchor: float
    cause: str
    memo: dict[Any, int] = dataclasses.field(default_factory=dict)

    def build(self, term: Term) -> int:
        m = self.m
        if isinstance(term, Var):
            return m.tensors[term.name]
        params = tuple(_value(p, m.params) for p in term.params)
        args = tuple(self.build(a) for a in term.args)
        key = (term.op, _hashable(params), args)
        if key in self.memo:
            return self.memo[key]
        spec = OPS[term.op]
        try:
            if spec.parallel:
                axes = m.group_axes(term.group, self.pcg.mesh_sizes)
                if axes is None:
                    raise RewriteError(f"{m.rule.name}: the right-hand side needs an axes group the left does not bind")
                op = build_parallel(term.op, params, axes)
                out = self.b.parallel(op, args[0], cause=self.cause, order=self.anchor)
            else:
                out = build_compute(self.b, term.op, params, args, order=self.anchor, cause=self.cause)
        except ShardingError as e:
            raise RewriteError(str(e)) from None
        self.memo[key] = out
        return out


def apply_match(pcg: PCG, m: Match, *, require_proof: bool = True) -> PCG:
    """The PCG with the match replaced by the rule's right-hand side (RewriteError if it cannot be
    built here). Refuses rules that `verify_rule` has not proved."""
    return apply_matches(pcg, [m], require_proof=require_proof)


def independent(matches: Sequence[Match]) -> bool:
    """Whether `matches` (made on one PCG) rewrite disjoint nodes and none binds a tensor another replaces: applied
    together (`apply_matches`), they make the PCG that applying them one after another does."""
    nodes: set[int] = set()
    roots: set[int] = set()
    bound: set[int] = set()
    for m in matches:
        if nodes & m.nodes or roots & set(m.tensors.values()) or bound & set(m.roots):
            return False
        nodes |= m.nodes
        roots |= set(m.roots)
        bound |= set(m.tensors.values())
    return True


def apply_matches(pcg: PCG, matches: Sequence[Match], *, require_proof: bool = True) -> PCG:
    """The PCG with each of `matches` (made on `pcg`, `independent`) replaced by its rule's right-hand side, in one
    pass over the nodes (RewriteError if one cannot be built here). Refuses rules `verify_rule` has not proved."""
    for m in matches:
        if require_proof and not is_proved(m.rule):
            raise UnprovedRuleError(f"rule {m.rule.name} is not proved; run shardc.pcg.verify_rule on it first")
    if len(matches) > 1 and not independent(matches):
        raise ValueError("apply_matches: the matches overlap; apply them one after another")
    b = GraphBuilder(pcg.mesh, pcg.tensors, pcg.consts, first_node_id=1 + max((n.id for n in pcg.nodes), default=-1))
    pos = {n.id: i for i, n in enumerate(pcg.nodes)}
    replace: dict[int, int] = {}
    for m in matches:
        rule = m.rule
        rhs = _RhsBuilder(pcg, m, b, max(pos[i] for i in m.nodes) + 0.5, f"rule {rule.name}")
        new_roots = [rhs.build(t) for t in rule.rhs]
        for old, new in zip(m.roots, new_roots):
            a, c = pcg.tensors[old], b.tensors[new]
            if (a.shape, a.dtype, a.sharding) != (c.shape, c.dtype, c.sharding):
                raise RewriteError(f"{rule.name}: %{old} {a.shape} {a.dtype} {a.sharding} would become "
                                   f"{c.shape} {c.dtype} {c.sharding}")
            replace[old] = new
    outputs = [replace.get(t, t) for t in pcg.outputs]
    spliced = splice(pcg, b.nodes, b.tensors, b.consts, replace, outputs) if is_clean(pcg) else None
    if spliced is not None:
        new, touched = spliced
    else:
        touched = None
        rerouted = {u.id for t in replace for u in pcg.users(t)}
        for i, n in enumerate(pcg.nodes):  # (the other nodes as they are, with their ids)
            if n.id in rerouted:
                n = dataclasses.replace(n, inputs=tuple(replace.get(t, t) for t in n.inputs))
            b.keep_node(n, float(i))
        try:
            new = b.finish(pcg.inputs, outputs)
        except ValueError as e:  # a cycle: the replacement feeds on what it replaces
            raise RewriteError(str(e)) from None
    if (uneven := new.uneven(since=len(pcg.tensors), nodes=touched)) is not None:  # (`pcg` is even: new tensors)
        names = "+".join(dict.fromkeys(m.rule.name for m in matches))
        raise RewriteError(f"{names}: {uneven} (a shard_map needs equal pieces)")
    return new


def _value(p: Any, env: dict[str, Any]) -> Any:
    if isinstance(p, PVar) and p.name in env:
        return env[p.name]
    return eval_param(p, env)


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


def rewrites(pcg: PCG, rule: Rule) -> Iterator[tuple[Match, PCG]]:
    """Every successful application of `rule` to `pcg`."""
    for m in find_matches(pcg, rule):
        try:
            yield m, apply_match(pcg, m)
        except RewriteError:
            continue
