"""`dotc[a, b]`: dots contracting any one dim of each operand (a Dense layer's backward dots, `einsum`s), which
the `dot` rules (`x @ w` only) do not match; the rules over them are proved and pay where a `dot` rule would."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from shardc import replicate, split
from shardc.pcg import build_pcg, hlo_collectives, lower_pcg, optimize
from shardc.pcg.lang import parse_rules
from shardc.pcg.library import library_rules
from shardc.pcg.match import find_matches
from shardc.pcg.simcost import SimCost
from shardc.pcg.verify import verify_rule


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def _gathered_then_dots(g, w, v):
    h = replicate(split(g, 0, "data") * 2.0)  # an all-gather of h, then three dots reading it
    return jnp.tanh(jnp.einsum("bk,nk->bn", h, w)), jnp.einsum("bn,bk->nk", v, h), jnp.tanh(h @ w.T)


def _args():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (256, 2048)), jax.random.normal(k[1], (256, 2048)) / 16,
            jax.random.normal(k[2], (256, 128)))


def _pcg(mesh):
    c = shardc.auto(_gathered_then_dots, mesh=mesh, search=False).compiled_info(*_args())
    return build_pcg(c.plan, c.closed_jaxpr)


def test_dotc_takes_the_dots_the_dot_rules_do_not(mesh):
    pcg = _pcg(mesh)
    rules = {r.name: r for r in library_rules()}
    matched = {name: [m.params for m in find_matches(pcg, rules[name])] for name in ("combine_dot", "combine_dotc")}
    # `h @ w.T` is `x @ w` to JAX (a transpose, then the plain dot): the dot rule's; `bk,nk->bn` contracts
    # the last dims of both: dotc[1, 1]'s; `bn,bk->nk` contracts the gathered dim itself, which no rule moves
    assert len(matched["combine_dot"]) == 1
    assert [(p["a"], p["b"]) for p in matched["combine_dotc"]] == [(1, 1)]


def _gathered_then_einsum(g, w):
    h = replicate(split(g, 0, "data") * 2.0)
    return jnp.tanh(jnp.einsum("bk,nk->bn", h, w))


def test_a_gather_before_an_einsum_moves_after_it(mesh):
    """`einsum("bk,nk->bn", h, w)` of an all-gathered h: gathering its result (256 x 256) instead of h (256 x
    2048) pays, and only `combine_dotc` can say so."""
    args = _args()[:2]
    c = shardc.auto(_gathered_then_einsum, mesh=mesh, search=False).compiled_info(*args)
    pcg = build_pcg(c.plan, c.closed_jaxpr)
    sim = SimCost("h100-sxm-8")
    with_dotc = optimize(pcg, library_rules(), cost_fn=sim)
    without = optimize(pcg, [r for r in library_rules() if "dotc" not in r.name], cost_fn=sim)
    assert "combine_dotc" in [s.rule for s in with_dotc.steps]
    assert with_dotc.cost < 0.9 * without.cost and without.cost == sim(pcg)
    fn = lower_pcg(with_dotc.pcg)
    np.testing.assert_allclose(np.asarray(fn(*args)[0]), np.asarray(_gathered_then_einsum(*args)), rtol=1e-4,
                               atol=1e-4)
    assert hlo_collectives(fn.lower(*args).compile().as_text()) == with_dotc.pcg.collectives()
    assert with_dotc.pcg.collectives()["all-gather"] == 1  # of the result


@pytest.mark.parametrize("text", [
    "w1: dotc[a, b](combine[d](x), w) => combine[d](dotc[a, b](x, w)) if d > a global w",  # dim not shifted
    "w2: dotc[a, b](x, combine[d](w)) => combine[rank(x) - 1 + d](dotc[a, b](x, w)) if d > b global x",
    "w3: partition[d](dotc[a, b](x, w)) => dotc[a, b](partition[d](x), w) if d >= a, d < rank(x) - 1",
    "w4: reduce(dotc[a, b](partition[a](x), partition[b](w))) => dotc[b, a](x, w)",  # contracting dims swapped
    "w5: dotc[a, b](reduce(x), w) => reduce(dotc[a, b](x, w))",  # w per device: not linear in x alone
    "w6: reduce(dotc[a, b](x, w)) => concat[1](reduce(dotc[a, b](chunk[0, 0, 2](x), w)), "
    "reduce(dotc[a, b](chunk[0, 1, 2](x), w))) if a > 0",  # halves joined on the wrong dim
])
def test_wrong_dotc_rules_are_refuted(text):
    (rule,) = parse_rules(text)
    assert not verify_rule(rule, use_record=False).proved
