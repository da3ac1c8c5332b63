"""The model zoo of `bench/zoo.py` (FlexFlow's benchmark families): an MLP, a CNN, an LSTM LM (small Flax
linen models defined here), the GPT-style LM of `bench/gpt.py` and the MoE translation Transformer of
`moe/transformer.py`. Each `ZooModel` gives a train step and *abstract* arguments (`jax.ShapeDtypeStruct`s,
made with `jax.eval_shape`), so a model far larger than this machine's memory can be planned and simulated.

Hints: the MoE model carries its GShard hints (axis "expert"); the others only a batch hint (axis "data").
The GPT's Megatron partitioning metadata is stripped: it pins every weight, and hints are never overridden,
so with it every baseline and the search would be Megatron's weight layout plus something.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bench.gpt import make_train_step  # next-token LM step, any model
from shardc import split

__all__ = ["ZooModel", "MLP", "CNN", "LSTMLM", "zoo"]


class MLP(nn.Module):
    """A deep ReLU MLP (FlexFlow's "MLP" family)."""

    widths: tuple[int, ...] = (8192, 8192, 8192, 8192)
    out: int = 1024

    @nn.compact
    def __call__(self, x):
        x = split(x, 0, "data")
        for w in self.widths:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.out)(x)


class CNN(nn.Module):
    """A VGG-style CNN: conv-conv-pool stages, then a classifier (FlexFlow's CNN family)."""

    channels: tuple[int, ...] = (64, 128, 256, 512)
    classes: int = 1000
    hidden: int = 4096

    @nn.compact
    def __call__(self, x):
        x = split(x, 0, "data")
        for c in self.channels:
            x = nn.relu(nn.Conv(c, (3, 3))(x))
            x = nn.relu(nn.Conv(c, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.classes)(x)


class LSTMLM(nn.Module):
    """A stacked LSTM language model (FlexFlow's RNNLM family); the time loop is a scan."""

    vocab: int = 32768
    hidden: int = 2048
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        ids = split(ids, 0, "data")
        x = nn.Embed(self.vocab, self.hidden)(ids)
        for _ in range(self.layers):
            x = nn.RNN(nn.OptimizedLSTMCell(self.hidden))(x)
        return nn.Dense(self.vocab)(x)


def _classifier_step(model: nn.Module, tx: optax.GradientTransformation) -> Callable:
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@dataclasses.dataclass
class ZooModel:
    """A zoo entry: `build(mesh, scale)` -> (train step, abstract args) traced under `mesh`, the global batch
    `scale` times the listed one (weak scaling: the listed batch is for 8 devices). The MoE model has a fixed
    number of groups, so its program does not depend on the mesh."""

    name: str
    family: str
    build: Callable[[Any], tuple[Callable, tuple]]
    note: str = ""


def _abstract(init: Callable, *args) -> Any:
    return jax.eval_shape(init, *args)


def _unbox(tree):
    return jax.tree_util.tree_map(lambda x: x.unbox() if isinstance(x, nn.meta.AxisMetadata) else x, tree,
                                  is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def _classifier(model: nn.Module, x_shape: tuple[int, ...], classes: int):
    def build(mesh, scale=1):
        tx = optax.adam(1e-3)
        x_full = (x_shape[0] * scale,) + tuple(x_shape[1:])
        x = jax.ShapeDtypeStruct(x_full, jnp.float32)
        y = jax.ShapeDtypeStruct((x_full[0],), jnp.int32)
        params = _abstract(lambda k: model.init(k, jnp.zeros(x_shape, jnp.float32))["params"], jax.random.key(0))
        opt = _abstract(tx.init, params)
        return _classifier_step(model, tx), (params, opt, x, y)

    return build


def _lstm(batch: int, seq: int, **kw):
    model = LSTMLM(**kw)

    def build(mesh, scale=1):
        tx = optax.adam(1e-3)
        ids = jax.ShapeDtypeStruct((batch * scale, seq + 1), jnp.int32)
        params = _abstract(lambda k: model.init(k, jnp.zeros((batch, seq), jnp.int32))["params"], jax.random.key(0))
        return make_train_step(model, tx), (params, _abstract(tx.init, params), ids)

    return build


def _gpt(layers: int, batch: int, seq: int, **kw):
    from bench.gpt import GPT

    model = GPT(layers=layers, seq=seq, **kw)

    def build(mesh, scale=1):
        tx = optax.adamw(1e-3)
        ids = jax.ShapeDtypeStruct((batch * scale, seq + 1), jnp.int32)
        with jax.set_mesh(mesh):
            params = _abstract(lambda k: model.init(k, jnp.zeros((batch, seq), jnp.int32))["params"],
                               jax.random.key(1))
        params = _unbox(params)  # without the Megatron metadata: every strategy is open to the baselines
        return make_train_step(model, tx), (params, _abstract(tx.init, params), ids)

    return build


def _moe(batch: int, length: int, **kw):
    from moe.transformer import Transformer, TransformerConfig, loss_fn

    def build(mesh, scale=1):
        cfg = TransformerConfig(**kw)
        model = Transformer(cfg)
        tx = optax.adam(1e-3)
        src = jax.ShapeDtypeStruct((batch * scale, length), jnp.int32)
        zeros = jnp.zeros((batch, length), jnp.int32)
        with jax.set_mesh(mesh):
            from annotations import mesh_context

            with mesh_context(mesh):
                params = _abstract(lambda k: model.init(k, zeros, zeros)["params"], jax.random.key(0))

        def step(params, opt_state, src, tgt_in, tgt_out):
            def loss(p):
                logits, aux = model.apply({"params": p}, src, tgt_in)
                return loss_fn(logits, tgt_out, aux, cfg)[0]

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return step, (params, _abstract(tx.init, params), src, src, src)

    return build


def zoo(scale: str = "full") -> list[ZooModel]:
    """The zoo. scale="full": the benchmark sizes; "tiny": the same families, small (for smoke runs)."""
    tiny = scale == "tiny"
    moe_kw = ({"vocab_size": 256, "d_model": 64, "mlp_dim": 128, "num_encoder_layers": 2, "num_decoder_layers": 2,
               "num_groups": 8} if tiny else
              {"vocab_size": 32000, "d_model": 1024, "num_heads": 16, "mlp_dim": 4096, "num_experts": 64,
               "num_encoder_layers": 6, "num_decoder_layers": 6, "num_groups": 64})
    moe_batch, moe_len = (8, 16) if tiny else (64, 256)
    return [
        ZooModel("mlp", "MLP", _classifier(MLP((512,) * 4 if tiny else (8192,) * 4, 128 if tiny else 1024),
                                           (64, 256) if tiny else (1024, 1024), 128 if tiny else 1024),
                 "4x Dense(8192), batch 1024, Adam"),
        ZooModel("cnn", "CNN", _classifier(CNN((8, 16) if tiny else (64, 128, 256, 512), 10 if tiny else 1000,
                                               64 if tiny else 4096),
                                           (16, 16, 16, 3) if tiny else (256, 64, 64, 3), 10 if tiny else 1000),
                 "VGG-style, 8 convs (64-512 ch) + 2 Dense, 64x64 images, batch 256, Adam"),
        ZooModel("lstm", "RNNLM", _lstm(16 if tiny else 256, 8 if tiny else 64,
                                        **({"vocab": 256, "hidden": 64} if tiny else {})),
                 "2-layer LSTM, hidden 2048, vocab 32k, seq 64, batch 256, Adam"),
        ZooModel("gpt12", "Transformer LM", _gpt(2 if tiny else 12, 8 if tiny else 16, 32 if tiny else 1024,
                                                 **({} if tiny else {"vocab": 32768, "d": 1024, "heads": 16})),
                 "12 layers, d 1024, seq 1024, vocab 32k, batch 16, AdamW"),
        ZooModel("gpt12-xl", "Transformer LM (memory-tight)",
                 _gpt(2 if tiny else 12, 8 if tiny else 16, 32 if tiny else 2048,
                      **({} if tiny else {"vocab": 32768, "d": 4096, "heads": 32})),
                 "12 layers, d 4096 (2.7 B params), seq 2048, batch 16, AdamW: data parallel does not fit"),
        ZooModel("gpt12-wide", "Transformer LM (memory-tight, few tokens)",
                 _gpt(2 if tiny else 12, 8, 32 if tiny else 512,
                      **({} if tiny else {"vocab": 32768, "d": 6144, "heads": 48})),
                 "12 layers, d 6144 (5.8 B params), seq 512, batch 8, AdamW: data parallel does not fit, "
                 "few tokens per step"),
        ZooModel("gpt48", "Transformer LM (deep, memory-tight)",
                 _gpt(4 if tiny else 48, 8 if tiny else 32, 32 if tiny else 2048,
                      **({} if tiny else {"vocab": 32768, "d": 2048, "heads": 16})),
                 "48 layers, d 2048 (2.5 B params), seq 2048, batch 32, AdamW: its activations do not fit 8 H100s "
                 "without rematerialization"),
        ZooModel("moe", "MoE Transformer", _moe(moe_batch, moe_len, **moe_kw),
                 "GShard translation Transformer, 6+6 layers, d 1024, 64 experts every other FFN, batch 64x256"),
        ZooModel("moe-auto", "MoE Transformer (no hints)",
                 _moe(moe_batch, moe_len, group_axes=None, expert_axes=None, **moe_kw),
                 "the same model with its GShard hints off (`group_axes=expert_axes=None`): the experts' and "
                 "tokens' layouts are left to the search"),
    ]
