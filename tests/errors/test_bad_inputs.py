"""A catalogue of bad input, each through the user's path (`@shardc.auto` / `shardc.make_mesh`).

Every row is one mistake a user can make, the error type and the words the user must see. Errors
must be a `ShardingError` whose message names what is wrong (tensor shape, dim, sizes, axes) and, for
hints, the line of this file that wrote it; no internal exception may leak, neither as the error nor
chained behind it. Degradation rows expect a warning instead, and still correct numbers; "plan" rows
are inputs that must *not* change anything (NaN/inf values) or must be kept exactly (no silently
dropped hint).
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

import shardc
from shardc import replicate, shard, split
from shardc.rules import NoShardingRuleWarning

MESH = shardc.make_mesh({"data": 2, "model": 4})
X = jnp.arange(48, dtype=jnp.float32).reshape(8, 6) / 10
THIS_FILE = "test_bad_inputs.py"


@dataclasses.dataclass
class Case:
    name: str
    run: Callable[[], Any]
    words: tuple[str, ...]
    kind: str = "error"  # error | warning
    line: bool = True  # the message names the `# BAD` line of `run`


CASES: list[Case] = []


def case(*words: str, kind: str = "error", line: bool = True):
    def deco(fn: Callable[[], Any]) -> Callable[[], Any]:
        CASES.append(Case(fn.__name__, fn, words, kind, line))
        return fn

    return deco


def plan(f: Callable, *args: Any, **options: Any) -> shardc.Plan:
    return shardc.auto(f, mesh=options.pop("mesh", MESH), **options, search=False).plan(*(args or (X,)))


def bad_line(fn: Callable) -> int:
    src, start = inspect.getsourcelines(fn)
    for i, text in enumerate(src):
        if "# BAD" in text:
            return start + i
    raise AssertionError(f"{fn.__name__} has no # BAD marker")


# ------------------------------------------------------------------------------------------ hints


@case("unknown mesh axis 'dta'", "dim 0 (size 8)", "['data', 'model']", "(8, 6)")
def hint_on_missing_axis():
    plan(lambda x: split(x, 0, "dta"))  # BAD


@case("dim 2 is out of range", "(8, 6)", "2 dims", "-2..1")
def dim_out_of_range():
    plan(lambda x: split(x, 2, "data"))  # BAD


@case("dim -3 is out of range", "(8, 6)")
def negative_dim_out_of_range():
    plan(lambda x: split(x, -3, "data"))  # BAD


@case("dim must be an int", "str", "(8, 6)")
def dim_not_an_int():
    plan(lambda x: split(x, "0", "data"))  # BAD


@case("dim 0 is out of range", "0 dims", "float32[]")
def hint_on_a_scalar_tensor():
    plan(lambda x: split(jnp.sum(x), 0, "data"))  # BAD


@case("'data'", "used twice", "the same dim", "size 8")
def axis_repeated_in_one_dim():
    plan(lambda x: split(x, 0, ("data", "data")))  # BAD


@case("'model'", "used twice", "dim 1 (size 6)", "dim 0 (size 8)")
def axis_repeated_across_dims():
    plan(lambda x: shard(x, ("model", "model")))  # BAD


@case("dim 1", "size 6", "not divisible by 4", "model=4")
def size_not_divisible():
    plan(lambda x: split(x, 1, "model"))  # BAD


@case("dim 1", "size 12", "not divisible by 8", "data=2, model=4")
def size_not_divisible_by_axis_product():
    plan(lambda x: shard(x, (None, ("data", "model"))), jnp.ones((8, 12)))  # BAD


@case("into 3 parts", "no product of mesh axes", "'data': 2, 'model': 4", "(6, 8)")
def count_no_product_of_axes_equals():
    plan(lambda x: split(x, 0, 3), jnp.ones((6, 8)))  # BAD


@case("dim 1", "size 6", "not divisible into 4 parts")
def count_not_dividing_the_dim():
    plan(lambda x: split(x, 1, 4))  # BAD


@case("into 2 parts", "excluding ['data']", "dim 1")
def count_needs_an_axis_already_taken():
    plan(lambda x: shard(x, ("data", 2)), jnp.ones((8, 8)))  # BAD


@case("number of partitions", ">= 1, got 0", "dim 0 (size 8)")
def count_zero():
    plan(lambda x: split(x, 0, 0))  # BAD


@case("must be a mesh axis name", "list", "dim 0 (size 8)")
def axes_of_the_wrong_type():
    plan(lambda x: split(x, 0, ["data"]))  # BAD


@case("3 entries", "(8, 6)", "only 2 dims")
def spec_longer_than_rank():
    plan(lambda x: shard(x, ("data", None, None)))  # BAD


@case("spec must be a sequence", "str 'data'")
def spec_that_is_a_string():
    plan(lambda x: shard(x, "data"))  # BAD


@case("expected a jax or numpy array", "list")
def hint_on_a_python_list():
    plan(lambda x: split([1.0, 2.0], 0, "data"))  # BAD


@case("expected a jax or numpy array", "dict")
def hint_on_a_dict():
    plan(lambda x: split({"w": x}, 0, "data"))  # BAD


@case("replicate", "expected a jax or numpy array", "float")
def hint_on_a_python_float():
    plan(lambda x: x * replicate(2.0))  # BAD


@case("with_sharding_constraint", "dim 1", "size 6", "not divisible by model(4)")
def sharding_constraint_not_divisible():
    plan(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(MESH, P(None, "model"))))  # BAD


@case("dim 0", "size 6", "not divisible by 4")
def hint_under_vmap_not_divisible():
    plan(lambda x: jax.vmap(lambda row: split(row, 0, "model"))(x), jnp.ones((4, 6)))  # BAD


@case("conflicting hints", "carried to the next step", "model", "data", "(8, 6)")
def conflicting_pinned_hints_on_carried_state():
    boxed = {"w": nn.Partitioned(X, names=("model", None))}
    plan(lambda p: jax.tree.map(lambda v: shard(v * 2, ("data", None)), p), boxed)  # BAD


@case("conflicting hints on a result of lax.cond/switch", "dim 1", "model", "data", "in another")
def cond_branches_pin_a_result_differently():
    def f(v):
        return jax.lax.cond(v.sum() > 0, lambda u: shard(u * 2, ("data", shardc.UNCONSTRAINED)),
                            lambda u: shard(u * 3, ("data", "model")), v)  # BAD

    plan(f, jnp.ones((8, 8)))


@case("conflicting hints on a result of lax.cond/switch", "dim 0", "split over data", "left open")
def switch_branch_splits_what_another_leaves_open():
    def f(v):
        branches = [lambda u: split(u, 0, "data"), lambda u: u * 2, lambda u: split(u, 1, "model")]  # BAD
        return jax.lax.switch(jnp.int32(v.sum()) % 3, branches, v)

    plan(f, jnp.ones((8, 8)))


# ------------------------------------------------------------------------------------------ meshes


@case("need 16 devices, but 8 are available", line=False)
def mesh_with_more_devices_than_exist():
    shardc.make_mesh({"data": 4, "model": 4})


@case("axis names repeat", "['a', 'a']", line=False)
def mesh_with_repeated_axis_names():
    shardc.make_mesh([("a", 2), ("a", 4)])


@case("axis 'a'", "positive int size", "got 0", line=False)
def mesh_with_a_zero_sized_axis():
    shardc.make_mesh({"a": 0})


@case("needs a jax.sharding.Mesh", "got str", line=False)
def mesh_that_is_not_a_mesh():
    shardc.auto(lambda x: x, mesh="data", search=False)


@case("'a'", "Explicit", "hints need Auto axes")
def mesh_with_explicit_axes():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    plan(lambda x: split(x, 0, "a"), mesh=mesh)  # BAD


@case("@shardc.auto function on mesh {'data': 2, 'model': 4}", "planned on mesh {'a': 8}", "same mesh",
      "test_bad_inputs.py")
def nested_auto_function_on_another_mesh():
    inner = shardc.auto(lambda u: split(u, 1, "model") * 2, mesh=MESH, search=False)  # BAD
    outer = shardc.auto(lambda v: inner(v), mesh=shardc.make_mesh({"a": 8}), search=False)
    outer(X)


# ------------------------------------------------------------------------------------------ Flax metadata and rules


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(8, kernel_init=init)(x)


_PARAMS = _Dense().init(jax.random.key(0), jnp.ones((2, 6)))["params"]


def _apply(p, x):
    return _Dense().apply({"params": p}, x)


@case("'modle'", "neither a mesh axis", "nor a logical axis with a rule", "rules=[('modle'", line=False)
def partitioned_name_that_is_not_a_mesh_axis():  # (a *logical* name without a rule is replicated, as in Flax)
    plan(lambda p: p, {"w": nn.Partitioned(X, names=(None, "modle"))})


@case("unknown mesh axis 'nope'", "['kernel']", "(6, 8)", "{'data': 2, 'model': 4}", line=False)
def logical_rule_to_a_missing_axis():
    plan(_apply, _PARAMS, jnp.ones((2, 6)), rules=[("embed", "nope"), ("mlp", None)])


@case("rules=...", "sequence of (logical axis, mesh axes) pairs", "got str", line=False)
def rules_that_are_not_pairs():
    plan(_apply, _PARAMS, jnp.ones((2, 6)), rules="data")


@case("rules=...", "('embed',)", "is not a (logical axis name", line=False)
def rule_with_one_element():
    plan(_apply, _PARAMS, jnp.ones((2, 6)), rules=[("embed",)])


@case("['w']", "dim 1", "size 6", "not divisible by model(4) = 4", line=False)
def flax_metadata_not_divisible():
    plan(lambda p: p, {"w": nn.Partitioned(X, names=(None, "model"))})


@case("['w']", "3 axis names", "(8, 6)", line=False)
def flax_metadata_of_the_wrong_rank():  # (fewer names than dims read as a PartitionSpec: the rest replicated)
    plan(lambda p: p, {"w": nn.Partitioned(X, names=("data", None, None))})


# ------------------------------------------------------------------------------------------ in_shardings / out_shardings


@case("in_shardings[0]", "NamedSharding on mesh {'a': 8}", "planned on mesh {'data': 2, 'model': 4}", "test_bad_inputs.py")
def in_shardings_on_another_mesh():
    shardc.auto(lambda x: x * 2, mesh=MESH, in_shardings=(NamedSharding(shardc.make_mesh({"a": 8}), P("a")),))  # BAD


@case("in_shardings[1]", "in_shardings[0]", "one program runs on one mesh")
def in_shardings_on_two_meshes():
    shardc.auto(lambda x, y: x * y, in_shardings=(NamedSharding(MESH, P("data")),  # BAD
                                                 NamedSharding(shardc.make_mesh({"a": 8}), P("a"))))


@case("in_shardings P('modle',)", "unknown mesh axis 'modle'", "dim 0 of argument [0]", "(8, 6)",
      "{'data': 2, 'model': 4}")
def in_shardings_naming_an_unknown_axis():
    shardc.auto(lambda x: x * 2, mesh=MESH, in_shardings=P("modle"), search=False).plan(X)  # BAD


@case("in_shardings[0]['w'] P(None, 'model')", "dim 1 of argument [0]['w'] (8, 6)", "size 6",
      "not divisible by model(4) = 4")
def in_shardings_not_divisible():
    f = shardc.auto(lambda p: p["w"] * 2, mesh=MESH, in_shardings=({"w": P(None, "model")},), search=False)  # BAD
    f.plan({"w": X})


@case("in_shardings[0]", "dict with keys ['w']", "the positional arguments[0] is a dict with keys ['v', 'w']",
      "pytree prefix")
def in_shardings_that_are_not_a_prefix():
    f = shardc.auto(lambda p: p["w"] * p["v"], mesh=MESH, in_shardings=({"w": P("data")},), search=False)  # BAD
    f.plan({"w": X, "v": X})


@case("in_shardings is a tuple of 2", "1 positional argument")
def in_shardings_of_the_wrong_length():
    shardc.auto(lambda x: x * 2, mesh=MESH, in_shardings=(P("data"), P()), search=False).plan(X)  # BAD


@case("in_shardings[0]", "has 3 entries", "argument [0] has shape (8, 6)")
def in_shardings_with_more_entries_than_dims():
    shardc.auto(lambda x: x * 2, mesh=MESH, in_shardings=(P("data", None, None),), search=False).plan(X)  # BAD


@case("in_shardings[0]", "is str 'data'", "expected a jax.sharding.NamedSharding, a PartitionSpec or None")
def in_shardings_leaf_that_is_not_a_sharding():
    shardc.auto(lambda x: x * 2, mesh=MESH, in_shardings=("data",))  # BAD


@case("out_shardings[1] P('model',)", "dim 0 of output out[1] (6,)", "not divisible by model(4) = 4")
def out_shardings_not_divisible():
    f = shardc.auto(lambda x: (x, x.sum(0)), mesh=MESH, out_shardings=(None, P("model")), search=False)  # BAD
    f.plan(X)


# ------------------------------------------------------------------------------------------ calls


@case("argument leaf [1]", "is of type str, not an array", line=False)
def non_array_argument():
    plan(lambda x, s: x, X, "hello")


@case("donate_argnums=(3,)", "1 positional argument", "no argument 3 to donate", "test_bad_inputs.py")
def donating_an_argument_that_does_not_exist():
    shardc.auto(lambda x: x * 2, mesh=MESH, donate_argnums=3, search=False)(X)  # BAD


@case("donate_argnums=-1", "non-negative ints", line=False)
def donating_a_negative_position():
    shardc.auto(lambda x: x * 2, mesh=MESH, donate_argnums=-1, search=False)


# ------------------------------------------------------------------------------------------ degradation

_COUNTER = itertools.count()


def _softsign_primitive(rule: Any = None) -> tuple[Primitive, Callable]:
    """A fresh custom primitive (a new name each time, so its one warning is not suppressed by an earlier
    test): softsign with impl, abstract eval, lowering and jvp, optionally with a factor rule."""
    p = Primitive(f"test_softsign_{next(_COUNTER)}")

    def impl(x):
        return x / (1 + jnp.abs(x))

    p.def_impl(impl)
    p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
    ad.defjvp(p, lambda g, x: g / (1 + jnp.abs(x)) ** 2)
    if rule is not None:
        shardc.register_rule(p, rule)
    return p, impl


def _degradation_run(p: Primitive, impl: Callable) -> None:
    def step(x, w):
        def loss(w):
            h = split(x, 0, "data") @ w
            return jnp.sum(p.bind(h) ** 2)

        return jax.value_and_grad(loss)(w)

    def ref(x, w):
        return jax.value_and_grad(lambda w: jnp.sum(impl(x @ w) ** 2))(w)

    x, w = X, jnp.linspace(-1, 1, 24, dtype=jnp.float32).reshape(6, 4)
    f = shardc.auto(step, mesh=MESH, search=False)
    for got, want in zip(f(x, w), jax.jit(ref)(x, w)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    f(x, w)  # a second call warns no more
    return p.name


@case("has no sharding rule for primitive 'test_softsign_", "replicated", kind="warning", line=False)
def primitive_without_a_rule():
    _degradation_run(*_softsign_primitive())


def _broken_rule(ins, outs, params):
    raise RuntimeError("rule bug")


@case("test_softsign_", "its rule failed", "RuntimeError: rule bug", kind="warning", line=False)
def primitive_whose_rule_raises():
    _degradation_run(*_softsign_primitive(_broken_rule))


# ------------------------------------------------------------------------------------------ the table


def _no_leak(e: BaseException) -> None:
    """No internal exception behind the ShardingError (what Python would print as 'During handling...')."""
    chained = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    assert chained is None or isinstance(chained, shardc.ShardingError), f"chained {type(chained).__name__}: {chained}"


def test_catalogue_is_big_enough():
    assert sum(c.kind == "error" for c in CASES) >= 25
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("c", [c for c in CASES if c.kind == "error"], ids=lambda c: c.name)
def test_bad_input_is_a_clear_sharding_error(c: Case):
    with pytest.raises(Exception) as info:
        c.run()
    e = info.value
    assert type(e) is shardc.ShardingError, f"{type(e).__name__}: {e}"
    msg = str(e)
    for w in c.words:
        assert w in msg, f"{w!r} not in: {msg}"
    if c.line:
        assert f"{THIS_FILE}:{bad_line(c.run)}" in msg, msg
    assert "Traceback" not in msg
    _no_leak(e)


@pytest.mark.parametrize("c", [c for c in CASES if c.kind == "warning"], ids=lambda c: c.name)
def test_degradation_warns_once_and_computes_right(c: Case):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.run()
    ours = [w for w in caught if issubclass(w.category, NoShardingRuleWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    msg = str(ours[0].message)
    for w in c.words:
        assert w in msg, f"{w!r} not in: {msg}"


def test_carried_state_that_changes_shape_warns_once_and_computes_right():
    """Each call re-plans (slow, not wrong): a ReplanWarning naming the argument and the shapes, once; and
    composing a shape-changing function with itself is fine."""
    def grow(p):
        return {"w": jnp.concatenate([p["w"], p["w"][:1]])}

    step = shardc.auto(grow, mesh=MESH, search=False)
    p = {"w": X}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            p = step(p)
    ours = [str(w.message) for w in caught if issubclass(w.category, shardc.ReplanWarning)]
    assert len(ours) == 1 and all(w in ours[0] for w in ("change shape between calls", "argument p['w'] is "
                                                         "float32[9, 6]", "returned as out['w']", "took float32[8, 6]"))
    assert p["w"].shape == (X.shape[0] + 3, X.shape[1])
    half = shardc.auto(lambda x: x[::2] * 2, mesh=MESH, search=False)
    with pytest.warns(shardc.ReplanWarning):  # (the composition re-plans for the smaller shape)
        np.testing.assert_allclose(half(half(X)), X[::4] * 4)


# ------------------------------------------------------------------------------------------ inputs that must change nothing


def _step(x, w):
    def loss(w):
        return jnp.mean((split(x, 0, "data") @ shard(w, (None, "model"))) ** 2)

    return jax.value_and_grad(loss)(w)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nan_and_inf_inputs_do_not_change_the_plan(poison):
    w = jnp.ones((6, 8))
    clean = shardc.auto(_step, mesh=MESH, search=False).plan(X, w)
    bad_x = X.at[3, 2].set(poison)
    f = shardc.auto(_step, mesh=MESH, search=False)
    assert f.plan(bad_x, w).fingerprint() == clean.fingerprint()
    loss, grad = f(bad_x, w)
    ref_loss, ref_grad = jax.jit(_step)(bad_x, w)
    np.testing.assert_array_equal(np.isfinite(np.asarray(grad)), np.isfinite(np.asarray(ref_grad)))
    assert np.isnan(float(loss)) == np.isnan(float(ref_loss))


@pytest.mark.parametrize("hint, dims", [
    (lambda x: split(x, -1, "model"), ((), ("model",))),  # negative dims count from the end
    (lambda x: split(x, 0, 8), (("data", "model"), ())),  # an 8-way count takes both axes
    (lambda x: split(x, 0, 1), ((), ())),  # a 1-way count replicates, closed
    (lambda x: shard(x, (("model", "data"), None)), (("model", "data"), ())),  # minor-major order kept
    (lambda x: shard(x, P("data", "model")), (("data",), ("model",))),
], ids=["negative-dim", "count-8", "count-1", "axis-order", "partition-spec"])
def test_accepted_hints_are_placed_exactly(hint, dims):
    plan_ = plan(lambda x: hint(x) * 2, jnp.ones((8, 8)))
    (op,) = [op for op in plan_.graph.ops if op.primitive == "shardc_hint"]
    assert plan_.shardings[op.outputs[0]].dims == dims
