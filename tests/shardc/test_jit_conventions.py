"""The conventions of `jax.jit`, compared with `jax.jit` itself (the compiled program's input/output shardings,
the outputs): `in_shardings` / `out_shardings` (shardc/jit_shardings.py; bad options are rows of
tests/errors/test_bad_inputs.py) and arrays already placed on the mesh, which keep their layout
(shardc/placement.py; a re-placement is a warning)."""
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import shardc


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


def _step(w, x):
    h = jnp.tanh(x @ w)
    return w - 0.1 * x.T @ h, jnp.mean(h ** 2)


W = jnp.linspace(-1, 1, 16 * 32, dtype=jnp.float32).reshape(16, 32)
X = jnp.linspace(-2, 2, 8 * 16, dtype=jnp.float32).reshape(8, 16)


def _same_layouts(ours, theirs, shapes):
    """Compiled shardings equal as layouts (jax may write P('data') where shardc writes P('data', None))."""
    ours, theirs = jax.tree.leaves(ours), jax.tree.leaves(theirs)  # (shardc's program takes flat arguments)
    assert len(ours) == len(theirs) == len(shapes)
    for a, b, shape in zip(ours, theirs, shapes):
        assert a.is_equivalent_to(b, len(shape)), (a, b)


def _compiled_like_jit(f, fun, args, mesh, **jit_options):
    ours = f.lower(*args).compile()
    with jax.set_mesh(mesh):  # (jax.jit reads PartitionSpecs on the context mesh)
        theirs = jax.jit(fun, **jit_options).lower(*args).compile()
    _same_layouts(ours.input_shardings[0], theirs.input_shardings[0], [a.shape for a in jax.tree.leaves(args)])
    return ours, theirs


@pytest.mark.parametrize("search", [False, True], ids=["hints", "search"])
def test_in_shardings_are_what_jax_jit_compiles(mesh, search):
    """NamedSharding and PartitionSpec leaves pin the inputs exactly, also under the search."""
    ins = (NamedSharding(mesh, P(None, "model")), P("data"))
    f = shardc.auto(_step, mesh=mesh, in_shardings=ins, search=search, budget_s=0.5)
    _compiled_like_jit(f, _step, (W, X), mesh, in_shardings=ins)
    plan = f.plan(W, X)
    assert [s.dims for s in plan.input_shardings()] == [((), ("model",)), (("data",), ())]
    for got, want in zip(f(W, X), jax.jit(_step)(W, X)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_in_shardings_of_a_state_with_empty_containers(mesh):
    """The shardings Flax computes for an optax state hold empty containers (`optax.EmptyState()` of SGD
    without momentum, of `clip_by_global_norm`): a prefix like any other, as for jax.jit."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    opt_state = tx.init(W)

    def step(w, opt_state, x):
        g = jax.grad(lambda w: _step(w, x)[1])(w)
        updates, opt_state = tx.update(g, opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    ins = (NamedSharding(mesh, P(None, "model")), jax.tree.map(lambda _: P(), opt_state), P("data"))
    f = shardc.auto(step, mesh=mesh, in_shardings=ins, search=False)
    _compiled_like_jit(f, step, (W, opt_state, X), mesh, in_shardings=ins)


def test_out_shardings_are_what_jax_jit_compiles(mesh):
    outs = (NamedSharding(mesh, P("model", None)), None)
    f = shardc.auto(_step, mesh=mesh, out_shardings=outs, search=False)
    ours = f.lower(W, X).compile()
    theirs = jax.jit(_step, out_shardings=outs).lower(W, X).compile()
    assert ours.output_shardings[0].is_equivalent_to(theirs.output_shardings[0], 2)
    new_w, _ = f(W, X)
    assert new_w.sharding.is_equivalent_to(outs[0], 2)


def test_none_leaves_and_unconstrained_dims_are_left_to_shardc(mesh):
    """A prefix: one entry per argument, None for 'shardc decides', UNCONSTRAINED for an open dim; a
    PartitionSpec's missing trailing entries are replicated (closed), as in jax.jit."""
    def step(params, x):
        return jnp.tanh(x @ params["w1"]) @ params["w2"]

    params = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 8))}
    for x_spec, x_dims in ((P("data", P.UNCONSTRAINED), (("data",), ("model",))), (P("data"), (("data",), ()))):
        ins = ({"w1": P("model", None), "w2": None}, x_spec)
        plan = shardc.auto(step, mesh=mesh, in_shardings=ins, search=False).plan(params, X)
        w1, w2, x = plan.input_shardings()
        assert w1.dims == (("model",), ()) and x.dims == x_dims
        assert w2.dims == ((), ())  # left to shardc: propagation decided it
        np.testing.assert_allclose(shardc.auto(step, mesh=mesh, in_shardings=ins, search=False)(params, X),
                                   jax.jit(step)(params, X), rtol=1e-5)


def test_named_shardings_fix_the_mesh_and_specs_name_axes_the_search_must_have(mesh):
    f = shardc.auto(_step, in_shardings=(NamedSharding(mesh, P(None, "model")), None), budget_s=0.5)
    assert f.plan(W, X).mesh_sizes == {"data": 2, "model": 4}
    g = shardc.auto(_step, in_shardings=(None, P("batch")), budget_s=0.5)
    plan = g.plan(W, X)
    assert "batch" in plan.mesh_sizes and plan.input_shardings()[1].dims == (("batch",), ())
    np.testing.assert_allclose(g(W, X)[1], jax.jit(_step)(W, X)[1], rtol=1e-5)


def test_flax_example_convention_unboxed_state_with_logical_shardings(mesh):
    """What the Flax examples and MaxText give jax.jit: unboxed params plus
    nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)."""
    rules = (("embed", "data"), ("mlp", "model"))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = lambda n, names: nn.Dense(n, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), names))
            return dense(16, ("mlp", "embed"))(nn.relu(dense(32, ("embed", "mlp"))(x)))

    model, tx = MLP(), optax.sgd(0.1)
    boxed = model.init(jax.random.key(0), X)["params"]
    params = nn.meta.unbox(boxed)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)

    def train_step(params, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        return optax.apply_updates(params, tx.update(g, tx.init(params))[0]), loss

    f = shardc.auto(train_step, mesh=mesh, rules=rules, in_shardings=(shardings, P("data")), search=False)
    _compiled_like_jit(f, train_step, (params, X), mesh, in_shardings=(shardings, P("data")))
    got, want = f(params, X), jax.jit(train_step)(params, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_in_shardings_skip_static_arguments_as_in_jax_jit(mesh):
    def scaled(w, n, x):
        return _step(w * n, x)

    ins = (P(None, "model"), P("data"))  # (w, x): the static n has no entry
    f = shardc.auto(scaled, mesh=mesh, static_argnums=1, in_shardings=ins, search=False)
    plan = f.plan(W, 2.0, X)
    assert [s.dims for s in plan.input_shardings()] == [((), ("model",)), (("data",), ())]
    np.testing.assert_allclose(f(W, 2.0, X)[1], jax.jit(scaled, static_argnums=1)(W, 2.0, X)[1], rtol=1e-5)


def test_options_are_accepted_wherever_auto_options_are(mesh):
    """shardc.plan / shardc.plan_for take them too (the old API's bare TypeError), and an unknown option is a
    TypeError that lists the options."""
    plan = shardc.plan(_step, W, X, mesh=mesh, in_shardings=(None, P("data")), search=False)
    assert plan.input_shardings()[1].dims == (("data",), ())
    big = shardc.plan_for(_step, W, X, topology="h100-sxm-8x2", in_shardings=(None, P("data")), budget_s=0.3)
    assert big.input_shardings()[1].dims == (("data",), ()) and math.prod(big.mesh_sizes.values()) == 16
    with pytest.raises(TypeError, match="in_shardings"):
        shardc.auto(_step, in_sharding=P("data"))


# ------------------------------------------------------------------------------------------ placed arrays


def _placement_warnings(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    return out, [str(w.message) for w in caught if issubclass(w.category, shardc.PlacementWarning)]


@pytest.mark.parametrize("search", [False, True], ids=["hints", "search"])
def test_a_batch_placed_on_data_keeps_its_layout(mesh, search):
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    w = jax.device_put(W, NamedSharding(mesh, P(None, "model")))
    f = shardc.auto(_step, mesh=mesh, search=search, budget_s=0.5)
    compiled = f.lower(w, x).compile()  # (JAX's mismatch error before)
    reference = jax.jit(_step).lower(w, x).compile()
    for ours, theirs, a in zip(compiled.input_shardings[0], reference.input_shardings[0], (w, x)):
        assert ours.is_equivalent_to(a.sharding, a.ndim) and theirs.is_equivalent_to(a.sharding, a.ndim)
    out, notes = _placement_warnings(lambda: f(w, x))
    assert notes == []
    for got, want in zip(out, jax.jit(_step)(w, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lower_places_an_argument_whose_committed_layout_is_no_hint_as_a_call_would():
    """The Flax lm1b example commits its batch to P('data') on a mesh whose data axis has size 1: no hint
    (it splits nothing), so the plan may lay it out otherwise; `lower` lowers it there, as a call places it
    (JAX's mismatch error before)."""
    mesh = shardc.make_mesh({"data": 1, "fsdp": 8})
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    f = shardc.auto(lambda w, x: _step(w, shardc.split(x, 0, ("fsdp",))), mesh=mesh, search=False)
    assert f.plan(W, x).input_shardings()[1].dims == (("fsdp",), ())
    compiled = f.lower(W, x).compile()
    assert compiled.input_shardings[0][1].is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)
    for got, want in zip(f(W, x), jax.jit(_step)(W, X)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_next_step_reuses_the_plan_for_its_own_outputs(mesh):
    """Outputs come back placed as the plan laid them out: the same plan, no re-plan per layout."""
    f = shardc.auto(_step, mesh=mesh, search=False)
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    w, _ = f(W, x)
    first = f.plan(W, x)
    w, _ = f(w, x)
    assert f.plan(w, x) is first and len(f._placed_plans) == 0


def test_another_layout_on_the_same_mesh_gets_its_own_plan(mesh):
    f = shardc.auto(_step, mesh=mesh, search=False)
    by_rows = f.plan(W, jax.device_put(X, NamedSharding(mesh, P("data"))))
    by_cols = f.plan(W, jax.device_put(X, NamedSharding(mesh, P(None, "model"))))
    assert by_rows.input_shardings()[1].dims == (("data",), ())
    assert by_cols.input_shardings()[1].dims == ((), ("model",))


def test_without_a_mesh_the_arrays_mesh_is_the_plans(mesh):
    """mesh=None: the mesh the arguments are placed on, with Auto axes even when jax.make_mesh made it
    Explicit; so is the mesh jax.set_mesh entered."""
    explicit = jax.make_mesh((2, 4), ("rows", "cols"))
    x = jax.device_put(X, NamedSharding(explicit, P("rows")))
    f = shardc.auto(_step, budget_s=0.5)
    (new_w, loss), notes = _placement_warnings(lambda: f(W, x))
    plan = f.plan(W, x)
    assert plan.mesh_sizes == {"rows": 2, "cols": 4} and plan.input_shardings()[1].dims == (("rows",), ())
    assert notes == []
    np.testing.assert_allclose(loss, jax.jit(_step)(W, X)[1], rtol=1e-5)
    g = shardc.auto(_step, search=False)
    with jax.set_mesh(mesh):
        assert g.plan(W, X).mesh_sizes == {"data": 2, "model": 4}


def test_a_replacement_is_reported_naming_the_argument(mesh):
    """An array on another mesh, or one whose layout in_shardings overrides, is copied: a warning, once."""
    other = shardc.make_mesh({"a": 8})
    x = jax.device_put(X, NamedSharding(other, P("a")))
    f = shardc.auto(_step, mesh=mesh, search=False)
    (_, loss), notes = _placement_warnings(lambda: (f(W, x), f(W, x))[0])
    assert len(notes) == 1 and "argument x" in notes[0] and "another mesh" in notes[0]
    np.testing.assert_allclose(loss, jax.jit(_step)(W, X)[1], rtol=1e-5)
    g = shardc.auto(_step, mesh=mesh, in_shardings=(None, P(None, "model")), search=False)
    placed = jax.device_put(X, NamedSharding(mesh, P("data")))
    _, notes = _placement_warnings(lambda: g(W, placed))
    assert len(notes) == 1 and "in_shardings sets its layout" in notes[0] and "P('data',)" in notes[0]
    assert g.plan(W, placed).input_shardings()[1].dims == ((), ("model",))


def test_nnx_objects_take_in_and_out_shardings(mesh):
    """At an NNX object's position None (its metadata and the search decide); out_shardings is a prefix of
    what the step returns, as under nnx.jit."""
    import optax
    from flax import nnx

    with nnx.use_eager_sharding(False):
        net = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(net, optax.sgd(0.1), wrt=nnx.Param)

    def step(net, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(net)
        optimizer.update(net, grads)
        return loss, net(x)

    f = shardc.auto(step, mesh=mesh, search=False, in_shardings=(None, None, P("data")),
                    out_shardings=(None, P(None, "model")))
    loss, y = f(net, optimizer, X)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    assert f.plan(net, optimizer, X).input_shardings()[-1].dims == (("data",), ())
