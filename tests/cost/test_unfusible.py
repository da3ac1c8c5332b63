"""XLA's globally unfusible producers (`shardc.cost.unfusible`): a binary elementwise value is fused into its readers
only if fusion can take it in along every path to each of them."""
import jax
import jax.numpy as jnp
import pytest

from shardc.cost import program
from shardc.cost.program import program_info
from shardc.ir.build import build_graph


def _silu_products(gradient_through_matmul: bool):
    """The graph of a GLU-like function's gradient, and the canonical value of its `s * sigmoid(s)`. With
    `gradient_through_matmul`, the SiLU's readers are the gate product (read by a matmul) and the gradient
    `silu * dh`, where `dh` comes back through that matmul; without, the readers are two elementwise products
    of values not computed from the SiLU."""
    def loss(w, x):
        s = x @ w[0]
        silu = s * jax.nn.sigmoid(s)
        if gradient_through_matmul:
            return jnp.mean(((silu * (x @ w[1])) @ w[2]) ** 2)
        return jnp.mean(silu * (x @ w[1])) + jnp.mean(silu * x[:, :1])

    w = (jnp.ones((16, 32)), jnp.ones((16, 32)), jnp.ones((32, 16)))
    graph = build_graph(jax.make_jaxpr(jax.grad(loss))(w, jnp.ones((64, 16))))
    info = program_info(graph, "cpu")
    (silu,) = [op for op in graph.ops if op.primitive == "mul" and any(
        graph.values[v].producer is not None and graph.ops[graph.values[v].producer].primitive == "logistic"
        for v in op.inputs) and any(graph.ops[graph.values[v].producer].primitive == "dot_general"
                                    for v in op.inputs if graph.values[v].producer is not None)]
    return info, info.canon[silu.outputs[0]]


def test_a_silu_whose_gradient_comes_back_through_a_matmul_is_materialised():
    info, silu = _silu_products(True)
    assert not info.fused[silu]


def test_a_silu_read_only_by_elementwise_work_is_fused():
    info, silu = _silu_products(False)
    assert info.fused[silu]


def test_the_rule_is_a_switch(monkeypatch: pytest.MonkeyPatch):
    """Without it the model fuses the SiLU (what it did before, 11% under XLA on a replicated Flax GLU step)."""
    monkeypatch.setattr(program, "GLOBALLY_UNFUSIBLE", False)
    info, silu = _silu_products(True)
    assert info.fused[silu]


def test_a_loop_carry_is_no_path_back_into_the_body():
    """In a scan body, `a = h * x` is read by `a + h` and `a * 2`, and the next state is computed from both; the
    state `h` is not computed from `a` within an iteration (XLA reaches across no loop's back edge), so `a` is
    fused (XLA: one fusion holding `a` and both readers). The back edge's tie names the state it feeds: taken for
    a path, it made `a` unfusible."""
    def f(h0, xs):
        def body(h, x):
            a = h * x
            h2 = jnp.tanh((a + h) * (a * 2.0))
            return h2, h2.sum()
        return jax.lax.scan(body, h0, xs)

    graph = build_graph(jax.make_jaxpr(f)(jnp.ones((64, 128)), jnp.ones((5, 64, 128))))
    info = program_info(graph, "cpu")
    (a,) = [op for op in graph.ops if op.primitive == "mul" and not any(graph.values[v].is_const for v in op.inputs)
            and len(op.inputs) == 2 and all(len(graph.values[v].shape) == 2 for v in op.inputs)
            and any(graph.ops[u].primitive == "add" for u in range(len(graph.ops))
                    if op.outputs[0] in graph.ops[u].inputs)]
    assert info.fused[info.canon[a.outputs[0]]]
