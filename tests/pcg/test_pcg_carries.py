"""Partial-sum loop carries (`shardc.pcg.carries`): a scan accumulating a gradient reduced every trip carries each
device's share of the sum instead, and reduces once after the loop; the rewrite runs only on carries it is
correct for, and only while the rules it rests on are proved."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc import split
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg
from shardc.pcg import carries as carries_mod
from shardc.pcg.carries import partial_carries
from shardc.pcg.choice import choose_pcg, jit_pcg
from shardc.pcg.lang import parse_rule
from shardc.pcg.ops import Reduce, ReduceScatter
from shardc.pcg.simcost import simulate_pcg

TOPOLOGY = "h100-sxm-8"


def _accumulate(start):
    """A weight-gradient accumulation over a scan: batch split over `data`, the sum kept split over `data`."""
    def step(w, xs, ys):
        def body(acc, xy):
            x, y = xy
            g = split(x, 0, "data").T @ split(y, 0, "data")  # (contracts the split batch: partial sums)
            return start.update(acc, g), None
        acc, _ = jax.lax.scan(body, start.init(w), (xs, ys))
        return w - 0.1 * split(acc, 0, "data")
    return step


class _FromZero:
    init = staticmethod(jnp.zeros_like)
    update = staticmethod(lambda acc, g: acc + g)


class _FromW:
    init = staticmethod(lambda w: w)
    update = staticmethod(lambda acc, g: acc + g)


class _ReadInBody:
    init = staticmethod(jnp.zeros_like)
    update = staticmethod(lambda acc, g: acc + g + jnp.tanh(acc))


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (32, 16)), jax.random.normal(k[1], (5, 512, 32)),
            jax.random.normal(k[2], (5, 512, 16)))


def _planned(start):
    step = _accumulate(start)
    args = _args()
    info = shardc.auto(step, mesh=shardc.make_mesh({"data": 8}), search=False).compiled_info(*args)
    return step, args, info, build_pcg(info.plan, info.closed_jaxpr, fuse=True)


def _reductions(pcg):
    return [n for n in pcg.nodes if isinstance(n.op, (Reduce, ReduceScatter))]


def test_an_accumulating_scan_carries_partial_sums_and_reduces_once():
    step, args, info, pcg = _planned(_FromZero)
    (loop,) = pcg.region_nodes()
    assert _reductions(loop.op.bodies[0]), "the plan reduces in the loop: nothing to rewrite"
    new, done = partial_carries(pcg)
    assert [(d.carries, [str(s) for s in d.layouts]) for d in done] == [((0,), ["[-, -] partial(data)"])]
    (loop,) = new.region_nodes()
    assert not _reductions(loop.op.bodies[0])  # no collective left in the loop
    assert [str(n.op) for n in _reductions(new)] == ["reduce_scatter[0,data]"]  # one, after it
    fn = lower_pcg(new)
    np.testing.assert_allclose(np.asarray(fn(*args)[0]), np.asarray(jax.jit(step)(*args)), rtol=1e-5, atol=1e-5)
    hlo = fn.lower(*args).compile().as_text()
    assert hlo_collectives(hlo) == new.collectives() == {"reduce-scatter": 1}
    assert simulate_pcg(new, TOPOLOGY).step_time < simulate_pcg(pcg, TOPOLOGY).step_time


@pytest.mark.parametrize("start", [_FromW, _ReadInBody], ids=["not_starting_at_zero", "read_in_the_body"])
def test_a_carry_it_is_not_correct_for_is_kept(start):
    step, args, info, pcg = _planned(start)
    new, done = partial_carries(pcg)
    assert done == [] and new is pcg


def test_it_runs_only_on_proved_rules(monkeypatch):
    _, _, _, pcg = _planned(_FromZero)
    monkeypatch.setattr(carries_mod, "CARRY_RULES", carries_mod.CARRY_RULES + ("no_such_rule",))
    assert partial_carries(pcg) == (pcg, [])
    monkeypatch.undo()
    import shardc.pcg.library as library

    (wrong,) = parse_rule("reduce_add: add(reduce(x), reduce(y)) => reduce(x)")  # (Z3 refutes it)
    rules = [wrong if r.name == "reduce_add" else r for r in library.library_rules()]
    monkeypatch.setattr(library, "library_rules", lambda: rules)
    assert partial_carries(pcg) == (pcg, [])


def test_choose_pcg_keeps_it_when_faster_and_says_so():
    step, args, info, pcg = _planned(_FromZero)
    ch = choose_pcg(info.plan, info.closed_jaxpr, TOPOLOGY, max_evaluations=5)
    assert ch.chosen and ch.steps[0].rule == "partial_sum_carry"
    assert ch.steps[0].cost_after < ch.steps[0].cost_before
    assert "partial_sum_carry" in str(ch) and "reduced once after the loop" in str(ch)
    got = jit_pcg(info.plan, ch.pcg)(*args)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(jax.jit(step)(*args)), rtol=1e-5, atol=1e-5)
