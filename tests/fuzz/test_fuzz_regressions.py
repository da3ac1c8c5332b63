"""Every failure the fuzzer found, as a named test (the program as the generator printed it, shrunk).

Fixed in shardc:
* `empty2` (scan's residual buffers under grad) had no factor rule: every scan+grad program fell back
  to the conservative rule with a NoShardingRuleWarning. Now a result-only rule like iota's.

Fixed in the oracle:
* a chain of contractions grew gradients to ~1.6e3 where float32 rounding of the (differently ordered)
  sharded sums exceeded the 2e-4 relative tolerance, although the sharded result was closer to a float64
  run than the unsharded one; such mismatches are now adjudicated against float64.

Upstream (XLA), pinned with a pure-JAX reproduction that fails today (strict xfail, so the day XLA is
fixed this file says so):
* XLA CPU: a scatter-add into a dim sharded over the mesh (the gradient of `take` on a sharded dim),
  added to a value resharded onto that dim, loses the other shards' values (algsimp + scatter expander).
  shardc now compiles without the scatter expander on CPU (`shardc.lower.CPU_COMPILER_OPTIONS`), so the
  fuzz program that found it computes the right numbers; before, the oracle attributed it to XLA
  (shardc's own compiled program reproduced the wrong numbers exactly and was right without the pass).
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fuzzlib
import shardc
from fuzzlib import Program, Step
from shardc.rules import NoShardingRuleWarning

# ------------------------------------------------------------------------------------------ fixed in shardc

SCAN_UNDER_GRAD = Program(
    mesh=(("x", 2), ("y", 4)),
    steps=(
        Step(kind="input", args=(), attrs=(), shape=(4, 8), dtype="float32"),
        Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 1), ("axes", ("y",))), shape=(4, 8)),
        Step(kind="input", args=(), attrs=(), shape=(3, 4, 8), dtype="float32"),
        Step(kind="scan", args=(1, 2), attrs=(("inner", ("x", "?")),), shape=(3, 4, 8)),
    ),
    outputs=(3,),
)


def test_scan_under_grad_needs_no_conservative_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoShardingRuleWarning)
        out = fuzzlib.check_program(SCAN_UNDER_GRAD)
    assert out.upstream_bug is None and out.hints_checked >= 2


def test_empty_buffers_have_a_rule():
    from shardc.rules import rule_or_conservative

    for prim, outs in (("empty2", [()]), ("empty", [(4, 8)])):
        rule, conservative = rule_or_conservative(prim, [], outs, {})
        assert not conservative and len(rule.results) == 1


# ------------------------------------------------------------------------------------------ fixed in the oracle

ROUNDING_CHAIN = Program(
    mesh=(("x", 2), ("y", 2), ("z", 2)),
    steps=(
        Step(kind="input", args=(), attrs=(), shape=(4, 8, 8)),
        Step(kind="pad", args=(0,), attrs=(("config", ((0, 0, 1), (0, 0, 0), (0, 0, 0))),), shape=(7, 8, 8)),
        Step(kind="fori", args=(1,), attrs=(("n", 3), ("inner", ("?", ("x", "y"), None))), shape=(7, 8, 8)),
        Step(kind="einsum", args=(0, 0), attrs=(("spec", "abc,abc->a"),), shape=(4,)),
        Step(kind="einsum", args=(3, 0), attrs=(("spec", "a,abc->a"),), shape=(4,)),
        Step(kind="einsum", args=(4, 0), attrs=(("spec", "a,abc->a"),), shape=(4,)),
        Step(kind="input", args=(), attrs=(), shape=(4,)),
        Step(kind="binary", args=(5, 6), attrs=(("fn", "sub"),), shape=(4,)),
        Step(kind="remat_chain", args=(7,), attrs=(("inner", (("y",),)),), shape=(4,)),
    ),
    outputs=(8,),
)


def test_float32_rounding_of_a_contraction_chain_is_adjudicated_by_float64():
    out = fuzzlib.check_program(ROUNDING_CHAIN)
    assert out.upstream_bug is None


def test_adjudication_still_rejects_a_wrong_result():
    fun = fuzzlib.program_function(ROUNDING_CHAIN)
    args = fuzzlib.make_args(ROUNDING_CHAIN)
    ref = jax.jit(fun)(*args)
    wrong = jax.tree.map(lambda a: a * 1.01, ref)
    assert not fuzzlib._as_accurate_as_unsharded(fun, args, wrong, ref)
    assert fuzzlib._as_accurate_as_unsharded(fun, args, ref, ref)


# ------------------------------------------------------------------------------------------ upstream XLA bugs

XLA_SCATTER_PROGRAM = Program(
    mesh=(("x", 4), ("y", 2)),
    steps=(
        Step(kind="input", args=(), attrs=(), shape=(3, 6, 1), dtype="float32"),
        Step(kind="hint", args=(0,), attrs=(("how", "split"), ("dim", 1), ("axes", ("y",))), shape=(3, 6, 1)),
        Step(kind="input", args=(), attrs=(("high", 6),), shape=(1, 1), dtype="int32"),
        Step(kind="gather", args=(1, 2), attrs=(("dim", 1),), shape=(3, 1, 1, 1)),
        Step(kind="reshape", args=(1,), attrs=(), shape=(3, 6)),
        Step(kind="rev", args=(4,), attrs=(("dims", (0, 1)),), shape=(3, 6)),
    ),
    outputs=(3, 5),
)


def _scatter_then_add(mesh):
    cols = NamedSharding(mesh, P(None, "y", None))
    wsc = jax.lax.with_sharding_constraint

    def f(w, idx, upd):  # the backward pass of XLA_SCATTER_PROGRAM, by hand
        z = wsc(jnp.zeros((3, 6, 1)), cols)
        s = wsc(z.at[:, idx].add(upd), cols)
        r = wsc(wsc(jax.lax.rev(w, (0, 1)), NamedSharding(mesh, P())), NamedSharding(mesh, P(None, "y")))
        return wsc(r.reshape(3, 6, 1), cols) + s

    return f, cols


@pytest.mark.xfail(strict=True, reason="XLA CPU miscompiles scatter-add into a sharded dim + add (algsimp and "
                                       "scatter expander); no shardc involved")
def test_xla_cpu_scatter_add_into_a_sharded_dim():
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    f, cols = _scatter_then_add(mesh)
    rep = NamedSharding(mesh, P())
    w = np.arange(18, dtype=np.float32).reshape(3, 6)
    upd = np.full((3, 1, 1), 100, np.float32)
    idx = np.array([0], np.int32)
    want = np.asarray(jax.lax.rev(w, (0, 1))).reshape(3, 6, 1).copy()
    want[:, 0] += 100
    got = jax.jit(f, in_shardings=(rep, rep, rep), out_shardings=cols)(w, idx, upd)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_xla_cpu_scatter_bug_is_not_in_the_pipeline_without_scatter_expansion():
    """The same lowered program is right when XLA keeps the scatter: the bug is in that rewrite."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    f, cols = _scatter_then_add(mesh)
    rep = NamedSharding(mesh, P())
    w = np.arange(18, dtype=np.float32).reshape(3, 6)
    upd, idx = np.full((3, 1, 1), 100, np.float32), np.array([0], np.int32)
    lowered = jax.jit(f, in_shardings=(rep, rep, rep), out_shardings=cols).lower(w, idx, upd)
    got = lowered.compile(compiler_options={"xla_disable_hlo_passes": "scatter_expander"})(w, idx, upd)
    want = np.asarray(jax.lax.rev(w, (0, 1))).reshape(3, 6, 1).copy()
    want[:, 0] += 100
    np.testing.assert_array_equal(np.asarray(got), want)


def test_fuzz_program_that_hit_the_xla_scatter_bug_is_right_under_shardc():
    out = fuzzlib.check_program(XLA_SCATTER_PROGRAM)  # raises FuzzFailure if shardc's result were wrong
    assert out.upstream_bug is None and not out.rounding


def test_xla_scatter_bug_attribution_when_the_workaround_is_off(monkeypatch):
    """Without shardc's CPU workaround the same program is wrong, and the oracle attributes it to XLA."""
    import importlib

    monkeypatch.setattr(importlib.import_module("shardc.lower"), "CPU_COMPILER_OPTIONS", {})
    out = fuzzlib.check_program(XLA_SCATTER_PROGRAM)
    assert out.upstream_bug is not None and "scatter expander" in out.upstream_bug


def test_oracle_still_fails_programs_that_are_wrong_in_shardc(monkeypatch):
    """The XLA attribution must not excuse a real shardc bug: break the plan's lowering of one hint
    (lower it to a constraint on the wrong value) and the oracle must report it."""
    import importlib

    lower = importlib.import_module("shardc.lower")
    real = lower.jit_plan

    def wrong_jit_plan(plan, closed, donate=()):
        jitted = real(plan, closed, donate)

        class Wrong:
            def __call__(self, *args):
                out = jitted(*args)
                return [o + 1 if i == 0 else o for i, o in enumerate(out)]

            def lower(self, *args):
                return jitted.lower(*args)

        return Wrong()

    auto = importlib.import_module("shardc.auto")
    monkeypatch.setattr(auto, "jit_plan", wrong_jit_plan)
    with pytest.raises(fuzzlib.FuzzFailure, match="sharded - unsharded"):
        fuzzlib.check_program(XLA_SCATTER_PROGRAM)
