"""Loop restructuring (shardc/loops.py) under the fuzzer: generated programs with loops (their train steps'
backward loops too) rewritten by `restructure_loops` compute what the program computes. Fixed seeds."""
import jax
import numpy as np

import fuzzlib
from shardc.loops import restructure_loops



def _check(prog: fuzzlib.Program) -> int:
    """How many loops were restructured in `prog`'s program, after checking it computes the same."""
    fun = fuzzlib.program_function(prog)
    args = fuzzlib.make_args(prog, 0)
    closed = jax.make_jaxpr(fun)(*args)
    out = restructure_loops(closed)
    if out is None:
        return 0
    new, reports = out
    flat = jax.tree.leaves(args)
    run = lambda c: jax.jit(lambda *x: jax.core.eval_jaxpr(c.jaxpr, c.consts, *x))(*flat)  # noqa: E731
    for w, g in zip(run(closed), run(new), strict=True):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        assert w.shape == g.shape, fuzzlib.describe(prog)
        scale = 1.0 + np.max(np.abs(w), initial=0.0)
        assert np.max(np.abs(g - w), initial=0.0) <= 1e-4 * scale, (fuzzlib.describe(prog),
                                                                    [r.describe() for r in reports])
    return len(reports)


def test_restructured_loops_compute_what_the_program_computes():
    seen = fuzzlib.check_seeded(41000, 40, _check, max_ops=8, ops=fuzzlib.LOOP_OPS)
    assert len(seen) >= 40 and sum(1 for n in seen if n) >= 5, seen


def test_programs_with_their_loops_restructured_run_sharded_as_the_programs_compute():
    """The restructured programs through the whole oracle (`check_program(loops=True)`: planned with their hints,
    sharded results equal to the program as written, compiled collectives the plan's). `python bench/fuzz.py
    --loops` is the long soak."""
    from shardc.loops import loop_rewrites

    def check(prog: fuzzlib.Program) -> int:
        fuzzlib.check_program(prog, loops=True)
        closed = jax.make_jaxpr(fuzzlib.program_function(prog))(*fuzzlib.make_args(prog, 0))
        return len(loop_rewrites(closed))

    seen = fuzzlib.check_seeded(45000, 16, check, max_ops=8, ops=fuzzlib.LOOP_OPS)
    assert len(seen) >= 16 and sum(1 for n in seen if n) >= 4, seen
