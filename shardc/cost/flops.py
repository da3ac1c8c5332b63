"""FLOPs and transcendentals of one op at its local (per-device) shapes, counted as XLA's
`HloCostAnalysis` counts them, so predictions compare with `compiled.cost_analysis()`:

* elementwise arithmetic, comparisons, selects, converts: one FLOP per result element;
* transcendentals (exp, log, tanh, logistic, sqrt, rsqrt, pow, erf, sin, cos, ...): no FLOPs, one
  transcendental per element;
* `integer_pow(x, n)`: the multiplies of square-and-multiply (n=2: one; a negative n adds a divide);
* reductions: (input elements - output elements) applications of the combiner (one FLOP each); on
  XLA:CPU a long reduction becomes a tree (windows of 32, padded), counted as XLA:CPU counts it;
* dot_general: 2 x result elements x contracted size (a multiply, or a reduce of one, where XLA rewrites it
  so: `dot_rewrite`); convolution: 2 x (output, kernel) positions that read an input element (taps over padding and dilation holes not counted, as XLA counts them);
* data movement (broadcast, reshape, transpose, slice, concatenate, pad, gather, iota, copies): none;
* scatter-add and friends: one FLOP per update element; sort: n log2 n;
* pooling (reduce_window_*): window size - 1 per result element; its gradient (select_and_scatter_add) as
  XLA counts it on the backend (XLA:CPU rewrites it, see `_select_and_scatter`).

Rules live in one table keyed by primitive name (`FLOP_RULES`); unknown primitives count as zero.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

__all__ = ["OpCount", "FLOP_RULES", "count_op", "register_flops", "dot_rewrite", "TRANSCENDENTAL", "ELEMENTWISE",
           "MOVEMENT"]

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class OpCount:
    flops: float = 0.0
    transcendentals: float = 0.0

    def __add__(self, other: "OpCount") -> "OpCount":
        return OpCount(self.flops + other.flops, self.transcendentals + other.transcendentals)


FlopRule = Callable[[Sequence[Shape], Sequence[Shape], Mapping[str, Any]], OpCount]
FLOP_RULES: dict[str, FlopRule] = {}


def register_flops(*names: str) -> Callable[[FlopRule], FlopRule]:
    def deco(fn: FlopRule) -> FlopRule:
        for n in names:
            FLOP_RULES[n] = fn
        return fn

    return deco


def _n(shape: Shape) -> int:
    return math.prod(shape)


TRANSCENDENTAL = ("exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "pow",
                  "sin", "cos", "tan", "atan2", "erf", "erfc", "erf_inv", "acosh", "asinh", "atanh", "asin",
                  "acos", "atan", "sinh", "cosh", "lgamma", "digamma", "igamma", "random_gamma_grad")
ELEMENTWISE = ("add", "sub", "mul", "div", "rem", "max", "min", "neg", "sign", "abs", "floor", "ceil", "round",
               "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "convert_element_type",
               "clamp", "is_finite", "add_any", "nextafter", "shift_left", "shift_right_logical",
               "shift_right_arithmetic", "population_count", "clz", "imag", "real", "conj", "complex",
               "square", "reduce_precision", "copysign", "stop_gradient_add")
MOVEMENT = ("broadcast_in_dim", "reshape", "transpose", "slice", "dynamic_slice", "dynamic_update_slice",
            "concatenate", "pad", "gather", "iota", "copy", "copy_p", "squeeze", "expand_dims", "rev", "split",
            "stop_gradient", "sharding_constraint", "shardc_hint", "pcg_collective", "tie", "scan_slice", "scan_stack",
            "random_wrap", "random_unwrap", "random_bits", "random_seed", "random_fold_in", "random_split",
            "threefry2x32", "optimization_barrier", "name", "device_put", "bitcast_convert_type", "psum", "pmax")


@register_flops(*ELEMENTWISE)
def _elementwise(ins, outs, params) -> OpCount:
    return OpCount(flops=float(sum(_n(s) for s in outs)))


@register_flops(*TRANSCENDENTAL)
def _transcendental(ins, outs, params) -> OpCount:
    return OpCount(transcendentals=float(sum(_n(s) for s in outs)))


@register_flops(*MOVEMENT)
def _movement(ins, outs, params) -> OpCount:
    return OpCount()


@register_flops("integer_pow")
def _integer_pow(ins, outs, params) -> OpCount:
    y = int(params.get("y", 2))
    k = abs(y)
    mults = max(k.bit_length() - 1 + bin(k).count("1") - 1, 0) if k else 0
    if y < 0:
        mults += 1
    return OpCount(flops=float(mults * _n(outs[0])))


@register_flops("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def _reduce(ins, outs, params, backend: str = "") -> OpCount:
    out = max(_n(outs[0]), 1)
    n = _n(ins[0]) // out
    if backend == "cpu":  # XLA:CPU's tree reduction: padded windows of 32, then the window results
        return OpCount(flops=float(out * _tree_reduce_steps(n)))
    return OpCount(flops=float(max(_n(ins[0]) - _n(outs[0]), 0)))


def _tree_reduce_steps(n: int, window: int = 32) -> int:
    """Combiner applications per output of XLA:CPU's TreeReductionRewriter for a reduction of n values."""
    if n <= window:
        return max(n - 1, 0)
    m = -(-n // window)
    return (window - 1) * m + _tree_reduce_steps(m, window)


@register_flops("argmax", "argmin")
def _argreduce(ins, outs, params) -> OpCount:
    # A variadic (value, index) reduce: its comparator is 9 elementwise ops per step (checked on XLA:CPU).
    return OpCount(flops=float(9 * max(_n(ins[0]) - _n(outs[0]), 0)))


@register_flops("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(ins, outs, params, backend: str = "") -> OpCount:
    n = ins[0][int(params.get("axis", 0))] if ins and ins[0] else 1
    rows = _n(outs[0]) // max(n, 1)
    if backend == "cpu":  # reduce-window lowering: quadratic in blocks of 16, then over the block sums
        if n <= 16:
            return OpCount(flops=float(rows * n * (n - 1)))
        m = -(-n // 16)
        return OpCount(flops=float(rows * (16 * n + m * m - 1)))
    return OpCount(flops=float(rows * max(n - 1, 0)))


def dot_rewrite(params: Mapping[str, Any], ranks: Sequence[int]) -> str | None:
    """What XLA's algebraic simplifier makes of a dot_general with these params and operand ranks: "multiply" when
    it contracts no dim (an outer, broadcast or elementwise product: a multiply of broadcasts of its operands,
    fused like any elementwise op), "reduce" when both operands have batch and contracting dims only (a
    vector-vector product: a reduce of a multiply), else None (a dot). Measured on XLA:CPU."""
    dn = params.get("dimension_numbers")
    if dn is None:
        return None
    (lc, rc), (lb, rb) = dn
    if not lc:
        return "multiply"
    if len(ranks) >= 2 and len(lc) + len(lb) == ranks[0] and len(rc) + len(rb) == ranks[1]:
        return "reduce"
    return None


@register_flops("dot_general")
def _dot(ins, outs, params, backend: str = "") -> OpCount:
    (lc, _), _ = params["dimension_numbers"]
    rewrite = dot_rewrite(params, [len(s) for s in ins])
    if rewrite == "multiply":
        return OpCount(flops=float(_n(outs[0])))
    k = math.prod(ins[0][d] for d in lc)
    out = _n(outs[0])
    if rewrite == "reduce":  # (the multiply, then the reduction)
        return OpCount(flops=float(out * k)) + _reduce([(out * k,)], [(out,)], {}, backend)
    return OpCount(flops=2.0 * out * k)


@register_flops("conv_general_dilated")
def _conv(ins, outs, params) -> OpCount:
    """2 x input features per group x output features x batch per group x, per spatial dim, the (output,
    kernel) position pairs that read an input element (not padding, not a hole of the input's dilation):
    what XLA's `HloCostAnalysis::GetConvolutionFlops` counts."""
    lhs, rhs, out = ins[0], ins[1], outs[0]
    dn = params.get("dimension_numbers")
    lhs_spec, rhs_spec, out_spec = (tuple(range(len(lhs))),) * 3 if dn is None else (tuple(d) for d in dn)
    nsp = len(lhs) - 2
    strides = tuple(params.get("window_strides") or (1,) * nsp)
    padding = tuple(params.get("padding") or ((0, 0),) * nsp)
    lhs_dil = tuple(params.get("lhs_dilation") or (1,) * nsp)
    rhs_dil = tuple(params.get("rhs_dilation") or (1,) * nsp)
    positions = 1
    for d in range(nsp):
        positions *= _valid_positions(lhs[lhs_spec[d + 2]], rhs[rhs_spec[d + 2]], out[out_spec[d + 2]],
                                      strides[d], padding[d][0], lhs_dil[d], rhs_dil[d])
    fgc = int(params.get("feature_group_count", 1) or 1)
    bgc = int(params.get("batch_group_count", 1) or 1)
    fma = (lhs[lhs_spec[1]] // fgc) * out[out_spec[1]] * (lhs[lhs_spec[0]] // bgc) * positions
    return OpCount(flops=2.0 * fma)


def _valid_positions(n_in: int, n_kernel: int, n_out: int, stride: int, pad_lo: int, lhs_dil: int,
                     rhs_dil: int) -> int:
    """(output index, kernel index) pairs of one spatial dim whose input index is a real element."""
    count = 0
    for k in range(n_kernel):
        if stride == 1 and lhs_dil == 1:  # a contiguous range of output indices
            base = pad_lo - k * rhs_dil
            count += max(min(n_in + base, n_out) - max(base, 0), 0)
            continue
        for o in range(n_out):
            i = o * stride - pad_lo + k * rhs_dil
            if i % lhs_dil == 0 and 0 <= i // lhs_dil < n_in:
                count += 1
    return count


@register_flops("reduce_window_max", "reduce_window_min", "reduce_window_sum")
def _reduce_window(ins, outs, params) -> OpCount:
    """One application of the reduction per window element but the first, per result element (pooling)."""
    return OpCount(flops=float(_n(outs[0]) * (math.prod(params["window_dimensions"]) - 1)))


@register_flops("select_and_scatter_add")
def _select_and_scatter(ins, outs, params, backend: str = "") -> OpCount:
    """The gradient of max pooling, per source element (the pooled gradient): a select per window element but
    the first and one scatter-add. XLA:CPU rewrites it into a variadic reduce-window carrying the value and
    one index per dim (7 + rank FLOPs per application, measured against `cost_analysis`) and a scatter."""
    window = math.prod(params["window_dimensions"])
    per = 7 + len(ins[1]) if backend == "cpu" else 1
    return OpCount(flops=float(_n(ins[0]) * ((window - 1) * per + 1)))


@register_flops("scatter-add", "scatter_add", "scatter_mul", "scatter_min", "scatter_max", "scatter")
def _scatter(ins, outs, params) -> OpCount:
    updates = ins[2] if len(ins) > 2 else ins[-1]
    return OpCount(flops=float(_n(updates)))


@register_flops("sort")
def _sort(ins, outs, params) -> OpCount:
    n = _n(ins[0])
    return OpCount(flops=float(n * max(math.ceil(math.log2(max(n, 1))), 0)))


@register_flops("top_k")
def _top_k(ins, outs, params) -> OpCount:
    return OpCount()


def count_op(primitive: str, ins: Sequence[Shape], outs: Sequence[Shape], params: Mapping[str, Any],
             backend: str = "") -> OpCount:
    """FLOPs and transcendentals of one op at the given (local) shapes; zero for unknown primitives.
    `backend` ("cpu", "gpu", "tpu" or "") selects backend-specific rewrites XLA counts (reductions)."""
    rule = FLOP_RULES.get(primitive)
    if rule is None:
        return OpCount()
    try:
        if rule in _BACKEND_AWARE:
            return rule(ins, outs, params, backend)
        return rule(ins, outs, params)
    except (KeyError, IndexError, TypeError, ValueError):
        return OpCount()


_BACKEND_AWARE = {_reduce, _cumulative, _select_and_scatter, _dot}
