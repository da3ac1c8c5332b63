"""Flax logical partitioning with Flax's own semantics (shardc/flax_rules.py), compared with Flax itself:
`nn.logical_to_mesh_axes`, `nn.logical_to_mesh_sharding`, `nnx.spmd.get_var_pspec`."""
import random
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardc
from shardc.flax_rules import linen_mesh_axes, nnx_mesh_axes, nnx_rules

LOGICAL = ["batch", "embed", "mlp", "heads", "kv", "vocab"]
MESH_AXES = ["data", "fsdp", "tensor", "expert"]


def _normal(entry):
    """A PartitionSpec entry as a tuple of mesh axes (None: an open dim)."""
    if entry is P.UNCONSTRAINED:
        return None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _random_case(rng: random.Random):
    names = []
    for name in rng.sample(LOGICAL, rng.randint(1, 4)):
        r = rng.random()
        names.append(None if r < 0.15 else P.UNCONSTRAINED if r < 0.2 else ("data", "expert") if r < 0.25 else name)
    rules = []
    for _ in range(rng.randint(0, 8)):
        r = rng.random()
        target = None if r < 0.15 else tuple(rng.sample(MESH_AXES, 2)) if r < 0.35 else rng.choice(MESH_AXES)
        rules.append((rng.choice(LOGICAL), target))
    return tuple(names), tuple(rules)


def test_linen_mapping_is_flaxs_for_many_rule_sets():
    """Rule order, the fallback to a later rule when an axis is taken, no rule = replicated, a rule to None,
    tuples of axes, entries that are not names: all as nn.logical_to_mesh_axes."""
    rng = random.Random(14)
    fallbacks = 0
    for _ in range(600):
        names, rules = _random_case(rng)
        want = tuple(_normal(e) for e in nn.logical_to_mesh_axes(names, rules))
        assert linen_mesh_axes(names, rules, "test") == want, (names, rules)
        fallbacks += any(want[names.index(n)] == _normal(t) and t != dict(rules)[n]
                         for n, t in rules if n in names and isinstance(n, str))
    assert fallbacks > 20  # the sample exercises the fallback


def test_the_fallback_of_flaxs_docs():
    rules = (("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tensor"))
    assert linen_mesh_axes(("embed", "mlp"), rules, "") == (("fsdp",), ("tensor",))
    assert linen_mesh_axes(("mlp", "kv"), rules, "") == (("fsdp",), ())  # 'kv': no rule, replicated


@pytest.mark.parametrize("context", [(), (("mlp", "tensor"), ("vocab", "data"))])
def test_nnx_mapping_is_nnxs(context):
    """NNX: a name with a rule (the context's, then the variable's own) becomes its axes, others are mesh axes."""
    cases = [(("embed", "mlp"), (("embed", "fsdp"),)), (("embed", None), ()), (("data", "vocab"), (("kv", "data"),)),
             ((("data", "fsdp"), "mlp"), (("heads", "tensor"), ("heads", "expert")))]
    for names, local in cases:
        with nnx.use_eager_sharding(False):
            var = nnx.Param(jnp.ones((4, 8)), out_sharding=names, sharding_rules=local)
        with nn.logical_axis_rules(context):
            try:
                want = tuple(_normal(e) for e in nnx.spmd.get_var_pspec(var))
            except ValueError:  # NNX: inconsistent rules
                with pytest.raises(shardc.ShardingError, match="inconsistent"):
                    nnx_rules(context, local, "")
                continue
        assert nnx_mesh_axes(names, nnx_rules(context, local, "")) == want, (names, local, context)


class _Block(nn.Module):
    """An MLP and a projection with lm1b-style logical names ('kv' has no rule in lm1b's own config)."""

    @nn.compact
    def __call__(self, x):
        init = lambda names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        h = nn.Dense(32, kernel_init=init(("embed", "mlp")))(x)
        h = nn.with_logical_constraint(nn.relu(h), ("batch", "act_mlp"))
        h = nn.Dense(16, kernel_init=init(("mlp", "embed")))(h)
        return nn.Dense(8, kernel_init=init(("embed", "kv")))(h)


X = jnp.linspace(-1, 1, 8 * 16, dtype=jnp.float32).reshape(8, 16)
BOXED = _Block().init(jax.random.key(0), X)["params"]


def _apply(p, x):
    return _Block().apply({"params": p}, x)


@pytest.mark.parametrize("rules", [
    (("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tensor")),  # fallback: 'fsdp' is taken by 'embed'
    (("mlp", "fsdp"), ("mlp", "tensor"), ("embed", "fsdp")),  # rule order: 'mlp' first
    (("embed", None), ("embed", "tensor"), ("mlp", ("fsdp", "tensor"))),  # a rule to None wins
    (("batch", "fsdp"), ("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"), ("act_mlp", "tensor")),
], ids=["fallback", "order", "none-rule", "lm1b-like"])
def test_parameters_are_placed_as_flax_places_them(rules):
    mesh = shardc.make_mesh({"fsdp": 2, "tensor": 4})
    plan = shardc.auto(_apply, mesh=mesh, rules=rules, search=False).plan(BOXED, X)
    want = nn.logical_to_mesh_sharding(nn.get_partition_spec(BOXED), mesh, rules)
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    got = plan.input_shardings()[:len(flat)]
    kernels = 0
    for g, (path, w), a in zip(got, flat, jax.tree.leaves(nn.meta.unbox(BOXED))):
        if "kernel" in jax.tree_util.keystr(path):  # (the biases carry no metadata: propagation decides them)
            kernels += 1
            assert g.named(mesh).is_equivalent_to(w, a.ndim), (path, g, w.spec)
    assert kernels == 3


def test_with_logical_constraint_on_activations_applies_the_rules():
    """Traced inside nn.logical_axis_rules(rules): the constraint is in the program (without rules it is
    Flax's no-op), the activation is laid out by the rule, and the result is jax.jit's."""
    mesh = shardc.make_mesh({"fsdp": 2, "tensor": 4})
    rules = (("batch", "fsdp"), ("act_mlp", "tensor"))
    unboxed = nn.meta.unbox(BOXED)
    f = shardc.auto(_apply, mesh=mesh, rules=rules, in_shardings=(P(), None), search=False)
    plan = f.plan(unboxed, X)
    (op,) = [op for op in plan.graph.ops if op.primitive == "sharding_constraint"]
    assert plan.shardings[op.outputs[0]].dims == (("fsdp",), ("tensor",))
    assert plan.graph.values[op.outputs[0]].shape == (8, 32)
    plain = shardc.auto(_apply, mesh=mesh, in_shardings=(P(), None), search=False).plan(unboxed, X)
    assert not any(op.primitive == "sharding_constraint" for op in plain.graph.ops)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        want = jax.jit(_apply)(unboxed, X)
    np.testing.assert_allclose(f(unboxed, X), want, rtol=1e-5, atol=1e-6)


def _unhinted_warnings(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if issubclass(w.category, shardc.UnhintedParamsWarning)]


def test_unboxed_parameters_with_rules_warn_how_to_pass_their_shardings():
    mesh = shardc.make_mesh({"fsdp": 2, "tensor": 4})
    rules = (("embed", "fsdp"), ("mlp", "tensor"))
    unboxed = nn.meta.unbox(BOXED)

    def step(params, x):
        return _apply(params, x)

    notes = _unhinted_warnings(lambda: shardc.auto(step, mesh=mesh, rules=rules, search=False).plan(unboxed, X))
    assert len(notes) == 1 and "params['Dense_" in notes[0] and "kernel" in notes[0]
    assert "in_shardings=nn.logical_to_mesh_sharding(nn.get_partition_spec(" in notes[0]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(BOXED), mesh, rules)
    quiet = [lambda: shardc.auto(step, mesh=mesh, rules=rules, search=False).plan(BOXED, X),
             lambda: shardc.auto(step, mesh=mesh, rules=rules, in_shardings=(shardings, None), search=False)
             .plan(unboxed, X),
             lambda: shardc.auto(step, mesh=mesh, rules=rules, search=False)
             .plan(jax.device_put(unboxed, shardings), X)]
    for run in quiet:
        assert _unhinted_warnings(run) == []
