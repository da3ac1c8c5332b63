"""GShard top-2 gating (Algorithm 1 of arXiv:2006.16668) and a top-1 (Switch) router.

Semantics follow lingvo's `Top2GatingOnLogits` with `legacy_mtf_behavior=True` (the code GShard was
trained with), re-derived here; see docs/moe.md for the full description. In short, per group g of S
tokens (all shapes use GShard's letters G, S, E, C):

1. ``gates = softmax(logits)`` over E, in float32.
2. First expert ``e1 = argmax(gates)``, second expert ``e2 = argmax(gates without e1)``; their gates
   ``g1, g2`` are renormalised to ``g1 / (g1 + g2)``, ``g2 / (g1 + g2)`` *before* capacity is applied (and
   not renormalised again afterwards, so a token that loses its second expert keeps weight ``g1 < 1``).
3. Auxiliary load-balancing loss ``E * sum_e(density_e * mean_gate_e)`` averaged over groups, where
   ``density_e`` is the fraction of the group's (non-padding) tokens whose *first* choice is e and
   ``mean_gate_e`` the mean softmax probability of e over those tokens. Uniform routing gives exactly
   1.0, total collapse onto one expert gives E. (The paper's ``l_aux`` is this value divided by E**2.)
4. Every expert has ``C`` slots per group. First choices are placed in token order, and *all* first
   choices of the group take slots before any second choice does; a choice whose position is ``>= C``
   is dropped (the token then passes through the layer's residual).
5. Second expert policy: ``"all"`` keeps every second choice (subject to capacity); ``"random"`` keeps it
   iff ``u < g2 / threshold`` with ``u ~ U(0, 1)``; with the default threshold 0.5 that is probability
   ``min(1, 2 * g2)``, the paper's rule. Without an ``rng`` (evaluation, decoding) ``"random"`` is
   deterministic and keeps every second choice, exactly like ``"all"``.
6. Padding tokens are never dispatched, take no slot and are left out of the aux-loss statistics.

Positions and masks are computed in int32 (bfloat16 cumsums are exact only up to 256).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "GatingOutput",
    "RoutingStats",
    "compute_capacity",
    "routing_stats",
    "top1_gating",
    "top2_gating",
]

SECOND_EXPERT_POLICIES = ("all", "random")


class GatingOutput(NamedTuple):
    """Result of a router. Unpacks as ``combine_weights, dispatch_mask, aux_loss``.

    combine_weights: float32 ``[G, S, E, C]`` — weight of slot (e, c) in token s's output.
    dispatch_mask:   bool ``[G, S, E, C]`` — token s occupies slot c of expert e; ``== combine > 0``.
    aux_loss:        float32 scalar load-balancing loss (1.0 when uniform, E when collapsed).
    """

    combine_weights: jax.Array
    dispatch_mask: jax.Array
    aux_loss: jax.Array


class RoutingStats(NamedTuple):
    """Diagnostics of one routing decision (fractions of non-padding tokens)."""

    dropped: jax.Array  # routed to no expert at all (passes through the residual)
    one_expert: jax.Array  # routed to exactly one expert
    two_experts: jax.Array  # routed to two experts
    expert_load: jax.Array  # [E]: fraction of occupied slots per expert, over all groups


def compute_capacity(
    group_size: int, num_experts: int, capacity_factor: float, min_capacity: int = 1
) -> int:
    """Expert capacity C per group per expert: ``max(min_capacity, ceil(capacity_factor * S / E))``.

    The capacity factor already includes the top-k multiplier, as in lingvo/praxis: the paper's
    ``C = 2S/E`` for top-2 is ``capacity_factor=2.0``; Switch's ``C = S/E`` is ``capacity_factor=1.0``.
    """
    if group_size <= 0 or num_experts <= 0:
        raise ValueError(f"group size ({group_size}) and number of experts ({num_experts}) must be > 0")
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    # round() guards against 2.0000000004-style float error before the ceiling.
    c = math.ceil(round(capacity_factor * group_size / num_experts, 6))
    return max(int(min_capacity), int(c))


def _check_logits(logits, paddings):
    logits = jnp.asarray(logits)
    if logits.ndim == 2:  # [S, E]: a single group
        logits = logits[None]
        if paddings is not None:
            paddings = jnp.asarray(paddings)[None]
    if logits.ndim != 3:
        raise ValueError(f"gating logits must be [G, S, E] (or [S, E]), got shape {logits.shape}")
    logits = logits.astype(jnp.float32)
    g, s, _ = logits.shape
    if paddings is None:
        nonpad = jnp.ones((g, s), jnp.int32)
    else:
        paddings = jnp.asarray(paddings)
        if paddings.shape != (g, s):
            raise ValueError(f"paddings must be [G, S] = {(g, s)}, got {paddings.shape}")
        # 1 / True marks a padding token (lingvo convention).
        nonpad = jnp.logical_not(paddings.astype(jnp.bool_)).astype(jnp.int32)
    return logits, nonpad


def _squeeze_single_group(out: GatingOutput, squeeze: bool) -> GatingOutput:
    if not squeeze:
        return out
    return GatingOutput(out.combine_weights[0], out.dispatch_mask[0], out.aux_loss)


def _is_key(x) -> bool:
    if x is None:
        return False
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _split_key(paddings, rng, *aliases):
    """Resolve the rng aliases; a typed PRNG key passed where paddings go is taken as the rng."""
    for a in aliases:
        if a is not None:
            if rng is not None:
                raise ValueError("pass the PRNG key once (rng=, key= or prng_key=)")
            rng = a
    if _is_key(paddings):
        if rng is not None:
            raise ValueError("got a PRNG key as paddings and another as rng")
        paddings, rng = None, paddings
    return paddings, rng


def _resolve_capacity(s, e, capacity_factor, expert_capacity, min_capacity):
    if expert_capacity is not None:
        c = int(expert_capacity)
        if c <= 0:
            raise ValueError(f"expert_capacity must be > 0, got {expert_capacity}")
        return c
    return compute_capacity(s, e, capacity_factor, min_capacity)


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis, dtype=jnp.int32) - x


def _balance_loss(first_mask, gates, nonpad):
    """``E * sum_e(density_e * mean_gate_e)`` per group, averaged over groups with >=1 real token."""
    e = gates.shape[-1]
    count = jnp.sum(nonpad, axis=1)  # [G]
    denom = jnp.maximum(count, 1).astype(jnp.float32)[:, None]
    density = jnp.sum(first_mask, axis=1).astype(jnp.float32) / denom  # [G, E]
    mean_gate = jnp.sum(gates * nonpad[..., None].astype(jnp.float32), axis=1) / denom  # [G, E]
    per_group = jnp.sum(density * mean_gate, axis=-1) * e  # [G]
    valid = (count > 0).astype(jnp.float32)
    return jnp.sum(per_group * valid) / jnp.maximum(jnp.sum(valid), 1.0)


def _combine(gate, expert_index, position, kept, e, c):
    """``gate * one_hot(e) (x) one_hot(pos)`` for kept choices -> [G, S, E, C]."""
    w = jnp.where(kept > 0, gate, 0.0)
    return (
        w[..., None, None]
        * jax.nn.one_hot(expert_index, e, dtype=jnp.float32)[..., :, None]
        * jax.nn.one_hot(position, c, dtype=jnp.float32)[..., None, :]
    )


def top2_gating(
    logits,
    paddings=None,
    rng: jax.Array | None = None,
    *,
    capacity_factor: float = 2.0,
    expert_capacity: int | None = None,
    min_capacity: int = 1,
    second_expert_policy: str = "random",
    second_expert_threshold: float = 0.5,
    key: jax.Array | None = None,
    prng_key: jax.Array | None = None,
    expert_capacity_dim: int | None = None,
) -> GatingOutput:
    """GShard top-2 gating on router logits ``[G, S, E]``.

    Args:
      logits: ``[G, S, E]`` router logits (computed with ``einsum('GSM,ME->GSE')``); upcast to float32.
        ``[S, E]`` is taken as one group (outputs are then ``[S, E, C]``).
      paddings: optional ``[G, S]`` (``[S]`` for 2-D logits); 1 / True marks a padding token.
      rng: PRNG key for the ``"random"`` second-expert policy. ``None`` makes routing deterministic
        (evaluation / decoding): every second choice is kept, as with ``"all"``.
      capacity_factor: ``C = ceil(capacity_factor * S / E)``; 2.0 is the paper's ``2S/E``.
      expert_capacity: explicit C, overrides ``capacity_factor``.
      min_capacity: lower bound on the computed C.
      second_expert_policy: ``"random"`` (paper) or ``"all"``.
      second_expert_threshold: ``"random"`` keeps e2 iff ``U(0,1) < g2 / threshold``; 0.5 gives
        probability ``min(1, 2 * g2)``.
      key, prng_key, expert_capacity_dim: aliases of ``rng`` / ``expert_capacity`` (praxis/lingvo names).

    Returns:
      ``GatingOutput(combine_weights [G,S,E,C] f32, dispatch_mask [G,S,E,C] bool, aux_loss f32)``.
    """
    paddings, rng = _split_key(paddings, rng, key, prng_key)
    if expert_capacity is None:
        expert_capacity = expert_capacity_dim
    if second_expert_policy not in SECOND_EXPERT_POLICIES:
        raise ValueError(
            f"second_expert_policy must be one of {SECOND_EXPERT_POLICIES}, got {second_expert_policy!r}"
        )
    squeeze = jnp.ndim(logits) == 2
    logits, nonpad = _check_logits(logits, paddings)
    g, s, e = logits.shape
    if e < 2:
        raise ValueError(f"top-2 gating needs at least 2 experts, got E={e}")
    c = _resolve_capacity(s, e, capacity_factor, expert_capacity, min_capacity)
    use_rng = second_expert_policy == "random" and rng is not None
    out = _top2(logits, nonpad, rng if use_rng else None, c, use_rng, float(second_expert_threshold))
    return _squeeze_single_group(out, squeeze)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _top2(logits, nonpad, rng, c, use_rng, threshold) -> GatingOutput:
    g, s, e = logits.shape
    gates = jax.nn.softmax(logits, axis=-1)  # [G, S, E] f32

    # First choice.
    index_1 = jnp.argmax(gates, axis=-1).astype(jnp.int32)  # [G, S]
    onehot_1 = jax.nn.one_hot(index_1, e, dtype=jnp.int32)
    mask_1 = onehot_1 * nonpad[..., None]  # [G, S, E] int32
    gate_1 = jnp.sum(gates * onehot_1, axis=-1)

    # Second choice: best of the rest.
    gates_wo_1 = gates * (1 - onehot_1)
    index_2 = jnp.argmax(gates_wo_1, axis=-1).astype(jnp.int32)
    onehot_2 = jax.nn.one_hot(index_2, e, dtype=jnp.int32)
    mask_2 = onehot_2 * nonpad[..., None]
    gate_2 = jnp.sum(gates_wo_1 * onehot_2, axis=-1)

    # Renormalise before capacity (legacy_mtf_behavior).
    denom = gate_1 + gate_2 + 1e-9
    gate_1 = gate_1 / denom
    gate_2 = gate_2 / denom

    aux_loss = _balance_loss(mask_1, gates, nonpad)

    # Capacity for first choices, in token order.
    position_1 = _exclusive_cumsum(mask_1, axis=1)  # [G, S, E]
    mask_1 = mask_1 * (position_1 < c).astype(jnp.int32)
    count_1 = jnp.sum(mask_1, axis=1, keepdims=True)  # [G, 1, E]: slots taken by first choices
    pos_1 = jnp.sum(position_1 * mask_1, axis=-1)  # [G, S]
    kept_1 = jnp.sum(mask_1, axis=-1)  # [G, S] in {0, 1}

    # Second choices: randomly kept, never with a zero gate.
    keep_2 = gate_2 > 0.0
    if use_rng:
        u = jax.random.uniform(rng, (g, s), dtype=jnp.float32)
        keep_2 = keep_2 & (u < gate_2 / max(threshold, 1e-9))
    mask_2 = mask_2 * keep_2[..., None].astype(jnp.int32)
    # All first choices precede all second choices in every expert's buffer.
    position_2 = _exclusive_cumsum(mask_2, axis=1) + count_1
    mask_2 = mask_2 * (position_2 < c).astype(jnp.int32)
    pos_2 = jnp.sum(position_2 * mask_2, axis=-1)
    kept_2 = jnp.sum(mask_2, axis=-1)

    combine = _combine(gate_1, index_1, pos_1, kept_1, e, c) + _combine(gate_2, index_2, pos_2, kept_2, e, c)
    dispatch = combine > 0.0
    return GatingOutput(combine, dispatch, aux_loss)


def top1_gating(
    logits,
    paddings=None,
    rng: jax.Array | None = None,
    *,
    capacity_factor: float = 1.0,
    expert_capacity: int | None = None,
    min_capacity: int = 1,
    key: jax.Array | None = None,
) -> GatingOutput:
    """Switch-Transformer top-1 routing with the same conventions as :func:`top2_gating`.

    Each token goes to ``argmax(softmax(logits))`` with its (unnormalised) probability as combine weight;
    ``C = ceil(capacity_factor * S / E)`` (Switch's ``S/E`` at 1.0); tokens over capacity are dropped in
    token order; aux loss ``E * sum_e(f_e * P_e)`` (1.0 when uniform). ``rng`` is accepted for interface
    symmetry and unused.
    """
    paddings, rng = _split_key(paddings, rng, key, None)
    del rng
    squeeze = jnp.ndim(logits) == 2
    logits, nonpad = _check_logits(logits, paddings)
    g, s, e = logits.shape
    c = _resolve_capacity(s, e, capacity_factor, expert_capacity, min_capacity)
    return _squeeze_single_group(_top1(logits, nonpad, c), squeeze)


@functools.partial(jax.jit, static_argnums=(2,))
def _top1(logits, nonpad, c) -> GatingOutput:
    g, s, e = logits.shape
    gates = jax.nn.softmax(logits, axis=-1)
    index_1 = jnp.argmax(gates, axis=-1).astype(jnp.int32)
    onehot_1 = jax.nn.one_hot(index_1, e, dtype=jnp.int32)
    mask_1 = onehot_1 * nonpad[..., None]
    gate_1 = jnp.sum(gates * onehot_1, axis=-1)
    aux_loss = _balance_loss(mask_1, gates, nonpad)
    position_1 = _exclusive_cumsum(mask_1, axis=1)
    mask_1 = mask_1 * (position_1 < c).astype(jnp.int32)
    pos_1 = jnp.sum(position_1 * mask_1, axis=-1)
    kept_1 = jnp.sum(mask_1, axis=-1)
    combine = _combine(gate_1, index_1, pos_1, kept_1, e, c)
    return GatingOutput(combine, combine > 0.0, aux_loss)


def routing_stats(dispatch_mask, paddings=None) -> RoutingStats:
    """Fractions of non-padding tokens routed to 0, 1 and 2 experts, and per-expert slot occupancy."""
    dispatch_mask = jnp.asarray(dispatch_mask)
    g, s, e, c = dispatch_mask.shape
    if paddings is None:
        nonpad = jnp.ones((g, s), jnp.float32)
    else:
        nonpad = 1.0 - jnp.asarray(paddings).astype(jnp.float32)
    n_experts = jnp.sum(dispatch_mask, axis=(2, 3), dtype=jnp.int32)  # [G, S]
    total = jnp.maximum(jnp.sum(nonpad), 1.0)

    def frac(k):
        return jnp.sum((n_experts == k).astype(jnp.float32) * nonpad) / total

    load = jnp.sum(dispatch_mask, axis=(0, 1, 3), dtype=jnp.int32).astype(jnp.float32) / float(g * c)
    return RoutingStats(frac(0), frac(1), frac(2), load)
