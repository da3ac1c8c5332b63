"""Reshards of a value invariant in nested loops run where XLA's loop-invariant code motion leaves them: out of
every loop for a collective that reads the value alone, out of the innermost loop only for a collective-permute
or all-gather of a piece XLA first slices at device-dependent offsets (`shardc.sim.tasks.leaves_one_loop_only`),
unless that loop has one trip (XLA inlines it) or the outer loop is a reversed scan (its index arithmetic is
hoisted, and the loop state rebuilt for that passes the offsets on unchanged). A matrix `w` is read inside a
`fori_loop` nested in a `scan` in another layout than it enters in; the simulated bytes of each collective kind
must equal the compiled program's."""
import jax.numpy as jnp
import pytest
from jax import lax

import shardc
from shardc.check import compare, xla_log
from shardc.cost.reshard_path import reshard_steps
from shardc.sharding import Sharding
from shardc.sim.tasks import leaves_one_loop_only

MESH = {"x": 2, "y": 2, "z": 2}

# (w's layout where it enters the loops, its layout inside the inner loop, the permute slices first)
PAIRS = [
    ((("y", "z"), ()), (("x", "y"), ("z",)), True),  # the fuzzer's (seed 133001): slice over z, then permute
    ((("x",), ("y",)), (("x", "y"), ("z",)), True),
    (((), ("x",)), ((), ("y", "x")), True),
    ((("y", "z"), ()), (("x", "z"), ()), False),  # the whole piece moves
    (((), ("x",)), ((), ("z",)), False),
    ((("y", "x"), ()), ((), ("z",)), True),  # a slice over z alone, then an all-gather of the piece (seed 163006)
    ((("x",), ()), (("x",), ("z",)), False),  # a slice alone: no collective
    ((("x",), ("z",)), ((), ("z",)), False),  # an all-gather of the whole piece
]


def _spec(layout):
    return tuple(axes if axes else None for axes in layout)


def _program(src, dst, trips=2, reverse=False):
    def step(w, xs):
        w = shardc.shard(w, _spec(src))

        def cell(c, x):
            def inner(i, h):
                return shardc.shard(0.5 * h + jnp.tanh(h * shardc.shard(w, _spec(dst))), _spec(dst))

            c = lax.fori_loop(0, trips, inner, c + x)
            return c, c

        return lax.scan(cell, jnp.zeros_like(w), xs, reverse=reverse)[1]

    return step


CASES = [(s, d, sliced, 2, False) for s, d, sliced in PAIRS] + [
    (*PAIRS[0][:2], True, 1, False),  # a one-trip inner loop, which XLA inlines: the permute is in the outer body
    # with its offsets and leaves it (the fuzzer's seed 135013)
    (*PAIRS[0][:2], True, 2, True),  # a reversed outer scan (a scan's transpose is one): XLA hoists its index
    (*PAIRS[1][:2], True, 2, True),  # arithmetic, and the loop state it rebuilds for that lets the permute leave
    (*PAIRS[3][:2], False, 2, True),  # the outer loop too (the fuzzer's seed 136018, in the backward pass)
]


@pytest.mark.parametrize("src,dst,sliced,trips,reverse", CASES,
                         ids=[f"{s}->{d}, {n} trips{', reversed' if r else ''}" for s, d, _, n, r in CASES])
def test_an_invariant_reshard_in_nested_loops_runs_as_compiled(src, dst, sliced, trips, reverse):
    mesh = shardc.make_mesh(MESH)
    args = (jnp.ones((8, 8), jnp.float32), jnp.ones((3, 8, 8), jnp.float32))
    auto = shardc.auto(_program(src, dst, trips, reverse), mesh=mesh, search=False)
    info = auto.compiled_info(*args)
    plan = info.plan
    with xla_log() as log:
        compiled = info.jitted.lower(*args).compile()
    rows = {r.quantity: r for r in compare(plan, compiled, log).rows}
    steps = reshard_steps(Sharding(src), Sharding(dst), (8, 8), 4, MESH)
    first = next((c[0] for _, c in steps if c), None)
    if first is not None:  # (the pair is one XLA moves with that collective first)
        assert rows[f"{first.kind} bytes"].compiled > 0
    for quantity, row in rows.items():
        if quantity.endswith(" bytes") and quantity != "peak memory bytes":
            assert row.predicted == row.compiled, (quantity, row.predicted, row.compiled)
    assert leaves_one_loop_only(steps, Sharding(src), (8, 8), 4, MESH) is sliced


# A matrix hinted inside the loops (a hint of a loop-invariant value is invariant too): w enters the outer loop in
# one layout, is hinted to a second either in the outer body or in the inner one, and to a third for the dot in the
# inner one. (where the second hint is, w's three layouts, reversed outer scan, all-to-alls of w compiled)
_PERMUTE, _GATHER = (("y", None), ("x", None), (None, "x")), (("x", "y"), ("x", None), (None, "x"))
_SLICE, _NOTHING = ((None, None), ("x", None), (None, "x")), (("x", None), ("x", None), (None, "x"))
HINTED = [
    ("outer body", _PERMUTE, False, 3),  # a collective enters the inner loop: the all-to-all stays in the outer one
    ("outer body", _PERMUTE, True, 1),  # ... unless the outer scan is reversed
    ("outer body", _GATHER, False, 3),
    ("outer body", _SLICE, False, 1),  # no collective enters: it leaves both
    ("inner body", _PERMUTE, False, 3),  # after a permute that leaves the inner loop only, it cannot leave further
    ("inner body", _PERMUTE, True, 1),
    ("inner body", _GATHER, False, 1),
    ("inner body", _NOTHING, False, 1),
]


@pytest.mark.parametrize("where,layouts,reverse,runs", HINTED,
                         ids=[f"{w}, {ls[0]}->{ls[1]}->{ls[2]}{', reversed' if r else ''}" for w, ls, r, _ in HINTED])
def test_reshards_of_a_matrix_hinted_in_nested_loops_run_as_compiled(where, layouts, reverse, runs):
    outer, second, inside = layouts

    def step(h0, xs, w):
        w = shardc.shard(w, outer)

        def cell(c, x):
            w1 = shardc.shard(w, second) if where == "outer body" else w

            def body(i, h):
                wc = shardc.shard(w1 if where == "outer body" else shardc.shard(w1, second), inside)
                return 0.5 * h + 0.5 * jnp.tanh(h @ wc)

            c = lax.fori_loop(0, 2, body, c + x)
            return c, c

        return lax.scan(cell, h0, xs, reverse=reverse)[1]

    args = (jnp.ones((4, 12), jnp.float32), jnp.ones((3, 4, 12), jnp.float32), jnp.ones((12, 12), jnp.float32))
    info = shardc.auto(step, mesh=shardc.make_mesh({"x": 4, "y": 2}), search=False).compiled_info(*args)
    with xla_log() as log:
        compiled = info.jitted.lower(*args).compile()
    rows = {r.quantity: r for r in compare(info.plan, compiled, log).rows}
    assert rows["all-to-all bytes"].compiled == runs * 12 * 12 * 4 // 4  # (each device's piece of w, per run)
    for quantity, row in rows.items():
        if quantity.endswith(" bytes") and quantity != "peak memory bytes":
            assert row.predicted == row.compiled, (quantity, row.predicted, row.compiled)


# A matrix entering the inner loop through an all-to-all (hinted [-, x] -> [x, -] in the forward outer body): XLA takes
# the all-to-all out of both loops, and the reshard inside the inner body with it, whichever collective it has (the
# fuzzer's seed 160010; after a permute or an all-gather entering, the inner reshard runs once per outer trip).
# (the inner body's layout of w, the collective of its reshard)
AFTER_AN_ALL_TO_ALL = [
    ((None, "x"), "all-to-all"),  # back to the outer layout
    (("y", "x"), "collective-permute"),  # a slice, then a permute of the smaller piece (`leaves_one_loop_only`)
    ((None, None), "all-gather"),
]


@pytest.mark.parametrize("inside,kind", AFTER_AN_ALL_TO_ALL, ids=[f"[x, -]->{s}" for s, _ in AFTER_AN_ALL_TO_ALL])
def test_reshards_of_a_matrix_entering_through_an_all_to_all_leave_both_loops(inside, kind):
    def step(h0, xs, w):
        w = shardc.shard(w, (None, "x"))

        def cell(c, x):
            w1 = shardc.shard(w, ("x", None))  # the all-to-all entering the inner loop

            def body(i, h):
                return 0.5 * h + 0.5 * jnp.tanh(h @ shardc.shard(w1, inside))

            c = lax.fori_loop(0, 2, body, c + x)
            return c, c

        return lax.scan(cell, h0, xs)[1]

    args = (jnp.ones((4, 12), jnp.float32), jnp.ones((3, 4, 12), jnp.float32), jnp.ones((12, 12), jnp.float32))
    info = shardc.auto(step, mesh=shardc.make_mesh({"x": 4, "y": 2}), search=False).compiled_info(*args)
    with xla_log() as log:
        compiled = info.jitted.lower(*args).compile()
    report = compare(info.plan, compiled, log)
    rows = {r.quantity: r for r in report.rows}
    assert rows[f"{kind} bytes"].compiled > 0
    for quantity, row in rows.items():
        if quantity.endswith(" bytes") and quantity != "peak memory bytes":
            assert row.predicted == row.compiled, (quantity, row.predicted, row.compiled)
