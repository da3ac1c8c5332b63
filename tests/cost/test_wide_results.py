"""What XLA:CPU makes of a dropout mask (`shardc.cost.program`, `shardc.cost.wide_results`): jax's threefry loop
writes two 32-bit words per random number, and the mask computed from them — through a bitcast_convert_type
and a division by a constant, both cheap elementwise work for XLA — is fused into every reader."""
import jax
import jax.numpy as jnp

from shardc.cost.program import expensive, program_info
from shardc.ir.build import build_graph


def _graph():
    def loss(w, x, key):
        h = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        return jnp.mean((jnp.where(keep, h / 0.9, 0) @ w.T) ** 2)

    closed = jax.make_jaxpr(jax.grad(loss))(jnp.ones((64, 32)), jnp.ones((16, 64)), jax.random.key(0))
    return build_graph(closed)


def _ops(graph, primitive):
    return [op for op in graph.ops if op.primitive == primitive]


def test_threefry_bits_are_two_words_per_element_on_cpu():
    graph = _graph()
    (bits,) = _ops(graph, "random_bits")
    cpu, gpu = program_info(graph, "cpu"), program_info(graph, "gpu")
    assert cpu.wide == {cpu.canon[bits.outputs[0]]: 8}
    assert not gpu.wide


def test_a_mask_is_fused_through_its_bitcast_and_division_by_a_constant():
    graph = _graph()
    info = program_info(graph, "cpu")
    (convert,) = _ops(graph, "bitcast_convert_type")
    assert info.fused[info.canon[convert.outputs[0]]]
    divs = [op for op in _ops(graph, "div") if graph.values[op.outputs[0]].shape == (16, 32)]
    assert divs and all(not expensive(op, graph, "cpu", info.constant) for op in divs)
    (bits,) = _ops(graph, "random_bits")
    # the bits are read where the last value computed from them is materialised: in the backward pass
    (reader,) = [op for op in graph.ops if bits.outputs[0] in op.inputs]
    until = dict(info.until[reader.id])
    assert info.order[until[info.canon[bits.outputs[0]]]] > info.order[convert.id]
