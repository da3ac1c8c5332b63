"""GShard Mixture-of-Experts for shardc: top-2 gating, expert-parallel MoE layers, a MoE Transformer and a
translation example (``python -m moe.translate``). See docs/moe.md.

Public names are loaded lazily, so that ``python -m moe.translate`` can configure the number of CPU
devices before JAX starts.
"""
import importlib

_EXPORTS = {
    "GatingOutput": "moe.gating",
    "RoutingStats": "moe.gating",
    "compute_capacity": "moe.gating",
    "routing_stats": "moe.gating",
    "top1_gating": "moe.gating",
    "top2_gating": "moe.gating",
    "MoeFeedForward": "moe.layer",
    "MoeFeedForwardNNX": "moe.layer",
    "moe_ffn": "moe.layer",
    "reference_moe_loop": "moe.layer",
    "resolve_num_groups": "moe.layer",
    "Transformer": "moe.transformer",
    "TransformerConfig": "moe.transformer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
