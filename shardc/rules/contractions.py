"""Rules of contractions: dot_general and conv_general_dilated."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .builder import RuleBuilder
from .core import FactorKind, FactorRule, rule_for

__all__ = ["dot_general_rule", "conv_general_dilated_rule"]


@rule_for("dot_general")
def dot_general_rule(
    ins: Sequence[tuple[int, ...]], outs: Sequence[tuple[int, ...]], params: Mapping[str, Any]
) -> FactorRule | None:
    """Batch dims: one factor shared by lhs, rhs and result. Free (non-contracting, non-batch) dims of
    lhs then rhs: pass-through to the result, absent from the other operand. Contracting dims: one
    reduction factor shared by lhs and rhs. Any dimension order is allowed (the result is always
    batch, lhs free, rhs free — that is dot_general's definition)."""
    if len(ins) != 2 or len(outs) != 1:
        return None
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
    lhs, rhs = ins
    (out,) = outs
    if len(lc) != len(rc) or len(lb) != len(rb):
        return None
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    expected = tuple(lhs[d] for d in lb) + tuple(lhs[d] for d in lfree) + tuple(rhs[d] for d in rfree)
    if tuple(out) != expected:
        return None
    if any(lhs[l] != rhs[r] for l, r in zip(lb + lc, rb + rc)):
        return None
    b = RuleBuilder(ins, outs)
    o = 0
    for l, r in zip(lb, rb):
        b.factor(lhs[l], operands={0: l, 1: r}, results={0: o})
        o += 1
    for l in lfree:
        b.factor(lhs[l], operands={0: l}, results={0: o})
        o += 1
    for r in rfree:
        b.factor(rhs[r], operands={1: r}, results={0: o})
        o += 1
    for l, r in zip(lc, rc):
        b.factor(lhs[l], operands={0: l, 1: r}, kind=FactorKind.REDUCTION)
    return b.build()


def _conv_specs(params: Mapping[str, Any], rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    dn = params.get("dimension_numbers")
    if dn is None:  # lax's default: NC..., OI..., NC...
        spec = tuple(range(rank))
        return spec, spec, spec
    lhs_spec, rhs_spec, out_spec = dn
    return (
        tuple(int(d) for d in lhs_spec),
        tuple(int(d) for d in rhs_spec),
        tuple(int(d) for d in out_spec),
    )


@rule_for("conv_general_dilated")
def conv_general_dilated_rule(
    ins: Sequence[tuple[int, ...]], outs: Sequence[tuple[int, ...]], params: Mapping[str, Any]
) -> FactorRule | None:
    """Shardy's convolution factors, with a simpler spatial treatment.

    * batch groups (batch_group_count G > 1, e.g. the weight gradient of a grouped conv): a factor of
      size G, major on the lhs batch dim, rhs output-feature dim and output feature dim;
    * per-group batch: lhs batch <-> output batch, pass-through;
    * feature groups (feature_group_count G > 1): a factor of size G, major on the lhs feature dim, rhs
      output-feature dim and output feature dim, pass-through;
    * per-group input feature: lhs feature <-> rhs input feature, reduction;
    * per-group output feature: rhs output feature <-> output feature, pass-through;
    * spatial dims: a 1-wide, stride-1, unpadded, undilated window is pointwise (pass-through lhs <->
      output). Otherwise a sharded spatial dim needs a halo exchange, so lhs and output spatial dims are
      permutation factors (one shared factor when their sizes agree, as for 'SAME' padding; separate
      ones otherwise) and the kernel's spatial dim is need-replication.
    """
    if len(ins) != 2 or len(outs) != 1:
        return None
    lhs, rhs = ins
    (out,) = outs
    if not (len(lhs) == len(rhs) == len(out)):
        return None
    lhs_spec, rhs_spec, out_spec = _conv_specs(params, len(lhs))
    fgc = int(params.get("feature_group_count", 1) or 1)
    bgc = int(params.get("batch_group_count", 1) or 1)
    if fgc > 1 and bgc > 1:
        return None
    lb, lf, lsp = lhs_spec[0], lhs_spec[1], lhs_spec[2:]
    ro, ri, rsp = rhs_spec[0], rhs_spec[1], rhs_spec[2:]
    ob, of, osp = out_spec[0], out_spec[1], out_spec[2:]
    groups = fgc * bgc
    n_batch, n_in, n_out = lhs[lb], rhs[ri], rhs[ro]
    if (
        n_batch % bgc
        or out[ob] != n_batch // bgc
        or lhs[lf] != n_in * fgc
        or out[of] != n_out
        or n_out % groups
    ):
        return None
    nsp = len(lsp)
    strides = tuple(params.get("window_strides") or (1,) * nsp)
    padding = params.get("padding") or ((0, 0),) * nsp
    if isinstance(padding, str):  # jaxprs hold explicit pairs; be lenient with the string form
        padding = ((0, 0),) * nsp if padding == "VALID" else ((-1, -1),) * nsp
    lhs_dil = tuple(params.get("lhs_dilation") or (1,) * nsp)

    b = RuleBuilder(ins, outs)
    if bgc > 1:
        b.factor(bgc, operands={0: lb, 1: ro}, results={0: of})
    b.factor(out[ob], operands={0: lb}, results={0: ob})
    for i, (ls, rs, os_) in enumerate(zip(lsp, rsp, osp)):
        pointwise = (
            rhs[rs] == 1
            and lhs[ls] == out[os_]
            and int(strides[i]) == 1
            and tuple(int(p) for p in padding[i]) == (0, 0)
            and int(lhs_dil[i]) == 1
        )
        if pointwise:
            b.factor(lhs[ls], operands={0: ls}, results={0: os_})
            continue
        if lhs[ls] == out[os_]:
            b.factor(lhs[ls], operands={0: ls}, results={0: os_}, kind=FactorKind.PERMUTATION)
        else:
            b.factor(lhs[ls], operands={0: ls}, kind=FactorKind.PERMUTATION)
            b.factor(out[os_], results={0: os_}, kind=FactorKind.PERMUTATION)
        b.factor(rhs[rs], operands={1: rs}, kind=FactorKind.NEED_REPLICATION)
    if fgc > 1:
        b.factor(fgc, operands={0: lf, 1: ro}, results={0: of})
    b.factor(n_in, operands={0: lf, 1: ri}, kind=FactorKind.REDUCTION)
    b.factor(n_out // groups, operands={1: ro}, results={0: of})
    return b.build()
