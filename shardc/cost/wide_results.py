"""Ops whose compiled buffer is wider than their result: the backend writes more bytes per element than the
result's dtype holds, and the fusions reading the result compute it from that buffer.

XLA:CPU, jax's threefry `random_bits` with `jax_threefry_partitionable` (jax's default): jax lowers the hash on
CPU as a rolled loop (a `fori_loop` of 5 iterations) carrying its two 32-bit words per element, and the bits
asked for (the words' xor, converted to the bit width) are cheap elementwise work XLA fuses into each reader.
So the loop's result, 8 bytes per element whatever the bit width, is the buffer, and it lives until the last
fusion computing something from the bits — a dropout mask's select in the backward pass. (Elsewhere jax
unrolls the hash into elementwise work XLA may fuse whole; not modelled: the result's own dtype is counted.)
Without partitionable threefry, jax hashes ceil(bits / 32) counters and the words hold the result's bytes.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from shardc.ir.graph import Graph

__all__ = ["WIDE_RESULTS", "wide_results"]

_THREEFRY = "key<fry>"  # how jax prints a threefry2x32 key's dtype


def _threefry_words(op: Any, graph: Graph, backend: str) -> int | None:
    if backend != "cpu" or not jax.config.jax_threefry_partitionable or not op.inputs:
        return None
    return 8 if str(graph.values[op.inputs[0]].dtype) == _THREEFRY else None


# primitive -> (op, graph, backend) -> bytes per element of the buffer its lowering writes (None: the result's)
WIDE_RESULTS: dict[str, Callable[[Any, Graph, str], int | None]] = {"random_bits": _threefry_words}


def wide_results(graph: Graph, live: Sequence[bool], canon: Sequence[int], backend: str) -> dict[int, int]:
    """Per canonical value whose producer writes a buffer wider than the value: that buffer's bytes per element."""
    out: dict[int, int] = {}
    for op in graph.ops:
        rule = WIDE_RESULTS.get(op.primitive)
        if rule is None or not live[op.id] or len(op.outputs) != 1:
            continue
        per = rule(op, graph, backend)
        v = graph.values[op.outputs[0]]
        if per is not None and v.dtype is not None and per > v.dtype.itemsize:
            out[canon[op.outputs[0]]] = per
    return out
