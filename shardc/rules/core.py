"""Factor rules (Shardy's OpShardingRule): how an op's dims relate, in one registry for every pass.

Every operand and result dim maps to a tuple of *factors* (major to minor). A factor shared by an operand
dim and a result dim can stay sharded through the op with no communication; a *reduction* factor appears
only in operands (a contracting dim) and leaves the result as a partial sum; a *need-replication* factor
must be unsharded (the sorted dim of `sort`); a *permutation* factor moves data between positions
(slice, pad, concatenate dims) and is not propagated through.

Rules are built from einsum-like strings: `"bsd,df->bsf"`, and `"(ij)k->i(jk)"` for reshapes.
"""
from __future__ import annotations

import functools

import dataclasses
import enum
import re
import threading
import warnings
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "FactorKind",
    "FactorRule",
    "HIGHER_ORDER_PRIMITIVES",
    "SELF_COMBINED",
    "NoShardingRuleWarning",
    "conservative_rule",
    "rule_or_conservative",
    "RuleFn",
    "einsum_rule",
    "register_rule",
    "get_rule",
    "has_rule",
    "registered_primitives",
    "rule_for",
]


class FactorKind(enum.Enum):
    PASS_THROUGH = "pass_through"
    REDUCTION = "reduction"
    NEED_REPLICATION = "need_replication"
    PERMUTATION = "permutation"


# Reductions the op finishes by itself where its reduced dim is sharded: XLA's partitioner reduces each
# shard, all-gathers the per-shard candidates (argmax: each shard's largest value and its global index) and
# reduces those; the result holds no partial values (`OpStrategy.partial_axes`), and the all-gathers are
# the op's own collectives (`shardc.cost.op_collectives`).
SELF_COMBINED = frozenset({"argmax", "argmin"})

DimFactors = tuple[int, ...]  # factor ids of one dim, major to minor
TensorFactors = tuple[DimFactors, ...]  # one entry per dim


@dataclasses.dataclass(frozen=True, slots=True)
class FactorRule:
    """The factor mapping of one op instance (shapes are known, so factor sizes are concrete).

    operands/results: per tensor, per dim, the factor ids of that dim (a size-1 dim may have none).
    sizes: size of each factor. kinds: kind of each factor.
    blocked: factors along which propagation must not move shardings (they may still be sharded by a
    hint on every tensor that has them).
    reduce_op: for reduction factors, the combiner ("sum", "max", "min", "prod", "and", "or", "xor"), or
    one the op applies itself (`SELF_COMBINED`: argmax, argmin), which leaves no partial result.

    A factor that appears only in results is computed locally on every device (broadcast's new dims,
    iota); one that appears only in operands is a reduction, or needs replication when the op cannot be
    finished by a reduction (a reshape dim that does not line up).
    """

    operands: tuple[TensorFactors, ...]
    results: tuple[TensorFactors, ...]
    sizes: tuple[int, ...]
    kinds: tuple[FactorKind, ...]
    blocked: frozenset[int] = frozenset()
    reduce_op: str = "sum"

    @property
    def num_factors(self) -> int:
        return len(self.sizes)

    def tensors(self) -> tuple[TensorFactors, ...]:
        """Operands then results."""
        return self.operands + self.results

    def is_reduction(self, f: int) -> bool:
        return self.kinds[f] is FactorKind.REDUCTION

    @property
    def components(self) -> tuple[int, ...]:
        """Per factor, its group: factors linked through the tensors they occur in. An op's factors form one
        iteration space, so a mesh axis may shard only one factor of it — except that the operand/result
        pairs of an op like optimization_barrier are separate spaces (one group each)."""
        return _components(self)

    def propagatable(self, f: int) -> bool:
        return (
            self.kinds[f] in (FactorKind.PASS_THROUGH, FactorKind.REDUCTION)
            and f not in self.blocked
        )

    def factor_dims(self, f: int) -> tuple[tuple[int, int, int], ...]:
        """Where factor f occurs: (tensor index in operands+results, dim, position within the dim)."""
        return tuple(
            (t, d, tuple(dims).index(f))
            for t, tensor in enumerate(self.tensors())
            for d, dims in enumerate(tensor)
            if f in dims
        )

    def __str__(self) -> str:
        """Shardy-like notation: `([i, k], [k, j])->([i, j]) {i=8, j=16, k=8} reduction={k}`."""

        def name(f: int) -> str:
            letters = "ijklmnopqrstuvwxyzabcdefgh"
            return letters[f] if f < len(letters) else f"f{f}"

        def tensor(dims: TensorFactors) -> str:
            return "[" + ", ".join("".join(name(f) for f in d) or "1" for d in dims) + "]"

        text = (
            "(" + ", ".join(tensor(t) for t in self.operands) + ")->("
            + ", ".join(tensor(t) for t in self.results) + ")"
        )
        text += " {" + ", ".join(f"{name(f)}={n}" for f, n in enumerate(self.sizes)) + "}"
        for kind in (FactorKind.REDUCTION, FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION):
            fs = [name(f) for f, k in enumerate(self.kinds) if k is kind]
            if fs:
                text += f" {kind.value}={{{', '.join(fs)}}}"
        if self.blocked:
            text += " blocked={" + ", ".join(name(f) for f in sorted(self.blocked)) + "}"
        if FactorKind.REDUCTION in self.kinds and self.reduce_op != "sum":
            text += f" reduce_op={self.reduce_op}"
        return text

    def validate(self, operand_shapes: Sequence[Sequence[int]], result_shapes: Sequence[Sequence[int]]) -> None:
        """Check the rule against the op's shapes (an AssertionError means a rule bug).

        Every dim's factors multiply to the dim size; factor ids are in range and appear at most once per
        tensor; sizes, kinds and blocked agree.
        """
        n = len(self.sizes)
        if len(self.kinds) != n:
            raise AssertionError(f"rule has {n} factor sizes but {len(self.kinds)} kinds")
        if any(s < 0 for s in self.sizes):
            raise AssertionError(f"negative factor size in {self.sizes}")
        if not all(0 <= f < n for f in self.blocked):
            raise AssertionError(f"blocked factors {sorted(self.blocked)} out of range")
        for tensor in self.tensors():
            seen = [f for dims in tensor for f in dims]
            if not all(0 <= f < n for f in seen):
                raise AssertionError(f"factor id out of range in {tensor}")
            if len(seen) != len(set(seen)):
                raise AssertionError(f"a factor appears twice in one tensor: {tensor}")
        for kind, tensors, shapes in (("operand", self.operands, operand_shapes), ("result", self.results, result_shapes)):
            if len(tensors) != len(shapes):
                raise AssertionError(f"rule has {len(tensors)} {kind}s, op has {len(shapes)}")
            for t, (dims, shape) in enumerate(zip(tensors, shapes)):
                if len(dims) != len(shape):
                    raise AssertionError(f"{kind} {t}: rule has {len(dims)} dims, shape {tuple(shape)}")
                for d, (factors, size) in enumerate(zip(dims, shape)):
                    prod = 1
                    for f in factors:
                        prod *= self.sizes[f]
                    if prod != size:
                        raise AssertionError(
                            f"{kind} {t} dim {d}: factors {factors} have product {prod}, dim size {size}"
                        )


_TOKEN = re.compile(r"\(([a-zA-Z]+)\)|([a-zA-Z])|(1)")


def _parse_tensor(spec: str) -> list[list[str]]:
    """'b(hd)1' -> [['b'], ['h','d'], []]  ('1' is a size-1 dim with no factor)."""
    dims: list[list[str]] = []
    pos = 0
    spec = spec.replace(" ", "")
    while pos < len(spec):
        m = _TOKEN.match(spec, pos)
        if not m:
            raise ValueError(f"bad factor spec {spec!r} at {spec[pos:]!r}")
        if m.group(1):
            dims.append(list(m.group(1)))
        elif m.group(2):
            dims.append([m.group(2)])
        else:
            dims.append([])
        pos = m.end()
    return dims


def einsum_rule(
    spec: str,
    operand_shapes: Sequence[Sequence[int]],
    result_shapes: Sequence[Sequence[int]],
    *,
    kinds: Mapping[str, FactorKind] | None = None,
    sizes: Mapping[str, int] | None = None,
    blocked: str = "",
    reduce_op: str = "sum",
) -> FactorRule:
    """Build a FactorRule from an einsum-like string.

    `"bsd,df->bsf"`: letters are factors; a letter in operands but in no result is a reduction factor
    (unless `kinds` says otherwise). `"(ij)k->i(jk)"`: a parenthesised group is one dim made of several
    factors, major first; sizes of all but one factor of a group must come from `sizes` or from another
    dim where the factor stands alone. `1` is a size-1 dim with no factor. An empty tensor spec (``""``)
    is a scalar.
    """
    if "->" not in spec:
        raise ValueError(f"factor spec {spec!r} has no '->'")
    lhs, rhs = spec.split("->")
    in_specs = [_parse_tensor(s) for s in lhs.split(",")] if lhs.strip() or operand_shapes else []
    out_specs = [_parse_tensor(s) for s in rhs.split(",")] if rhs.strip() or result_shapes else []
    if len(in_specs) != len(operand_shapes) or len(out_specs) != len(result_shapes):
        raise ValueError(
            f"factor spec {spec!r} has {len(in_specs)} operands/{len(out_specs)} results, "
            f"op has {len(operand_shapes)}/{len(result_shapes)}"
        )
    order: list[str] = []
    known: dict[str, int] = dict(sizes or {})
    groups: list[tuple[list[str], int]] = []
    for specs, shapes in ((in_specs, operand_shapes), (out_specs, result_shapes)):
        for tensor_spec, shape in zip(specs, shapes):
            if len(tensor_spec) != len(shape):
                raise ValueError(f"factor spec {spec!r}: {''.join(map(str, tensor_spec))} vs shape {tuple(shape)}")
            for letters, size in zip(tensor_spec, shape):
                for letter in letters:
                    if letter not in order:
                        order.append(letter)
                if len(letters) == 1:
                    known.setdefault(letters[0], size)
                groups.append((letters, size))
    # Infer group members' sizes: a group with exactly one unknown factor determines it.
    changed = True
    while changed:
        changed = False
        for letters, size in groups:
            unknown = [x for x in letters if x not in known]
            if len(unknown) == 1:
                prod = 1
                for x in letters:
                    if x in known:
                        prod *= known[x]
                if prod == 0 or size % prod:
                    raise ValueError(f"factor spec {spec!r}: cannot size {unknown[0]} in dim of size {size}")
                known[unknown[0]] = size // prod
                changed = True
    missing = [x for x in order if x not in known]
    if missing:
        raise ValueError(f"factor spec {spec!r}: sizes of {missing} are not determined")
    index = {x: i for i, x in enumerate(order)}
    result_letters = {x for s in out_specs for d in s for x in d}
    kind_list = []
    for x in order:
        if kinds and x in kinds:
            kind_list.append(kinds[x])
        elif x in result_letters:
            kind_list.append(FactorKind.PASS_THROUGH)
        else:
            kind_list.append(FactorKind.REDUCTION)

    def tensors(specs: list[list[list[str]]]) -> tuple[TensorFactors, ...]:
        return tuple(tuple(tuple(index[x] for x in d) for d in s) for s in specs)

    rule = FactorRule(
        operands=tensors(in_specs),
        results=tensors(out_specs),
        sizes=tuple(known[x] for x in order),
        kinds=tuple(kind_list),
        blocked=frozenset(index[x] for x in blocked if x in index),
        reduce_op=reduce_op,
    )
    rule.validate(operand_shapes, result_shapes)
    return rule


# A rule function gets the op's operand shapes, result shapes and primitive params; returns a FactorRule,
# or None when it cannot describe this instance (then the conservative rule applies, with a warning).
RuleFn = Callable[[Sequence[tuple[int, ...]], Sequence[tuple[int, ...]], Mapping[str, Any]], "FactorRule | None"]

_REGISTRY: dict[str, RuleFn] = {}


def _name(primitive: Any) -> str:
    return primitive if isinstance(primitive, str) else primitive.name


def register_rule(primitive: Any, rule: RuleFn | str, **einsum_kwargs: Any) -> None:
    """Register the factor rule of a primitive (a jax Primitive or its name).

    `rule` is either a function (operand_shapes, result_shapes, params) -> FactorRule, or an einsum-like
    string such as `"ij,jk->ik"` used for every instance of the primitive.
    """
    if isinstance(rule, str):
        spec = rule
        if "->" not in spec:
            raise ValueError(f"factor spec {spec!r} has no '->'")
        for side in spec.split("->"):
            for tensor_spec in side.split(","):
                _parse_tensor(tensor_spec)  # fail at registration, not at the first use

        def from_string(ins, outs, params, _spec=spec):
            return einsum_rule(_spec, ins, outs, **einsum_kwargs)

        _REGISTRY[_name(primitive)] = from_string
    else:
        _REGISTRY[_name(primitive)] = rule


def rule_for(*primitives: Any) -> Callable[[RuleFn], RuleFn]:
    """Decorator form of register_rule for one or more primitives."""

    def deco(fn: RuleFn) -> RuleFn:
        for p in primitives:
            register_rule(p, fn)
        return fn

    return deco


def has_rule(primitive: Any) -> bool:
    return _name(primitive) in _REGISTRY


def get_rule(primitive: Any) -> RuleFn | None:
    return _REGISTRY.get(_name(primitive))


def registered_primitives() -> list[str]:
    return sorted(_REGISTRY)


# Primitives that carry sub-jaxprs: the graph builder inlines them or turns them into regions with
# data-flow edges, so they have no factor rule (`rule_or_conservative` must not be asked about them).
HIGHER_ORDER_PRIMITIVES = frozenset({
    "pjit", "jit", "closed_call", "core_call", "call",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin",
    "remat", "remat2", "checkpoint",
    "scan", "while", "cond",
    "shard_map", "custom_partitioning", "custom_linear_solve", "linear_call", "run_state",
})


class NoShardingRuleWarning(UserWarning):
    """An op is replicated because shardc has no sharding rule for it (issued once per primitive)."""


def conservative_rule(operand_shapes: Sequence[Sequence[int]], result_shapes: Sequence[Sequence[int]]) -> FactorRule:
    """The rule of an op shardc knows nothing about: every dim of every tensor is its own
    need-replication factor, so nothing stays sharded through the op and nothing propagates across it."""
    sizes: list[int] = []

    def tensor(shape: Sequence[int]) -> TensorFactors:
        dims = []
        for size in shape:
            dims.append((len(sizes),))
            sizes.append(int(size))
        return tuple(dims)

    operands = tuple(tensor(s) for s in operand_shapes)
    results = tuple(tensor(s) for s in result_shapes)
    return FactorRule(
        operands=operands,
        results=results,
        sizes=tuple(sizes),
        kinds=(FactorKind.NEED_REPLICATION,) * len(sizes),
    )


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def _warn_once(name: str, detail: str = "") -> None:
    with _WARNED_LOCK:
        if name in _WARNED:
            return
        _WARNED.add(name)
    message = f"shardc has no sharding rule for primitive {name!r}; its operands and results are replicated"
    if detail:
        message += f" ({detail})"
    warnings.warn(message, NoShardingRuleWarning, stacklevel=3)


def rule_or_conservative(
    primitive: Any,
    operand_shapes: Sequence[Sequence[int]],
    result_shapes: Sequence[Sequence[int]],
    params: Mapping[str, Any] | None = None,
) -> tuple[FactorRule, bool]:
    """The factor rule of one op instance, and whether it is the conservative fallback.

    Falls back to `conservative_rule` (with one `NoShardingRuleWarning` per primitive name per process)
    when the primitive has no registered rule, when its rule returns None for this instance, or when the
    rule fails (raises, or returns a rule that does not fit the shapes — a rule bug, named in the warning).
    """
    name = _name(primitive)
    ins = [tuple(int(d) for d in s) for s in operand_shapes]
    outs = [tuple(int(d) for d in s) for s in result_shapes]
    fn = _REGISTRY.get(name)
    if fn is None:
        _warn_once(name)
        return conservative_rule(ins, outs), True
    try:
        rule = fn(ins, outs, dict(params or {}))
        if rule is not None:
            rule.validate(ins, outs)
    except Exception as e:  # a rule bug must not stop compilation; it is reported, once
        _warn_once(name, f"its rule failed on operands {ins}, results {outs}: {type(e).__name__}: {e}")
        return conservative_rule(ins, outs), True
    if rule is None:
        _warn_once(name, f"its rule does not cover operands {ins}, results {outs}")
        return conservative_rule(ins, outs), True
    return rule, False


@functools.lru_cache(maxsize=1 << 14)
def _components(rule: FactorRule) -> tuple[int, ...]:
    parent = list(range(rule.num_factors))

    def find(f: int) -> int:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    for tensor in rule.operands + rule.results:
        fs = [f for dim in tensor for f in dim]
        for f in fs[1:]:
            parent[find(f)] = find(fs[0])
    if not _pairwise(rule):
        # one iteration space even where no tensor links two factors (a scatter's operand dims and its
        # updates' batch dims; the two sides of einsum 'a,b->a'): one axis on both would leave each
        # device a tile of one and a shard of the other that do not meet (XLA regroups the devices and
        # permutes the result back)
        for f in range(1, rule.num_factors):
            parent[find(f)] = find(0)
    return tuple(find(f) for f in range(rule.num_factors))


def _pairwise(rule: FactorRule) -> bool:
    """Whether operand i and result i have the same factors for every i (optimization_barrier, hints):
    the pairs are separate iteration spaces."""
    if len(rule.operands) != len(rule.results):
        return False
    return all(tuple(a) == tuple(r) for a, r in zip(rule.operands, rule.results))
