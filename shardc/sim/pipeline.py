"""The pipeline view of a simulated step: the schedule's timeline per stage, the bubble, the stage-boundary
transfers and the memory of each stage.

A pipelined step is one SPMD program (`shardc.pipeline.loop`), so the simulator prices it like any other:
the loop runs `iterations` times, every device computes in every iteration (in the bubble on zeros whose
results are never read) and the stage shift is a collective-permute over the stage axis
(`shardc.cost.op_collectives`). This module reads that simulation back as a pipeline:

* `schedule_timeline`: the lockstep schedule the loop runs — per stage, which microbatch (and repeat) it
  works on in each forward and backward iteration, from the time of one stage's piece of work forward
  (`forward_s`), backward (`backward_s`, plus the recomputed forward under 1F1B) and one shift (`shift_s`);
* `pipeline_cost(result)`: the simulated step's pipeline loops (their ops carry the loop's name scope):
  compute time, the bubble's share of it, the boundary transfers (bytes, the topology levels of the stage
  axis, seconds), and the peak memory of each stage's devices.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from shardc.pipeline.loop import LOOP_SCOPE
from shardc.pipeline.shift import SHIFT_PRIMITIVE
from shardc.pipeline.value import Pipeline

__all__ = ["StageSpan", "Timeline", "schedule_timeline", "PipelineCost", "pipeline_cost"]


@dataclasses.dataclass(frozen=True)
class StageSpan:
    """One stage working on one piece (a microbatch, in one repeat) in one iteration."""

    stage: int
    phase: str  # "forward" or "backward"
    iteration: int
    microbatch: int
    repeat: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The schedule's spans, its makespan and the fraction of stage time spent idle (the bubble)."""

    spans: tuple[StageSpan, ...]
    makespan: float
    busy: float  # seconds one stage computes on real microbatches

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy / self.makespan if self.makespan else 0.0

    def of_stage(self, stage: int) -> tuple[StageSpan, ...]:
        return tuple(s for s in self.spans if s.stage == stage)


def schedule_timeline(p: Pipeline, forward_s: float, backward_s: float, shift_s: float = 0.0) -> Timeline:
    """The loop's timeline: `p.iterations` forward iterations, each one piece of work per stage then one shift,
    then as many backward iterations in reverse order (each stage's backward of the piece it held, plus its
    recomputed forward when `p.remat`). Stages work in lockstep (one SPMD program)."""
    if min(forward_s, backward_s, shift_s) < 0:
        raise ValueError("schedule_timeline: times must be >= 0")
    n = p.iterations
    back = backward_s + (forward_s if p.remat else 0.0)
    spans = []
    for t in range(n):
        start = t * (forward_s + shift_s)
        for s in range(p.stages):
            held = p.holds(s, t)
            if held is not None:
                spans.append(StageSpan(s, "forward", t, held[0], held[1], start, start + forward_s))
    fwd_end = n * (forward_s + shift_s)
    for u in range(n):
        t = n - 1 - u
        start = fwd_end + u * (back + shift_s)
        for s in range(p.stages):
            held = p.holds(s, t)
            if held is not None:
                spans.append(StageSpan(s, "backward", t, held[0], held[1], start, start + back))
    pieces = p.microbatches * p.repeats
    return Timeline(tuple(spans), fwd_end + n * (back + shift_s), pieces * (forward_s + back))


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """A simulated pipelined step seen as a pipeline (see the module docstring). Times are seconds per step,
    bytes per device per step."""

    pipeline: Pipeline
    loop_compute_s: float  # compute of the pipeline loops (forward and backward), every iteration
    bubble_s: float  # the part of it spent in bubble iterations
    boundary_bytes: int  # collective-permute payload of the stage shifts
    boundary_s: float  # their time on the links
    boundary_levels: tuple[tuple[str, int], ...]  # topology levels the stage axis spans (level, devices)
    stage_peak_memory: tuple[int, ...]  # per stage, its devices' peak bytes

    def describe(self) -> str:
        lv = " x ".join(f"{name}:{k}" for name, k in self.boundary_levels) or "(none)"
        return (f"pipeline: {self.pipeline.describe()}\n"
                f"  loop compute {self.loop_compute_s * 1e3:.3f} ms, of it bubble {self.bubble_s * 1e3:.3f} ms; "
                f"stage boundary {self.boundary_bytes:,} B per device in {self.boundary_s * 1e6:.1f} us on {lv}; "
                f"peak memory per stage {', '.join(f'{m / 2**20:.2f} MiB' for m in self.stage_peak_memory)}")


def _stack(op: Any) -> str:
    return str(getattr(getattr(op, "source_info", None), "name_stack", "") or "")


def loop_regions(graph: Any) -> frozenset[str]:
    """The regions of the pipeline loops (forward, and its transpose): those whose ties carry the loop's scope
    (a body's own eqns have name stacks relative to the body, its ties the loop eqn's)."""
    return frozenset(op.region for op in graph.ops if op.primitive == "tie" and op.region and LOOP_SCOPE in _stack(op))


def pipeline_cost(result: Any) -> PipelineCost | None:
    """The pipeline view of `result` (a SimResult), None when its plan is not pipelined."""
    plan = result.plan
    p = getattr(plan, "pipeline", None)
    if p is None:
        return None
    ops = plan.graph.ops
    regions = loop_regions(plan.graph)
    loop_ps = shift_ps = shift_bytes = 0
    for slot in result.slots:
        op = ops[slot.op]
        if op.primitive == SHIFT_PRIMITIVE:
            shift_ps += slot.comm_ps
            shift_bytes += slot.payload.get("collective-permute", 0)
        if op.region and any(op.region == r or op.region.startswith(r + "/") for r in regions):
            loop_ps += slot.compute_ps
    from shardc.sim.tasks import PS

    loop_s = loop_ps / PS
    # SPMD: every stage's devices run the same program on same-shaped shards, so they peak alike
    return PipelineCost(p, loop_s, loop_s * p.bubble, int(shift_bytes), shift_ps / PS,
                        result.mapping.levels_of(p.axis), (result.peak_memory,) * p.stages)
