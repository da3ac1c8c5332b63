"""The cost a rewrite must lower to be kept: `CostFn = Callable[[PCG], float]`.

The default, `bytes_moved`, is a stand-in until the simulator (`shardc.sim`) can price a PCG: the bytes
one device sends over all collectives (ring algorithms), with local compute work and the node count
as small tie-breakers so that, at equal traffic, slicing early and gathering late win. Any callable
from PCG to a number can replace it (`optimize(pcg, cost_fn=...)`), e.g. a simulated step time.
"""
from __future__ import annotations

import math
from typing import Callable

from shardc.pcg.graph import PCG, Compute

__all__ = ["CostFn", "bytes_moved", "compute_work", "COMPUTE_WEIGHT", "NODE_WEIGHT"]

CostFn = Callable[[PCG], float]
COMPUTE_WEIGHT = 1e-3  # per local flop / element written, relative to one byte sent
NODE_WEIGHT = 1e-2  # per node: fewer launches


def compute_work(pcg: PCG) -> float:
    """Local work of the compute nodes: 2·M·N·K for dot_general, elements written for the rest."""
    mesh = pcg.mesh_sizes
    work = 0.0
    for n in pcg.nodes:
        if not isinstance(n.op, Compute):
            continue
        out = math.prod(pcg.tensors[n.outputs[0]].local_shape(mesh)) if n.outputs else 0
        if n.op.primitive == "dot_general":
            (lc, _), _ = n.op.params["dimension_numbers"]
            x = pcg.tensors[n.inputs[0]].local_shape(mesh)
            work += 2.0 * out * math.prod(x[d] for d in lc)
        else:
            work += out
    return work


def bytes_moved(pcg: PCG) -> float:
    """Bytes sent per device, plus small compute and node-count tie-breakers."""
    return pcg.comm_bytes() + COMPUTE_WEIGHT * compute_work(pcg) + NODE_WEIGHT * len(pcg.nodes)
