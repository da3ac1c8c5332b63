"""Every library rule is proved (by Z3 itself, not the proof record); wrong rules are refuted with a
counterexample; the rule language."""
import pytest

from shardc.pcg.lang import RuleSyntaxError, parse_rule, parse_rules
from shardc.pcg.library import generated_rules, library_rules
from shardc.pcg.verify import is_proved, verify_rule


def one(text):
    return parse_rule(text)[0]


def by_z3(rule):
    return verify_rule(rule, use_record=False)


def test_every_library_rule_is_proved():
    rules = library_rules()
    assert len(rules) >= 60
    failed = [str(v) for v in map(by_z3, rules) if not v.proved]
    assert not failed, "\n".join(failed)
    assert all(is_proved(r) for r in rules)


def test_every_generated_rule_is_proved():
    rules = generated_rules()
    assert len(rules) >= 100, "run python -m shardc generate-rules"
    failed = [str(v) for v in map(by_z3, rules) if not v.proved]
    assert not failed, "\n".join(failed)


def test_required_rules_are_in_the_library():
    texts = {r.text for r in library_rules()}
    for want in [
        "partition[d](reduce(x)) => reduce_scatter[d](x)",
        "partition[e](combine[d](x)) => all_to_all[d, e](x) if d != e",
        "combine[d](partition[d](x)) => x",
        "partition[d](combine[d](x)) => x",
        "add(reduce(x), reduce(y)) => reduce(add(x, y))",
        "ew1[f](combine[d](x)) => combine[d](ew1[f](x))",
        "transpose[p](reduce(x)) => reduce(transpose[p](x))",
        "dot(dot(x, a), b) => dot(x, dot(a, b))",
    ]:
        assert want in texts, want
    assert any(r.name == "fuse_dots" for r in library_rules())


@pytest.mark.parametrize("text, why", [
    # Reduce where Combine is needed
    ("wrong: add(combine[d](x), combine[d](y)) => reduce(add(x, y))", "shape"),
    ("wrong: combine[d](partition[d](x)) => reduce(partition[d](x))", "shape"),
    ("wrong: combine[d](reduce_scatter[d](x)) => reduce(combine[d](x))", "per-device"),
    # an AllToAll with its dims swapped
    ("wrong: partition[e](combine[d](x)) => all_to_all[e, d](x) if d != e", "shape"),
    # valid at degree 2, not at 4
    ("wrong: reduce(replicate(x)) => add(x, x)", "degree 4"),
    ("wrong: permute[1](permute[1](x)) => x", "degree 4"),
    # a matmul fusion with the concat on the wrong axis
    ("wrong: dot(x, w), dot(x, v) => chunk[rank(x) - 1, 0, 2](dot(x, concat[0](w, v))), "
     "chunk[rank(x) - 1, 1, 2](dot(x, concat[0](w, v)))", "shape"),
    ("wrong: add(dot(x, w), dot(y, v)) => dot(concat[0](x, y), concat[1](w, v))", "shape"),
    # reduce moved across a non-linear op
    ("wrong: ew1[f](reduce(x)) => reduce(ew1[f](x))", "value"),
])
def test_wrong_rules_are_refuted(text, why):
    v = by_z3(one(text))
    assert not v.proved
    assert v.counterexample
    r = one(text)
    assert not is_proved(r)
    if why == "degree 4":
        assert v.counterexample.startswith("degree 4")
    if why == "shape":
        assert "left side is defined but the right is not" in v.counterexample
    if why == "value":
        assert "left" in v.counterexample and "right" in v.counterexample and "inputs" in v.counterexample


def test_value_counterexample_is_concrete():
    v = by_z3(one("wrong: partition[d](combine[e](x)) => all_to_all[d, e](x) if d != e"))
    assert not v.proved
    # square shapes agree, so the counterexample is in the values: both sides are shown with inputs
    v2 = by_z3(one("wrong: reduce(x) => combine[0](x)"))
    assert not v2.proved and "device" in v2.counterexample


def test_degree_template_rule_proved_at_two_and_four():
    v = by_z3(one("t: reduce(replicate(x)) => scale[n](x)"))
    assert v.proved and v.instances >= 3


def test_global_annotation_matters():
    assert not by_z3(one("t: dot(reduce(x), w) => reduce(dot(x, w))")).proved
    assert by_z3(one("t: dot(reduce(x), w) => reduce(dot(x, w)) global w")).proved


def test_rule_language_errors():
    with pytest.raises(RuleSyntaxError, match="unknown op"):
        parse_rule("r: frobnicate(x) => x")
    with pytest.raises(RuleSyntaxError, match="only on the right"):
        parse_rule("r: neg(x) => add(x, y)")
    with pytest.raises(RuleSyntaxError, match="not bound"):
        parse_rule("r: reduce(x) => combine[d](reduce_scatter[d](x))")
    with pytest.raises(RuleSyntaxError, match="takes 1 argument"):
        parse_rule("r: neg(x, y) => x")
    with pytest.raises(RuleSyntaxError, match="global value and per device"):
        parse_rule("r: add(partition[0](x), combine[0](x)) => x")
    with pytest.raises(RuleSyntaxError, match="used twice"):
        parse_rules("a: neg(neg(x)) => x\na: neg(neg(y)) => y")


def test_round_trip_and_both_directions():
    rules = parse_rules("# comment\nr: transpose[p](combine[d](x)) => combine[pos(p, d)](transpose[p](x))\n"
                        "s: neg(reduce(x)) <=> reduce(neg(x))\n")
    assert [r.name for r in rules] == ["r", "s", "s~rev"]
    for r in rules:
        assert parse_rule(str(r))[0].text == r.text
    assert rules[2].text == "reduce(neg(x)) => neg(reduce(x))"
