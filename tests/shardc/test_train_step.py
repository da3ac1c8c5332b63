"""End-to-end: train steps under @shardc.auto give the losses of plain jax.jit, with shardings as planned."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardc
from shardc import replicate, split


@pytest.fixture(scope="module")
def mesh():
    return shardc.make_mesh({"data": 2, "model": 4})


class MLP(nn.Module):
    hidden: int = 64
    out: int = 16

    @nn.compact
    def __call__(self, x):
        x = split(x, 0, "data")
        h = nn.Dense(self.hidden, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")))(x)
        h = nn.relu(h)
        return nn.Dense(self.out, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)))(h)


def make_step(model, tx):
    def train_step(params, opt_state, batch):
        def loss_fn(p):
            pred = model.apply({"params": p}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def batch_of(seed, n=16, d=32, out=16):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(k1, (n, d)), "y": jax.random.normal(k2, (n, out))}


def run_steps(step, params, opt_state, steps=3):
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, batch_of(i))
        losses.append(float(loss))
    return params, opt_state, losses


def test_mlp_adamw_matches_jit_and_places_params(mesh):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((16, 32)))["params"]
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    ref_params, _, ref_losses = run_steps(jax.jit(make_step(model, tx)), params, opt_state)

    step = shardc.auto(make_step(model, tx), mesh=mesh, search=False)
    new_params, new_opt, losses = run_steps(step, params, opt_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)

    k0 = new_params["Dense_0"]["kernel"].value
    k1 = new_params["Dense_1"]["kernel"].value
    assert k0.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert k1.sharding.spec == jax.sharding.PartitionSpec("model", None)
    # Adam's mu and nu are sharded like their params.
    adam = new_opt[0]
    assert adam.mu["Dense_0"]["kernel"].value.sharding.spec == k0.sharding.spec
    assert adam.nu["Dense_1"]["kernel"].value.sharding.spec == k1.sharding.spec


def test_compiled_shardings_equal_plan_and_step_two_does_not_reshard(mesh):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((16, 32)))["params"]
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    step = shardc.auto(make_step(model, tx), mesh=mesh, search=False)
    batch = batch_of(0)
    plan = shardc.plan(step, params, opt_state, batch)
    compiled = step.lower(params, opt_state, batch).compile()
    flat_in = compiled.input_shardings[0]
    for got, want in zip(flat_in, plan.input_shardings()):
        assert got.is_equivalent_to(want.named(mesh), len(want.dims)), (got, want)
    for got, want in zip(compiled.output_shardings, plan.output_shardings()):
        assert got.is_equivalent_to(want.named(mesh), len(want.dims)), (got, want)
    # Outputs that feed the next step come out as they went in.
    n_state = len(jax.tree.leaves((params, opt_state)))
    for s_in, s_out in zip(plan.input_shardings()[:n_state], plan.output_shardings()[:n_state]):
        assert s_in == s_out
    # Gradients are sharded like their params: the kernel's gradient is an operand of the Adam update.
    p2, o2, _ = step(params, opt_state, batch)
    assert len(step._cache) == 1
    p3, o3, _ = step(p2, o2, batch_of(1))
    assert len(step._cache) == 1
    for a, b in zip(jax.tree.leaves((p2, o2)), jax.tree.leaves((p3, o3))):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_explain_names_hints_and_lines(mesh):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((16, 32)))["params"]
    tx = optax.sgd(0.1)
    step = shardc.auto(make_step(model, tx), mesh=mesh, search=False)
    text = shardc.plan(step, params, tx.init(params), batch_of(0)).explain()
    assert "split[data | ?]" in text
    assert "test_train_step.py" in text
    assert "['Dense_0']['kernel']" in text
    assert "model" in text


def test_the_updated_params_are_the_carried_state_not_metrics_shaped_like_them(mesh):
    """A step returning (metrics, new_params) with metrics shaped like the params: the params' next value
    is the output that updates them (its layout is the input's, so step 2 runs the same program), not the
    first output of the same structure."""
    def step(params, x):
        w = split(params["w"], 0, "data")
        metrics = {"w": split(jnp.tanh(w) * 3.0, 1, "model")}
        return metrics, {"w": w - 0.1 * jnp.sum(x)}

    params, x = {"w": jnp.ones((8, 8))}, jnp.ones((4,))
    auto = shardc.auto(step, mesh=mesh, search=False)
    plan = shardc.plan(auto, params, x)
    n_in = len(plan.graph.inputs)
    carried = plan.graph.carried()
    assert carried == {plan.graph.inputs[0]: plan.graph.outputs[1]}, (carried, n_in)
    assert plan.output_shardings()[1] == plan.input_shardings()[0]
    _, p2 = auto(params, x)
    auto(p2, x)
    assert len(auto._cache) == 1


def test_a_transpose_of_the_params_is_no_update_of_them(mesh):
    """A step returning (params transposed to the same shape, new_params): the elementwise update is the
    carried state, not the transpose that reads the params as directly (fuzz soak, seed 139013: the first won,
    and the hints conflicted on the carried value)."""
    def step(params, x):
        view = split(jnp.transpose(params["w"], (2, 1, 0)), 1, "data")
        return {"w": view}, {"w": params["w"] - 0.1 * jnp.sum(x)}

    params, x = {"w": jnp.ones((4, 6, 4))}, jnp.ones((4,))
    plan = shardc.plan(shardc.auto(step, mesh=mesh, search=False), params, x)
    assert plan.graph.carried() == {plan.graph.inputs[0]: plan.graph.outputs[1]}


def test_the_input_itself_re_hinted_is_not_its_update(mesh):
    """A step returning (params re-hinted to another layout, new_params): the re-hinted input is not an
    update of the params, the new params are (fuzz soak, seed 60042: step 2 failed with 'conflicting hints
    on a value carried to the next step' when the two outputs scored alike and the first won)."""
    def step(params, x):
        view = split(replicate(params["w"]), 1, "data")
        return {"w": view}, {"w": params["w"] - 0.1 * jnp.sum(x)}

    params, x = {"w": jnp.ones((8, 8))}, jnp.ones((4,))
    auto = shardc.auto(step, mesh=mesh, search=False)
    plan = shardc.plan(auto, params, x)
    assert plan.graph.carried() == {plan.graph.inputs[0]: plan.graph.outputs[1]}
    _, p2 = auto(params, x)
    _, p3 = auto(p2, x)  # step 2 takes step 1's params as placed
    np.testing.assert_allclose(np.asarray(p3["w"]), 1.0 - 0.2 * 4, rtol=1e-6)
