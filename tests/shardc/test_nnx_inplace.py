"""NNX train steps that mutate the model and optimizer in place (the `nnx.jit` style) under
`@shardc.auto`: the objects are updated after each call, exactly as `nnx.jit` updates them."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardc
from bench.fresh_models import check_report


class Net(nnx.Module):
    """Dense + BatchNorm + Dropout: parameters, batch statistics and an RNG stream all change per step."""

    def __init__(self, d: int, h: int, out: int, rngs: nnx.Rngs, partitioned: bool = False) -> None:
        init = nnx.initializers.lecun_normal()
        k1 = nnx.with_partitioning(init, (None, "model")) if partitioned else init
        k2 = nnx.with_partitioning(init, ("model", None)) if partitioned else init
        self.fc1 = nnx.Linear(d, h, use_bias=False, kernel_init=k1, rngs=rngs)  # BatchNorm follows
        self.bn = nnx.BatchNorm(h, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.fc2 = nnx.Linear(h, out, kernel_init=k2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x)))))


def train_step(model: Net, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def make(partitioned=False, d=16, h=64, out=8):
    with nnx.use_eager_sharding(False):
        model = Net(d, h, out, nnx.Rngs(0), partitioned)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def data(batch=32, d=16, out=8):
    k1, k2 = jax.random.split(jax.random.key(3))
    return jax.random.normal(k1, (batch, d)), jax.random.randint(k2, (batch,), 0, out)


def run(step, model, optimizer, x, y, n=3):
    return [float(step(model, optimizer, x, y)) for _ in range(n)]


def assert_same_state(a, b, tol=1e-5):
    sa, sb = nnx.state(a), nnx.state(b)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    for u, v in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        if jnp.issubdtype(u.dtype, jax.dtypes.prng_key):
            u, v = jax.random.key_data(u), jax.random.key_data(v)
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


@pytest.mark.parametrize("search", [False, True])
def test_inplace_step_matches_nnx_jit(search):
    x, y = data()
    model, opt = make()
    ref_model, ref_opt = make()
    got = run(shardc.auto(train_step, search=search, budget_s=1), model, opt, x, y)
    want = run(nnx.jit(train_step), ref_model, ref_opt, x, y)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[2] < got[0]  # it trains: the updates reached the objects
    assert_same_state(model, ref_model)  # parameters, BatchNorm statistics, RNG counts
    assert_same_state(opt, ref_opt)  # Adam moments and the step count


def test_partitioning_metadata_is_a_hint_and_state_comes_back_in_its_layout():
    mesh = shardc.make_mesh({"data": 2, "model": 4})
    x, y = data()
    model, opt = make(partitioned=True)
    f = shardc.auto(train_step, mesh=mesh, search=False)
    plan = f.plan(model, opt, x, y)
    kernel = plan.input_names.index("model['fc1']['kernel'].value")
    assert plan.input_shardings()[kernel].spec() == jax.sharding.PartitionSpec(None, "model")
    assert plan.output_names[0] == "out" and "model['fc1']['kernel'].value (updated)" in plan.output_names
    ref_model, ref_opt = make(partitioned=True)
    np.testing.assert_allclose(run(f, model, opt, x, y), run(nnx.jit(train_step), ref_model, ref_opt, x, y),
                               rtol=1e-5)
    assert model.fc1.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert_same_state(model, ref_model, tol=1e-4)
    assert len(f._nnx_steps) == 1  # one plan, reused by every call


def test_shared_variable_is_one_input_and_keyword_arguments():
    """A module reachable from two arguments is split once; NNX objects may come as keywords."""

    class Head(nnx.Module):
        def __init__(self, body: nnx.Linear, rngs: nnx.Rngs) -> None:
            self.body = body
            self.out = nnx.Linear(8, 2, rngs=rngs)

    def step(body, head, *, x):
        def loss_fn(h):
            return jnp.mean(h.out(h.body(x)) ** 2)

        loss, g = nnx.value_and_grad(loss_fn)(head)
        nnx.update(head, jax.tree.map(lambda p, d: p - 0.1 * d, nnx.state(head, nnx.Param), g))
        return loss

    def make_pair():
        body = nnx.Linear(4, 8, rngs=nnx.Rngs(1))
        return body, Head(body, nnx.Rngs(2))

    x = jnp.ones((8, 4))
    body, head = make_pair()
    f = shardc.auto(step, search=False)
    plan = f.plan(body, head, x=x)
    assert sum(1 for n in plan.input_names if "kernel" in n) == 2  # body.kernel once, out.kernel
    got = [float(f(body, head, x=x)) for _ in range(3)]
    rb, rh = make_pair()
    want = [float(nnx.jit(step)(rb, rh, x=x)) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert head.body is body  # the objects keep their identity and sharing
    np.testing.assert_allclose(body.kernel[...], rb.kernel[...], rtol=1e-5)


def test_plan_for_a_larger_topology_with_nnx_objects():
    model, opt = make(d=64, h=512, out=16)
    x, y = data(batch=256, d=64, out=16)
    before = np.asarray(model.fc1.kernel[...])
    plan = shardc.plan_for(train_step, model, opt, x, y, topology="h100-sxm-8x8", budget_s=2)
    assert check_report(plan.search) is None, plan.search.summary()
    assert int(np.prod(list(plan.mesh_sizes.values()))) == 64
    np.testing.assert_array_equal(model.fc1.kernel[...], before)  # planning runs nothing


def test_changing_a_plain_attribute_inside_the_step_is_refused():
    """nnx.jit carries a plain attribute set in the step (`model.eval()`, `model.flag = 1`) back to the
    caller; shardc carries back Variables only, so such a step is an error, not a silent difference."""

    def step(model, optimizer, x, y):
        loss = train_step(model, optimizer, x, y)
        model.eval()  # sets Dropout/BatchNorm flags: not Variables
        return loss

    model, opt = make()
    x, y = data()
    with pytest.raises(shardc.ShardingError, match=r"step \(.*test_nnx_inplace.py:\d+\) changes attributes"):
        shardc.auto(step, search=False)(model, opt, x, y)


def test_new_variables_made_in_the_step_come_back():
    """`sow` adds Variables during the step: like nnx.jit, they reach the caller's object."""

    class Probe(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            h = self.fc(x)
            self.sow(nnx.Intermediate, "h", h)
            return h

    def step(m, x):
        return jnp.sum(m(x))

    a, b, x = Probe(nnx.Rngs(0)), Probe(nnx.Rngs(0)), jnp.ones((8, 4))
    shardc.auto(step, search=False)(a, x)
    nnx.jit(step)(b, x)
    np.testing.assert_allclose(a.h.get_value()[0], b.h.get_value()[0], rtol=1e-6)


def test_explain_names_the_tie_of_carried_state():
    """An output that is the next value of an input says so in explain() (its layout comes from the tie)."""
    model, opt = make()
    x, y = data()
    plan = shardc.auto(train_step, search=False).plan(model, opt, x, y)
    n_state = len(jax.tree.leaves(nnx.state(model))) + len(jax.tree.leaves(nnx.state(opt)))
    g, tied = plan.graph, plan.graph.carried()
    for k in range(n_state):  # every Variable's new value is tied to its old one (or is it, unchanged)
        old, new = g.inputs[k], g.outputs[1 + k]
        assert new == old or tied.get(old) == new, plan.output_names[1 + k]
    text = plan.explain(width=400)  # (the default 120 columns shorten the cause cells)
    assert "model['fc1']['kernel'].value (updated)" in text
    assert "next value of input model['fc1']['kernel'].value (kept in its layout)" in text
