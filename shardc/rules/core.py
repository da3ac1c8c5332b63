"""Factor rules (Shardy's OpShardingRule): how an op's dims relate, in one registry for every pass.

Every operand and result dim maps to a tuple of *factors* (major to minor). A factor shared by an operand
dim and a result dim can stay sharded through the op with no communication; a *reduction* factor appears
only in operands (a contracting dim) and leaves the result as a partial sum; a *need-replication* factor
must be unsharded (the sorted dim of `sort`); a *permutation* factor moves data between positions
(slice, pad, concatenate dims) and is not propagated through.

Rules are built from einsum-like strings: `"bsd,df->bsf"`, and `"(ij)k->i(jk)"` for reshapes.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "FactorKind",
    "FactorRule",
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


DimFactors = tuple[int, ...]  # factor ids of one dim, major to minor
TensorFactors = tuple[DimFactors, ...]  # one entry per dim


@dataclasses.dataclass(frozen=True, slots=True)
class FactorRule:
    """The factor mapping of one op instance (shapes are known, so factor sizes are concrete).

    operands/results: per tensor, per dim, the factor ids of that dim (a size-1 dim may have none).
    sizes: size of each factor. kinds: kind of each factor.
    blocked: factors along which propagation must not move shardings (they may still be sharded by a
    hint on every tensor that has them).
    reduce_op: for reduction factors, the combiner ("sum", "max", "min", "prod", "and", "or").
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

    def propagatable(self, f: int) -> bool:
        return (
            self.kinds[f] in (FactorKind.PASS_THROUGH, FactorKind.REDUCTION)
            and f not in self.blocked
        )

    def validate(self, operand_shapes: Sequence[Sequence[int]], result_shapes: Sequence[Sequence[int]]) -> None:
        """Check that every dim's factors multiply to the dim size (a rule bug otherwise)."""
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
