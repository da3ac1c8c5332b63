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
