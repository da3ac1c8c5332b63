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


def _accumulating_train_step():
    """Gradient accumulation over microbatches as MaxText's `accumulate_gradient` writes it: a scan whose carry is
    a dict of the summed loss (starting at a literal 0.0), the summed gradients (`zeros_like`) and the summed
    weights, the microbatches split over `data` (data parallel), Adam after the loop."""
    import flax.linen as nn
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))

    model, tx = MLP(), optax.adam(1e-3)

    def loss_sum(p, x, y):
        w = (y > 0).astype(jnp.float32)
        xent = optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y)
        return jnp.sum(xent * w), jnp.sum(w)

    def train_step(params, opt_state, xs, ys):
        def micro(acc, xy):
            (loss, weights), g = jax.value_and_grad(loss_sum, has_aux=True)(params, *xy)
            return {"loss": acc["loss"] + loss, "grad": jax.tree.map(jnp.add, acc["grad"], g),
                    "weights": acc["weights"] + weights}, None
        init = {"loss": 0.0, "grad": jax.tree.map(jnp.zeros_like, params), "weights": 0.0}
        acc, _ = jax.lax.scan(micro, init, (split(xs, 1, "data"), split(ys, 1, "data")))
        grads = jax.tree.map(lambda g: g / acc["weights"], acc["grad"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, acc["loss"] / acc["weights"]

    params = model.init(jax.random.key(0), jnp.ones((64, 128)))
    xs = jax.random.normal(jax.random.key(1), (4, 64, 128))
    ys = jax.random.randint(jax.random.key(2), (4, 64), 0, 10)
    return train_step, (params, tx.init(params), xs, ys)


def test_gradient_accumulation_reduces_its_gradients_once():
    from bench.pcg_zoo import check_numerics

    step, args = _accumulating_train_step()
    info = shardc.auto(step, mesh=shardc.make_mesh({"data": 8}), search=False).compiled_info(*args)
    pcg = build_pcg(info.plan, info.closed_jaxpr, fuse=True)
    every_pcg, (every,) = partial_carries(pcg)
    assert every.carries == tuple(range(6))  # the gradients' 4 and the two sums starting at a literal 0.0
    ch = choose_pcg(info.plan, info.closed_jaxpr, TOPOLOGY, max_evaluations=5)
    assert ch.chosen and ch.steps[0].rule == "partial_sum_carry"
    assert ch.time < 0.6 * ch.plan_time  # (4 microbatches: the gradients' all-reduces once, not 4 times)
    # (the carries kept are the fastest of all of them and all but the smallest few)
    assert ch.steps[0].cost_after <= simulate_pcg(every_pcg, TOPOLOGY).step_time * (1 + 1e-9)
    worst, differ = check_numerics(step, args, info.plan, ch.pcg)
    assert worst < 1e-5 and not differ, (worst, differ)


def test_the_smallest_carries_are_left_out_while_that_is_faster():
    step, args = _accumulating_train_step()
    info = shardc.auto(step, mesh=shardc.make_mesh({"data": 8}), search=False).compiled_info(*args)
    pcg = build_pcg(info.plan, info.closed_jaxpr, fuse=True)

    def partial_sizes(p):
        (loop,) = p.region_nodes()
        return [p.tensors[t].rank for t in loop.inputs if p.tensors[t].sharding.partial]

    def cost(p):  # (a scalar carried unreduced costs 25, any other saves 10: all of them cost more than none)
        return 100.0 - sum(10.0 if r else -25.0 for r in partial_sizes(p))

    new, (step_done,) = partial_carries(pcg, cost_fn=cost)
    assert sorted(partial_sizes(new)) == [1, 1, 2, 2] and step_done.carries == (0, 1, 2, 3)
    assert (step_done.cost_before, step_done.cost_after) == (100.0, 60.0)
