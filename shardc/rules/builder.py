"""RuleBuilder: build a FactorRule factor by factor (Shardy's OpShardingRuleBuilder, in Python).

Einsum strings (`core.einsum_rule`) are the short form for fixed-rank ops; rules whose rank or structure
depends on params (elementwise ops of any rank, reshape, gather) add factors one at a time:

    b = RuleBuilder(ins, outs)
    b.factor(8, operands={0: 1, 1: 0}, kind=FactorKind.REDUCTION)   # lhs dim 1, rhs dim 0
    b.factor(4, operands={0: 0}, results={0: 0})                     # lhs dim 0 -> result dim 0
    rule = b.build()

Factors added to the same dim are ordered major to minor in the order they are added. A factor of size 1
is dropped (a size-1 dim has no factor), so callers need not special-case unit dims.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .core import FactorKind, FactorRule

__all__ = ["RuleBuilder", "pointwise_rule", "pairwise_identity_rule"]

Shape = tuple[int, ...]


class RuleBuilder:
    def __init__(self, operand_shapes: Sequence[Sequence[int]], result_shapes: Sequence[Sequence[int]]):
        self.operand_shapes: tuple[Shape, ...] = tuple(tuple(int(d) for d in s) for s in operand_shapes)
        self.result_shapes: tuple[Shape, ...] = tuple(tuple(int(d) for d in s) for s in result_shapes)
        self._operands = [[[] for _ in s] for s in self.operand_shapes]
        self._results = [[[] for _ in s] for s in self.result_shapes]
        self._sizes: list[int] = []
        self._kinds: list[FactorKind] = []
        self._blocked: set[int] = set()

    def factor(
        self,
        size: int,
        operands: Mapping[int, int] | None = None,
        results: Mapping[int, int] | None = None,
        kind: FactorKind = FactorKind.PASS_THROUGH,
        *,
        blocked: bool = False,
        keep_unit: bool = False,
    ) -> int | None:
        """Add a factor of `size` to the given dims ({tensor index: dim}); returns its id.

        A size-1 factor is not added (returns None) unless keep_unit.
        """
        size = int(size)
        if size == 1 and not keep_unit:
            return None
        f = len(self._sizes)
        self._sizes.append(size)
        self._kinds.append(kind)
        if blocked:
            self._blocked.add(f)
        for t, d in (operands or {}).items():
            self._operands[t][d].append(f)
        for t, d in (results or {}).items():
            self._results[t][d].append(f)
        return f

    def build(self, reduce_op: str = "sum") -> FactorRule:
        rule = FactorRule(
            operands=tuple(tuple(tuple(d) for d in t) for t in self._operands),
            results=tuple(tuple(tuple(d) for d in t) for t in self._results),
            sizes=tuple(self._sizes),
            kinds=tuple(self._kinds),
            blocked=frozenset(self._blocked),
            reduce_op=reduce_op,
        )
        rule.validate(self.operand_shapes, self.result_shapes)
        return rule


def pointwise_rule(
    operand_shapes: Sequence[Sequence[int]],
    result_shapes: Sequence[Sequence[int]],
    kind_of_dim: Mapping[int, FactorKind] | None = None,
    blocked_dims: frozenset[int] = frozenset(),
) -> FactorRule | None:
    """Elementwise rule, n operands to m results of one shape.

    Each result dim is one factor shared by every result and by every operand whose dim has the same
    size. An operand of rank 0 (a scalar broadcast) has no factors; an operand dim of size 1 where the
    result's is larger (jax's size-1 broadcasting in elementwise ops) has none either. Returns None for
    any other shape mismatch. `kind_of_dim` overrides the kind of some dims' factors (default
    pass-through), `blocked_dims` blocks them.
    """
    if not result_shapes:
        return None
    shape = tuple(result_shapes[0])
    if any(tuple(s) != shape for s in result_shapes):
        return None
    for s in operand_shapes:
        if len(s) not in (0, len(shape)):
            return None
    b = RuleBuilder(operand_shapes, result_shapes)
    for d, n in enumerate(shape):
        ops: dict[int, int] = {}
        for t, s in enumerate(b.operand_shapes):
            if not s:
                continue
            if s[d] == n:
                ops[t] = d
            elif s[d] != 1:
                return None
        b.factor(
            n,
            operands=ops,
            results={t: d for t in range(len(result_shapes))},
            kind=(kind_of_dim or {}).get(d, FactorKind.PASS_THROUGH),
            blocked=d in blocked_dims,
        )
    return b.build()


def pairwise_identity_rule(
    operand_shapes: Sequence[Sequence[int]], result_shapes: Sequence[Sequence[int]]
) -> FactorRule | None:
    """Operand i is result i (optimization_barrier, device_put, sharding constraints, hints):
    every dim of each pair is one pass-through factor; different pairs share nothing."""
    if len(operand_shapes) != len(result_shapes):
        return None
    if any(tuple(a) != tuple(r) for a, r in zip(operand_shapes, result_shapes)):
        return None
    b = RuleBuilder(operand_shapes, result_shapes)
    for t, shape in enumerate(b.operand_shapes):
        for d, n in enumerate(shape):
            b.factor(n, operands={t: d}, results={t: d})
    return b.build()
