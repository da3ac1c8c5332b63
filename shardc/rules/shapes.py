"""Rules of shape and layout primitives: broadcast_in_dim, reshape, squeeze, transpose, tile, concatenate,
split, stack, unstack, slice, pad, rev, iota."""
from __future__ import annotations

import math
from typing import Sequence

from .builder import RuleBuilder
from .core import FactorKind, FactorRule, conservative_rule, rule_for

__all__ = ["reshape_rule", "reshape_factors"]

PT, NR, PERM = FactorKind.PASS_THROUGH, FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION


@rule_for("broadcast_in_dim")
def broadcast_in_dim_rule(ins, outs, params) -> FactorRule | None:
    """Operand dim d -> result dim broadcast_dimensions[d]: shared factor when the sizes agree; an
    expanded dim (1 -> n) and every new dim get a result-only factor (each device fills its own part)."""
    if len(ins) != 1 or len(outs) != 1:  # extra operands only with dynamic shapes
        return None
    (a,), (r,) = ins, outs
    bdims = tuple(int(d) for d in params["broadcast_dimensions"])
    if len(bdims) != len(a):
        return None
    source = {od: i for i, od in enumerate(bdims)}
    b = RuleBuilder(ins, outs)
    for od, n in enumerate(r):
        i = source.get(od)
        if i is not None and a[i] == n:
            b.factor(n, operands={0: i}, results={0: od})
        elif i is None or a[i] == 1:
            b.factor(n, results={0: od})
        else:
            return None
    return b.build()


def reshape_factors(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[int, int | None, int | None]]:
    """Shardy's reshape factorisation: a list of (size, operand dim or None, result dim or None), in order
    (so factors of one dim come major first).

    Walk both shapes left to right accumulating products. While the products agree, the next factor is
    the gcd of the remaining sizes of the current in/out dims and is shared; when the gcd is 1 the walk
    has diverged and emits unshared factors for whichever side is behind until the products meet again.
    Size-1 dims get no factor. `(2,4,32)->(8,32)` gives 2,4 shared into result dim 0 and 32 shared;
    `(8,4)->(2,16)` gives i=2 (in0, out0), j=4 (in0, out1), k=4 (in1, out1).
    """
    a = [int(d) for d in in_shape]
    r = [int(d) for d in out_shape]
    if math.prod(a) != math.prod(r):
        raise ValueError(f"reshape {tuple(a)} -> {tuple(r)} changes the element count")
    out: list[tuple[int, int | None, int | None]] = []
    i = o = 0
    dims_in = dims_out = 1  # product of the dims entered so far
    fac_in = fac_out = 1  # product of the factors emitted so far
    steps = 0
    while i < len(a) or o < len(r):
        steps += 1
        if steps > 4 * (len(a) + len(r)) + 64:
            raise AssertionError(f"reshape factorisation of {tuple(a)} -> {tuple(r)} does not terminate")
        if i < len(a) and a[i] == 1 and dims_in == fac_in:
            i += 1
            continue
        if o < len(r) and r[o] == 1 and dims_out == fac_out:
            o += 1
            continue
        if i < len(a) and dims_in == fac_in:
            dims_in *= a[i]
        if o < len(r) and dims_out == fac_out:
            dims_out *= r[o]
        next_in = dims_in // fac_in
        next_out = dims_out // fac_out
        g = math.gcd(next_in, next_out)

        def diverged(nxt: int, smaller: int, larger: int) -> int:
            if larger % smaller == 0 and nxt % (larger // smaller) == 0:
                return larger // smaller  # this factor makes the products meet again
            if nxt > g:
                return nxt // g  # keep the gcd available for the next step
            return nxt

        if fac_in == fac_out:
            if g > 1:
                out.append((g, i, o))
                fac_in *= g
                fac_out *= g
            else:
                out.append((next_in, i, None))
                fac_in *= next_in
                out.append((next_out, None, o))
                fac_out *= next_out
        elif fac_in < fac_out:
            f = diverged(next_in, fac_in, fac_out)
            out.append((f, i, None))
            fac_in *= f
        else:
            f = diverged(next_out, fac_out, fac_in)
            out.append((f, None, o))
            fac_out *= f
        if i < len(a) and dims_in == fac_in:
            i += 1
        if o < len(r) and dims_out == fac_out:
            o += 1
    return out


def _reshape_like(ins, outs) -> FactorRule | None:
    if len(ins) != 1 or len(outs) != 1:
        return None
    (a,), (r,) = ins, outs
    if math.prod(a) != math.prod(r):
        return None
    if math.prod(a) == 0:
        # Nothing to keep in place; Shardy gives no rule either.
        return conservative_rule(ins, outs)
    b = RuleBuilder(ins, outs)
    for size, i, o in reshape_factors(a, r):
        shared = i is not None and o is not None
        b.factor(
            size,
            operands={0: i} if i is not None else None,
            results={0: o} if o is not None else None,
            # a factor on one side only does not line up with anything on the other: the data has to move
            kind=PT if shared else NR,
        )
    return b.build()


@rule_for("reshape")
def reshape_rule(ins, outs, params) -> FactorRule | None:
    """GCD factorisation (see reshape_factors). Shared factors are pass-through; factors on one side only
    are need-replication (sharding them would need an all-to-all). `dimensions` (a transpose fused into
    the reshape) must be None."""
    if params.get("dimensions") is not None:
        return None
    return _reshape_like(ins, outs)


@rule_for("squeeze")
def squeeze_rule(ins, outs, params) -> FactorRule | None:
    """Removes size-1 dims: the reshape factorisation pairs the remaining dims one to one."""
    return _reshape_like(ins, outs)


@rule_for("transpose")
def transpose_rule(ins, outs, params) -> FactorRule | None:
    """Result dim i is operand dim permutation[i]."""
    if len(ins) != 1 or len(outs) != 1:
        return None
    perm = tuple(int(d) for d in params["permutation"])
    (a,), (r,) = ins, outs
    if sorted(perm) != list(range(len(a))) or tuple(a[p] for p in perm) != tuple(r):
        return None
    b = RuleBuilder(ins, outs)
    for o, p in enumerate(perm):
        b.factor(a[p], operands={0: p}, results={0: o})
    return b.build()


@rule_for("tile")
def tile_rule(ins, outs, params) -> FactorRule | None:
    """Result dim = (reps, operand dim), reps major: the repetition factor is result-only (each device
    writes its copies), the operand's factor is shared."""
    (a,), (r,) = ins, outs
    reps = tuple(int(x) for x in params["reps"])
    if len(reps) != len(a) or tuple(n * k for n, k in zip(a, reps)) != tuple(r):
        return None
    b = RuleBuilder(ins, outs)
    for d, (n, k) in enumerate(zip(a, reps)):
        b.factor(k, results={0: d})
        b.factor(n, operands={0: d}, results={0: d})
    return b.build()


def _along_axis(ins, outs, axis: int, kind: FactorKind) -> FactorRule | None:
    """All tensors have the same rank and agree off `axis`: those dims are one shared pass-through factor
    each; along `axis` every tensor gets its own factor of `kind`."""
    tensors = list(ins) + list(outs)
    rank = len(tensors[0])
    if any(len(t) != rank for t in tensors) or not 0 <= axis < rank:
        return None
    b = RuleBuilder(ins, outs)
    for d in range(rank):
        if d == axis:
            continue
        if len({t[d] for t in tensors}) != 1:
            return None
        b.factor(
            tensors[0][d],
            operands={t: d for t in range(len(ins))},
            results={t: d for t in range(len(outs))},
        )
    for t in range(len(ins)):
        b.factor(ins[t][axis], operands={t: axis}, kind=kind)
    for t in range(len(outs)):
        b.factor(outs[t][axis], results={t: axis}, kind=kind)
    return b.build()


@rule_for("concatenate")
def concatenate_rule(ins, outs, params) -> FactorRule | None:
    """Non-concat dims shared pass-through; the concat dim of each operand and of the result is its own
    permutation factor (a sharded concat dim means moving pieces between devices)."""
    if len(outs) != 1 or not ins:
        return None
    return _along_axis(ins, outs, int(params["dimension"]), PERM)


@rule_for("split")
def split_rule(ins, outs, params) -> FactorRule | None:
    """Inverse of concatenate: the split axis is a permutation factor per tensor."""
    if len(ins) != 1:
        return None
    return _along_axis(ins, outs, int(params["axis"]), PERM)


@rule_for("stack")
def stack_rule(ins, outs, params) -> FactorRule | None:
    """Operands of one shape stacked along a new result dim: other dims shared, the new dim a
    result-only permutation factor (it selects which operand)."""
    if len(outs) != 1 or not ins:
        return None
    axis = int(params["axis"])
    (r,) = outs
    rest = tuple(r[:axis]) + tuple(r[axis + 1:])
    if any(tuple(a) != rest for a in ins) or r[axis] != len(ins):
        return None
    b = RuleBuilder(ins, outs)
    for d in range(len(rest)):
        od = d if d < axis else d + 1
        b.factor(rest[d], operands={t: d for t in range(len(ins))}, results={0: od})
    b.factor(r[axis], results={0: axis}, kind=PERM)
    return b.build()


@rule_for("unstack")
def unstack_rule(ins, outs, params) -> FactorRule | None:
    """Inverse of stack: the unstacked operand dim is an operand-only permutation factor."""
    if len(ins) != 1 or not outs:
        return None
    axis = int(params["axis"])
    (a,) = ins
    rest = tuple(a[:axis]) + tuple(a[axis + 1:])
    if any(tuple(r) != rest for r in outs) or a[axis] != len(outs):
        return None
    b = RuleBuilder(ins, outs)
    for d in range(len(rest)):
        od = d if d < axis else d + 1
        b.factor(rest[d], operands={0: od}, results={t: d for t in range(len(outs))})
    b.factor(a[axis], operands={0: axis}, kind=PERM)
    return b.build()


def _per_dim(ins, outs, moved: Sequence[bool], kind: FactorKind, n_operands_with_dims: int = 1) -> FactorRule | None:
    """Operand 0 and result 0 of equal rank: dim d is shared pass-through unless moved[d]; a moved dim
    is one shared `kind` factor when the sizes agree, else one factor per side. Other operands (scalars
    such as pad's padding value) get no factors."""
    (a, r) = ins[0], outs[0]
    if len(a) != len(r) or len(moved) != len(a) or len(outs) != 1:
        return None
    if any(len(s) != 0 for s in ins[n_operands_with_dims:]):
        return None
    b = RuleBuilder(ins, outs)
    for d, (n, m) in enumerate(zip(a, r)):
        if not moved[d]:
            if n != m:
                return None
            b.factor(n, operands={0: d}, results={0: d})
        elif n == m:
            b.factor(n, operands={0: d}, results={0: d}, kind=kind)
        else:
            b.factor(n, operands={0: d}, kind=kind)
            b.factor(m, results={0: d}, kind=kind)
    return b.build()


@rule_for("slice")
def slice_rule(ins, outs, params) -> FactorRule | None:
    """A dim taken whole (start 0, limit = size, stride 1) is pass-through; a sliced or strided dim is a
    permutation factor on each side (the kept part moves between devices)."""
    if len(ins) != 1:
        return None
    (a,) = ins
    start = tuple(int(x) for x in params["start_indices"])
    limit = tuple(int(x) for x in params["limit_indices"])
    strides = params.get("strides")
    strides = tuple(int(x) for x in strides) if strides is not None else (1,) * len(a)
    moved = [not (s == 0 and l == n and st == 1) for s, l, st, n in zip(start, limit, strides, a)]
    return _per_dim(ins, outs, moved, PERM)


@rule_for("pad")
def pad_rule(ins, outs, params) -> FactorRule | None:
    """A dim with any (lo, hi, interior) padding is a permutation factor (shared when the size is
    unchanged, e.g. lo=1, hi=-1); unpadded dims pass through. The padding value is a scalar."""
    if len(ins) != 2:
        return None
    config = [tuple(int(x) for x in c) for c in params["padding_config"]]
    moved = [c != (0, 0, 0) for c in config]
    return _per_dim(ins, outs, moved, PERM)


@rule_for("rev")
def rev_rule(ins, outs, params) -> FactorRule | None:
    """Reversed dims: one permutation factor shared by operand and result (Shardy's choice)."""
    if len(ins) != 1:
        return None
    dims = {int(d) for d in params["dimensions"]}
    return _per_dim(ins, outs, [d in dims for d in range(len(ins[0]))], PERM)


@rule_for("iota", "empty", "empty2")
def iota_rule(ins, outs, params) -> FactorRule | None:
    """No operands; every result dim is a result-only pass-through factor (each device generates its own
    block). Also `empty`/`empty2` (uninitialised buffers, e.g. scan's stacked residuals under grad).
    Dynamic-shape operands are not supported."""
    if ins or len(outs) != 1:
        return None
    b = RuleBuilder(ins, outs)
    for d, n in enumerate(outs[0]):
        b.factor(n, results={0: d})
    return b.build()
