"""The proof record: rules the rewrite engine applies without running Z3 are exactly the rules Z3
proves now, under this verifier; anything else goes back to Z3, and a refuted rule is never applied."""
from pathlib import Path

import pytest

from shardc.cli import main
from shardc.pcg import proofs, verify
from shardc.pcg.lang import parse_rule
from shardc.pcg.library import all_rules, library_rules
from shardc.pcg.proofs import ProofRecord, load_record, recorded, rule_key, verifier_id
from shardc.pcg.verify import verify_rule

STALE = "the packaged proof record is stale: run `python -m shardc verify-rules --record`"


@pytest.fixture(autouse=True)
def fresh_verdicts():
    verify.clear_cache()
    yield
    verify.clear_cache()
    proofs.clear_record_cache()


def test_the_packaged_record_lists_exactly_the_rules_under_this_verifier():
    record = load_record()
    assert record is not None, STALE
    assert record.verifier == verifier_id(), STALE
    assert record.proved == {rule_key(r.text) for r in all_rules()}, STALE


def test_a_recorded_rule_is_proved_without_z3(monkeypatch):
    def no_z3(*args, **kwargs):
        raise AssertionError("Z3 ran on a recorded rule")

    monkeypatch.setattr(verify, "_check_instance", no_z3)
    rule = next(r for r in library_rules() if r.name == "reduce_scatter")
    v = verify_rule(rule)
    assert v.proved and v.recorded and "proof record" in str(v)
    assert verify.is_proved(rule)
    with pytest.raises(AssertionError, match="Z3 ran"):
        verify_rule(rule, use_record=False)  # what `verify-rules` runs: never the record


def test_an_edited_rule_is_not_in_the_record_and_z3_refutes_it():
    rule = next(r for r in library_rules() if r.name == "combine_ew1")
    edited = parse_rule("edited: " + rule.text.replace("combine[d](ew1[f](x))", "combine[d](x)"))[0]
    assert edited.text != rule.text
    assert not recorded(edited.text)
    v = verify_rule(edited)
    assert not v.proved and not v.recorded and v.counterexample


def test_a_record_of_another_verifier_proves_nothing(tmp_path):
    rule = library_rules()[0]
    other = ProofRecord("0" * 64, frozenset({rule_key(rule.text)}))
    assert not recorded(rule.text, other)
    assert recorded(rule.text, ProofRecord(verifier_id(), frozenset({rule_key(rule.text)})))


@pytest.mark.parametrize("text", [
    "verifier abc\nnot-a-digest reduce_scatter\n",  # a line this code never writes
    f"{'a' * 64} reduce_scatter\n",  # no verifier line
])
def test_a_malformed_record_is_not_trusted(tmp_path, text):
    path = tmp_path / "proofs.record"
    path.write_text(text)
    assert load_record(path) is None


def test_verify_rules_record_writes_what_z3_proved(tmp_path, monkeypatch, capsys):
    rules_file = tmp_path / "two.rules"
    rules_file.write_text("ok: combine[d](partition[d](x)) => x\nbad: ew1[f](combine[d](x)) => combine[d](x)\n")
    assert main(["verify-rules", "--record", str(rules_file)]) == 2  # the record is of the packaged rules only
    assert "--record" in capsys.readouterr().out

    target = tmp_path / "proofs.record"
    monkeypatch.setattr(proofs, "_default_path", lambda: target)
    monkeypatch.setattr("shardc.pcg.library.all_rules",
                        lambda: [r for t in rules_file.read_text().splitlines() for r in parse_rule(t)])
    assert main(["verify-rules", "--record"]) == 1  # one refuted
    record = load_record(Path(target))
    ok, bad = (parse_rule(t)[0] for t in rules_file.read_text().splitlines())
    assert record.verifier == verifier_id()
    assert record.proved == {rule_key(ok.text)}
    assert recorded(ok.text, record) and not recorded(bad.text, record)
