"""The substitution engine under the fuzzer (issue 18): generated programs' plans become PCGs, random proved
rewrites are applied, and the `shard_map` lowering (what `shardc.auto(pcg=True)` runs for a PCG it chooses)
must compute what the unsharded program computes with the collectives the PCG names (`pcg_check.check_pcg`).
Fixed seeds: every run draws the same programs. `python bench/fuzz.py --pcg` is the long soak."""
import itertools

import jax
import pytest

import fuzzlib
import shardc
import pcg_check
from fuzzlib import Program, Step

BUCKETS = 2
PER_BUCKET = 15


def _run_bucket(bucket: int) -> None:
    draws = itertools.count()  # (each program's own seed for its arguments and rewrites)
    seen = fuzzlib.check_seeded(31000 + bucket, PER_BUCKET, lambda prog: pcg_check.check_pcg(prog, seed=next(draws)),
                                max_ops=12)
    assert len(seen) >= PER_BUCKET, f"only {len(seen)} programs ran"
    assert sum(1 for o in seen if o.rewrites) >= 3, "too few programs were rewritten to test the engine"


@pytest.mark.parametrize("bucket", range(BUCKETS))
def test_rewritten_pcgs_compute_the_unsharded_values(bucket):
    _run_bucket(bucket)


def test_rewritten_pcgs_of_searched_plans_compute_the_unsharded_values():
    """The same on the strategy search's plans (`check_pcg(search=True)`: layouts no hint asks for)."""
    draws = itertools.count()
    seen = fuzzlib.check_seeded(31100, 10, lambda prog: pcg_check.check_pcg(prog, seed=next(draws), search=True),
                                max_ops=12)
    assert len(seen) >= 10 and sum(1 for o in seen if o.rewrites) >= 2


# Programs the engine's fuzzing found wrong, shrunk (each failed before its fix).
UPDATE_ONE_ROW_OF_A_SPLIT_DIM = Program(mesh=(("x", 2), ("y", 4)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(8, 4, 8)),
    Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 0), ("axes", 4)), shape=(8, 4, 8)),
    # its gradient: a dynamic_update_slice writing one row of a dim split over y (each device wrote its own)
    Step(kind="dynamic_slice", args=(1,), attrs=(("start", (0, 0, 0)),), shape=(1, 4, 1)),
), outputs=(2,))


MIN_OVER_A_SPLIT_DIM = Program(mesh=(("x", 2), ("y", 2), ("z", 2)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(8,)),
    Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 0), ("axes", 2)), shape=(8,)),
    # partial minima over x: their all-reduce takes the min (it added them)
    Step(kind="reduce", args=(0,), attrs=(("fn", "min"), ("dims", (0,))), shape=()),
), outputs=(2,))

ONE_GATHER_OVER_A_SIZE_ONE_AXIS = Program(mesh=(("x", 1), ("y", 8)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(16, 1, 2)),
    Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 2), ("axes", "x")), shape=(16, 1, 2)),
    Step(kind="input", args=(), attrs=(), shape=(6, 1, 2)),
    Step(kind="concat", args=(2, 1), attrs=(("dim", 0),), shape=(22, 1, 2)),
    Step(kind="hint", args=(0,), attrs=(("how", "shard"), ("spec", (("y", "x"), "?", None))), shape=(16, 1, 2)),
    # all-gathered over y and over y+x (x of size 1): one collective after XLA's CSE (the PCG named two)
    Step(kind="dynamic_slice", args=(4,), attrs=(("start", (5, 0, 0)),), shape=(2, 1, 2)),
), outputs=(3, 5))


GATHER_OUT_OF_BOUNDS_OF_A_SPLIT_DIM = Program(mesh=(("x", 2), ("y", 4)), steps=(
    Step(kind="input", args=(), attrs=(("meta", ("x", None, None)),), shape=(4, 1, 6)),
    # rows 4 (out of bounds: the fill value, NaN, not the pieces' masked zeros) and 3, -1, 0 of a dim split over x
    Step(kind="gather", args=(0,), attrs=(("dim", 0), ("indices", ((4, 3), (-1, 0)))), shape=(2, 2, 1, 6)),
    Step(kind="input", args=(), attrs=(), shape=(1,)),
    Step(kind="binary", args=(0, 2), attrs=(("fn", "mul"),), shape=(4, 1, 6)),
), outputs=(1,))

WHOLE_UPDATE_OF_A_GATHERED_VALUE = Program(mesh=(("x", 2), ("y", 1), ("z", 4)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(4, 2)),
    Step(kind="hint", args=(0,), attrs=(("how", "replicate"),), shape=(4, 2)),
    Step(kind="input", args=(), attrs=(("meta", (None, ("y", "x"), None)),), shape=(2, 4, 2)),
    Step(kind="dynamic_slice", args=(2,), attrs=(("start", (0, 0, 0)),), shape=(1, 3, 1)),
    Step(kind="broadcast", args=(3,), attrs=(("pos", 2),), shape=(1, 3, 3, 1)),
    Step(kind="input", args=(), attrs=(), shape=(1, 3, 3, 1)),
    # overwritten whole: XLA never reads the all-gathered operand (the PCG named its all-gather)
    Step(kind="update_slice", args=(4, 5), attrs=(("start", (0, 0, 0, 0)),), shape=(1, 3, 3, 1)),
), outputs=(6,))

SLICE_OF_THE_OTHER_CONCATENATED_OPERAND = Program(mesh=(("x", 2), ("y", 2), ("z", 2)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(4, 6)),
    Step(kind="input", args=(), attrs=(), shape=(2, 6)),
    Step(kind="scatter_add", args=(0, 1), attrs=(("dim", 0), ("indices", (3, 2))), shape=(4, 6)),
    Step(kind="input", args=(), attrs=(("meta", (("x", "y"), None)),), shape=(4, 6)),
    Step(kind="concat", args=(3, 0), attrs=(("dim", 0),), shape=(8, 6)),
    # reads only the second operand: XLA never reads the first (the PCG named its all-gather)
    Step(kind="slice", args=(4,), attrs=(("start", (6, 0)), ("limit", (7, 6)), ("strides", (2, 1))), shape=(1, 6)),
), outputs=(5,))


MAX_OF_ONE_VALUE_TWICE = Program(mesh=(("x", 2), ("y", 1), ("z", 4)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(12,)),
    # XLA drops max(x, x)'s second operand for the first: its value matters (zeros there gave max(x, 0))
    Step(kind="binary", args=(0, 0), attrs=(("fn", "max"),), shape=(12,)),
    Step(kind="input", args=(), attrs=(), shape=(12,)),
    Step(kind="einsum", args=(1, 2), attrs=(("spec", "a,a->a"),), shape=(12,)),
    Step(kind="input", args=(), attrs=(("high", 12),), shape=(2, 3), dtype="int32"),
    Step(kind="gather", args=(3, 4), attrs=(("dim", 0),), shape=(2, 3)),
    Step(kind="slice", args=(5,), attrs=(("start", (0, 2)), ("limit", (2, 3)), ("strides", (1, 1))), shape=(2, 1)),
), outputs=(6,))


A_CONSTANT_OUTPUT = Program(mesh=(("x", 2), ("y", 2), ("z", 2)), steps=(  # (the PCG refused it: "a constant")
    Step(kind="input", args=(), attrs=(), shape=(8, 8)),  # its gradient, under constant cotangents, is zeros
    Step(kind="input", args=(), attrs=(), shape=(8, 3, 1)),
    Step(kind="einsum", args=(1, 1), attrs=(("spec", "abc,adc->b"),), shape=(3,)),
    Step(kind="einsum", args=(2, 1), attrs=(("spec", "a,bac->a"),), shape=(3,)),
), outputs=(0, 3), const_cotangents=True)


def test_a_program_returning_a_constant_has_a_pcg():
    assert pcg_check.check_pcg(A_CONSTANT_OUTPUT).unsupported is None


# seed 900, shrunk: the scatter-add's gradient passes jax's `reshard`, which the PCG ran replicated (an all-gather
# the plan does not make, which XLA removed: the PCG named 4, 3 compiled); now its operand, placed
A_JAX_RESHARD = Program(mesh=(("x", 2), ("y", 4)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(16, 12, 1)),
    Step(kind="hint", args=(0,), attrs=(("how", "shard"), ("spec", (None, ("y",), None))), shape=(16, 12, 1)),
    Step(kind="input", args=(), attrs=(), shape=(3, 16, 12, 1)),
    Step(kind="scan", args=(1, 2), attrs=(("inner", None),), shape=(3, 16, 12, 1)),
    Step(kind="input", args=(), attrs=(), shape=(1, 1, 11, 1)),
    Step(kind="update_slice", args=(3, 4), attrs=(("start", (0, 2, 1, 0)),), shape=(3, 16, 12, 1)),
    Step(kind="scatter_add", args=(5, 2), attrs=(("dim", 3), ("indices", (0,))), shape=(3, 16, 12, 1)),
    Step(kind="input", args=(), attrs=(), shape=(3, 16, 12, 1)),
    Step(kind="where", args=(3, 7), attrs=(), shape=(3, 16, 12, 1)),
), outputs=(6,))


A_SELECT_OF_ONE_VALUE = Program(mesh=(("x", 4), ("y", 2)), steps=(  # seed 1000, cut down
    Step(kind="input", args=(), attrs=(), shape=(1, 8)),
    Step(kind="hint", args=(0,), attrs=(("how", "shard"), ("spec", ("?", ("y",)))), shape=(1, 8)),
    Step(kind="concat", args=(0, 1), attrs=(("dim", 1),), shape=(1, 16)),
    # where(p, x, x) is x to XLA: its all-gather is the concatenate's (the PCG named two)
    Step(kind="where", args=(0, 1), attrs=(), shape=(1, 8)),
    Step(kind="slice", args=(3,), attrs=(("start", (0, 4)), ("limit", (1, 7)), ("strides", (1, 2))), shape=(1, 2)),
), outputs=(2, 4))


SUMS_OF_A_VALUE_AND_OF_ITS_RESHAPE = Program(mesh=(("x", 2), ("y", 2), ("z", 2)), steps=(  # seed 1201, shrunk
    Step(kind="input", args=(), attrs=(), shape=(4, 4, 3)),
    Step(kind="transpose", args=(0,), attrs=(("perm", (0, 2, 1)),), shape=(4, 3, 4)),
    Step(kind="reshape", args=(1,), attrs=(), shape=(48,)),
    Step(kind="input", args=(), attrs=(("meta", (None, ("x", "y"))),), shape=(3, 48)),
    Step(kind="scan", args=(2, 3), attrs=(("inner", ("?",)),), shape=(3, 48)),  # (lays the reshape out over x+y)
    Step(kind="input", args=(), attrs=(), shape=(6, 96)),
    Step(kind="slice", args=(5,), attrs=(("start", (2, 0)), ("limit", (4, 96)), ("strides", (2, 1))), shape=(1, 96)),
    # each einsum sums a whole operand: the transpose and its reshape, split alike; XLA's simplifier sums the
    # reshape's operand instead, so its all-reduce is the other's (the PCG named two)
    Step(kind="einsum", args=(6, 1), attrs=(("spec", "ab,cde->b"),), shape=(96,)),
    Step(kind="einsum", args=(7, 2), attrs=(("spec", "a,b->a"),), shape=(96,)),
    Step(kind="input", args=(), attrs=(), shape=(2, 1)),
    Step(kind="update_slice", args=(5, 9), attrs=(("start", (2, 0)),), shape=(6, 96)),
), outputs=(8,))

A_LOOP_INVARIANT_GATHERED_IN_TWO_LOOPS = Program(mesh=(("x", 2), ("y", 1), ("z", 4)), steps=(  # seed 1204, shrunk
    Step(kind="input", args=(), attrs=(), shape=(16,)),
    Step(kind="input", args=(), attrs=(("high", 16),), shape=(4,), dtype="int32"),
    Step(kind="gather", args=(0, 1), attrs=(("dim", 0),), shape=(4,)),
    Step(kind="broadcast", args=(2,), attrs=(("pos", 0),), shape=(4, 4)),
    Step(kind="input", args=(), attrs=(), shape=(3, 4, 4)),
    # the inner loop's matrix, gathered in its forward and its backward loops: XLA takes both all-gathers out of
    # the loops, where they are one (the PCG named two)
    Step(kind="nested_loop", args=(3, 4, 3), attrs=(("n", 2), ("inner", (("x",), None))), shape=(3, 4, 4)),
), outputs=(5,))

TWO_LOOPS_OF_ONE_INPUT = Program(mesh=(("x", 2), ("y", 2), ("z", 2)), steps=(  # seed 1440 (--pcg --search)
    Step(kind="input", args=(), attrs=(), shape=(4,)),
    # two fori_loops of one input, different only by a hint: in the PCG (no hint ops) they are one loop on one
    # value, which XLA's CSE keeps once, merging the all-gathers of their results (the PCG named 6, XLA made 5)
    Step(kind="fori", args=(0,), attrs=(("n", 2), ("inner", (("y",),))), shape=(4,)),
    Step(kind="hint", args=(1,), attrs=(("how", "shard"), ("spec", (("z", "x"),))), shape=(4,)),
    Step(kind="fori", args=(0,), attrs=(("n", 2), ("inner", None)), shape=(4,)),
), outputs=(2, 3))

A_SUM_OF_PARTIAL_SUMS = Program(mesh=(("x", 4), ("y", 2)), steps=(  # seed 1610, shrunk
    Step(kind="input", args=(), attrs=(("meta", ("y", None)),), shape=(6, 3)),
    Step(kind="input", args=(), attrs=(), shape=(8, 8, 4)),
    Step(kind="hint", args=(1,), attrs=(("how", "split"), ("dim", 0), ("axes", ("y",))), shape=(8, 8, 4)),
    Step(kind="input", args=(), attrs=(), shape=(3, 3)),
    # the sum of every element, and the sum of the row sums (the einsum sums them): XLA's simplifier makes them
    # one sum, whose all-reduce over y is one (the PCG named two)
    Step(kind="reduce", args=(0,), attrs=(("fn", "sum"), ("dims", (0, 1))), shape=()),
    Step(kind="reduce", args=(0,), attrs=(("fn", "sum"), ("dims", (1,))), shape=(6,)),
    Step(kind="input", args=(), attrs=(), shape=(1,)),
    Step(kind="binary", args=(5, 6), attrs=(("fn", "sub"),), shape=(6,)),
    Step(kind="einsum", args=(3, 5), attrs=(("spec", "ab,c->ab"),), shape=(3, 3)),
), outputs=(4, 8))


# A fori loop of one trip gathering its carry, and the same gather of that value outside: XLA inlines the loop and
# its CSE makes them one all-gather; the PCG counted two (seed 173004).
A_LOOP_OF_ONE_TRIP_GATHERING_ITS_CARRY = Program(mesh=(("x", 2), ("y", 4)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(4, 12, 8)),
    Step(kind="input", args=(), attrs=(("meta", (("y", "x"),)),), shape=(8,)),
    Step(kind="fori", args=(1,), attrs=(("n", 1), ("inner", (("x",),))), shape=(8,)),
    Step(kind="input", args=(), attrs=(), shape=(1,)),
    Step(kind="concat", args=(3, 1), attrs=(("dim", 0),), shape=(9,))), outputs=(0, 2, 4))

# Sums over the trailing dims of x and of a reshape of x merging those dims (seed 175008, shrunk by hand): XLA's
# simplifier reduces the reshape's operand instead, so the two all-reduces are one (the PCG named two).
SUMS_OF_A_RESHAPE_AND_OF_ITS_OPERAND = Program(mesh=(("x", 8),), steps=(
    Step(kind="input", args=(), attrs=(), shape=(8, 8, 2)),
    Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 1), ("axes", "x")), shape=(8, 8, 2)),
    Step(kind="reshape", args=(1,), attrs=(), shape=(8, 16)),
    Step(kind="einsum", args=(2, 1), attrs=(("spec", "ab,acd->a"),), shape=(8,)),
), outputs=(3,))


REGRESSIONS = {
    "a_loop_of_one_trip_gathering_its_carry": A_LOOP_OF_ONE_TRIP_GATHERING_ITS_CARRY,
    "two_loops_of_one_input": TWO_LOOPS_OF_ONE_INPUT,
    "a_sum_of_partial_sums": A_SUM_OF_PARTIAL_SUMS,
    "sums_of_a_value_and_of_its_reshape": SUMS_OF_A_VALUE_AND_OF_ITS_RESHAPE,
    "a_loop_invariant_gathered_in_two_loops": A_LOOP_INVARIANT_GATHERED_IN_TWO_LOOPS,
    "a_select_of_one_value": A_SELECT_OF_ONE_VALUE,
    "a_jax_reshard": A_JAX_RESHARD,
    "max_of_one_value_twice": MAX_OF_ONE_VALUE_TWICE,
    "update_one_row_of_a_split_dim": UPDATE_ONE_ROW_OF_A_SPLIT_DIM,
    "min_over_a_split_dim": MIN_OVER_A_SPLIT_DIM,
    "one_gather_over_a_size_one_axis": ONE_GATHER_OVER_A_SIZE_ONE_AXIS,
    "gather_out_of_bounds_of_a_split_dim": GATHER_OUT_OF_BOUNDS_OF_A_SPLIT_DIM,
    "whole_update_of_a_gathered_value": WHOLE_UPDATE_OF_A_GATHERED_VALUE,
    "slice_of_the_other_concatenated_operand": SLICE_OF_THE_OTHER_CONCATENATED_OPERAND,
    "sums_of_a_reshape_and_of_its_operand": SUMS_OF_A_RESHAPE_AND_OF_ITS_OPERAND,
}


@pytest.mark.parametrize("prog", list(REGRESSIONS.values()), ids=list(REGRESSIONS))
def test_pcg_regressions(prog):
    pcg_check.check_pcg(prog)


# x contracted with itself, and the gradient of a product with it (seed 175014, shrunk by hand): two dots of one
# broadcast operand that contract different dims it was broadcast along make the same values; XLA's simplifier makes
# them one, and the shuffle after each is one (the fused PCG named four collective-permutes, XLA compiled three).
DOTS_OF_A_BROADCAST_ALONG_EITHER_DIM = Program(mesh=(("x", 2), ("y", 2), ("z", 2)), steps=(
    Step(kind="input", args=(), attrs=(("meta", (("y", "z"), None, None)),), shape=(4, 2, 2)),
    Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 0), ("axes", ("z", "x"))), shape=(4, 2, 2)),
    Step(kind="einsum", args=(0, 0), attrs=(("spec", "abc,abd->bacd"),), shape=(2, 4, 2, 2)),
    Step(kind="einsum", args=(2, 0), attrs=(("spec", "abcd,bea->a"),), shape=(2,)),
), outputs=(1, 3))


def test_dots_of_a_broadcast_along_either_dim_are_one_value():
    """`check_pcg` with seed 1 builds the fused PCG (as `choose_pcg` does) and rewrites nothing: exact collectives."""
    pcg_check.check_pcg(DOTS_OF_A_BROADCAST_ALONG_EITHER_DIM, seed=1, rewrites=0)


# An RNN over a batch split 4 ways: the gradient adds c_t^T @ g_t (partial sums over x) into w's cotangent each trip.
AN_RNN_OVER_A_SPLIT_BATCH = Program(mesh=(("x", 4), ("y", 2)), steps=(
    Step(kind="input", args=(), attrs=(), shape=(8, 4)),
    Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 0), ("axes", ("x",))), shape=(8, 4)),
    Step(kind="input", args=(), attrs=(), shape=(3, 8, 4)),
    Step(kind="input", args=(), attrs=(), shape=(4, 4)),
    Step(kind="rnn", args=(1, 2, 3), attrs=(("inner", None),), shape=(3, 8, 4)),
), outputs=(4,))


def test_an_rnn_gradient_carried_as_partial_sums_equals_the_program():
    """`check_pcg` (seed 4 draws the partial-sum carries, `shardc.pcg.carries`): w's cotangent is carried unreduced
    through the backward loop and reduced after it; the lowering equals the unsharded program, with the PCG's
    collectives."""
    outcome = pcg_check.check_pcg(AN_RNN_OVER_A_SPLIT_BATCH, seed=4)
    assert outcome.rewrites[:1] == ("partial_sum_carry",)


def test_a_loop_invariant_collective_is_priced_out_of_its_loops():
    """The PCG of `A_LOOP_INVARIANT_GATHERED_IN_TWO_LOOPS` gathers the inner loop's matrix inside both inner
    loops; XLA runs those all-gathers out of the loops, as the plan's simulation prices a reshard of a
    loop-invariant value, and so does the PCG's now (it priced them on every trip: 1,152 bytes against 512)."""
    from shardc.pcg import build_pcg
    from shardc.pcg.simcost import simulate_pcg
    from shardc.sim import simulate

    prog = A_LOOP_INVARIANT_GATHERED_IN_TWO_LOOPS
    fun, args = fuzzlib.program_function(prog), fuzzlib.make_args(prog, 0)
    info = shardc.auto(fun, mesh=shardc.make_mesh(dict(prog.mesh)), search=False).compiled_info(*args)
    pcg = build_pcg(info.plan, info.closed_jaxpr, fuse=True)
    plan_sim, pcg_sim = simulate(info.plan, "h100-sxm-8"), simulate_pcg(pcg, "h100-sxm-8").result
    assert plan_sim.payload.get("all-gather", 0) > 0 and pcg_sim.payload == plan_sim.payload


def test_a_loop_computed_twice_runs_once():
    """The PCG of `TWO_LOOPS_OF_ONE_INPUT` has the same loop twice on the same values (the two forward loops): the
    lowering runs it once (a duplicate region's results are the first's) and the same collective of one value
    once within a body (inside a loop, XLA's CSE cannot merge two collective-permutes whose slices' offsets its
    loop-invariant code motion made two loop-state values), so the compiled program has the collectives the PCG
    names, with or without fused parallel ops."""
    from shardc.pcg import build_pcg, hlo_collectives
    from shardc.pcg.choice import jit_pcg

    prog = TWO_LOOPS_OF_ONE_INPUT
    fun, args = fuzzlib.program_function(prog), fuzzlib.make_args(prog, 0)
    info = shardc.auto(fun, mesh=shardc.make_mesh(dict(prog.mesh)), search=False).compiled_info(*args)
    for fuse in (False, True):
        pcg = build_pcg(info.plan, info.closed_jaxpr, fuse=fuse)
        regions = pcg.region_nodes()
        assert sum(pcg.duplicate(n) for n in regions) == 1
        hlo = jit_pcg(info.plan, pcg).lower(*jax.tree.leaves(args)).compile().as_text()
        assert hlo.count(" while(") == len(regions) - 1
        assert hlo_collectives(hlo) == pcg.collectives()


# Fuzz seed 2602 (`bench/fuzz.py --pcg --search`, 2026-12-02), shrunk: the searched plan's PCG gathers a (4,) value
# split over z in the bodies of two loops, the compiled program in one: no result of the first loop (a scan) is read,
# so JAX's dead-code elimination drops it from the lowering. `PCG.collectives()` counted its all-gather (five named,
# four compiled); it now counts only what the read outputs need (`PCG.live`, through loops' carries).
A_LOOP_NOTHING_READS = Program(mesh=(('x', 2), ('y', 1), ('z', 4)), steps=(
    Step(kind='input', args=(), attrs=(), shape=(4, 4), dtype='float32'),
    Step(kind='input', args=(), attrs=(), shape=(4, 4), dtype='float32'),
    Step(kind='where', args=(0, 1), attrs=(), shape=(4, 4), dtype='float32'),
    Step(kind='slice', args=(1,), attrs=(('start', (1, 0)), ('limit', (4, 4)), ('strides', (2, 1))), shape=(2, 4),
         dtype='float32'),
    Step(kind='transpose', args=(1,), attrs=(('perm', (1, 0)),), shape=(4, 4), dtype='float32'),
    Step(kind='argmax', args=(4,), attrs=(('dim', 1),), shape=(4,), dtype='float32'),
    Step(kind='scan', args=(5, 3), attrs=(('inner', (None,)),), shape=(2, 4), dtype='float32'),
    Step(kind='update_slice', args=(6, 3), attrs=(('start', (0, 0)),), shape=(2, 4), dtype='float32'),
    Step(kind='input', args=(), attrs=(), shape=(2, 2, 4), dtype='float32'),
    Step(kind='input', args=(), attrs=(), shape=(4, 4), dtype='float32'),
    Step(kind='nested_loop', args=(7, 8, 9), attrs=(('n', 1), ('inner', None)), shape=(2, 2, 4), dtype='float32'),
    Step(kind='hint', args=(10,), attrs=(('how', 'shard'), ('spec', (('y',), '?', ('z',)))), shape=(2, 2, 4),
         dtype='float32'),
    Step(kind='dynamic_slice', args=(11,), attrs=(('start', (0, 0, 1)),), shape=(2, 2, 2), dtype='float32'),
    Step(kind='reshape', args=(4,), attrs=(), shape=(4, 2, 2), dtype='float32'),
    Step(kind='input', args=(), attrs=(), shape=(4, 3, 2), dtype='float32'),
    Step(kind='scatter_add', args=(13, 14), attrs=(('dim', 1), ('indices', (0, 0, 1))), shape=(4, 2, 2),
         dtype='float32')), outputs=(12,), step_mode=False, const_cotangents=False)


def test_a_loop_no_result_of_which_is_read_has_no_collective():
    pcg_check.check_pcg(A_LOOP_NOTHING_READS, search=True)


# Fuzz seed 4701 (`bench/fuzz.py --pcg --search`, 2026-12-03), shrunk: the gradient sums one value over dim 0 twice,
# once through a reshape that changes nothing; JAX gives the second `reduce_sum` an `out_sharding` annotation the
# first lacks. XLA computes one sum and all-reduces it once; the PCG keyed the two ops apart by that annotation (its
# lowering drops it) and named one all-reduce more than ran (three named, two compiled).
SUMS_APART_BY_A_SHARDING_ANNOTATION = Program(mesh=(('x', 2), ('y', 2), ('z', 2)), steps=(
    Step(kind='input', args=(), attrs=(('meta', (None, ('z', 'x'), 'y')),), shape=(1, 16, 16), dtype='float32'),
    Step(kind='einsum', args=(0, 0), attrs=(('spec', 'abc,abc->c'),), shape=(16,), dtype='float32'),
    Step(kind='hint', args=(1,), attrs=(('how', 'shard'), ('spec', (('y',),))), shape=(16,), dtype='float32'),
    Step(kind='broadcast', args=(2,), attrs=(('pos', 0),), shape=(4, 16), dtype='float32'),
    Step(kind='binary', args=(3, 1), attrs=(('fn', 'add'),), shape=(4, 16), dtype='float32'),
    Step(kind='input', args=(), attrs=(), shape=(4, 1), dtype='float32'),
    Step(kind='scatter_add', args=(4, 5), attrs=(('dim', 1), ('indices', (4,))), shape=(4, 16), dtype='float32')),
    outputs=(6, 2), step_mode=False, const_cotangents=False)


def test_ops_apart_only_by_a_sharding_annotation_are_one():
    pcg_check.check_pcg(SUMS_APART_BY_A_SHARDING_ANNOTATION, seed=4701, search=True)
