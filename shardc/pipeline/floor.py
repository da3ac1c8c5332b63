"""A floor under every plan of one traced program: seconds no sharding of it simulates below.

`choose_pipeline` traces each candidate pipeline before it screens it. From the traced graph alone (no
propagation, no plan) this module bounds what any plan of that program can simulate to, so that a candidate
whose floor is above the time of a plan already in hand (the unpipelined search's) is neither screened nor
searched: none of its plans could be chosen.

The simulator (`shardc.sim`) runs one device's tasks on one compute stream and a stream per link class; the
compute stream's tasks never overlap, so the step is at least the sum of its compute tasks. The floor counts
only the part of those tasks that no plan can take away:

* every op XLA keeps (`ProgramInfo.counts`: live, not merged by CSE) that computes something whatever its
  operands' layouts: not a free primitive (hints, ties, scan slices), not folded to a constant, not an op
  some layout turns into a bitcast (a reshape, transpose, broadcast or reduction that only moves unit dims of
  its local pieces, unless its global shapes rule that out: `may_be_bitcast`; transposes layout assignment
  makes bitcasts), not an op whose own collectives can stand in for it (a stage shift:
  `shardc.cost.op_collectives`);
* of each, the device's fixed per-kernel overhead when it ends a kernel (its result is written to memory:
  fusion, `ProgramInfo.fused`, is decided by the graph, not the plan), times the runs per step (loop trips);
* of each matmul, its FLOPs spread over every device of the mesh at the roofline's matmul rate (a layout
  can split a dot's work no finer than over all devices; memory traffic and the rest only add).

The floor is of the program as traced: when the search may rewrite it to rematerialize layers
(`shardc.search.remat_choice`: a rewritten program fuses differently, and its floor can be lower),
`floor_applies` says no. The floor holds for the roofline estimator (`AnalyticalEstimator`: time = max(compute, memory) + overhead at
a kernel boundary), which every preset topology uses; on a device with measured ops (the `cpu-host`), whose
times are measured, the floor is 0 (it bounds nothing). `tests/pipeline/test_pipeline_floor.py` checks it
against every plan the search scores.
"""
from __future__ import annotations

import math
from typing import Any

from shardc.cost.estimator import MATMUL_PRIMITIVES
from shardc.cost.flops import count_op
from shardc.cost.op_collectives import OP_COLLECTIVES
from shardc.cost.program import _UNIT_DIM_OPS, FREE_PRIMITIVES, program_info

__all__ = ["floor_applies", "may_be_bitcast", "step_floor"]

_FLOORED_MATMULS = frozenset({"dot_general"}) & MATMUL_PRIMITIVES  # (a convolution's halo: not counted)


def step_floor(graph: Any, topology: Any, devices: int) -> float:
    """Seconds below which no plan of `graph` on `devices` devices of `topology` (a `Topology`) simulates."""
    dev = topology.device
    if dev.measured_ops:  # measured times: no per-kernel floor to rely on
        return 0.0
    info = program_info(graph, topology.backend)
    canon, fused, constant = info.canon, info.fused, info.constant
    total = 0.0
    for op in graph.ops:
        i = op.id
        if (not info.counts(i) or op.primitive in FREE_PRIMITIVES or op.primitive in OP_COLLECTIVES
                or i in info.bitcast or op.primitive in _UNIT_DIM_OPS and may_be_bitcast(graph, op, devices)):
            continue
        if op.outputs and all(constant[canon[v]] for v in op.outputs):
            continue
        seconds = 0.0
        if not op.outputs or not all(fused[canon[v]] for v in op.outputs):  # a kernel boundary
            seconds += dev.op_overhead
        if op.primitive in _FLOORED_MATMULS:
            vals = graph.values
            count = count_op(op.primitive, [vals[v].shape for v in op.inputs], [vals[v].shape for v in op.outputs],
                             op.params)
            seconds += count.flops / devices / (dev.flops_per_s(str(vals[op.inputs[0]].dtype))
                                                * dev.matmul_efficiency)
        total += seconds * info.trips[i]
    return total


def may_be_bitcast(graph: Any, op: Any, devices: int) -> bool:
    """Whether some layout on `devices` devices could make `op` (a reshape, transpose, broadcast or
    reduction: `moves_no_data`'s ops) a bitcast of its local pieces: False only when its global shapes rule it
    out. A layout divides each dim by the product of the mesh axes on it, and the axes of one tensor multiply
    to at most `devices`; so a dim longer than `devices` is never of size 1 locally, and a bitcast keeps the
    element count: input and output counts that differ by more than a factor `devices` never match."""
    if len(op.inputs) != 1 or len(op.outputs) != 1:
        return False  # (moves_no_data: one operand and one result, else not a bitcast)
    src, dst = graph.values[op.inputs[0]].shape, graph.values[op.outputs[0]].shape
    a, b = math.prod(src), math.prod(dst)
    if a > devices * b or b > devices * a:
        return False
    if op.primitive == "transpose":  # the dims no layout makes unit keep their order, else it moves data
        long = [d for d in op.params["permutation"] if src[d] > devices]
        return long == sorted(long)
    return True


def floor_applies(program: Any, remat: Any) -> bool:
    """Whether the floor of `program`'s graph bounds every plan a search with `remat` (AutoFunction's option)
    can make of it: the search plans only the program as traced unless it may rematerialize its layers
    (`choose_remat`: repeated layer groups outside loop bodies, no remat of the user's own)."""
    if not remat:
        return True
    from shardc.remat import inlined_layer_groups, uses_own_remat

    return uses_own_remat(program) or not inlined_layer_groups(program)
