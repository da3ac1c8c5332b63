"""Primitives that only name their operand: the sharding hints and constraints, a name, a stop_gradient, a copy
(jax lowers `copy_p` to its operand), and what jax itself inserts under a mesh with automatic axes — `reshard`
(`jnp.where` reshards its operands to their common sharding: the same), `device_put` and `layout_constraint`
inside a jit.

After partitioning none is an instruction (a hint may be a reshard before it); what reads their result reads
their operand. Kept apart so that the modules of `shardc.cost` that need the list share one
(`program.ALIASES`, `windows.WINDOW_RULES`).
"""
from __future__ import annotations

__all__ = ["ALIASES", "HINTS"]

HINTS = frozenset({"shardc_hint", "sharding_constraint"})
ALIASES = HINTS | {"name", "stop_gradient", "copy", "copy_p", "reshard", "device_put", "layout_constraint"}
