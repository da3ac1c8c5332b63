"""Where pipeline stages come from: the layer stacks of a train step, and the trace that pipelines one.

A *layer stack* is a `lax.scan` over stacked per-layer parameters that carries the activations: what
`nn.scan` (Flax), MaxText's `scan_layers=True` and hand-written `jax.lax.scan(layer, x, params)` make. The
body is Python code, so a pipelined step is made by tracing the step again with `jax.lax.scan` standing
in for itself: the chosen stack runs as `shardc.pipeline.loop.pipelined_scan` (microbatches need the body
traced at the microbatch's shape, which a traced jaxpr no longer allows), every other scan as written.
JAX then differentiates the pipelined loop under the user's `jax.grad`, and the optimizer update is the
user's. `find_stacks` notes the stacks while the step is traced for planning anyway (no extra trace).

Limits: a scan written as `from jax.lax import scan` (bound before shardc could stand in for it) or inside
a `jax.jit`-decorated function JAX has already traced is not seen; Python-unrolled layers (separate
parameters per layer) are no stack (docs/pipeline.md says why); one stack per program is pipelined.
"""
from __future__ import annotations

import contextlib
import re
import dataclasses
import threading
from typing import Any, Callable, Iterator

import jax
from jax._src import source_info_util

from annotations.errors import ShardingError
from shardc.pipeline.loop import pipelined_scan
from shardc.pipeline.value import Pipeline

__all__ = ["Stack", "find_stacks", "largest", "pipelining", "PipelineNotApplied"]

_LOCK = threading.RLock()
_ORIGINAL_SCAN = jax.lax.scan


@dataclasses.dataclass(frozen=True)
class Stack:
    """One layer stack seen while tracing: its position among the step's top-level scans, length (layers),
    batch (dim 0 of its carry), the bytes of its stacked per-layer inputs, and its module path."""

    index: int
    layers: int
    batch: int
    param_bytes: int
    name: str


class PipelineNotApplied(ShardingError):
    """The traced step had no layer stack where the pipeline said (the step changed, or its scan was not seen)."""


class _Intercept:
    """`jax.lax.scan` during one trace: notes top-level stacks, and pipelines the chosen one."""

    def __init__(self, pipeline: Pipeline | None = None, index: int | None = None) -> None:
        self.pipeline, self.index = pipeline, index
        self.depth = 0
        self.seen: list[Stack] = []
        self.applied = False

    def __call__(self, f: Callable, init: Any, xs: Any = None, length: int | None = None, reverse: bool = False,
                 unroll: Any = 1, **kw: Any) -> Any:
        if self.depth:
            return _ORIGINAL_SCAN(f, init, xs, length, reverse, unroll, **kw)
        stack = _as_stack(len(self.seen), init, xs, length, reverse)
        if stack is not None:
            self.seen.append(stack)
        if stack is not None and self.pipeline is not None and stack.index == self.index:
            self.applied = True
            p = self.pipeline.bind(stack.layers, stack.name)
            return pipelined_scan(f, init, xs, p, self._inner, where=f"layer stack {stack.name}")
        return self._inner(f, init, xs, length, reverse, unroll, **kw)

    def _inner(self, *args: Any, **kw: Any) -> Any:
        self.depth += 1
        try:
            return _ORIGINAL_SCAN(*args, **kw)
        finally:
            self.depth -= 1


def _as_stack(index: int, init: Any, xs: Any, length: int | None, reverse: bool) -> Stack | None:
    """The scan as a layer stack, or None: forward, at least 2 iterations over stacked inputs, carrying
    arrays that share a leading (batch) dim."""
    xs_leaves = [x for x in jax.tree.leaves(xs) if hasattr(x, "shape") and getattr(x, "ndim", 0) >= 1]
    carry = jax.tree.leaves(init)
    if reverse or not xs_leaves or not carry:
        return None
    n = xs_leaves[0].shape[0] if length is None else int(length)
    if n < 2 or any(getattr(c, "ndim", 0) < 1 for c in carry) or len({c.shape[0] for c in carry}) != 1:
        return None
    nbytes = sum(x.size * x.dtype.itemsize for x in xs_leaves if jax.dtypes.issubdtype(x.dtype, jax.numpy.floating))
    if not nbytes:
        return None
    name = str(source_info_util.current_name_stack())
    while re.fullmatch(r"\w+\((.*)\)", name):  # jvp(Model) -> Model: the module path, not the transforms
        name = re.fullmatch(r"\w+\((.*)\)", name).group(1)
    name = name or f"scan {index}"
    return Stack(index, n, int(carry[0].shape[0]), int(nbytes), name)


@contextlib.contextmanager
def _standing_in(intercept: _Intercept) -> Iterator[_Intercept]:
    with _LOCK:
        jax.lax.scan = intercept
        try:
            yield intercept
        finally:
            jax.lax.scan = _ORIGINAL_SCAN


@contextlib.contextmanager
def find_stacks() -> Iterator[list[Stack]]:
    """Inside the block, note the layer stacks of what is traced (the list is filled as it traces)."""
    with _standing_in(_Intercept()) as icpt:
        yield icpt.seen


def largest(stacks: list[Stack]) -> Stack | None:
    """The stack holding the most parameter bytes (the one worth cutting into stages)."""
    return max(stacks, key=lambda s: (s.param_bytes, -s.index), default=None)


@contextlib.contextmanager
def pipelining(pipeline: Pipeline, index: int) -> Iterator[None]:
    """Inside the block, the `index`-th top-level stack traced runs as `pipeline`; a PipelineNotApplied when
    no such stack was traced."""
    with _standing_in(_Intercept(pipeline, index)) as icpt:
        yield
    if not icpt.applied:
        raise PipelineNotApplied(
            f"the pipeline ({pipeline.describe()}) was for the layer stack at scan {index} of the step, but tracing "
            f"the step again met {len(icpt.seen)} layer stack(s); a layer scan is seen when the step calls "
            f"jax.lax.scan (or nn.scan) while shardc traces it")
