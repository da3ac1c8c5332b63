"""Choosing a pipeline: stages, microbatches and schedule, each with the intra-stage strategies the search
finds for it, against the unpipelined search.

`choose_pipeline` enumerates the pipelines a step's layer stack admits on a device count (`candidates`),
plans each with the strategy search on the meshes it implies (`shardc.plan_for(..., pipeline=p)`), plans
the step without a pipeline too, and keeps the fastest plan that fits memory. Every pipelined search also
scores the `megatron` baseline on its meshes: tensor parallel inside a stage, data parallel across, the
stages over the outermost axis — Megatron-LM's 3-D parallelism ("megatron-3d" in the table).

It is an outer enumeration around the search, not one search space: each candidate costs a search.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax

from annotations import provisional_mesh
from annotations.errors import ShardingError
from shardc.pipeline.jit import stack_of
from shardc.pipeline.value import Pipeline
from shardc.sharding import make_mesh

__all__ = ["Choice", "candidates", "choose_pipeline"]


@dataclasses.dataclass(frozen=True)
class Choice:
    """One scored plan: `name` ("unpipelined", "pipelined", "megatron-3d"), its pipeline (None unpipelined),
    mesh, simulated step time (s) and peak (bytes per device), and whether it fits."""

    name: str
    pipeline: Pipeline | None
    mesh: dict[str, int]
    time: float
    peak: float
    feasible: bool

    def describe(self) -> str:
        what = self.pipeline.describe() if self.pipeline is not None else "no pipeline"
        fits = "" if self.feasible else " (does not fit)"
        return f"{self.name:<12} {self.time * 1e3:9.2f} ms{fits}  peak {self.peak / 2**30:6.1f} GiB  {self.mesh}  {what}"


def candidates(devices: int, layers: int, batch: int, max_stages: int = 8) -> Iterator[Pipeline]:
    """Pipelines of a `layers`-deep stack and a batch of `batch` on `devices` devices: stages dividing both,
    1, 2 or 4 data shards, microbatches 1, 2, 4 or 8 times the stages (each a whole number of rows per
    shard), gpipe and 1f1b, and circular with 2 repeats where the layers allow."""
    for stages in range(2, max_stages + 1):
        if layers % stages or devices % stages:
            continue
        for shards in (1, 2, 4):
            if devices % (stages * shards):
                continue
            data = ("data",) if shards > 1 else ()
            for micro in (stages, 2 * stages, 4 * stages, 8 * stages):
                if micro > batch or batch % micro or (batch // micro) % shards:
                    continue
                for schedule in ("gpipe", "1f1b"):
                    yield Pipeline(stages, micro, schedule, data=data, shards=shards)
                if micro == stages and layers % (2 * stages) == 0:
                    yield Pipeline(stages, micro, "circular", repeats=2, data=data, shards=shards)


def _choice(name: str, plan: Any, pipeline: Pipeline | None) -> Choice:
    c = plan.cost
    return Choice(name, pipeline, dict(plan.mesh_sizes), c.step_time, c.peak_memory, c.fits)


def choose_pipeline(step: Callable, args: tuple, *, topology: Any, budget_s: float, pipeline: bool = True,
                    pipelines: list[Pipeline] | None = None, plan_for: Callable | None = None,
                    **options: Any) -> tuple[Any, list[Choice]]:
    """The fastest plan that fits, over the unpipelined search and (with `pipeline=True`) every pipeline of
    `pipelines` (default: `candidates` for the step's largest layer stack); returns it and every choice
    scored, "megatron-3d" rows included. `options` go to `shardc.plan_for`."""
    if plan_for is None:
        from shardc.auto import plan_for
    from shardc.sim import as_topology

    n = as_topology(topology).num_devices
    base = plan_for(step, *args, topology=topology, budget_s=budget_s, **options)
    best, choices = base, [_choice("unpipelined", base, None)]
    if pipeline:
        if pipelines is None:
            with provisional_mesh(True):
                stack = stack_of(step, args, make_mesh({"data": len(jax.devices()), "model": 1, "expert": 1}))
            pipelines = list(candidates(n, stack.layers, stack.batch))
        for p in pipelines:
            try:
                plan = plan_for(step, *args, topology=topology, budget_s=budget_s, pipeline=p, **options)
            except ShardingError as e:  # a pipeline this step cannot take (said in the table, not fatal)
                choices.append(Choice(f"error: {str(e).splitlines()[0][:80]}", p, {}, float("inf"), 0.0, False))
                continue
            choices.append(_choice("pipelined", plan, plan.pipeline))
            for b in plan.search.baselines if plan.search is not None else ():
                if b.name == "megatron":
                    choices.append(Choice("megatron-3d", plan.pipeline, dict(b.mesh), b.score.time, b.score.peak,
                                          b.score.feasible))
            if _key(plan) < _key(best):
                best = plan
    return best, choices


def _key(plan: Any) -> tuple:
    c = plan.cost
    return (not c.fits, c.step_time, c.peak_memory)
