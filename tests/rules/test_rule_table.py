"""The per-primitive rule table, family by family: trace a tiny function, look up each eqn's rule with the
eqn's own shapes and params, validate it, and check the factor structure that matters."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

import shardc.rules as R
from shardc.rules import FactorKind

PT, RED, NR, PERM = (
    FactorKind.PASS_THROUGH,
    FactorKind.REDUCTION,
    FactorKind.NEED_REPLICATION,
    FactorKind.PERMUTATION,
)


@dataclasses.dataclass
class Op:
    name: str
    ins: list[tuple[int, ...]]
    outs: list[tuple[int, ...]]
    params: dict[str, Any]
    rule: R.FactorRule


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for w in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(w, jcore.ClosedJaxpr):
                yield w.jaxpr
            elif isinstance(w, jcore.Jaxpr):
                yield w


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in R.HIGHER_ORDER_PRIMITIVES:
            for sub in _subjaxprs(eqn):
                yield from _eqns(sub)
        else:
            yield eqn


def trace(f, *args) -> list[Op]:
    """Every first-order eqn of f's jaxpr with its rule; every rule must exist and validate."""
    ops = []
    for eqn in _eqns(jax.make_jaxpr(f)(*args).jaxpr):
        name = eqn.primitive.name
        ins = [tuple(v.aval.shape) for v in eqn.invars]
        outs = [tuple(v.aval.shape) for v in eqn.outvars]
        fn = R.get_rule(name)
        assert fn is not None, f"no rule for {name}"
        rule = fn(ins, outs, dict(eqn.params))
        assert rule is not None, f"rule for {name} returned None on {ins} -> {outs}, {eqn.params}"
        rule.validate(ins, outs)
        ops.append(Op(name, ins, outs, dict(eqn.params), rule))
    return ops


def only(f, *args, prim: str) -> Op:
    ops = [op for op in trace(f, *args) if op.name == prim]
    assert len(ops) == 1, f"expected one {prim}, got {[o.name for o in trace(f, *args)]}"
    return ops[0]


def of(rule: R.FactorRule, t: int, d: int) -> tuple[int, ...]:
    """Factors of dim d of tensor t (operands then results)."""
    return rule.tensors()[t][d]


def one(rule, t, d) -> int:
    fs = of(rule, t, d)
    assert len(fs) == 1, fs
    return fs[0]


def assert_pointwise(op: Op):
    """Each result dim of size > 1 is one pass-through factor, shared with every operand dim of that size."""
    rule = op.rule
    nin = len(op.ins)
    for r, shape in enumerate(op.outs):
        for d, n in enumerate(shape):
            if n == 1:
                assert of(rule, nin + r, d) == ()
                continue
            f = one(rule, nin + r, d)
            assert rule.kinds[f] is PT, op.name
            for t, s in enumerate(op.ins):
                if len(s) == 0:
                    assert all(dims == () for dims in rule.operands[t])
                elif s[d] == n:
                    assert of(rule, t, d) == (f,), (op.name, t, d)
                else:
                    assert s[d] == 1 and of(rule, t, d) == ()


# ---------------------------------------------------------------- dot_general

def test_dot_general_einsum_contracting_is_shared_reduction():
    x, w = jnp.ones((2, 4, 8)), jnp.ones((8, 16))
    op = only(lambda x, w: jnp.einsum("bsd,df->bsf", x, w), x, w, prim="dot_general")
    rule = op.rule
    c = one(rule, 0, 2)
    assert rule.kinds[c] is RED and of(rule, 1, 0) == (c,)
    assert all(c not in dims for dims in rule.results[0])
    assert of(rule, 2, 0) == of(rule, 0, 0) and of(rule, 2, 1) == of(rule, 0, 1)
    assert of(rule, 2, 2) == of(rule, 1, 1)
    assert rule.reduce_op == "sum"


def test_dot_general_non_canonical_dimension_order():
    # lhs (k=8, m=3, b=5), rhs (b=5, k=8, n=7): batch lhs2<->rhs0, contracting lhs0<->rhs1
    x, y = jnp.ones((8, 3, 5)), jnp.ones((5, 8, 7))
    dn = (((0,), (1,)), ((2,), (0,)))
    op = only(lambda x, y: lax.dot_general(x, y, dn), x, y, prim="dot_general")
    assert op.outs == [(5, 3, 7)]
    rule = op.rule
    b = one(rule, 0, 2)
    assert of(rule, 1, 0) == (b,) and of(rule, 2, 0) == (b,) and rule.kinds[b] is PT
    k = one(rule, 0, 0)
    assert of(rule, 1, 1) == (k,) and rule.kinds[k] is RED
    assert of(rule, 2, 1) == of(rule, 0, 1) and of(rule, 2, 2) == of(rule, 1, 2)
    # the lhs free factor is absent from rhs and vice versa
    assert one(rule, 0, 1) not in {f for d in rule.operands[1] for f in d}


def test_dot_general_batched_attention_scores():
    q, k = jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 4, 16))
    op = only(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), q, k, prim="dot_general")
    rule = op.rule
    kinds = sorted(k.value for k in rule.kinds)
    assert kinds.count("reduction") == 1  # d
    assert rule.sizes[rule.kinds.index(RED)] == 16


# ---------------------------------------------------------------- elementwise

UNARY_FLOAT = [
    lax.neg, lax.exp, lax.log, lax.log1p, lax.expm1, lax.tanh, lax.logistic, lax.sin, lax.cos, lax.tan,
    lax.sqrt, lax.rsqrt, lax.cbrt, lax.abs, lax.sign, lax.floor, lax.ceil, lax.round, lax.is_finite,
    lax.erf, lax.erfc, lax.erf_inv, lax.lgamma, lax.digamma, lax.exp2, lax.asin, lax.acos, lax.atan,
    lax.sinh, lax.cosh, lax.asinh, lax.acosh, lax.atanh, lax.square, lambda x: lax.integer_pow(x, 3),
    lax.bessel_i0e, lax.bessel_i1e, lax.stop_gradient, lambda x: lax.reduce_precision(x, 5, 10),
    lambda x: x.astype(jnp.bfloat16), jnp.copy,
]
BINARY_FLOAT = [
    lax.add, lax.sub, lax.mul, lax.div, lax.rem, lax.max, lax.min, lax.pow, lax.atan2, lax.nextafter,
    lax.eq, lax.ne, lax.lt, lax.le, lax.gt, lax.ge, lax.igamma, lax.igammac, lax.zeta,
]
BINARY_INT = [
    lax.bitwise_and, lax.bitwise_or, lax.bitwise_xor, lax.shift_left, lax.shift_right_arithmetic,
    lax.shift_right_logical,
]
UNARY_INT = [lax.bitwise_not, lax.population_count, lax.clz]


def test_elementwise_primitives_are_pointwise():
    x = jnp.ones((4, 8))
    i = jnp.ones((4, 8), jnp.int32)
    c = jnp.ones((4, 8), jnp.complex64)

    def f(x, i, c):
        outs = [g(x) for g in UNARY_FLOAT] + [g(x, x) for g in BINARY_FLOAT]
        outs += [g(i) for g in UNARY_INT] + [g(i, i) for g in BINARY_INT]
        outs += [lax.real(c), lax.imag(c), lax.conj(c), lax.complex(x, x)]
        outs += [lax.polygamma(x, x), lax.betainc(x, x, x), lax.clamp(x, x, x)]
        outs += [lax.select_n(x > 0, x, x), lax.bitcast_convert_type(x, jnp.int32)]
        return outs

    ops = trace(f, x, i, c)
    names = {op.name for op in ops}
    expected = {
        "neg", "exp", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt",
        "cbrt", "abs", "sign", "floor", "ceil", "round", "is_finite", "erf", "erfc", "erf_inv", "lgamma",
        "digamma", "exp2", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "square",
        "integer_pow", "bessel_i0e", "bessel_i1e", "stop_gradient", "reduce_precision",
        "convert_element_type", "copy", "add", "sub", "mul", "div", "rem", "max", "min", "pow", "atan2",
        "nextafter", "eq", "ne", "lt", "le", "gt", "ge", "igamma", "igammac", "zeta", "and", "or", "xor",
        "shift_left", "shift_right_arithmetic", "shift_right_logical", "not", "population_count", "clz",
        "real", "imag", "conj", "complex", "polygamma", "regularized_incomplete_beta", "clamp", "select_n",
        "bitcast_convert_type",
    }
    assert expected <= names, expected - names
    for op in ops:
        if op.name in expected:
            assert_pointwise(op)


def test_scalar_and_size1_operands_get_no_factors():
    x = jnp.ones((4, 8))
    op = only(lambda x: x * 2.0, x, prim="mul")
    assert op.ins == [(4, 8), ()] and op.rule.operands[1] == ()
    assert_pointwise(op)
    # jax broadcasts size-1 dims inside elementwise ops
    op = only(lambda x: x - jnp.max(x, axis=1, keepdims=True), x, prim="sub")
    assert op.ins == [(4, 8), (4, 1)]
    assert of(op.rule, 1, 1) == () and of(op.rule, 1, 0) == of(op.rule, 0, 0)
    assert_pointwise(op)


def test_clamp_with_scalar_bounds_and_select_with_scalar_predicate():
    x = jnp.ones((4, 8))
    op = only(lambda x: lax.clamp(0.0, x, 1.0), x, prim="clamp")
    assert op.ins == [(), (4, 8), ()]
    assert op.rule.operands[0] == () and op.rule.operands[2] == ()
    assert_pointwise(op)
    op = only(lambda x, p: lax.select_n(p, x, -x), x, True, prim="select_n")
    assert op.ins[0] == ()
    assert_pointwise(op)


def test_add_any_from_gradient_accumulation():
    ops = trace(jax.grad(lambda x: jnp.sum(jnp.sin(x) * jnp.cos(x))), jnp.ones((4, 8)))
    add_any = [op for op in ops if op.name == "add_any"]
    assert add_any
    for op in add_any:
        assert_pointwise(op)


def test_bitcast_convert_type_narrowing_adds_a_replicated_dim():
    op = only(lambda x: lax.bitcast_convert_type(x, jnp.int8), jnp.ones((4, 8)), prim="bitcast_convert_type")
    assert op.outs == [(4, 8, 4)]
    assert of(op.rule, 1, 0) == of(op.rule, 0, 0)
    assert op.rule.kinds[one(op.rule, 1, 2)] is NR


def test_optimization_barrier_is_pairwise():
    x, y = jnp.ones((4, 8)), jnp.ones((3,))
    op = only(lambda x, y: lax.optimization_barrier((x, y)), x, y, prim="optimization_barrier")
    rule = op.rule
    assert of(rule, 2, 0) == of(rule, 0, 0) and of(rule, 2, 1) == of(rule, 0, 1)
    assert of(rule, 3, 0) == of(rule, 1, 0)
    assert of(rule, 0, 0) != of(rule, 1, 0)


def test_sharding_constraint_and_device_put_pass_through():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto))
    s = NamedSharding(mesh, P("x", "y"))
    x = jnp.ones((4, 8))
    for prim, f in (
        ("sharding_constraint", lambda x: lax.with_sharding_constraint(x, s)),
        ("device_put", lambda x: jax.device_put(x, s)),
    ):
        op = only(f, x, prim=prim)
        assert_pointwise(op)


def test_checkpoint_name_passes_through():
    from jax.ad_checkpoint import checkpoint_name

    op = only(lambda x: checkpoint_name(x * 2, "h"), jnp.ones((4, 8)), prim="name")
    assert_pointwise(op)


def test_shardc_hint_rule_passes_every_dim_through():
    hint = jcore.Primitive("shardc_hint")
    assert R.has_rule(hint)
    rule, conservative = R.rule_or_conservative(hint, [(4, 1, 8)], [(4, 1, 8)], {"spec": None})
    assert not conservative
    assert rule.operands == (((0,), (), (1,)),) and rule.results == rule.operands
    assert rule.kinds == (PT, PT)


# ---------------------------------------------------------------- broadcast / reshape / transpose

def test_broadcast_in_dim_expanded_and_new_dims_are_result_only():
    x = jnp.ones((4, 1))
    op = only(lambda x: lax.broadcast_in_dim(x, (3, 4, 8), (1, 2)), x, prim="broadcast_in_dim")
    rule = op.rule
    assert of(rule, 1, 1) == of(rule, 0, 0)
    assert of(rule, 0, 1) == ()
    new, expanded = one(rule, 1, 0), one(rule, 1, 2)
    for f in (new, expanded):
        assert rule.kinds[f] is PT and len(rule.factor_dims(f)) == 1


def test_expand_dims_and_squeeze():
    x = jnp.ones((4, 8))
    op = only(lambda x: jnp.expand_dims(x, 1), x, prim="broadcast_in_dim")
    assert op.outs == [(4, 1, 8)]
    assert of(op.rule, 1, 0) == of(op.rule, 0, 0) and of(op.rule, 1, 2) == of(op.rule, 0, 1)
    op = only(lambda x: lax.squeeze(x, (1,)), jnp.ones((4, 1, 8)), prim="squeeze")
    assert of(op.rule, 1, 0) == of(op.rule, 0, 0) and of(op.rule, 1, 1) == of(op.rule, 0, 2)


def test_reshape_gcd_factorisation_examples():
    op = only(lambda x: x.reshape(2, 16), jnp.ones((8, 4)), prim="reshape")
    rule = op.rule
    (i, j), (k,) = rule.operands[0]
    assert rule.results[0] == ((i,), (j, k))
    assert (rule.sizes[i], rule.sizes[j], rule.sizes[k]) == (2, 4, 4)
    assert all(kind is PT for kind in rule.kinds)

    op = only(lambda x: x.reshape(8, 32), jnp.ones((2, 4, 32)), prim="reshape")
    (i,), (j,), (k,) = op.rule.operands[0]
    assert op.rule.results[0] == ((i, j), (k,))


def test_reshape_keeps_split_heads_dim_shared():
    # (b, s, h*d) -> (b, s, h, d)
    op = only(lambda x: x.reshape(2, 16, 8, 32), jnp.ones((2, 16, 256)), prim="reshape")
    rule = op.rule
    h, d = of(rule, 0, 2)
    assert of(rule, 1, 2) == (h,) and of(rule, 1, 3) == (d,)
    assert rule.sizes[h] == 8 and rule.sizes[d] == 32
    assert of(rule, 1, 0) == of(rule, 0, 0) and of(rule, 1, 1) == of(rule, 0, 1)
    # and back: (b, s, h, d) -> (b, s, h*d)
    op = only(lambda x: x.reshape(2, 16, 256), jnp.ones((2, 16, 8, 32)), prim="reshape")
    assert of(op.rule, 1, 2) == of(op.rule, 0, 2) + of(op.rule, 0, 3)


def test_reshape_size1_dims_and_diverging_dims():
    op = only(lambda x: x.reshape(4, 1, 8), jnp.ones((32,)), prim="reshape")
    assert of(op.rule, 1, 1) == ()
    op = only(lambda x: x.reshape(2, 3), jnp.ones((3, 2)), prim="reshape")
    rule = op.rule
    # no common factor: every factor is on one side only and needs replication
    assert all(len(rule.factor_dims(f)) == 1 and rule.kinds[f] is NR for f in range(rule.num_factors))


def _factor_coords(shape, dims_factors, sizes):
    """For each flat index of a tensor, the coordinate of each of its factors."""
    coords = {}
    idx = np.indices(shape).reshape(len(shape), -1) if shape else np.zeros((0, 1), int)
    for d, fs in enumerate(dims_factors):
        x = idx[d].copy()
        for f in reversed(fs):  # minor first
            coords[f] = x % sizes[f]
            x //= sizes[f]
    return coords


def _random_reshape(rng):
    rank = rng.integers(0, 5)
    a = [int(rng.choice([1, 2, 3, 4, 6, 8, 12])) for _ in range(rank)]
    primes = []
    n = math.prod(a)
    p = 2
    while n > 1:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    rng.shuffle(primes)
    cuts = sorted(rng.choice(len(primes) + 1, size=rng.integers(0, len(primes) + 1), replace=False).tolist())
    out, prev = [], 0
    for c in cuts + [len(primes)]:
        out.append(math.prod(primes[prev:c]))
        prev = c
    if rng.random() < 0.3:
        out.insert(int(rng.integers(0, len(out) + 1)), 1)
    return tuple(a), tuple(out)


def test_reshape_shared_factors_keep_data_in_place():
    """Semantic check: along every shared factor, an element has the same coordinate before and after the
    reshape (so a sharding on that factor needs no communication)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        a, r = _random_reshape(rng)
        rule = R.get_rule("reshape")([a], [r], {"dimensions": None})
        rule.validate([a], [r])
        ca = _factor_coords(a, rule.operands[0], rule.sizes)
        cr = _factor_coords(r, rule.results[0], rule.sizes)
        for f in set(ca) & set(cr):
            assert rule.kinds[f] is PT
            np.testing.assert_array_equal(ca[f], cr[f], err_msg=f"{a}->{r} factor {f}")
        for f in set(ca) ^ set(cr):
            assert rule.kinds[f] is NR


def test_transpose():
    op = only(lambda x: jnp.transpose(x, (2, 0, 1)), jnp.ones((2, 3, 4)), prim="transpose")
    for o, p in enumerate((2, 0, 1)):
        assert of(op.rule, 1, o) == of(op.rule, 0, p)


def test_tile_and_stack_and_unstack():
    op = only(lambda x: jnp.tile(x, (2, 1)), jnp.ones((4, 8)), prim="tile")
    rep, inner = of(op.rule, 1, 0)
    assert op.rule.sizes[rep] == 2 and (inner,) == of(op.rule, 0, 0)
    ops = trace(jax.grad(lambda x: jnp.sum(jnp.stack([x, 2 * x]) ** 2)), jnp.ones((4, 8)))
    stack = next(op for op in ops if op.name == "stack")
    assert stack.rule.kinds[one(stack.rule, 2, 0)] is PERM
    assert of(stack.rule, 2, 1) == of(stack.rule, 0, 0) == of(stack.rule, 1, 0)
    unstack = next(op for op in ops if op.name == "unstack")
    assert unstack.rule.kinds[one(unstack.rule, 0, 0)] is PERM


# ---------------------------------------------------------------- reductions and scans

@pytest.mark.parametrize(
    "prim, f, op_name",
    [
        ("reduce_sum", lambda x: jnp.sum(x, 0), "sum"),
        ("reduce_max", lambda x: jnp.max(x, 0), "max"),
        ("reduce_min", lambda x: jnp.min(x, 0), "min"),
        ("reduce_prod", lambda x: jnp.prod(x, 0), "prod"),
        ("reduce_and", lambda x: jnp.all(x > 0, 0), "and"),
        ("reduce_or", lambda x: jnp.any(x > 0, 0), "or"),
        ("reduce_xor", lambda x: lax.reduce(x.astype(jnp.int32), 0, lax.bitwise_xor, (0,)), "xor"),
    ],
)
def test_reductions(prim, f, op_name):
    op = only(f, jnp.ones((4, 8)), prim=prim)
    r = one(op.rule, 0, 0)
    assert op.rule.kinds[r] is RED and op.rule.reduce_op == op_name
    assert of(op.rule, 1, 0) == of(op.rule, 0, 1)


@pytest.mark.parametrize("prim, f", [("argmax", lambda x: jnp.argmax(x, 1)), ("argmin", lambda x: jnp.argmin(x, 1))])
def test_argmax_reduced_dim_is_a_reduction_the_op_combines_itself(prim, f):
    """Sharded, each device reduces its piece and XLA all-gathers the candidates (shardc.cost.op_collectives):
    a reduction factor, but no partial result (SELF_COMBINED)."""
    from shardc.plan import OpStrategy
    from shardc.rules.core import SELF_COMBINED

    op = only(f, jnp.ones((4, 8)), prim=prim)
    r = one(op.rule, 0, 1)
    assert op.rule.kinds[r] is RED and op.rule.reduce_op == prim and prim in SELF_COMBINED
    assert of(op.rule, 1, 0) == of(op.rule, 0, 0)
    strat = OpStrategy(tuple(("x",) if f == r else () for f in range(op.rule.num_factors)))
    assert strat.partial_axes(op.rule) == frozenset() and strat.partial_groups(op.rule) == ()


def test_generic_reduce():
    op = only(lambda x: lax.reduce(x > 0, False, lax.bitwise_and, (0,)), jnp.ones((4, 8)), prim="reduce")
    assert op.rule.kinds[one(op.rule, 0, 0)] is NR


@pytest.mark.parametrize(
    "prim, f",
    [
        ("cumsum", lambda x: jnp.cumsum(x, 1)),
        ("cumprod", lambda x: jnp.cumprod(x, 1)),
        ("cummax", lambda x: lax.cummax(x, 1)),
        ("cummin", lambda x: lax.cummin(x, 1)),
        ("cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1)),
        ("sort", lambda x: jnp.sort(x, 1)),
    ],
)
def test_scanned_dim_needs_replication(prim, f):
    op = only(f, jnp.ones((4, 8)), prim=prim)
    s = one(op.rule, 0, 1)
    assert op.rule.kinds[s] is NR and of(op.rule, 1, 1) == (s,)
    assert op.rule.kinds[one(op.rule, 0, 0)] is PT and of(op.rule, 1, 0) == of(op.rule, 0, 0)


def test_multi_operand_sort_shares_factors():
    op = only(lambda x: jnp.argsort(x, 1), jnp.ones((4, 8)), prim="sort")
    assert len(op.ins) == 2 and len(op.outs) == 2
    rule = op.rule
    for t in range(4):
        assert rule.tensors()[t] == rule.tensors()[0]


def test_top_k():
    op = only(lambda x: lax.top_k(x, 3), jnp.ones((4, 8)), prim="top_k")
    rule = op.rule
    assert rule.kinds[one(rule, 0, 1)] is NR
    k = one(rule, 1, 1)
    assert rule.kinds[k] is NR and of(rule, 2, 1) == (k,)
    assert of(rule, 1, 0) == of(rule, 2, 0) == of(rule, 0, 0)


# ---------------------------------------------------------------- concat / slice / pad / rev / split

def test_concatenate_and_split():
    x = jnp.ones((4, 8))
    op = only(lambda x: jnp.concatenate([x, x[:, :3]], 1), x, prim="concatenate")
    rule = op.rule
    assert of(rule, 0, 0) == of(rule, 1, 0) == of(rule, 2, 0)
    cat = {one(rule, t, 1) for t in range(3)}
    assert len(cat) == 3 and all(rule.kinds[f] is PERM for f in cat)
    op = only(lambda x: jnp.split(x, [2, 6], 1), x, prim="split")
    assert all(op.rule.kinds[one(op.rule, t, 1)] is PERM for t in range(4))
    assert len({of(op.rule, t, 0) for t in range(4)}) == 1


def test_slice_full_dims_pass_through_sliced_dims_permute():
    op = only(lambda x: x[1:3, :], jnp.ones((4, 8)), prim="slice")
    rule = op.rule
    assert of(rule, 1, 1) == of(rule, 0, 1) and rule.kinds[one(rule, 0, 1)] is PT
    assert rule.kinds[one(rule, 0, 0)] is PERM and rule.kinds[one(rule, 1, 0)] is PERM
    assert of(rule, 0, 0) != of(rule, 1, 0)
    op = only(lambda x: x[:, ::2], jnp.ones((4, 8)), prim="slice")
    assert op.rule.kinds[one(op.rule, 0, 1)] is PERM and of(op.rule, 1, 0) == of(op.rule, 0, 0)


def test_pad_and_rev():
    x = jnp.ones((4, 8))
    op = only(lambda x: lax.pad(x, 0.0, ((1, 2, 0), (0, 0, 0))), x, prim="pad")
    rule = op.rule
    assert rule.operands[1] == ()
    assert rule.kinds[one(rule, 0, 0)] is PERM and of(rule, 2, 1) == of(rule, 0, 1)
    op = only(lambda x: jnp.flip(x, 0), x, prim="rev")
    f = one(op.rule, 0, 0)
    assert op.rule.kinds[f] is PERM and of(op.rule, 1, 0) == (f,)
    assert op.rule.kinds[one(op.rule, 0, 1)] is PT


def test_iota():
    op = only(lambda: lax.broadcasted_iota(jnp.int32, (4, 8), 1), prim="iota")
    assert op.rule.operands == () and all(k is PT for k in op.rule.kinds) and op.rule.num_factors == 2


# ---------------------------------------------------------------- dynamic slicing

def test_dynamic_slice_sliced_dims_need_replication_and_are_blocked():
    # scan-over-layers style: take layer i of stacked weights
    w = jnp.ones((6, 8, 16))
    op = only(lambda w, i: lax.dynamic_index_in_dim(w, i, 0, keepdims=False), w, 2, prim="dynamic_slice")
    rule = op.rule
    assert all(dims == () for t in rule.operands[1:] for dims in t)  # scalar indices
    layer = one(rule, 0, 0)
    assert rule.kinds[layer] is NR and layer in rule.blocked
    assert of(rule, len(op.ins), 0) == ()  # result dim of size 1
    assert of(rule, len(op.ins), 1) == of(rule, 0, 1) and rule.kinds[one(rule, 0, 1)] is PT


def test_dynamic_update_slice():
    """A dim the update covers two wide: whole on every tensor (XLA gathers the operand there)."""
    x, u = jnp.ones((6, 8)), jnp.ones((2, 8))
    op = only(lambda x, u, i: lax.dynamic_update_slice_in_dim(x, u, i, 0), x, u, 1, prim="dynamic_update_slice")
    rule = op.rule
    nin = len(op.ins)
    assert of(rule, nin, 0) == of(rule, 0, 0)
    dim = one(rule, 0, 0)
    assert rule.kinds[dim] is NR and dim in rule.blocked
    upd = one(rule, 1, 0)
    assert rule.kinds[upd] is NR and upd in rule.blocked
    assert of(rule, 1, 1) == of(rule, 0, 1) == of(rule, nin, 1)


def test_dynamic_update_slice_of_one_row():
    """A dim the update covers one element wide passes through operand and result (a KV-cache write: XLA
    selects the row on the device holding it)."""
    x, u = jnp.ones((6, 8)), jnp.ones((1, 8))
    op = only(lambda x, u, i: lax.dynamic_update_slice_in_dim(x, u, i, 0), x, u, 1, prim="dynamic_update_slice")
    rule = op.rule
    nin = len(op.ins)
    assert of(rule, nin, 0) == of(rule, 0, 0) and rule.kinds[one(rule, 0, 0)] is PT
    assert of(rule, 1, 1) == of(rule, 0, 1) == of(rule, nin, 1)


# ---------------------------------------------------------------- gather / scatter

def test_embedding_lookup_gather():
    table, ids = jnp.ones((100, 16)), jnp.ones((4, 7), jnp.int32)
    op = only(lambda t, i: t[i], table, ids, prim="gather")
    rule = op.rule
    assert op.ins == [(100, 16), (4, 7, 1)] and op.outs == [(4, 7, 16)]
    vocab = one(rule, 0, 0)
    assert rule.kinds[vocab] is RED and rule.reduce_op == "sum"
    assert of(rule, 2, 2) == of(rule, 0, 1) and rule.kinds[one(rule, 0, 1)] is PT
    assert of(rule, 2, 0) == of(rule, 1, 0) and of(rule, 2, 1) == of(rule, 1, 1)
    assert of(rule, 1, 2) == ()  # index vector dim of size 1


def test_take_axis0():
    op = only(lambda t, i: jnp.take(t, i, axis=0), jnp.ones((100, 16)), jnp.ones((5,), jnp.int32), prim="gather")
    rule = op.rule
    assert rule.kinds[one(rule, 0, 0)] is RED
    assert of(rule, 2, 0) == of(rule, 1, 0) and of(rule, 2, 1) == of(rule, 0, 1)


def test_take_along_axis_explicit_batch_dims():
    x, idx = jnp.ones((4, 8)), jnp.ones((4, 5), jnp.int32)
    op = only(lambda x, i: jnp.take_along_axis(x, i, axis=1), x, idx, prim="gather")
    rule = op.rule
    b = one(rule, 0, 0)  # operand batching dim shared by operand, indices and result
    assert of(rule, 1, 0) == (b,) and of(rule, 2, 0) == (b,) and rule.kinds[b] is PT
    assert of(rule, 2, 1) == of(rule, 1, 1)  # implicit batch dim: indices <-> result
    assert rule.kinds[one(rule, 0, 1)] is RED  # the gathered dim


def test_gather_index_vector_dim_and_partial_slices():
    # x[i:i+2, j] with dynamic i, j through gather: index vector of size 2
    x = jnp.ones((6, 8))
    dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(1,), start_index_map=(0, 1))
    op = only(
        lambda x, i: lax.gather(x, i, dn, slice_sizes=(2, 1), mode="clip"),
        x, jnp.zeros((5, 2), jnp.int32), prim="gather",
    )
    rule = op.rule
    assert op.outs == [(5, 2)]
    assert rule.kinds[one(rule, 1, 1)] is NR  # index vector dim
    assert rule.kinds[one(rule, 0, 0)] is NR and one(rule, 0, 0) in rule.blocked  # 2 of 6 rows
    assert rule.kinds[one(rule, 0, 1)] is RED  # collapsed
    assert of(rule, 2, 0) == of(rule, 1, 0)


def test_embedding_gradient_scatter_add():
    table, ids = jnp.ones((100, 16)), jnp.ones((4, 7), jnp.int32)
    ops = trace(jax.grad(lambda t, i: jnp.sum(t[i] ** 2)), table, ids)
    op = next(op for op in ops if op.name == "scatter-add")
    rule = op.rule
    # operand (100,16), indices (4,7,1), updates (4,7,16) -> (100,16)
    assert op.ins == [(100, 16), (4, 7, 1), (4, 7, 16)]
    for d in (0, 1):  # batch dims of the ids: reduction (data-parallel gradient is a partial sum)
        f = one(rule, 1, d)
        assert of(rule, 2, d) == (f,) and rule.kinds[f] is RED
    assert rule.reduce_op == "sum"
    vocab = one(rule, 0, 0)
    assert of(rule, 3, 0) == (vocab,) and rule.kinds[vocab] is PT
    assert of(rule, 0, 1) == of(rule, 2, 2) == of(rule, 3, 1)


def test_take_along_axis_gradient_scatter_add_batching():
    x, idx = jnp.ones((4, 8)), jnp.ones((4, 8), jnp.int32)
    ops = trace(jax.grad(lambda x, i: jnp.sum(jnp.take_along_axis(x, i, axis=1))), x, idx)
    op = next(op for op in ops if op.name == "scatter-add")
    rule = op.rule
    b = one(rule, 0, 0)
    assert of(rule, 1, 0) == of(rule, 2, 0) == of(rule, 3, 0) == (b,) and rule.kinds[b] is PT


@pytest.mark.parametrize(
    "prim, f, kind",
    [
        ("scatter", lambda x, i: x.at[i].set(1.0), NR),
        ("scatter-add", lambda x, i: x.at[i].add(1.0), RED),
        ("scatter-mul", lambda x, i: x.at[i].mul(2.0), RED),
        ("scatter-min", lambda x, i: x.at[i].min(2.0), RED),
        ("scatter-max", lambda x, i: x.at[i].max(2.0), RED),
    ],
)
def test_scatter_family(prim, f, kind):
    op = only(f, jnp.ones((4, 8)), jnp.array([1, 2, 3]), prim=prim)
    rule = op.rule
    batch = one(rule, 1, 0)
    assert rule.kinds[batch] is kind and of(rule, 2, 0) == (batch,)
    assert of(rule, 0, 0) == of(rule, 3, 0) and rule.kinds[one(rule, 0, 0)] is PT


# ---------------------------------------------------------------- conv

def _conv(x, k, **kw):
    return lax.conv_general_dilated(x, k, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)


def test_conv_same_padding():
    x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 6))
    op = only(lambda x, k: _conv(x, k, window_strides=(1, 1), padding="SAME"), x, k, prim="conv_general_dilated")
    rule = op.rule
    assert of(rule, 2, 0) == of(rule, 0, 0) and rule.kinds[one(rule, 0, 0)] is PT  # batch
    cin = one(rule, 0, 3)
    assert of(rule, 1, 2) == (cin,) and rule.kinds[cin] is RED  # input feature
    cout = one(rule, 1, 3)
    assert of(rule, 2, 3) == (cout,) and rule.kinds[cout] is PT  # output feature
    for d in (1, 2):
        sp = one(rule, 0, d)
        assert rule.kinds[sp] is PERM and of(rule, 2, d) == (sp,)
        assert rule.kinds[one(rule, 1, d - 1)] is NR  # kernel window


def test_conv_strided_grouped_and_1x1():
    x = jnp.ones((2, 8, 8, 6))
    op = only(
        lambda x, k: _conv(x, k, window_strides=(2, 2), padding="VALID", feature_group_count=3),
        x, jnp.ones((3, 3, 2, 9)), prim="conv_general_dilated",
    )
    rule = op.rule
    g, cin = of(rule, 0, 3)
    assert rule.sizes[g] == 3 and rule.kinds[g] is PT and rule.kinds[cin] is RED
    assert of(rule, 1, 3)[0] == g and of(rule, 2, 3)[0] == g
    assert of(rule, 0, 1) != of(rule, 2, 1)  # 8 -> 3: separate spatial factors
    op = only(lambda x, k: _conv(x, k, window_strides=(1, 1), padding="VALID"), x, jnp.ones((1, 1, 6, 4)),
              prim="conv_general_dilated")
    assert of(op.rule, 2, 1) == of(op.rule, 0, 1) and op.rule.kinds[one(op.rule, 0, 1)] is PT


def test_conv_weight_gradient_batch_groups():
    x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 1, 6))
    ops = trace(
        jax.grad(lambda k, x: jnp.sum(_conv(x, k, window_strides=(1, 1), padding="SAME", feature_group_count=3)) ** 2),
        k, x,
    )
    convs = [op for op in ops if op.name == "conv_general_dilated"]
    assert any(op.params["batch_group_count"] == 3 for op in convs)


# ---------------------------------------------------------------- windows, fft, linalg, random

def test_pooling_and_its_gradients():
    import flax.linen as nn

    x = jnp.ones((2, 8, 8, 3))
    ops = trace(jax.grad(lambda x: jnp.sum(nn.max_pool(x, (2, 2), (2, 2)) ** 2)), x)
    names = {op.name for op in ops}
    assert {"reduce_window_max", "select_and_scatter_add"} <= names
    pool = next(op for op in ops if op.name == "reduce_window_max")
    assert of(pool.rule, 1, 0) == of(pool.rule, 0, 0) and pool.rule.kinds[one(pool.rule, 0, 1)] is PERM
    ops = trace(lambda x, t: jax.jvp(lambda x: nn.max_pool(x, (2, 2), (2, 2)), (x,), (t,)), x, x)
    assert "select_and_gather_add" in {op.name for op in ops}
    trace(lambda x: nn.avg_pool(x, (2, 2), (2, 2)), x)


def test_fft_and_linalg():
    x = jnp.ones((3, 4, 8))
    op = only(lambda x: jnp.fft.rfft(x), x, prim="fft")
    assert op.rule.kinds[one(op.rule, 0, 2)] is NR and of(op.rule, 1, 0) == of(op.rule, 0, 0)
    m = jnp.eye(4)[None].repeat(3, 0)
    ops = trace(
        lambda m, b: (
            jnp.linalg.cholesky(m), jnp.linalg.qr(m), jnp.linalg.svd(m), jnp.linalg.eigh(m),
            jnp.linalg.solve(m, b),
        ),
        m, jnp.ones((3, 4, 2)),
    )
    names = {op.name for op in ops}
    assert {"cholesky", "qr", "svd", "eigh", "lu", "triangular_solve"} <= names
    for op in ops:
        if op.name in R.linalg.LINALG_CORE_RANK:
            batch = one(op.rule, 0, 0)
            assert op.rule.kinds[batch] is PT
            for t, s in enumerate(op.ins + op.outs):
                if s:
                    assert of(op.rule, t, 0) == (batch,)


def test_random_primitives():
    def f(key, x):
        k1, k2 = jax.random.split(key)
        return jax.random.normal(k1, (4, 8)) + jax.random.bernoulli(k2, 0.5, (4, 8)) * x

    ops = trace(f, jax.random.key(0), jnp.ones((4, 8)))
    names = {op.name for op in ops}
    assert {"random_split", "random_bits"} <= names
    bits = next(op for op in ops if op.name == "random_bits")
    assert all(bits.rule.kinds[f] is PT for f in range(bits.rule.num_factors))
    ops = trace(lambda k: jax.random.key_data(jax.random.split(jax.random.wrap_key_data(k), 3)),
                jnp.zeros((2,), jnp.uint32))
    assert {"random_wrap", "random_unwrap"} <= {op.name for op in ops}
    unwrap = next(op for op in ops if op.name == "random_unwrap")
    assert of(unwrap.rule, 1, 0) == of(unwrap.rule, 0, 0)
    assert unwrap.rule.kinds[one(unwrap.rule, 1, 1)] is NR
