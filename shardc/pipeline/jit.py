"""`pipeline_jit`: a train step with one layer stack pipelined, as one `jax.jit` program on a mesh.

The step is traced with its layer stack (a `jax.lax.scan` over stacked per-layer parameters, `nn.scan`)
running as `shardc.pipeline.loop.pipelined_scan`: stage weights stacked with the stage dim split over the
pipeline's mesh axis, a loop of `microbatches + stages - 1` iterations shifting the activations one stage
by a collective-permute, gradients accumulated over the microbatches by JAX's own differentiation of
that loop. Everything else in the step (embedding, loss, optimizer update) is the user's code under the
user's hints.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
from jax.sharding import Mesh

from annotations.errors import ShardingError
from shardc.pipeline.stacks import Stack, find_stacks, largest, pipelining
from shardc.pipeline.value import Pipeline

__all__ = ["check_mesh", "for_mesh", "pipeline_meshes", "stack_of", "pipeline_jit"]


def check_mesh(p: Pipeline, mesh: Mapping[str, int]) -> None:
    """A ShardingError unless `mesh` (axis name -> size) has the pipeline's stage axis of `stages` devices
    and its data axes holding `shards` devices."""
    if p.axis not in mesh:
        raise ShardingError(f"pipeline over mesh axis {p.axis!r}: the mesh {dict(mesh)} has no such axis")
    if mesh[p.axis] != p.stages:
        raise ShardingError(f"pipeline of {p.stages} stages over mesh axis {p.axis!r}: that axis has {mesh[p.axis]} "
                            f"devices (one stage per device of the stage axis)")
    missing = [a for a in p.data if a not in mesh]
    if missing:
        raise ShardingError(f"pipeline data axes {p.data}: the mesh {dict(mesh)} lacks {missing}")
    n = math.prod(mesh[a] for a in p.data)
    if n != p.shards:
        raise ShardingError(f"pipeline data axes {p.data} hold {n} devices on mesh {dict(mesh)}, but the pipeline "
                            f"says shards={p.shards}")


def pipeline_meshes(p: Pipeline, devices: int, model_axis: str = "model") -> list[dict[str, int]]:
    """The meshes of `devices` devices a pipeline implies when no mesh is given: the stage axis outermost (the
    slowest topology level: only activations cross it), then its data axis (one, of `shards` devices) and
    `model_axis` with the devices left, in either order (which of them lies inside a node). Without data axes
    the mesh still has a "data" axis, of size 1 (hints on the batch name it)."""
    if len(p.data) > 1:
        raise ShardingError(f"pipeline data axes {p.data}: without mesh=, name at most one data axis")
    if devices % (p.stages * p.shards):
        raise ShardingError(f"pipeline of {p.stages} stages x {p.shards} data shards does not divide {devices} "
                            f"devices")
    rest = {p.data[0] if p.data else "data": p.shards, model_axis: devices // (p.stages * p.shards)}
    orders = [rest] if 1 in rest.values() else [rest, dict(reversed(list(rest.items())))]
    return [{p.axis: p.stages, **r} for r in orders]


def for_mesh(stages: int, microbatches: int, mesh: Mapping[str, int], schedule: str = "gpipe", repeats: int = 1,
             axis: str = "stage", data: tuple[str, ...] = (), defer_wgrad: bool = False) -> Pipeline:
    """A `Pipeline` whose data shards are what `data` holds on `mesh`, checked against it."""
    p = Pipeline(stages, microbatches, schedule, repeats, axis, tuple(data),
                 math.prod(mesh[a] for a in data if a in mesh) if data else 1, defer_wgrad=defer_wgrad)
    check_mesh(p, mesh)
    return p


def stack_of(step: Callable, args: tuple, mesh: Mesh) -> Stack:
    """The layer stack of `step(*args)` worth pipelining (the most parameter bytes); a ShardingError when the
    step has none."""
    with jax.set_mesh(mesh), find_stacks() as seen:
        jax.eval_shape(lambda *a: step(*a), *args)  # a fresh function: JAX's trace cache would skip the trace
    best = largest(seen)
    if best is None:
        raise ShardingError(f"{getattr(step, '__qualname__', step)}: no layer stack to pipeline (a jax.lax.scan or "
                            f"nn.scan over stacked per-layer parameters that carries the activations)")
    return best


class PipelinedStep:
    """`step` jitted with its layer stack pipelined (see `pipeline_jit`); call it like `step`, or `.lower`."""

    def __init__(self, step: Callable, pipeline: Pipeline, mesh: Mesh, stack: int | None,
                 jit_kwargs: Mapping[str, Any]) -> None:
        check_mesh(pipeline, dict(mesh.shape))
        self.step, self.pipeline, self.mesh, self.stack = step, pipeline, mesh, stack

        def traced(*args: Any) -> Any:
            assert self.stack is not None
            with pipelining(self.pipeline, self.stack):
                return step(*args)

        self._jitted = jax.jit(traced, **dict(jit_kwargs))

    def _find(self, args: tuple) -> None:
        if self.stack is None:
            self.stack = stack_of(self.step, args, self.mesh).index

    def lower(self, *args: Any) -> Any:
        self._find(args)
        with jax.set_mesh(self.mesh):
            return self._jitted.lower(*args)

    def __call__(self, *args: Any) -> Any:
        self._find(args)
        with jax.set_mesh(self.mesh):
            return self._jitted(*args)


def pipeline_jit(step: Callable, pipeline: Pipeline, mesh: Mesh, stack: int | None = None,
                 **jit_kwargs: Any) -> PipelinedStep:
    """`jax.jit(step)` on `mesh` with the step's layer stack (the `stack`-th top-level layer scan, default the
    one with the most parameter bytes) run as `pipeline`: one SPMD program."""
    if not isinstance(pipeline, Pipeline):
        raise ShardingError(f"pipeline_jit: expected a shardc.pipeline.Pipeline, got {type(pipeline).__name__}")
    return PipelinedStep(step, pipeline, mesh, stack, jit_kwargs)
