"""Rules of random-number primitives.

Key arrays are tensors whose shape excludes the key data (`key<fry>[]` is rank 0). Elementwise key ops
(random_seed, random_fold_in, random_clone, threefry2x32) are in elementwise.py. Here: ops whose result
extends the keys' shape with new trailing dims (random_bits, random_split) — the key dims pass through and
the new dims are result-only pass-through factors (jax's threefry is partitionable: every device can
generate its block of bits from the key alone) — and the ops that expose or hide the key data dim.
"""
from __future__ import annotations

from .builder import RuleBuilder
from .core import FactorKind, FactorRule, rule_for

PT, NR = FactorKind.PASS_THROUGH, FactorKind.NEED_REPLICATION


def _prefix(ins, outs, trailing_kind: FactorKind) -> FactorRule | None:
    """One operand, one result; the shorter one's shape is a prefix of the longer one's. Prefix dims are
    shared pass-through; the longer tensor's extra trailing dims are its own factors of `trailing_kind`."""
    if len(ins) != 1 or len(outs) != 1:
        return None
    (a,), (r,) = ins, outs
    lead = min(len(a), len(r))
    if tuple(a[:lead]) != tuple(r[:lead]):
        return None
    b = RuleBuilder(ins, outs)
    for d in range(lead):
        b.factor(a[d], operands={0: d}, results={0: d})
    for d in range(lead, len(a)):
        b.factor(a[d], operands={0: d}, kind=trailing_kind)
    for d in range(lead, len(r)):
        b.factor(r[d], results={0: d}, kind=trailing_kind)
    return b.build()


@rule_for("random_bits", "random_split")
def random_bits_rule(ins, outs, params) -> FactorRule | None:
    """keys[K] -> bits[K + shape] / keys[K + shape]: K passes through, `shape` is result-only."""
    if len(ins) == 1 and len(outs) == 1 and len(outs[0]) < len(ins[0]):
        return None
    return _prefix(ins, outs, PT)


@rule_for("random_wrap", "random_unwrap")
def random_wrap_rule(ins, outs, params) -> FactorRule | None:
    """uint32[K + key_shape] <-> keys[K]: K passes through; the key-data dim is need-replication."""
    return _prefix(ins, outs, NR)


@rule_for("rng_bit_generator")
def rng_bit_generator_rule(ins, outs, params) -> FactorRule | None:
    """state -> (new state, bits): the state is need-replication (shared with the new state); the bits'
    dims are result-only pass-through (Shardy's rule)."""
    if len(ins) != 1 or len(outs) != 2 or tuple(ins[0]) != tuple(outs[0]):
        return None
    b = RuleBuilder(ins, outs)
    for d, n in enumerate(ins[0]):
        b.factor(n, operands={0: d}, results={0: d}, kind=NR, blocked=True)
    for d, n in enumerate(outs[1]):
        b.factor(n, results={1: d})
    return b.build()


@rule_for("rng_uniform")
def rng_uniform_rule(ins, outs, params) -> FactorRule | None:
    """(scalar a, scalar b) -> uniform[shape]: result-only factors."""
    if len(outs) != 1 or any(len(s) for s in ins):
        return None
    b = RuleBuilder(ins, outs)
    for d, n in enumerate(outs[0]):
        b.factor(n, results={0: d})
    return b.build()
