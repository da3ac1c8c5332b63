"""Rule core: einsum strings, RuleBuilder, validation, the conservative fallback and its warning."""
import warnings

import pytest

import shardc.rules as R
from shardc.rules import FactorKind, FactorRule, NoShardingRuleWarning

PT, RED, NR, PERM = (
    FactorKind.PASS_THROUGH,
    FactorKind.REDUCTION,
    FactorKind.NEED_REPLICATION,
    FactorKind.PERMUTATION,
)


def test_einsum_matmul_and_compound_dims():
    rule = R.einsum_rule("bsd,df->bsf", [(2, 4, 8), (8, 16)], [(2, 4, 16)])
    b, s, d, f = range(4)
    assert rule.operands == (((b,), (s,), (d,)), ((d,), (f,)))
    assert rule.results == (((b,), (s,), (f,)),)
    assert rule.kinds[d] is RED and rule.kinds[b] is PT
    assert rule.sizes == (2, 4, 8, 16)

    rule = R.einsum_rule("(ij)k->i(jk)", [(8, 4)], [(2, 16)])
    assert rule.sizes == (2, 4, 4)
    assert rule.operands == (((0, 1), (2,)),) and rule.results == (((0,), (1, 2)),)

    rule = R.einsum_rule("i1->i", [(4, 1)], [(4,)])
    assert rule.operands == (((0,), ()),)


def test_rule_str_is_shardy_like():
    rule = R.einsum_rule("ik,kj->ij", [(8, 8), (8, 16)], [(8, 16)])
    assert str(rule) == "([i, j], [j, k])->([i, k]) {i=8, j=8, k=16} reduction={j}"


def test_validate_catches_bad_rules():
    good = R.einsum_rule("ij->ji", [(2, 3)], [(3, 2)])
    good.validate([(2, 3)], [(3, 2)])
    with pytest.raises(AssertionError):
        good.validate([(2, 4)], [(4, 2)])
    dup = FactorRule(operands=(((0,), (0,)),), results=(), sizes=(2,), kinds=(PT,))
    with pytest.raises(AssertionError, match="twice"):
        dup.validate([(2, 2)], [])
    out_of_range = FactorRule(operands=(((1,),),), results=(), sizes=(2,), kinds=(PT,))
    with pytest.raises(AssertionError):
        out_of_range.validate([(2,)], [])


def test_builder_orders_factors_major_first_and_drops_unit_factors():
    b = R.RuleBuilder([(6, 1)], [(2, 3)])
    i = b.factor(2, operands={0: 0}, results={0: 0})
    j = b.factor(3, operands={0: 0}, results={0: 1})
    assert b.factor(1, operands={0: 1}) is None
    rule = b.build()
    assert rule.operands == (((i, j), ()),)
    assert rule.results == (((i,), (j,)),)
    assert rule.factor_dims(j) == ((0, 0, 1), (1, 1, 0))


def test_register_string_rule_and_lookup():
    R.register_rule("shardc_test_matmul_prim", "ij,jk->ik")
    assert R.has_rule("shardc_test_matmul_prim")
    rule = R.get_rule("shardc_test_matmul_prim")([(8, 4), (4, 2)], [(8, 2)], {})
    assert rule.kinds == (PT, RED, PT)
    assert "shardc_test_matmul_prim" in R.registered_primitives()


def test_conservative_rule_replicates_everything():
    rule = R.conservative_rule([(4, 8), ()], [(3,)])
    rule.validate([(4, 8), ()], [(3,)])
    assert rule.num_factors == 3
    assert all(k is NR for k in rule.kinds)
    assert not any(rule.propagatable(f) for f in range(rule.num_factors))
    # every factor is used by exactly one dim
    assert sorted(f for t in rule.tensors() for d in t for f in d) == [0, 1, 2]


def test_unknown_primitive_warns_once_per_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rule, conservative = R.rule_or_conservative("shardc_test_unknown_a", [(4, 8)], [(4, 8)], {})
        R.rule_or_conservative("shardc_test_unknown_a", [(2,)], [(2,)], {})
        R.rule_or_conservative("shardc_test_unknown_b", [(2,)], [(2,)], {})
    assert conservative
    rule.validate([(4, 8)], [(4, 8)])
    messages = [str(w.message) for w in caught if issubclass(w.category, NoShardingRuleWarning)]
    assert len(messages) == 2
    assert messages[0].startswith(
        "shardc has no sharding rule for primitive 'shardc_test_unknown_a'; its operands and results are replicated"
    )
    assert "shardc_test_unknown_b" in messages[1]


def test_rule_returning_none_or_failing_falls_back():
    R.register_rule("shardc_test_none_rule", lambda ins, outs, params: None)

    def broken(ins, outs, params):
        raise KeyError("dimension_numbers")

    R.register_rule("shardc_test_broken_rule", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, c1 = R.rule_or_conservative("shardc_test_none_rule", [(4,)], [(4,)], {})
        _, c2 = R.rule_or_conservative("shardc_test_broken_rule", [(4,)], [(4,)], {})
    assert c1 and c2
    messages = [str(w.message) for w in caught if issubclass(w.category, NoShardingRuleWarning)]
    assert len(messages) == 2
    assert "'shardc_test_none_rule'" in messages[0] and "does not cover" in messages[0]
    assert "KeyError" in messages[1]


def test_known_primitive_is_not_conservative_and_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rule, conservative = R.rule_or_conservative("add", [(4, 8), ()], [(4, 8)], {})
    assert not conservative
    assert rule.operands[1] == ()


def test_higher_order_primitives_have_no_rules():
    for name in ("pjit", "jit", "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call", "remat2"):
        assert name in R.HIGHER_ORDER_PRIMITIVES
        assert not R.has_rule(name)
