"""Expert-parallel MoE feed-forward layer: GShard Algorithm 2, in Flax linen and Flax NNX.

The math lives in one pure function, :func:`moe_ffn`; :class:`MoeFeedForward` (linen) and
:class:`MoeFeedForwardNNX` (NNX) only own the parameters and call it. Dims use GShard's letters:
G groups, S tokens per group, E experts, C expert capacity, M model dim, H expert hidden dim.

    x        = split(x, 0, G-axes)                      GSM
    wg       = replicate(wg)                            ME
    logits   = einsum('GSM,ME->GSE', x, wg)             GSE   (float32)
    combine, dispatch, aux = top2_gating(logits)        GSEC  (split on G)
    xe       = einsum('GSEC,GSM->EGCM', dispatch, x)    EGCM  (split on E)   <- all-to-all #1
    h        = relu(einsum('EGCM,EMH->EGCH', xe, wi))   EGCH  (split on E)
    ye       = einsum('EGCH,EHM->GECM', h, wo)          GECM  (split on G)   <- all-to-all #2
    y        = einsum('GSEC,GECM->GSM', combine, ye)    GSM   (split on G)

GShard puts G and E on the *same* devices (``group_axes = expert_axes = ("expert",)``, the default), so
the change of split dim between GSEC and EGCM, and back between EGCH and GECM, is an all-to-all. With
``group_axes=("data", "expert")`` and ``expert_axes=("expert",)`` G is split over every device and the
all-to-alls run along the expert axis only (G stays split over "data" in EGCM, as in praxis).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from annotations import replicate, split
from moe.gating import GatingOutput, routing_stats, top1_gating, top2_gating

__all__ = [
    "MoeFeedForward",
    "MoeFeedForwardNNX",
    "moe_ffn",
    "resolve_num_groups",
    "reference_moe_loop",
]

Axes = Sequence[str] | str | None


def _axes(a: Axes) -> tuple[str, ...]:
    if a is None:
        return ()
    if isinstance(a, str):
        return (a,)
    return tuple(a)


def _split(x, dim, axes):
    axes = _axes(axes)
    if not axes:
        return x
    return split(x, dim, axes[0] if len(axes) == 1 else axes)


def _mesh_axis_sizes() -> dict[str, int]:
    """Axis sizes of the mesh in force (``jax.set_mesh``), or {} without one."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover - very old/new jax
        return {}
    if mesh is None or getattr(mesh, "empty", True):
        return {}
    return dict(mesh.shape)


def resolve_num_groups(
    num_tokens: int,
    num_groups: int | None = None,
    group_size: int | None = None,
    group_axes: Axes = ("expert",),
) -> int:
    """Number of groups G for ``num_tokens`` tokens.

    * ``num_groups`` given: used as is (must divide the tokens);
    * ``group_size`` given: the smallest G >= tokens / group_size that divides the tokens and is a
      multiple of the number of devices along ``group_axes`` (mesh-tensorflow's rule);
    * neither: one group per device along ``group_axes`` in the current mesh (GShard/praxis), 1 without a mesh.
    """
    sizes = _mesh_axis_sizes()
    devices = math.prod(sizes.get(a, 1) for a in _axes(group_axes))
    if num_groups is None:
        if group_size is None:
            num_groups = devices
        else:
            want = max(1, -(-num_tokens // int(group_size)))
            g = want
            while g <= num_tokens and (num_tokens % g or g % devices):
                g += 1
            if g > num_tokens:
                raise ValueError(
                    f"cannot split {num_tokens} tokens into groups of about {group_size} tokens with a "
                    f"group count divisible by {devices} devices along {_axes(group_axes)}"
                )
            num_groups = g
    if num_groups <= 0 or num_tokens % num_groups:
        raise ValueError(
            f"MoE layer: {num_tokens} tokens cannot be split into {num_groups} equal groups; "
            f"choose num_groups/group_size dividing the number of tokens (batch x length)"
        )
    return int(num_groups)


def moe_ffn(
    x,
    gate_kernel,
    wi,
    wo,
    *,
    paddings=None,
    rng: jax.Array | None = None,
    router: str = "top2",
    capacity_factor: float = 2.0,
    expert_capacity: int | None = None,
    min_capacity: int = 1,
    second_expert_policy: str = "random",
    second_expert_threshold: float = 0.5,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
    group_axes: Axes = ("expert",),
    expert_axes: Axes = ("expert",),
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> tuple[jax.Array, GatingOutput]:
    """GShard MoE FFN on grouped tokens. ``x``: [G, S, M]; ``gate_kernel``: [M, E]; ``wi``: [E, M, H];
    ``wo``: [E, H, M]; ``paddings``: optional [G, S] (1 = padding). Returns ``(y [G, S, M], gating)``.

    Dropped tokens (over capacity) and padding get 0 output: they pass through the caller's residual.
    """
    group_axes, expert_axes = _axes(group_axes), _axes(expert_axes)
    rest_axes = tuple(a for a in group_axes if a not in expert_axes)  # G's axes while E is split
    dtype = x.dtype

    x = _split(x, 0, group_axes)
    gate_kernel = replicate(gate_kernel)
    wi = _split(wi, 0, expert_axes)
    wo = _split(wo, 0, expert_axes)

    logits = jnp.einsum("GSM,ME->GSE", x.astype(jnp.float32), gate_kernel.astype(jnp.float32))
    logits = _split(logits, 0, group_axes)
    if router == "top2":
        gating = top2_gating(
            logits,
            paddings,
            rng=rng,
            capacity_factor=capacity_factor,
            expert_capacity=expert_capacity,
            min_capacity=min_capacity,
            second_expert_policy=second_expert_policy,
            second_expert_threshold=second_expert_threshold,
        )
    elif router == "top1":
        gating = top1_gating(
            logits, paddings, rng=rng, capacity_factor=capacity_factor, expert_capacity=expert_capacity,
            min_capacity=min_capacity,
        )
    else:
        raise ValueError(f"router must be 'top2' or 'top1', got {router!r}")

    combine = _split(gating.combine_weights.astype(dtype), 0, group_axes)  # GSEC
    dispatch = _split(gating.dispatch_mask.astype(dtype), 0, group_axes)  # GSEC

    xe = jnp.einsum("GSEC,GSM->EGCM", dispatch, x)
    xe = _split(xe, 0, expert_axes)
    xe = _split(xe, 1, rest_axes)
    h = jnp.einsum("EGCM,EMH->EGCH", xe, wi.astype(dtype))
    h = _split(h, 0, expert_axes)
    h = _split(h, 1, rest_axes)
    h = activation(h)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, h.shape)
        h = jnp.where(keep, h / (1.0 - dropout_rate), 0.0).astype(dtype)
    ye = jnp.einsum("EGCH,EHM->GECM", h, wo.astype(dtype))
    if rest_axes:
        # G also spans non-expert axes (praxis layout): keep E on the expert axes here; the all-to-all
        # back to G-on-all-axes happens at the combine einsum.
        ye = _split(ye, 0, rest_axes)
        ye = _split(ye, 1, expert_axes)
    else:
        ye = _split(ye, 0, group_axes)
    y = jnp.einsum("GSEC,GECM->GSM", combine, ye)
    y = _split(y, 0, group_axes)
    return y, gating


def reference_moe_loop(x, gate_kernel, wi, wo, activation=jax.nn.relu):
    """Slow per-token reference without capacity: ``y_t = sum_k g_k * FFN_{e_k}(x_t)`` (top-2, renormalised).

    ``x``: [T, M] (numpy or jax). For tests.
    """
    import numpy as np

    x = np.asarray(x, np.float64)
    gk, wi, wo = (np.asarray(a, np.float64) for a in (gate_kernel, wi, wo))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ gk
        p = np.exp(logits - logits.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        e1, e2 = int(order[0]), int(order[1])
        g1, g2 = p[e1] / (p[e1] + p[e2]), p[e2] / (p[e1] + p[e2])
        for g, e in ((g1, e1), (g2, e2)):
            h = np.asarray(activation(jnp.asarray(x[t] @ wi[e])), np.float64)
            out[t] += g * (h @ wo[e])
    return out


def _flatten_tokens(x, paddings, num_groups, group_size, group_axes):
    *lead, m = x.shape
    tokens = math.prod(lead)
    g = resolve_num_groups(tokens, num_groups, group_size, group_axes)
    xg = x.reshape(g, tokens // g, m)
    pg = None if paddings is None else jnp.asarray(paddings).reshape(g, tokens // g)
    return xg, pg, lead


def _unif(scale):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


def _expert_init(init, expert_axes):
    """An expert weight's initializer: its expert dim split over `expert_axes` (partitioning metadata, a
    hint), or, without expert axes, no metadata at all, so that the layout is left to shardc (metadata of
    all-None would pin the experts replicated)."""
    if expert_axes is None:
        return init
    return nn.with_partitioning(init, (expert_axes, None, None))


class MoeFeedForward(nn.Module):
    """GShard MoE FFN (linen). ``__call__(x [..., M], paddings [...] = None, deterministic=True)`` returns
    ``(y [..., M], aux_loss)``; no residual or layer norm is applied here.

    Parameters: ``gate`` [M, E] (replicated), ``wi`` [E, M, H] and ``wo`` [E, H, M], both created with
    ``nn.with_partitioning`` so their expert dim is split over ``expert_axes`` (with ``expert_axes=None``
    they carry no partitioning metadata: shardc chooses their layout). Init as lingvo:
    ``U(+-sqrt(3/M))`` for gate and wi, ``U(+-sqrt(3/H))`` for wo.

    Training (``deterministic=False``) with the ``"random"`` policy draws from the ``"gating"`` rng stream;
    expert dropout draws from ``"dropout"``. Evaluation uses ``eval_capacity_factor`` when set.
    Routing stats are sown into the ``"intermediates"`` collection.
    """

    num_experts: int
    hidden_dim: int
    router: str = "top2"
    capacity_factor: float = 2.0
    eval_capacity_factor: float | None = None
    expert_capacity: int | None = None
    min_capacity: int = 1
    second_expert_policy: str = "random"
    second_expert_threshold: float = 0.5
    num_groups: int | None = None
    group_size: int | None = None
    group_axes: Axes = ("expert",)
    expert_axes: Axes = ("expert",)
    activation: Callable[[jax.Array], jax.Array] = jax.nn.relu
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, paddings=None, deterministic: bool = True):
        m = x.shape[-1]
        e, h = self.num_experts, self.hidden_dim
        ex = _axes(self.expert_axes)
        ex_name = None if not ex else (ex[0] if len(ex) == 1 else ex)
        gate = self.param(
            "gate", nn.with_partitioning(_unif(math.sqrt(3.0 / m)), (None, None)), (m, e), self.param_dtype
        )
        wi = self.param("wi", _expert_init(_unif(math.sqrt(3.0 / m)), ex_name), (e, m, h), self.param_dtype)
        wo = self.param("wo", _expert_init(_unif(math.sqrt(3.0 / h)), ex_name), (e, h, m), self.param_dtype)
        xg, pg, lead = _flatten_tokens(x.astype(self.dtype), paddings, self.num_groups, self.group_size,
                                       self.group_axes)
        rng = None
        if not deterministic and self.router == "top2" and self.second_expert_policy == "random":
            rng = self.make_rng("gating")
        dropout_rng = None
        if not deterministic and self.dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        cf = self.capacity_factor
        if deterministic and self.eval_capacity_factor is not None:
            cf = self.eval_capacity_factor
        y, gating = moe_ffn(
            xg, gate, wi, wo,
            paddings=pg, rng=rng, router=self.router, capacity_factor=cf,
            expert_capacity=self.expert_capacity, min_capacity=self.min_capacity,
            second_expert_policy=self.second_expert_policy,
            second_expert_threshold=self.second_expert_threshold,
            activation=self.activation, group_axes=self.group_axes, expert_axes=self.expert_axes,
            dropout_rate=self.dropout_rate, dropout_rng=dropout_rng,
        )
        stats = routing_stats(gating.dispatch_mask, pg)
        self.sow("intermediates", "dropped_fraction", stats.dropped)
        self.sow("intermediates", "aux_loss", gating.aux_loss)
        return y.reshape(*lead, m), gating.aux_loss


class MoeFeedForwardNNX(nnx.Module):
    """GShard MoE FFN (Flax NNX); same math and parameters as :class:`MoeFeedForward`.

    ``__call__(x [..., M], paddings=None, *, rng=None, deterministic=None)`` returns ``(y, aux_loss)``.
    Routing is random (``"random"`` policy) only when an ``rng`` key is passed; without one it is
    deterministic, as in evaluation.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        hidden_dim: int,
        *,
        rngs: nnx.Rngs,
        router: str = "top2",
        capacity_factor: float = 2.0,
        eval_capacity_factor: float | None = None,
        expert_capacity: int | None = None,
        min_capacity: int = 1,
        second_expert_policy: str = "random",
        second_expert_threshold: float = 0.5,
        num_groups: int | None = None,
        group_size: int | None = None,
        group_axes: Axes = ("expert",),
        expert_axes: Axes = ("expert",),
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
    ):
        m, e, h = model_dim, num_experts, hidden_dim
        ex = _axes(expert_axes)
        ex_name = None if not ex else (ex[0] if len(ex) == 1 else ex)
        # Partitioning metadata as nnx.with_partitioning would attach; applied eagerly only under a mesh.
        eager = bool(_mesh_axis_sizes())
        self.gate = nnx.Param(
            _unif(math.sqrt(3.0 / m))(rngs.params(), (m, e), param_dtype),
            out_sharding=(None, None), eager_sharding=eager,
        )
        # Without expert axes the experts carry no metadata (all-None would pin them replicated).
        expert_meta = {} if ex_name is None else {"out_sharding": (ex_name, None, None), "eager_sharding": eager}
        self.wi = nnx.Param(_unif(math.sqrt(3.0 / m))(rngs.params(), (e, m, h), param_dtype), **expert_meta)
        self.wo = nnx.Param(_unif(math.sqrt(3.0 / h))(rngs.params(), (e, h, m), param_dtype), **expert_meta)
        self.router = router
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.expert_capacity = expert_capacity
        self.min_capacity = min_capacity
        self.second_expert_policy = second_expert_policy
        self.second_expert_threshold = second_expert_threshold
        self.num_groups = num_groups
        self.group_size = group_size
        self.group_axes = _axes(group_axes)
        self.expert_axes = _axes(expert_axes)
        self.activation = activation
        self.dtype = dtype

    def __call__(self, x, paddings=None, *, rng: jax.Array | None = None, deterministic: bool | None = None):
        if deterministic is None:
            deterministic = rng is None
        m = x.shape[-1]
        xg, pg, lead = _flatten_tokens(x.astype(self.dtype), paddings, self.num_groups, self.group_size,
                                       self.group_axes)
        cf = self.capacity_factor
        if deterministic and self.eval_capacity_factor is not None:
            cf = self.eval_capacity_factor
        y, gating = moe_ffn(
            xg, self.gate[...], self.wi[...], self.wo[...],
            paddings=pg, rng=None if deterministic else rng, router=self.router, capacity_factor=cf,
            expert_capacity=self.expert_capacity, min_capacity=self.min_capacity,
            second_expert_policy=self.second_expert_policy,
            second_expert_threshold=self.second_expert_threshold,
            activation=self.activation, group_axes=self.group_axes, expert_axes=self.expert_axes,
        )
        return y.reshape(*lead, m), gating.aux_loss
