"""Graceful degradation: a primitive shardc has no rule for is planned replicated, named once in a
warning (and in the plan's notes), hints around it still hold, and the step gives the right numbers."""
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

import shardc
from shardc.rules import NoShardingRuleWarning

MESH = shardc.make_mesh({"data": 2, "model": 4})
_IDS = itertools.count()


def _softplus_primitive() -> Primitive:
    p = Primitive(f"degradation_softplus_{next(_IDS)}")  # fresh name: its one warning is ours to see

    def impl(x):
        return jnp.logaddexp(x, 0.0)

    p.def_impl(impl)
    p.def_abstract_eval(lambda x: x)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
    ad.defjvp(p, lambda g, x: g * jax.nn.sigmoid(x))
    return p


def test_unknown_primitive_is_replicated_named_once_and_correct():
    p = _softplus_primitive()

    def step(x, w):
        def loss(w):
            h = shardc.split(x, 0, "data") @ shardc.shard(w, (None, "model"))
            return jnp.mean(p.bind(h) ** 2)

        return jax.value_and_grad(loss)(w)

    def ref(x, w):
        return jax.value_and_grad(lambda w: jnp.mean(jnp.logaddexp(x @ w, 0.0) ** 2))(w)

    x = jnp.linspace(-2, 2, 64, dtype=jnp.float32).reshape(8, 8)
    w = jnp.linspace(-1, 1, 64, dtype=jnp.float32).reshape(8, 8)
    f = shardc.auto(step, mesh=MESH, search=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = f.plan(x, w)
        got = f(x, w)
        f(x * 2, w)  # a second call (and a second signature) warns no more
        f(jnp.ones((16, 8)), w)
    ours = [c for c in caught if issubclass(c.category, NoShardingRuleWarning)]
    assert len(ours) == 1 and p.name in str(ours[0].message) and "replicated" in str(ours[0].message)
    assert any(p.name in note for note in plan.warnings)

    (op,) = [op for op in plan.graph.ops if op.primitive == p.name]
    assert op.conservative
    assert all(axes == () for axes in plan.strategies[op.id].factor_axes)  # it runs replicated
    for v in op.inputs:  # a sharded operand is gathered before it, and the plan says so
        if not plan.shardings[v].is_replicated():
            assert any(r.value == v and r.consumer == op.id and r.dst.is_replicated() for r in plan.reshards)
    # the hints around it are kept
    hinted = [plan.shardings[o.outputs[0]].dims for o in plan.graph.ops if o.primitive == "shardc_hint"]
    assert any(d[0] == ("data",) for d in hinted) and ((), ("model",)) in hinted

    want = jax.jit(ref)(x, w)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-7)
    assert got[1].sharding.spec == jax.sharding.PartitionSpec(None, "model")
