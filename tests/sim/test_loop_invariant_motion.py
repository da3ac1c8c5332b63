"""Reshards of a value invariant in nested loops run where XLA's loop-invariant code motion leaves them: out of
every loop for a collective that reads the value alone, out of the innermost loop only for a collective-permute
of a piece XLA first slices at device-dependent offsets (`shardc.sim.tasks.leaves_one_loop_only`), unless
that loop has one trip (XLA inlines it) or the outer loop is a reversed scan (its index arithmetic is hoisted,
and the loop state rebuilt for that passes the offsets on unchanged). A matrix `w` is read inside a `fori_loop` nested in a `scan` in another
layout than it enters in; the simulated bytes of each collective kind must equal the compiled program's."""
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
    permute = rows["collective-permute bytes"]
    assert permute.compiled > 0  # (the pair is one XLA moves with a permute)
    for quantity, row in rows.items():
        if quantity.endswith(" bytes") and quantity != "peak memory bytes":
            assert row.predicted == row.compiled, (quantity, row.predicted, row.compiled)
    steps = reshard_steps(Sharding(src), Sharding(dst), (8, 8), 4, MESH)
    assert leaves_one_loop_only(steps, Sharding(src), (8, 8), 4, MESH) is sliced
