"""Matching tries a rule's root only where its operands can match (`shardc.pcg.match._candidates`): a term
`ew1(combine(x))` at the readers of combines, a second root `dot(x, u)` at the readers of the `x` the first bound.
It must find every match the plain scan over all nodes of the root's kind finds, in the same order."""
import shardc
from shardc.pcg import build_pcg
from shardc.pcg import match as match_module
from shardc.pcg.library import all_rules
from shardc.pcg.match import find_matches
from shardc.pcg.optimize import usable_rules
from tests.pcg.test_pcg_qkv import _step_and_args


def _match_list(pcg, rules):
    return [(r.name, m.roots, tuple(sorted(m.tensors.items())), tuple(sorted(m.params.items())), m.axes, m.axes_b)
            for r in rules for m in find_matches(pcg, r)]


def test_anchored_roots_find_what_a_scan_of_every_node_finds(monkeypatch):
    step, args = _step_and_args(64, 4, 8)  # attention with Megatron hints, its gradient and an SGD step
    c = shardc.auto(step, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)
    rules = usable_rules(all_rules())
    anchored = _match_list(pcg, rules)
    narrowed = [t for r in rules for t in r.lhs if not isinstance(t, match_module.Var)
                and len(match_module._candidates(pcg, t)) < len(match_module._kind_index(pcg).get(t.op, []))]

    scanned_pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)  # (a PCG of its own: no memoised candidates)
    monkeypatch.setattr(match_module, "_read_from", lambda pcg, tensors, tids: tids)  # every node of the kind
    scanned = _match_list(scanned_pcg, rules)

    assert anchored == scanned
    assert len({m[0] for m in anchored}) >= 5  # rules of several kinds match (collectives moved, dots fused, ...)
    assert any(m[0].startswith("fuse_dots") for m in anchored)  # a two-root rule (q, k, v read one input)
    assert len(narrowed) >= 20  # the anchoring leaves out roots for many rules' terms


def test_matches_near_some_nodes_are_those_of_the_whole_pcg_rooted_there():
    """Where the root must be near the last rewrite (`find_matches(..., near)`, as the lookahead and a later pass
    look), the roots tried are the few near tensors of the root's kind (`_candidates_in`): the matches are those of
    the whole PCG with a root among them, in the same order."""
    step, args = _step_and_args(64, 4, 8)
    c = shardc.auto(step, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)
    rules = usable_rules(all_rules())
    everywhere = {r.name: [m for m in find_matches(pcg, r)] for r in rules}
    checked = 0
    seeds = [{min(m.nodes)} for ms in everywhere.values() for m in ms[:2]]  # (a node of a match, then any three)
    seeds += [{n.id for n in pcg.nodes[start:start + 3]} for start in range(0, len(pcg.nodes), 37)]
    for ids in seeds:
        for r in rules:
            near = match_module.roots_near(pcg, ids, max(match_module.term_depth(t) for t in r.lhs))
            got = [(m.roots, m.tensors) for m in find_matches(pcg, r, near)]
            assert got == [(m.roots, m.tensors) for m in everywhere[r.name] if set(m.roots) & near], r.name
            checked += len(got)
    assert checked >= 20


def test_a_rule_left_out_near_some_nodes_has_no_match_touching_them():
    """A rule none of whose left-hand ops the nodes near a rewrite could be (`node_kinds`, `lhs_ops`) is not looked
    for there (the lookahead, a later pass): every match touching some nodes is of a rule that is kept for them."""
    step, args = _step_and_args(64, 4, 8)
    c = shardc.auto(step, mesh=shardc.make_mesh({"data": 2, "model": 4}), search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr, fuse=True)
    rules = usable_rules(all_rules())
    matches = [(r, m) for r in rules for m in find_matches(pcg, r)]
    left_out = touched = 0
    for start in range(0, len(pcg.nodes), 5):
        ids = {n.id for n in pcg.nodes[start:start + 4]}
        kinds = match_module.node_kinds(pcg, ids)
        kept = {r.name for r in rules if match_module.lhs_ops(r) & kinds}
        left_out += len(rules) - len(kept)
        for r, m in matches:
            if m.nodes & ids:
                assert r.name in kept, (r.name, sorted(ids))
                touched += 1
    assert touched >= 30 and left_out > 10 * len(range(0, len(pcg.nodes), 5))  # (most rules are left out somewhere)
