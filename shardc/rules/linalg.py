"""Rules of fft and batched linear-algebra primitives: leading batch dims pass through, the transformed
(matrix / fft) dims are need-replication."""
from __future__ import annotations

from .builder import RuleBuilder
from .core import FactorKind, FactorRule, register_rule, rule_for

__all__ = ["LINALG_CORE_RANK", "batched_core_rule"]

NR = FactorKind.NEED_REPLICATION


@rule_for("fft")
def fft_rule(ins, outs, params) -> FactorRule | None:
    """The last len(fft_lengths) dims are transformed: need-replication (one shared factor when operand
    and result sizes agree, else one per side, as for the last dim of rfft/irfft). Leading dims pass."""
    if len(ins) != 1 or len(outs) != 1:
        return None
    (a,), (r,) = ins, outs
    k = len(params["fft_lengths"])
    if len(a) != len(r) or k > len(a):
        return None
    lead = len(a) - k
    if a[:lead] != r[:lead]:
        return None
    b = RuleBuilder(ins, outs)
    for d in range(lead):
        b.factor(a[d], operands={0: d}, results={0: d})
    for d in range(lead, len(a)):
        if a[d] == r[d]:
            b.factor(a[d], operands={0: d}, results={0: d}, kind=NR)
        else:
            b.factor(a[d], operands={0: d}, kind=NR)
            b.factor(r[d], results={0: d}, kind=NR)
    return b.build()


# primitive -> rank of the per-matrix core of its first operand (the rest of its dims are batch dims)
LINALG_CORE_RANK = {
    "cholesky": 2,
    "cholesky_update": 2,
    "triangular_solve": 2,
    "lu": 2,
    "lu_pivots_to_permutation": 1,
    "qr": 2,
    "geqrf": 2,
    "geqp3": 2,
    "householder_product": 2,
    "eigh": 2,
    "eig": 2,
    "svd": 2,
    "schur": 2,
    "hessenberg": 2,
    "tridiagonal": 2,
    "tridiagonal_solve": 1,
    "symmetric_product": 2,
}


def batched_core_rule(core_rank: int):
    """Every tensor starts with the first operand's batch dims (shared pass-through factors); every other
    dim of every tensor is its own need-replication factor (a matrix factorisation needs whole matrices).
    Scalars (e.g. symmetric_product's alpha/beta) get no factors."""

    def rule(ins, outs, params) -> FactorRule | None:
        if not ins:
            return None
        nb = len(ins[0]) - core_rank
        if nb < 0:
            return None
        batch = tuple(ins[0][:nb])
        tensors = [s for s in list(ins) + list(outs) if len(s)]
        if any(len(s) < nb or tuple(s[:nb]) != batch for s in tensors):
            return None
        b = RuleBuilder(ins, outs)
        for d in range(nb):
            b.factor(
                batch[d],
                operands={t: d for t, s in enumerate(ins) if len(s)},
                results={t: d for t, s in enumerate(outs) if len(s)},
            )
        for t, s in enumerate(ins):
            for d in range(nb if len(s) else 0, len(s)):
                b.factor(s[d], operands={t: d}, kind=NR)
        for t, s in enumerate(outs):
            for d in range(nb if len(s) else 0, len(s)):
                b.factor(s[d], results={t: d}, kind=NR)
        return b.build()

    return rule


for _prim, _rank in LINALG_CORE_RANK.items():
    register_rule(_prim, batched_core_rule(_rank))
