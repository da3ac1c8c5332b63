"""Loop restructuring (shardc/loops.py): a scan's per-trip matmuls that need no carry run before or after the loop
for all trips, accumulated weight gradients are summed once; the program computes what it did, and under
`shardc.auto(pcg=True)` the search runs it when its plan is faster (issue 18)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardc
from bench.pcg_zoo import concrete
from bench.zoo_models import zoo
from shardc.loops import loop_rewrites, restructure_loops


def _scan_dots(closed) -> list[int]:
    """The matmuls in each top-level scan body."""
    return [sum(q.primitive.name == "dot_general" for q in e.params["jaxpr"].jaxpr.eqns)
            for e in closed.jaxpr.eqns if e.primitive.name == "scan"]


def _run(closed, flat):
    return jax.jit(lambda *x: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *x))(*flat)


def _assert_same(closed, new, flat, tol=1e-5):
    want, got = _run(closed, flat), _run(new, flat)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        w, g = np.asarray(w), np.asarray(g)
        assert w.shape == g.shape and w.dtype == g.dtype
        assert np.allclose(g, w, rtol=tol, atol=tol), float(np.max(np.abs(g - w)))


def _lstm():
    zm = next(m for m in zoo("tiny") if m.name == "lstm")
    mesh = shardc.make_mesh({"data": 2, "model": 2, "expert": 2}, jax.devices()[:8])
    step, args = zm.build(mesh)
    return step, concrete(args)


def test_the_lstm_s_loops_keep_only_the_recurrence_and_compute_the_same_step():
    step, args = _lstm()
    flat = jax.tree.leaves(args)
    closed = jax.make_jaxpr(step)(*args)
    new, reports = restructure_loops(closed)
    # forward scans: the input projection hoisted; backward scans: the input gradient sunk, the 12 gradients the
    # layer's weights and biases accumulate (4 gates x kernel, recurrent kernel, bias) summed once
    assert sorted((r.hoisted, r.sunk, r.summed) for r in reports) == [(0, 1, 12), (0, 1, 12), (1, 0, 0), (1, 0, 0)]
    assert [r.describe() for r in loop_rewrites(closed)] == [r.describe() for r in reports]
    assert sorted(_scan_dots(new)) == [1, 1, 1, 1]  # each loop: the recurrent matmul (forward or backward) only
    assert sorted(_scan_dots(closed)) == [2, 2, 4, 4]
    _assert_same(closed, new, flat)


def _weights(k=0):
    r = np.random.default_rng(k)
    return [jnp.asarray(r.normal(size=s), jnp.float32) * 0.3 for s in ((6, 5), (5, 5), (4, 7, 6), (5,))]


def test_a_hand_written_reverse_scan_with_accumulators_started_elsewhere():
    """A reverse scan: a carry-free projection (through a transpose of the constant weight, made once), a
    recurrent matmul, a weight gradient accumulated into a carry that does not start at zero and a bias sum, a
    per-trip output from a matmul no carry needs, and a scanned input passed through."""
    w, u, xs, b = _weights()

    def f(w, u, xs, b):
        def body(carry, x):
            h, gw, gb = carry
            p = x @ jnp.transpose(w.T)  # carry-free: hoisted (with the transpose, once)
            h2 = jnp.tanh(p + h @ u + b)
            gw = gw + x.T @ h2  # accumulated: summed once after the loop
            gb = gb + jnp.sum(h2, axis=0)
            return (h2, gw, gb), (h2 @ u.T, x)  # a matmul no carry needs: sunk
        init = (jnp.zeros((7, 5)), jnp.ones((6, 5)), jnp.full((5,), 2.0))
        return jax.lax.scan(body, init, xs, reverse=True)

    closed = jax.make_jaxpr(f)(w, u, xs, b)
    new, (report,) = restructure_loops(closed)
    assert (report.hoisted, report.sunk, report.summed) == (1, 1, 2)
    assert _scan_dots(new) == [1]
    _assert_same(closed, new, [w, u, xs, b])


def test_a_scan_whose_matmuls_all_need_the_carry_is_left_as_it_is():
    w, u, xs, b = _weights(1)

    def f(u, xs):
        def body(h, x):
            h = jnp.tanh(h @ u + x[:, :5])
            return h, jnp.sum(h)
        return jax.lax.scan(body, jnp.zeros((7, 5)), xs)

    closed = jax.make_jaxpr(f)(u, xs)
    assert restructure_loops(closed) is None and loop_rewrites(closed) == []


def test_a_sum_added_to_a_carry_read_elsewhere_in_the_loop_stays_a_running_sum():
    """The carry is read by more than its add (its running value is used): not an accumulator."""
    w, u, xs, b = _weights(2)

    def f(u, xs):
        def body(carry, x):
            h, g = carry
            h = jnp.tanh(h @ u + x[:, :5] + jnp.sum(g))
            g = g + x[:, :5].T @ h
            return (h, g), None
        return jax.lax.scan(body, (jnp.zeros((7, 5)), jnp.zeros((5, 5))), xs)

    closed = jax.make_jaxpr(f)(u, xs)
    out = restructure_loops(closed)
    if out is not None:  # (the carry-free slice may be hoisted; the running sum must stay in the loop)
        assert all(r.summed == 0 for r in out[1])
        _assert_same(closed, out[0], [u, xs])


@pytest.mark.parametrize("pcg", [True, False])
def test_under_pcg_the_search_runs_the_restructured_lstm_when_it_is_faster(pcg):
    """On tpu-v5e-8 (HBM-bound small matmuls) the restructured tiny LSTM plans faster: it runs, equals jax.jit,
    and compiles to the collectives its plan lists. pcg=False: the program as traced."""
    step, args = _lstm()
    af = shardc.auto(step, search=True, pcg=pcg, topology="tpu-v5e-8", budget_s=2, devices=8)
    plan = af.plan(*args)
    if not pcg:
        assert plan.loops is None and sorted(_scan_dots(plan.program)) == [2, 2, 4, 4]
        return
    assert plan.loops is not None and plan.loops.chosen and plan.loops.time < plan.loops.base_time
    assert sorted(_scan_dots(plan.program)) == [1, 1, 1, 1]
    assert "loops restructured" in plan.explain()
    got = jax.tree.leaves(af(*args))
    want = jax.tree.leaves(jax.jit(step)(*args))
    for g, w in zip(got, want):
        assert np.allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    report = shardc.check(plan)
    assert report.ok, str(report)


def test_without_its_proved_rules_the_loops_stay_as_traced(monkeypatch):
    """A rule the restructuring rests on missing from the library (or refuted): nothing is rewritten."""
    import shardc.pcg.library as library

    step, args = _lstm()
    closed = jax.make_jaxpr(step)(*args)
    monkeypatch.setattr(library, "LOOP_RULES", library.LOOP_RULES + ("no_such_rule",))
    assert restructure_loops(closed) is None


def test_the_optimizer_does_not_try_the_loop_rules():
    from shardc.pcg.library import LOOP_RULES, all_rules, loop_rules_proved
    from shardc.pcg.optimize import usable_rules

    assert loop_rules_proved()
    names = {r.name.split("~")[0] for r in usable_rules(all_rules())}
    assert names and not names & set(LOOP_RULES)


def test_a_gradient_accumulation_loop_is_left_as_written():
    """Microbatches looped to bound memory: every matmul of the body needs no carry, and the gradients are
    accumulated; running them all at once is not what the author asked for (and no recurrence would stay)."""
    w, u, xs, b = _weights(3)

    def step(w, xs):
        def body(carry, x):
            g, loss = carry
            lv, gw = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
            return (g + gw, loss + lv), None
        return jax.lax.scan(body, (jnp.zeros_like(w), 0.0), xs)[0]

    closed = jax.make_jaxpr(step)(w, xs)
    assert restructure_loops(closed) is None


def test_flax_recurrent_layers_with_lengths_and_both_directions_compute_the_same_step():
    """Flax's own recurrent building blocks as a user writes them: `nn.Bidirectional` of `nn.RNN(nn.LSTMCell)`
    (four Dense gates per input) and an `nn.GRUCell`, with per-sequence lengths (the carry kept past a sequence's
    end), dropout between; a train step with Adam. Every loop has something to move, and the step is unchanged."""
    import flax.linen as nn
    import optax

    class Tagger(nn.Module):
        @nn.compact
        def __call__(self, x, lengths, train):
            x = nn.Bidirectional(nn.RNN(nn.LSTMCell(16)), nn.RNN(nn.LSTMCell(16)))(x, seq_lengths=lengths)
            x = nn.Dropout(0.2, deterministic=not train)(x)
            x = nn.RNN(nn.GRUCell(12))(x, seq_lengths=lengths)
            return nn.Dense(3)(x)

    model, tx = Tagger(), optax.adam(1e-2)
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(4, 7, 5)), jnp.float32)
    lengths = jnp.asarray([7, 3, 5, 1], jnp.int32)
    labels = jnp.asarray(r.integers(0, 3, (4, 7)), jnp.int32)
    params = model.init(jax.random.key(0), x, lengths, False)["params"]

    def step(params, opt, x, lengths, labels, key):
        def loss_fn(p):
            logits = model.apply({"params": p}, x, lengths, True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    args = (params, tx.init(params), x, lengths, labels, jax.random.key(1))
    closed = jax.make_jaxpr(step)(*args)
    new, reports = restructure_loops(closed)
    # three forward loops (the LSTMs' four input gates hoisted, the GRU's three) and their backward loops (the
    # gradients summed once; the GRU's input gradient sunk: the LSTMs read the data, which needs none)
    assert sorted((r.hoisted, r.sunk, r.summed) for r in reports) == [(0, 0, 12), (0, 0, 12), (0, 3, 10), (3, 0, 0),
                                                                      (4, 0, 0), (4, 0, 0)]
    _assert_same(closed, new, jax.tree.leaves(args))


def _fake_plan(t: float):
    from types import SimpleNamespace

    score = SimpleNamespace(time=t, peak=0.0, feasible=True)
    return SimpleNamespace(search=SimpleNamespace(chosen=SimpleNamespace(score=score)))


def test_choose_loops_runs_the_faster_program_and_survives_a_restructured_one_it_cannot_plan():
    from annotations.errors import ShardingError
    from shardc.search.loop_choice import choose_loops

    step, args = _lstm()
    closed = jax.make_jaxpr(step)(*args)
    times = {True: 1.0, False: 2.0}  # traced: 1 s; restructured: 2 s
    program, plan, _, choice = choose_loops(closed, lambda p: (p, _fake_plan(times[p is closed]), None))
    assert program is closed and not choice.chosen and "slower, not run" in choice.summary()
    times = {True: 2.0, False: 1.0}
    program, plan, _, choice = choose_loops(closed, lambda p: (p, _fake_plan(times[p is closed]), None))
    assert program is not closed and choice.chosen and (choice.time, choice.base_time) == (1.0, 2.0)

    def planner(p):
        if p is not closed:
            raise ShardingError("cannot plan this")
        return p, _fake_plan(1.5), None

    program, plan, _, choice = choose_loops(closed, planner)
    assert program is closed and not choice.chosen and "cannot plan this" in choice.summary()


def test_with_a_plan_file_the_loops_stay_as_traced(tmp_path):
    """A plan file pins the program's decisions: pcg=True does not search a restructured program beside it."""
    step, args = _lstm()
    path = str(tmp_path / "plans.json")
    af = shardc.auto(step, search=path, pcg=True, topology="tpu-v5e-8", budget_s=1, devices=8)
    plan = af.plan(*args)
    assert plan.loops is None and sorted(_scan_dots(plan.program)) == [2, 2, 4, 4]


def test_a_layer_scan_whose_weights_differ_every_trip_is_left_as_written():
    """An LM's blocks as one nn.scan: each trip's matmuls read that layer's weights (scanned in), so running them
    all at once would read as many bytes; its backward loop's weight gradients are outputs, not sums."""
    from bench.gpt import make_train_step, setup

    model, tx, params, opt, ids = setup(layers=2, scan=True, batch=4, seq=16)
    closed = jax.make_jaxpr(make_train_step(model, tx))(params, opt, ids)
    from shardc.loops import _has_scan

    assert _has_scan(closed.jaxpr)  # (the scans are there, inside the step's calls)
    assert restructure_loops(closed) is None


def test_a_scan_inside_a_jitted_function_is_found_and_reported():
    """The step's scans inside a nested jax.jit (a call): inlined first, restructured, and `loop_rewrites` reports
    the same."""
    step, args = _lstm()
    closed = jax.make_jaxpr(jax.jit(step))(*args)
    assert not any(e.primitive.name == "scan" for e in closed.jaxpr.eqns)  # (all inside the call)
    new, reports = restructure_loops(closed)
    assert len(reports) == 4 and [r.describe() for r in loop_rewrites(closed)] == [r.describe() for r in reports]
    _assert_same(closed, new, jax.tree.leaves(args))
