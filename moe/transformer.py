"""Encoder-decoder Transformer whose every other feed-forward layer is a GShard MoE layer (Flax linen).

Pre-layer-norm Transformer (Vaswani et al.) with sinusoidal positions and one embedding shared by
source, target and output projection (a joint subword vocabulary). In each stack, layer ``i`` uses
:class:`moe.layer.MoeFeedForward` when ``i % moe_every == moe_every - 1`` (GShard: every other layer)
and a dense ReLU FFN otherwise. ``__call__`` returns the logits and the mean auxiliary load-balancing
loss of the MoE layers; :func:`loss_fn` adds it with weight ``aux_loss_weight``.

Greedy decoding keeps a key/value cache per decoder layer (:meth:`Transformer.decode_step`), so a
sentence of length L costs L single-token decoder passes. MoE layers route the tokens of one decoding
step (one per sentence) as one group, deterministically, with capacity from ``decode_capacity_factor``
(None: C = S, nothing dropped, at E/2 times the expert compute).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from annotations import split
from moe.layer import MoeFeedForward

__all__ = ["TransformerConfig", "Transformer", "loss_fn", "greedy_decode", "num_moe_layers"]

Axes = Sequence[str] | str | None


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    d_model: int = 256
    num_heads: int = 4
    mlp_dim: int = 1024
    num_encoder_layers: int = 3
    num_decoder_layers: int = 3
    # MoE
    num_experts: int = 8
    expert_hidden_dim: int | None = None  # default: mlp_dim
    moe_every: int = 2  # GShard: every other FFN is a MoE layer
    router: str = "top2"
    capacity_factor: float = 2.0
    eval_capacity_factor: float | None = 2.0
    second_expert_policy: str = "random"
    second_expert_threshold: float = 0.5
    aux_loss_weight: float = 0.01
    num_groups: int | None = None  # default: one group per device along group_axes
    group_size: int | None = None
    group_axes: Axes = ("expert",)
    expert_axes: Axes = ("expert",)
    batch_axes: Axes = None  # if set: activations hinted split on batch over these axes
    # rest
    dropout_rate: float = 0.1
    max_len: int = 256
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    dtype: Any = jnp.float32
    decode: bool = False  # set by greedy_decode: MoE routes one group per decoding step
    # Capacity factor of a decoding step's group (one token per sentence); None = C = S, nothing dropped.
    decode_capacity_factor: float | None = None

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and self.moe_every > 0 and layer % self.moe_every == self.moe_every - 1


def num_moe_layers(cfg: TransformerConfig) -> int:
    return sum(cfg.is_moe(i) for i in range(cfg.num_encoder_layers)) + sum(
        cfg.is_moe(i) for i in range(cfg.num_decoder_layers)
    )


def _hint_batch(x, cfg: TransformerConfig):
    if not cfg.batch_axes:
        return x
    axes = cfg.batch_axes
    if not isinstance(axes, str):
        axes = tuple(axes)
        axes = axes[0] if len(axes) == 1 else axes
    return split(x, 0, axes)


def sinusoidal_positions(length: int, d: int) -> np.ndarray:
    pos = np.arange(length)[:, None]
    i = np.arange(d // 2)[None, :]
    angle = pos / np.power(10000.0, 2 * i / d)
    out = np.zeros((length, d), np.float32)
    out[:, 0::2] = np.sin(angle)
    out[:, 1::2] = np.cos(angle)
    return out


class Attention(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(self, q_in, kv_in, mask, deterministic: bool, cache=None, cache_index=None):
        cfg = self.cfg
        h = cfg.num_heads
        hd = cfg.d_model // h
        dense = lambda name: nn.DenseGeneral((h, hd), dtype=cfg.dtype, name=name)  # noqa: E731
        q = dense("query")(q_in)
        k = dense("key")(kv_in)
        v = dense("value")(kv_in)
        new_cache = None
        if cache is not None:
            ck, cv = cache
            k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, cache_index, 0, 0))
            v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, cache_index, 0, 0))
            new_cache = (k, v)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        w = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(cfg.dtype)
        w = nn.Dropout(cfg.dropout_rate)(w, deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", w, v)
        out = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=cfg.dtype, name="out")(out)
        return out, new_cache


class FeedForward(nn.Module):
    """Dense FFN or MoE FFN; returns (y, aux_loss or None)."""

    cfg: TransformerConfig
    moe: bool

    @nn.compact
    def __call__(self, x, paddings, deterministic: bool):
        cfg = self.cfg
        if not self.moe:
            y = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype, name="wi")(x)
            y = nn.relu(y)
            y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
            return nn.Dense(cfg.d_model, dtype=cfg.dtype, name="wo")(y), None
        if cfg.decode:
            # One decoding step: route the step's tokens (one per sentence) as one group, with capacity
            # ceil(decode_capacity_factor * S / E), or C = S (never drop) when that is None.
            # (No sharding hints: a decoding step's single group cannot be split.)
            s = int(np.prod(x.shape[:-1]))
            cap = s if cfg.decode_capacity_factor is None else max(
                1, min(s, math.ceil(cfg.decode_capacity_factor * s / cfg.num_experts)))
            kw = dict(num_groups=1, group_size=None, expert_capacity=cap, group_axes=None, expert_axes=None)
        else:
            kw = dict(num_groups=cfg.num_groups, group_size=cfg.group_size, expert_capacity=None,
                      group_axes=cfg.group_axes, expert_axes=cfg.expert_axes)
        y, aux = MoeFeedForward(
            num_experts=cfg.num_experts,
            hidden_dim=cfg.expert_hidden_dim or cfg.mlp_dim,
            router=cfg.router,
            capacity_factor=cfg.capacity_factor,
            eval_capacity_factor=cfg.eval_capacity_factor,
            second_expert_policy=cfg.second_expert_policy,
            second_expert_threshold=cfg.second_expert_threshold,
            dropout_rate=0.0,
            dtype=cfg.dtype,
            name="moe",
            **kw,
        )(x, paddings, deterministic=deterministic)
        return y, aux


class EncoderLayer(nn.Module):
    cfg: TransformerConfig
    moe: bool

    @nn.compact
    def __call__(self, x, mask, paddings, deterministic: bool):
        cfg = self.cfg
        drop = lambda t: nn.Dropout(cfg.dropout_rate)(t, deterministic=deterministic)  # noqa: E731
        y = nn.LayerNorm(dtype=cfg.dtype, name="ln_attn")(x)
        y, _ = Attention(cfg, name="attn")(y, y, mask, deterministic)
        x = _hint_batch(x + drop(y), cfg)
        y = nn.LayerNorm(dtype=cfg.dtype, name="ln_ffn")(x)
        y, aux = FeedForward(cfg, self.moe, name="ffn")(y, paddings, deterministic)
        x = _hint_batch(x + drop(y), cfg)
        return x, aux


class DecoderLayer(nn.Module):
    cfg: TransformerConfig
    moe: bool

    @nn.compact
    def __call__(self, x, enc, self_mask, cross_mask, paddings, deterministic: bool, cache=None, index=None):
        cfg = self.cfg
        drop = lambda t: nn.Dropout(cfg.dropout_rate)(t, deterministic=deterministic)  # noqa: E731
        y = nn.LayerNorm(dtype=cfg.dtype, name="ln_self")(x)
        y, new_cache = Attention(cfg, name="self_attn")(y, y, self_mask, deterministic, cache, index)
        x = _hint_batch(x + drop(y), cfg)
        y = nn.LayerNorm(dtype=cfg.dtype, name="ln_cross")(x)
        y, _ = Attention(cfg, name="cross_attn")(y, enc, cross_mask, deterministic)
        x = _hint_batch(x + drop(y), cfg)
        y = nn.LayerNorm(dtype=cfg.dtype, name="ln_ffn")(x)
        y, aux = FeedForward(cfg, self.moe, name="ffn")(y, paddings, deterministic)
        x = _hint_batch(x + drop(y), cfg)
        return x, aux, new_cache


def _mean_aux(auxes):
    auxes = [a for a in auxes if a is not None]
    if not auxes:
        return jnp.zeros((), jnp.float32)
    return sum(auxes) / len(auxes)


class Transformer(nn.Module):
    cfg: TransformerConfig

    def setup(self):
        cfg = self.cfg
        self.embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.d_model**-0.5), name="embed"
        )
        self.encoder_layers = [
            EncoderLayer(cfg, cfg.is_moe(i), name=f"encoder_{i}") for i in range(cfg.num_encoder_layers)
        ]
        self.decoder_layers = [
            DecoderLayer(cfg, cfg.is_moe(i), name=f"decoder_{i}") for i in range(cfg.num_decoder_layers)
        ]
        self.encoder_norm = nn.LayerNorm(dtype=cfg.dtype, name="encoder_norm")
        self.decoder_norm = nn.LayerNorm(dtype=cfg.dtype, name="decoder_norm")
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def _embed(self, tokens, offset=0, deterministic=True):
        cfg = self.cfg
        x = self.embed(tokens) * math.sqrt(cfg.d_model)
        pos = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model))
        length = tokens.shape[1]
        pe = jax.lax.dynamic_slice_in_dim(pos, offset, length, axis=0) if not isinstance(offset, int) else pos[
            offset : offset + length
        ]
        x = (x + pe[None]).astype(cfg.dtype)
        return _hint_batch(self.dropout(x, deterministic=deterministic), cfg)

    def encode(self, src, deterministic: bool = True):
        """src [B, Ls] int -> (encoder output [B, Ls, M], aux loss)."""
        cfg = self.cfg
        valid = src != cfg.pad_id
        mask = valid[:, None, None, :]
        paddings = (~valid).astype(jnp.int32)
        x = self._embed(src, 0, deterministic)
        auxes = []
        for layer in self.encoder_layers:
            x, aux = layer(x, mask, paddings, deterministic)
            auxes.append(aux)
        return self.encoder_norm(x), _mean_aux(auxes)

    def decode(self, enc, src, tgt_in, deterministic: bool = True):
        """Teacher-forced decoder: tgt_in [B, Lt] -> (logits [B, Lt, V], aux loss)."""
        cfg = self.cfg
        lt = tgt_in.shape[1]
        valid = tgt_in != cfg.pad_id
        # Position 0 is BOS (never pad); causal mask.
        causal = jnp.tril(jnp.ones((lt, lt), bool))[None, None]
        self_mask = causal & valid[:, None, None, :]
        cross_mask = (src != cfg.pad_id)[:, None, None, :]
        paddings = (~valid).astype(jnp.int32)
        x = self._embed(tgt_in, 0, deterministic)
        auxes = []
        for layer in self.decoder_layers:
            x, aux, _ = layer(x, enc, self_mask, cross_mask, paddings, deterministic)
            auxes.append(aux)
        x = self.decoder_norm(x)
        return self.embed.attend(x).astype(jnp.float32), _mean_aux(auxes)

    def __call__(self, src, tgt_in, deterministic: bool = True):
        """Returns (logits [B, Lt, V] float32, mean aux loss over the MoE layers)."""
        enc, aux_e = self.encode(src, deterministic)
        logits, aux_d = self.decode(enc, src, tgt_in, deterministic)
        n_e = sum(self.cfg.is_moe(i) for i in range(self.cfg.num_encoder_layers))
        n_d = sum(self.cfg.is_moe(i) for i in range(self.cfg.num_decoder_layers))
        aux = (aux_e * n_e + aux_d * n_d) / max(n_e + n_d, 1)
        return logits, aux

    def init_cache(self, batch: int, length: int):
        cfg = self.cfg
        hd = cfg.d_model // cfg.num_heads
        z = jnp.zeros((batch, length, cfg.num_heads, hd), cfg.dtype)
        return [(z, z) for _ in range(cfg.num_decoder_layers)]

    def decode_step(self, enc, src, token, cache, index):
        """One greedy step: token [B, 1] at position ``index`` -> (logits [B, V], new cache)."""
        cfg = self.cfg
        length = cache[0][0].shape[1]
        self_mask = (jnp.arange(length) <= index)[None, None, None, :]
        cross_mask = (src != cfg.pad_id)[:, None, None, :]
        paddings = jnp.zeros(token.shape, jnp.int32)
        x = self._embed(token, index, True)
        new_cache = []
        for layer, c in zip(self.decoder_layers, cache):
            x, _, nc = layer(x, enc, self_mask, cross_mask, paddings, True, c, index)
            new_cache.append(nc)
        x = self.decoder_norm(x)
        return self.embed.attend(x[:, 0]).astype(jnp.float32), new_cache


def loss_fn(logits, targets, aux_loss, cfg: TransformerConfig, label_smoothing: float = 0.1):
    """Label-smoothed cross-entropy per non-pad target token + ``aux_loss_weight * aux_loss``.

    Returns (total loss, metrics dict with 'nll' (no smoothing), 'xent', 'aux', 'tokens')."""
    v = logits.shape[-1]
    weights = (targets != cfg.pad_id).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    smooth = -jnp.mean(logp, axis=-1)
    xent = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    ntok = jnp.maximum(jnp.sum(weights), 1.0)
    xent = jnp.sum(xent * weights) / ntok
    nll = jnp.sum(nll * weights) / ntok
    total = xent + cfg.aux_loss_weight * aux_loss
    return total, {"loss": total, "xent": xent, "nll": nll, "aux": aux_loss, "tokens": jnp.sum(weights)}


def greedy_decode(params, cfg: TransformerConfig, src, max_len: int):
    """Greedy translation of ``src`` [B, Ls] (numpy/jax int); returns [B, max_len] token ids (after BOS).

    Deterministic (no random routing, no dropout). jit this (``jax.jit(greedy_decode,
    static_argnums=(1, 3))``).
    """
    dcfg = dataclasses.replace(cfg, decode=True, dropout_rate=0.0)
    model = Transformer(dcfg)
    b = src.shape[0]
    enc, _ = model.apply({"params": params}, src, method=Transformer.encode)
    cache = model.init_cache(b, max_len)
    token = jnp.full((b, 1), cfg.bos_id, jnp.int32)
    done = jnp.zeros((b,), bool)
    out = jnp.full((b, max_len), cfg.pad_id, jnp.int32)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < max_len) & ~jnp.all(done)

    def body(carry):
        i, token, cache, done, out = carry
        logits, cache = model.apply({"params": params}, enc, src, token, cache, i, method=Transformer.decode_step)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        nxt = jnp.where(done, cfg.pad_id, nxt)
        out = out.at[:, i].set(nxt)
        done = done | (nxt == cfg.eos_id)
        return i + 1, nxt[:, None], cache, done, out

    # Stops as soon as every sentence has produced EOS.
    _, _, _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(0), token, cache, done, out))
    return out
