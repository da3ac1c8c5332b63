"""Megatron's pairing on the zoo's Transformer LM (bench/gpt.py without its metadata, as bench/zoo_models.py
builds it): column-parallel QKV and first MLP projection, row-parallel attention output and second MLP
projection, one all-reduce over the model axis per pair and no reshard of a weight between them."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardc
from bench.gpt import GPT, make_train_step
from search_models import problem_of
from shardc.search.baselines import baseline_plan

MESH = {"data": 2, "model": 4}


def _names(args):
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    return [("params", "opt_state", "ids")[path[0].idx] + jax.tree_util.keystr(path[1:]) for path, _ in leaves]


@pytest.fixture(scope="module")
def megatron_plan():
    model, tx = GPT(vocab=512, d=128, heads=4, layers=1, seq=32), optax.adamw(1e-3)
    ids = jax.ShapeDtypeStruct((8, 33), jnp.int32)
    params = jax.eval_shape(lambda k: model.init(k, jnp.zeros((8, 32), jnp.int32))["params"], jax.random.key(0))
    params = nn.meta.unbox(params)  # without the Megatron metadata, as the zoo has it
    args = (params, jax.eval_shape(tx.init, params), ids)
    problem = problem_of(make_train_step(model, tx), args, names=_names(args))
    return baseline_plan("megatron", problem, shardc.make_mesh(MESH))


def _forward_dots(plan):
    """The first four dot_generals with a weight operand, in program order: qkv, out, fc1, fc2 of the block."""
    g, out = plan.graph, []
    for op in g.ops:
        if op.primitive == "dot_general" and any((g.values[v].name or "").startswith("params") for v in op.inputs):
            out.append(op)
    return out[:4]


def test_megatron_pairs_column_then_row_in_attention_and_mlp(megatron_plan):
    plan, g = megatron_plan, megatron_plan.graph
    sizes = plan.mesh_sizes
    kinds = []
    for op in _forward_dots(plan):
        strat = plan.strategies[op.id]
        weight = strat.tensor_sharding(op.rule, op.rule.operands[1], sizes).dims
        partial = strat.partial_axes(op.rule)
        kinds.append("row" if weight == (("model",), ()) and partial == {"model"} else
                     "column" if weight == ((), ("model",)) and not partial else f"{weight} {partial}")
    assert kinds == ["column", "row", "column", "row"]
    # no weight moves between the pairs (the attention output projection computed column-parallel needed
    # its row-split kernel all-to-all'd and its input all-gathered)
    assert not [r for r in plan.reshards if r.kind.startswith("all-to-all")]
    # what made the residual stream split on its width before: the position table split like a projection
    by_name = {g.values[v].name: plan.shardings[v] for v in g.inputs}
    assert by_name["params['pos']"].dims == ((), ())  # position embeddings replicated, as Megatron-LM has them
    assert by_name["params['Embed_0']['embedding']"].dims == (("model",), ())  # vocab-parallel


class FusedQKV(nn.Module):
    """One Dense(3 * d) for q, k and v, reshaped to (b, s, heads, 3, head_dim): Megatron-LM's interleaved
    order, in which a contiguous column split of the fused kernel gives each device whole heads of q, k and
    v. (In the (b, s, 3, heads, head_dim) order, or with `jnp.split(qkv, 3, -1)` as bench/gpt.py has it, no
    contiguous split does: the plan all-gathers the fused output before taking the heads apart.)"""

    d: int = 64
    heads: int = 4

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(512, self.d)(ids)
        b, s, _ = x.shape
        hd = self.d // self.heads
        qkv = nn.Dense(3 * self.d)(nn.LayerNorm()(x)).reshape(b, s, self.heads, 3, hd)
        q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / hd ** 0.5, axis=-1)
        x = x + nn.Dense(self.d, name="out")(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, self.d))
        x = x + nn.Dense(self.d, name="fc2")(nn.gelu(nn.Dense(4 * self.d, name="fc1")(nn.LayerNorm()(x))))
        return nn.Dense(512)(nn.LayerNorm()(x))


def test_fused_qkv_split_on_heads_without_gathers():
    model, tx = FusedQKV(), optax.adamw(1e-3)
    ids = jax.random.randint(jax.random.key(0), (8, 17), 0, 512)
    params = model.init(jax.random.key(1), ids[:, :-1])["params"]
    args = (params, tx.init(params), ids)
    problem = problem_of(make_train_step(model, tx), args, names=_names(args))
    plan = baseline_plan("megatron", problem, shardc.make_mesh(MESH))
    g, sizes = plan.graph, plan.mesh_sizes
    fused = {(8, 16, 3 * 64), (8, 16, 4, 3, 16)}
    assert not [r for r in plan.reshards if r.bytes and tuple(g.values[r.value].shape) in fused]
    scores = [op for op in g.ops if op.primitive == "dot_general" and g.values[op.outputs[0]].shape == (8, 4, 16, 16)]
    assert scores and all(plan.strategies[op.id].tensor_sharding(op.rule, op.rule.results[0], sizes).dims[1]
                          == ("model",) for op in scores)  # every q.k (and its gradients) on its heads
    # the program XLA compiles from the plan moves what the plan says it moves
    report = shardc.check(plan)
    for row in report.rows:
        if row.quantity.endswith(" bytes") and "memory" not in row.quantity:
            assert row.ok, str(report)
