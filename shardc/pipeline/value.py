"""`Pipeline`: the pipeline dimension of a plan — how a stack of repeated layers is cut into stages and fed
microbatches — and the schedule arithmetic every pass shares (which stage holds which microbatch when,
the bubble, which layers each stage holds).

Schedules (docs/pipeline.md):

* "gpipe": every stage runs its layers on one microbatch per iteration, `microbatches + stages - 1`
  iterations; the backward pass keeps every iteration's activations (all microbatches in flight);
* "1f1b": the same loop, each stage's layers rematerialized in the backward pass: only each iteration's
  stage input is kept, so activation memory is bounded like Megatron's 1F1B (at most one microbatch's
  layer activations at a time, plus the stage inputs), at the price of one more forward pass;
* "circular": the stack is cut into `stages * repeats` pieces, stage s holding pieces s, s + stages, ...;
  each microbatch goes round the stages `repeats` times (GSPMD/MaxText's circular schedule, Megatron's
  interleaved one), `microbatches * repeats + stages - 1` iterations of `1/repeats` of the work each: a
  smaller bubble. Needs microbatches == stages (the last stage feeds the first directly).
"""
from __future__ import annotations

import dataclasses

from annotations.errors import ShardingError

__all__ = ["Pipeline", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "circular")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Stages, microbatches and schedule of one pipelined layer stack.

    `axis` is the mesh axis that carries the stage dim. `data` names the mesh axes (`shards` devices in
    all) that split each microbatch inside a stage: each of those devices accumulates its own parameter
    gradients over the microbatches, reduced over `data` once after the loop (without them, the partial
    gradients of every iteration would be all-reduced in the loop). `layers` is the stack's length and
    `stack` names it, once the value is bound to a program (`bind`). `defer_wgrad` moves the weight
    matmuls' gradients out of the loop: one GEMM per weight over every microbatch after it, no per-iteration
    accumulation and no weight-gradient work in the bubble (`shardc.pipeline.wgrad`)."""

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1
    axis: str = "stage"
    data: tuple[str, ...] = ()
    shards: int = 1
    layers: int | None = None
    stack: str = ""
    defer_wgrad: bool = False

    def __post_init__(self) -> None:
        for name in ("stages", "microbatches", "repeats"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ShardingError(f"Pipeline({name}={v!r}): expected a positive int")
        if self.schedule not in SCHEDULES:
            raise ShardingError(f"Pipeline(schedule={self.schedule!r}): expected one of {', '.join(SCHEDULES)}")
        if self.schedule != "circular" and self.repeats != 1:
            raise ShardingError(f"Pipeline(schedule={self.schedule!r}, repeats={self.repeats}): repeats > 1 is the "
                                f"circular schedule (schedule='circular')")
        if self.schedule == "circular" and self.microbatches != self.stages:
            raise ShardingError(f"Pipeline(schedule='circular', stages={self.stages}, microbatches={self.microbatches}): "
                                f"the circular schedule needs as many microbatches as stages (the last stage hands each "
                                f"microbatch straight back to the first)")
        if self.microbatches % self.stages:
            raise ShardingError(f"Pipeline(stages={self.stages}, microbatches={self.microbatches}): microbatches must be "
                                f"a multiple of stages (each stage's share of the input and output buffer)")
        if not isinstance(self.defer_wgrad, bool):
            raise ShardingError(f"Pipeline(defer_wgrad={self.defer_wgrad!r}): expected True or False")
        if self.defer_wgrad and self.schedule == "1f1b":
            raise ShardingError("Pipeline(schedule='1f1b', defer_wgrad=True): deferring the weight gradients keeps every "
                                "microbatch's matmul inputs until after the loop, which is what 1f1b's recomputation "
                                "avoids keeping; use 'gpipe' or 'circular' with defer_wgrad")
        if not isinstance(self.axis, str) or not self.axis:
            raise ShardingError(f"Pipeline(axis={self.axis!r}): expected a mesh axis name")
        if isinstance(self.data, str):
            object.__setattr__(self, "data", (self.data,))
        if self.axis in self.data:
            raise ShardingError(f"Pipeline(axis={self.axis!r}, data={self.data!r}): the stage axis cannot split the "
                                f"microbatches too")
        if isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1 \
                or (self.shards > 1) != bool(self.data):
            raise ShardingError(f"Pipeline(data={self.data!r}, shards={self.shards!r}): shards is the number of "
                                f"devices the data axes hold (> 1 exactly when data names axes)")

    # -- binding to a program -------------------------------------------------------------------------
    def bind(self, layers: int, stack: str = "") -> "Pipeline":
        """This pipeline for a stack of `layers` layers; a ShardingError when they do not cut evenly."""
        pieces = self.stages * self.repeats
        if layers % pieces:
            what = f"{self.stages} stages" + (f" x {self.repeats} repeats" if self.repeats > 1 else "")
            raise ShardingError(f"pipeline of {what}: the layer stack {stack or ''} has {layers} layers, which "
                                f"{pieces} does not divide (stages must divide the layer count)")
        return dataclasses.replace(self, layers=layers, stack=stack)

    @property
    def layers_per_stage(self) -> int:
        """Layers a stage applies per iteration (one piece of the stack)."""
        if self.layers is None:
            raise ShardingError("this Pipeline is not bound to a layer stack yet (Pipeline.bind)")
        return self.layers // (self.stages * self.repeats)

    def stage_layers(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, the indices of the stack's layers it holds (in the order it applies them)."""
        k = self.layers_per_stage
        return tuple(tuple(r * self.stages * k + s * k + j for r in range(self.repeats) for j in range(k))
                     for s in range(self.stages))

    # -- the schedule ----------------------------------------------------------------------------------
    @property
    def iterations(self) -> int:
        """Iterations of the pipeline loop: every stage runs one piece per iteration."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """Fraction of the loop's iterations in which a stage holds no real microbatch."""
        return (self.stages - 1) / self.iterations

    def holds(self, stage: int, t: int) -> tuple[int, int] | None:
        """(microbatch, repeat) stage `stage` works on at iteration `t`, None in the bubble."""
        k = t - stage
        if k < 0 or k >= self.microbatches * self.repeats:
            return None
        return k % self.microbatches, k // self.microbatches

    @property
    def remat(self) -> bool:
        """Whether each stage's layers are recomputed in the backward pass (the 1F1B-memory schedule)."""
        return self.schedule == "1f1b"

    def stage_map(self) -> str:
        """Which layers of the stack each stage (a position on the stage axis) holds, one line per stage."""
        def spans(idx: tuple[int, ...]) -> str:
            runs, start = [], idx[0]
            for a, b in zip(idx, idx[1:] + (None,)):
                if b != a + 1:
                    runs.append(f"{start}" if start == a else f"{start}-{a}")
                    start = b
            return ", ".join(runs)

        return "\n".join(f"stage {s} ({self.axis}={s}): layers {spans(idx)} of {self.stack or 'the stack'}"
                         for s, idx in enumerate(self.stage_layers()))

    def describe(self) -> str:
        rep = f" x {self.repeats} repeats" if self.repeats > 1 else ""
        data = f", each split over {'+'.join(self.data)} ({self.shards})" if self.data else ""
        wg = ", weight gradients after the loop" if self.defer_wgrad else ""
        return (f"{self.schedule}{wg}, {self.stages} stages{rep} over mesh axis {self.axis!r}, {self.microbatches} "
                f"microbatches{data}, {self.iterations} iterations, bubble {100 * self.bubble:.1f}%")
