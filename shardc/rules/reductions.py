"""Rules of reductions, scans, sorts and windowed reductions."""
from __future__ import annotations

from .builder import RuleBuilder, pointwise_rule
from .core import FactorKind, FactorRule, register_rule, rule_for

__all__ = ["REDUCE_OPS", "reduce_rule", "scan_along_axis_rule"]

PT, RED, NR, PERM = (
    FactorKind.PASS_THROUGH,
    FactorKind.REDUCTION,
    FactorKind.NEED_REPLICATION,
    FactorKind.PERMUTATION,
)

# primitive -> combiner of its partial results
REDUCE_OPS = {
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_prod": "prod",
    "reduce_and": "and",
    "reduce_or": "or",
    "reduce_xor": "xor",
}


def _norm_axes(axes, rank: int) -> tuple[int, ...] | None:
    out = tuple(sorted({int(a) % rank if rank else int(a) for a in axes}))
    if any(not 0 <= a < rank for a in out):
        return None
    return out


def _reduce(ins, outs, axes, kind: FactorKind, reduce_op: str = "sum", n_data: int | None = None) -> FactorRule | None:
    """Operands [:n_data] share one shape and are reduced over `axes` into results of the kept dims;
    further operands (init values) are scalars. Kept dims: shared pass-through; reduced dims: one
    operand-only factor of `kind` shared by the data operands."""
    n_data = len(ins) if n_data is None else n_data
    if n_data < 1 or not outs:
        return None
    a = tuple(ins[0])
    if any(tuple(s) != a for s in ins[:n_data]) or any(len(s) for s in ins[n_data:]):
        return None
    axes = _norm_axes(axes, len(a))
    if axes is None:
        return None
    kept = [d for d in range(len(a)) if d not in axes]
    expected = tuple(a[d] for d in kept)
    if any(tuple(r) != expected for r in outs):
        return None
    b = RuleBuilder(ins, outs)
    for o, d in enumerate(kept):
        b.factor(a[d], operands={t: d for t in range(n_data)}, results={t: o for t in range(len(outs))})
    for d in axes:
        b.factor(a[d], operands={t: d for t in range(n_data)}, kind=kind)
    return b.build(reduce_op=reduce_op)


def reduce_rule(reduce_op: str):
    """reduce_sum & co.: reduced dims are reduction factors (the result is a partial `reduce_op` over
    the mesh axes sharding them); kept dims pass through."""

    def rule(ins, outs, params) -> FactorRule | None:
        if len(ins) != 1 or len(outs) != 1:
            return None
        return _reduce(ins, outs, params["axes"], RED, reduce_op)

    rule.__name__ = f"reduce_{reduce_op}_rule"
    return rule


for _prim, _op in REDUCE_OPS.items():
    register_rule(_prim, reduce_rule(_op))


# argmax / argmin: the reduced dim is a reduction factor the op finishes itself (`SELF_COMBINED`): sharded, each
# device reduces its piece and XLA all-gathers the per-shard (value, global index) candidates and reduces them
# (two small all-gathers, `shardc.cost.op_collectives`), where gathering the operand would move all of it (an
# argmax of vocabulary-parallel logits for an accuracy metric).
for _prim in ("argmax", "argmin"):
    register_rule(_prim, reduce_rule(_prim))


@rule_for("reduce")
def generic_reduce_rule(ins, outs, params) -> FactorRule | None:
    """lax.reduce with a user computation: operands (*xs, *inits), results one per x. The combiner is
    arbitrary, so the reduced dims are need-replication; kept dims pass through."""
    n = len(outs)
    if len(ins) != 2 * n:
        return None
    return _reduce(ins, outs, params["dimensions"], NR, n_data=n)


def scan_along_axis_rule(ins, outs, params) -> FactorRule | None:
    """cumsum & co. and sort: operands and results share one shape; the scanned/sorted dim is one
    need-replication factor shared by all of them, the other dims pass through."""
    axis_param = "dimension" if "dimension" in params else "axis"
    shape = tuple(outs[0]) if outs else ()
    rank = len(shape)
    if not outs or any(tuple(s) != shape for s in list(ins) + list(outs)):
        return None
    axis = int(params[axis_param])
    axis = axis % rank if rank else axis
    return pointwise_rule(ins, outs, kind_of_dim={axis: NR})


for _prim in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"):
    register_rule(_prim, scan_along_axis_rule)


def _top_k_like(ins, outs, axis: int) -> FactorRule | None:
    if len(ins) != 1 or not outs:
        return None
    (a,) = ins
    rank = len(a)
    axis = axis % rank if rank else axis
    k = outs[0][axis] if rank else None
    for r in outs:
        if len(r) != rank or any(r[d] != a[d] for d in range(rank) if d != axis) or r[axis] != k:
            return None
    b = RuleBuilder(ins, outs)
    for d in range(rank):
        if d != axis:
            b.factor(a[d], operands={0: d}, results={t: d for t in range(len(outs))})
    b.factor(a[axis], operands={0: axis}, kind=NR)
    b.factor(k, results={t: axis for t in range(len(outs))}, kind=NR)
    return b.build()


@rule_for("top_k")
def top_k_rule(ins, outs, params) -> FactorRule | None:
    """Values and indices of the top k along `axis` (default last): the operand's axis and the results'
    k-sized axis are need-replication; the other dims pass through."""
    rank = len(ins[0]) if ins else 0
    return _top_k_like(ins, outs, int(params.get("axis", rank - 1)))


@rule_for("approx_top_k")
def approx_top_k_rule(ins, outs, params) -> FactorRule | None:
    rank = len(ins[0]) if ins else 0
    return _top_k_like(ins, outs, int(params.get("reduction_dimension", rank - 1)))


def _window_trivial(params, d: int, with_dilation: bool = True) -> bool:
    """Window of one element, stride 1, no padding, no dilation along dim d: the op is pointwise there."""
    wd = params["window_dimensions"][d]
    ws = params["window_strides"][d]
    pad = tuple(int(p) for p in params["padding"][d])
    ok = int(wd) == 1 and int(ws) == 1 and pad == (0, 0)
    if with_dilation:
        for key in ("base_dilation", "window_dilation"):
            dil = params.get(key)
            if dil is not None and int(dil[d]) != 1:
                ok = False
    return ok


def _windowed(ins, outs, params, n_data: int) -> FactorRule | None:
    """Operands [:n_data] of one shape, scalars after them (init values), results of one shape: a
    dim with a trivial window is one shared pass-through factor; otherwise the data operands share one
    permutation factor and the results another (a sharded windowed dim needs a halo exchange)."""
    if n_data < 1 or not outs:
        return None
    a = tuple(ins[0])
    r = tuple(outs[0])
    if (
        any(tuple(s) != a for s in ins[:n_data])
        or any(len(s) for s in ins[n_data:])
        or any(tuple(s) != r for s in outs)
        or len(a) != len(r)
    ):
        return None
    b = RuleBuilder(ins, outs)
    ops = lambda d: {t: d for t in range(n_data)}  # noqa: E731
    res = lambda d: {t: d for t in range(len(outs))}  # noqa: E731
    for d in range(len(a)):
        if _window_trivial(params, d):
            if a[d] != r[d]:
                return None
            b.factor(a[d], operands=ops(d), results=res(d))
        elif a[d] == r[d]:
            b.factor(a[d], operands=ops(d), results=res(d), kind=PERM)
        else:
            b.factor(a[d], operands=ops(d), kind=PERM)
            b.factor(r[d], results=res(d), kind=PERM)
    return b.build()


@rule_for("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def reduce_window_rule(ins, outs, params) -> FactorRule | None:
    """Pooling: trivially-windowed dims pass through, windowed dims are permutation factors."""
    if len(ins) != 1 or len(outs) != 1:
        return None
    return _windowed(ins, outs, params, 1)


@rule_for("reduce_window")
def generic_reduce_window_rule(ins, outs, params) -> FactorRule | None:
    """lax.reduce_window with a computation: operands (*xs, *inits)."""
    n = len(outs)
    if len(ins) != 2 * n:
        return None
    return _windowed(ins, outs, params, n)


@rule_for("select_and_gather_add")
def select_and_gather_add_rule(ins, outs, params) -> FactorRule | None:
    """(tangents, operand) -> window-reduced tangents (the jvp of max pooling)."""
    if len(ins) != 2 or len(outs) != 1:
        return None
    return _windowed(ins, outs, params, 2)


@rule_for("select_and_scatter_add")
def select_and_scatter_add_rule(ins, outs, params) -> FactorRule | None:
    """(source, operand) -> result of operand's shape (the gradient of max pooling). Trivially-windowed
    dims: one factor shared by all three. Windowed dims: operand and result share a permutation factor;
    the source's dim is need-replication."""
    if len(ins) != 2 or len(outs) != 1:
        return None
    src, a = ins
    (r,) = outs
    if tuple(a) != tuple(r) or len(src) != len(a):
        return None
    b = RuleBuilder(ins, outs)
    for d in range(len(a)):
        if _window_trivial(params, d, with_dilation=False):
            if src[d] != a[d]:
                return None
            b.factor(a[d], operands={0: d, 1: d}, results={0: d})
        else:
            b.factor(src[d], operands={0: d}, kind=NR)
            b.factor(a[d], operands={1: d}, results={0: d}, kind=PERM)
    return b.build()
