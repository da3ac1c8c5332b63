"""Rules of elementwise and identity-like primitives.

Elementwise: every result dim is one pass-through factor shared by all results and by each operand
whose dim has that size; rank-0 operands (scalar broadcast, e.g. `mul x 2.0`, clamp's bounds, select_n's
scalar predicate) and size-1 operand dims that jax broadcasts (`sub (4,8) (4,1)`) get no factor.
Identity-like ops (optimization_barrier, device_put, sharding constraints, shardc_hint) pair operand i
with result i.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .builder import RuleBuilder, pairwise_identity_rule, pointwise_rule
from .core import FactorKind, FactorRule, register_rule

__all__ = [
    "UNARY_ELEMENTWISE",
    "BINARY_ELEMENTWISE",
    "NARY_ELEMENTWISE",
    "IDENTITY_PRIMITIVES",
    "elementwise_rule",
    "identity_rule",
]

UNARY_ELEMENTWISE = (
    # arithmetic and math
    "neg", "sign", "abs", "floor", "ceil", "round", "is_finite",
    "exp", "exp2", "log", "log1p", "expm1", "logistic", "tanh",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    "sqrt", "rsqrt", "cbrt", "square", "integer_pow",
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "bessel_i0e", "bessel_i1e",
    "real", "imag", "conj",
    # bits and logic
    "not", "population_count", "clz",
    # dtype and value plumbing
    "convert_element_type", "reduce_precision", "copy", "stop_gradient", "zeros_like",
    # PRNG keys, elementwise over the key array's shape
    "random_seed", "random_clone",
)

BINARY_ELEMENTWISE = (
    "add", "sub", "mul", "div", "rem", "max", "min", "pow", "atan2", "nextafter", "add_any",
    "and", "or", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical", "mulhi",
    "eq", "ne", "lt", "le", "gt", "ge",
    "complex", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "polygamma", "zeta",
    "random_fold_in", "random_gamma",
)

NARY_ELEMENTWISE = (
    "select_n",  # (pred, *cases); pred may be a scalar
    "clamp",  # (min, x, max); min/max may be scalars
    "regularized_incomplete_beta",  # (a, b, x)
    "threefry2x32",  # (k1, k2, x1, x2) -> (y1, y2)
    "iota_2x32_shape",  # () -> (hi, lo)
    "platform_index",  # () -> scalar
)

# operand i <-> result i, every dim pass-through
IDENTITY_PRIMITIVES = (
    "optimization_barrier",
    "device_put",
    "sharding_constraint",
    "shardc_hint",
    "reshard",
    "layout_constraint",
    "pvary",
    "name",  # jax.ad_checkpoint.checkpoint_name: a label for remat policies
)


def elementwise_rule(
    operand_shapes: Sequence[tuple[int, ...]], result_shapes: Sequence[tuple[int, ...]], params: Mapping[str, Any]
) -> FactorRule | None:
    return pointwise_rule(operand_shapes, result_shapes)


def identity_rule(
    operand_shapes: Sequence[tuple[int, ...]], result_shapes: Sequence[tuple[int, ...]], params: Mapping[str, Any]
) -> FactorRule | None:
    return pairwise_identity_rule(operand_shapes, result_shapes)


def bitcast_convert_type_rule(ins, outs, params) -> FactorRule | None:
    """Same width: elementwise. Narrowing (f32 -> i8[...,4]) adds a trailing result dim holding the
    pieces of one element; widening removes a trailing operand dim. That dim is need-replication (it is
    the inside of one element); the leading dims stay pass-through."""
    if len(ins) != 1 or len(outs) != 1:
        return None
    (a,), (r,) = ins, outs
    if len(a) == len(r):
        return pointwise_rule(ins, outs)
    b = RuleBuilder(ins, outs)
    lead = min(len(a), len(r))
    if a[:lead] != r[:lead] or abs(len(a) - len(r)) != 1:
        return None
    for d in range(lead):
        b.factor(a[d], operands={0: d}, results={0: d})
    if len(r) > len(a):
        b.factor(r[-1], results={0: lead}, kind=FactorKind.NEED_REPLICATION)
    else:
        b.factor(a[-1], operands={0: lead}, kind=FactorKind.NEED_REPLICATION)
    return b.build()


for _name in UNARY_ELEMENTWISE + BINARY_ELEMENTWISE + NARY_ELEMENTWISE:
    register_rule(_name, elementwise_rule)
for _name in IDENTITY_PRIMITIVES:
    register_rule(_name, identity_rule)
register_rule("bitcast_convert_type", bitcast_convert_type_rule)
