"""GShard Mixture-of-Experts for shardc: top-2 gating, expert-parallel MoE layers, a MoE Transformer and a
translation example (``python -m moe.translate``). See docs/moe.md."""
from moe.gating import (
    GatingOutput,
    RoutingStats,
    compute_capacity,
    routing_stats,
    top1_gating,
    top2_gating,
)
from moe.layer import MoeFeedForward, MoeFeedForwardNNX, moe_ffn, reference_moe_loop, resolve_num_groups

__all__ = [
    "GatingOutput",
    "RoutingStats",
    "compute_capacity",
    "routing_stats",
    "top1_gating",
    "top2_gating",
    "MoeFeedForward",
    "MoeFeedForwardNNX",
    "moe_ffn",
    "reference_moe_loop",
    "resolve_num_groups",
]
