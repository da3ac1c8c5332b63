"""The simulator analyses a plan's program at each device's shapes where they change what XLA does
(`shardc.cost.device_shapes`): a data-parallel batch of one or two sequences per device is no batch of 8 or 16."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import shardc
from shardc.cost.device_shapes import DeviceShapes, info_for
from shardc.cost.program import program_info


def _row_norm(x):
    return jnp.sum(jnp.exp(x - jnp.max(x, -1, keepdims=True)), -1)


def _plan(f, *args):
    return shardc.auto(f, mesh=shardc.make_mesh({"x": 8}), search=False).plan(*args)


def test_a_batch_of_one_per_device_is_a_signature_and_a_replicated_plan_none():
    x = jnp.ones((8, 8, 256))
    split = _plan(lambda x: _row_norm(shardc.split(x, 0, "x")), x)
    replicated = _plan(_row_norm, x)
    shapes = DeviceShapes(split.graph, split.mesh_sizes)
    signature = dict(shapes.signature(split.shardings))
    assert signature, "the split activations have a unit dim on each device"
    assert all(shape[0] == 1 and split.graph.values[v].shape[0] == 8 for v, shape in signature.items())
    assert not DeviceShapes(replicated.graph, replicated.mesh_sizes).signature(replicated.shardings)
    # the per-device analysis is its own (reductions of 2048 elements per device: no library fusion there),
    # and the graph's own analysis is what an empty signature gets
    local = info_for(split.graph, "cpu", frozenset(signature.items()))
    assert local is not program_info(split.graph, "cpu")
    assert info_for(split.graph, "cpu", frozenset()) is program_info(split.graph, "cpu")
    assert len(local.library) < len(program_info(split.graph, "cpu").library)


class _Attention(nn.Module):
    """Self-attention with a fused QKV projection (8 heads of 32), as Flax users write it."""

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        qkv = nn.Dense(3 * d)(x).reshape(b, t, 3, 8, d // 8)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // 8)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        return nn.Dense(d)(o)


@pytest.mark.parametrize("batch", [16])
def test_peak_memory_of_data_parallel_attention_at_two_sequences_per_device(batch):
    """16 sequences over 8 devices: each device's softmax statistics are 2048-element reductions, no library
    fusion there (YNNPACK's 4096-element floor), as the global shapes' 16384 are (1.165x over before)."""
    model = _Attention()
    x = jnp.ones((batch, 128, 256))
    params = model.init(jax.random.key(0), x)

    def step(params, x):
        x = shardc.split(x, 0, "x")
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        return loss, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    row = shardc.check(shardc.auto(step, mesh=shardc.make_mesh({"x": 8}), search=False), params, x) \
        .row("peak memory bytes")
    assert abs(row.predicted - row.compiled) <= 0.02 * row.compiled, (row.predicted, row.compiled)
