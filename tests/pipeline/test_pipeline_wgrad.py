"""Weight gradients deferred past the pipeline loop (`Pipeline(defer_wgrad=True)`, shardc.pipeline.wgrad): the
backward loop computes only the activations' gradients; after it, one GEMM per weight matmul contracts every
microbatch the stage ran (no per-iteration accumulation, no weight-gradient work in the bubble). The step still
equals the unpipelined `jax.jit` step."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardc
from shardc.pipeline import Pipeline
from shardc.pipeline.jit import for_mesh, pipeline_jit
from shardc.pipeline.wgrad import find_sites

from test_pipeline_lowering import CASES, LAYERS, TX, dots_run, make_args, make_step, rel, train


def _sites(body, carry, *weights):
    closed = jax.make_jaxpr(body)(carry, *weights)
    return find_sites(closed, range(1, 1 + len(weights)))


def test_sites_are_weight_matmuls_whose_weight_has_no_other_use():
    h = jnp.ones((4, 8))

    def body(h, w1, w2, b, w3):
        y = jnp.tanh(h @ w1.astype(jnp.bfloat16).astype(jnp.float32))  # through casts
        y = jax.jit(jnp.matmul)(y, w2)  # inside a jit
        y = y + b  # a bias: no matmul, not deferred
        return y @ w3 + jnp.sum(w3)  # w3 also summed: its gradient is not only the matmul's, not deferred

    sites = _sites(body, h, jnp.ones((8, 8)), jnp.ones((8, 8)), jnp.ones((8,)), jnp.ones((8, 8)))
    assert sites.leaves == {0, 1}
    by_leaf = {s.leaf: s for s in sites.sites}
    assert [e.primitive.name for e in by_leaf[0].chain] == ["convert_element_type", "convert_element_type"]
    assert len(by_leaf[1].path) == 2  # (the jit eqn, the dot inside it)
    assert not by_leaf[0].weight_is_lhs

    def lhs(h, w):  # the weight as the dot's left operand
        return (w @ h.T).T

    (site,) = _sites(lhs, h, jnp.ones((8, 8))).sites
    assert site.weight_is_lhs


def test_defer_with_1f1b_is_an_error():
    with pytest.raises(shardc.ShardingError, match="1f1b"):
        Pipeline(2, 4, "1f1b", defer_wgrad=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_loop_has_no_weight_matmuls(case):
    """Per iteration the gpipe backward loop computes each layer's weight gradients (2 dots per layer); deferred,
    they run once after the loop: per weight matmul, iterations - 1 fewer dots executed."""
    axes, model_axis, data = CASES[case]
    mesh = shardc.make_mesh(axes)
    step, args = make_step(model_axis), make_args()
    pipe = for_mesh(axes["stage"], 4, axes, "gpipe", data=data)
    dots = {d: dots_run(pipeline_jit(step, dataclasses.replace(pipe, defer_wgrad=d), mesh).lower(*args).compile()
                        .as_text()) for d in (False, True)}
    sites = 2 * LAYERS // axes["stage"]  # two weight matmuls per layer, the stage's layers
    assert dots[False] - dots[True] == sites * (pipe.iterations - 1), dots


def test_flax_attention_stack_with_deferred_weight_gradients():
    """Flax's own attention (`nn.MultiHeadDotProductAttention`: DenseGeneral kernels of rank 3, the einsums of
    `dot_product_attention`) and MLP in an `nn.scan`, pipelined with deferred weight gradients on stage 2 x
    data 4: the loss and every gradient equal the unpipelined jax.jit step's. (Gradients, not parameters after
    Adam steps: the key projection's bias has a gradient of exactly zero in exact arithmetic — softmax ignores
    a constant per row — so its float noise, which Adam scales up to full-size steps, differs between any two
    programs.)"""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(nn.LayerNorm()(x))
            return x + nn.Dense(16)(jax.nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
            x, _ = blocks(name="blocks")(nn.Dense(16)(x), None)
            return nn.Dense(4)(x.mean(1))

    model = Model()
    x, y = jax.random.normal(jax.random.key(0), (16, 6, 8)), jax.random.normal(jax.random.key(1), (16, 4))
    params = model.init(jax.random.key(2), x)["params"]

    def grads(p, x, y):
        return jax.value_and_grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(p)

    axes = {"stage": 2, "data": 4}
    mesh = shardc.make_mesh(axes)
    with jax.set_mesh(mesh):
        want_l, want = jax.jit(grads)(params, x, y)
    piped = pipeline_jit(grads, for_mesh(2, 4, axes, "gpipe", data=("data",), defer_wgrad=True), mesh)
    got_l, got = piped(params, x, y)
    assert abs(got_l - want_l) <= 1e-6 * abs(want_l)
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        assert float(jnp.max(jnp.abs(w - g))) <= 1e-5 * float(jnp.max(jnp.abs(w))) + 1e-7 * scale, \
            jax.tree_util.keystr(path)
    # the attention's and the MLP's kernels were deferred: fewer dots than the loop's own differentiation
    plain = pipeline_jit(grads, for_mesh(2, 4, axes, "gpipe", data=("data",)), mesh)
    assert dots_run(piped.lower(params, x, y).compile().as_text()) < \
        dots_run(plain.lower(params, x, y).compile().as_text())


def test_auto_runs_the_deferred_plan_and_the_simulator_sees_its_collectives():
    """@shardc.auto with a deferred pipeline: numerics equal jax.jit; the plan's collective bytes per kind are
    the compiled program's; the simulated peak is within shardc.check's tolerance of XLA's."""
    axes = {"stage": 2, "data": 4}
    mesh = shardc.make_mesh(axes)
    step, args = make_step(None), make_args()
    f = shardc.auto(step, mesh=mesh, search=False, topology="h100-sxm-8",
                    pipeline=for_mesh(2, 4, axes, "gpipe", data=("data",), defer_wgrad=True))
    with jax.set_mesh(mesh):
        want_p, want_l = train(jax.jit(step), args)
    got_p, got_l = train(f, args)
    assert np.allclose(want_l, got_l, rtol=1e-5, atol=0)
    for w, g in zip(jax.tree.leaves(want_p), jax.tree.leaves(got_p)):
        assert rel(w, g) <= 1e-5
    plan = f.plan(*args)
    assert "weight gradients after the loop" in plan.explain()
    rows = {r.quantity: r for r in shardc.check(plan).rows}
    assert rows["collective-permute bytes"].predicted == rows["collective-permute bytes"].compiled > 0
    assert all(r.ok for q, r in rows.items() if q.endswith("bytes")), {q: (r.predicted, r.compiled) for q, r in rows.items()}
