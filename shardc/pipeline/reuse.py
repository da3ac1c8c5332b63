"""What the candidates of one pipeline choice share while each is planned (`choose_pipeline`).

Every candidate is the same step with its layer stack run as another pipeline, so some of the work of
planning one is the same for all, and a finalist's full search plans the very program its screen traced:

* the **layer stack** (`shardc.pipeline.stacks.Stack`): found by the first candidate's trace, then given
  to the others, which would each trace the unpipelined step once more to find it;
* the **tracing mesh**: a pipelined step names the stage (and data) axes, so a candidate traced on the
  default mesh fails and is traced again on a mesh with those axes (`shardc.search.integrate.trace`);
  the mesh the first candidate's trace succeeded on, per stage and data axes, is where the next ones start;
* each **traced program** (`jax.make_jaxpr` of the pipelined step, by call signature, tracing mesh,
  pipeline and stack): the finalist's search reuses its screen's trace.

A trace depends only on these (the step, its arguments' shapes, the tracing mesh, the pipeline and the
stack), so the plans are those each candidate planned alone would get.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["SharedTraces"]


@dataclasses.dataclass
class SharedTraces:
    """The stack, tracing meshes and traced programs the `AutoFunction`s of one choice share (`_shared=`);
    `traced` and `reused` count the programs traced and those taken from here."""

    stack: Any = None
    meshes: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    programs: dict[tuple, tuple] = dataclasses.field(default_factory=dict)
    traced: int = 0
    reused: int = 0

    def prepare(self, af: Any) -> None:
        """Before `af` (a pipelined AutoFunction without a mesh) plans: the stack and the tracing mesh the
        earlier candidates found, when they did."""
        if af.pipeline is None:
            return
        if af._stack is None and self.stack is not None:
            af._stack = self.stack
        start = self.meshes.get(_axes_key(af.pipeline))
        if start is not None and not af._mesh_given:
            af.mesh = start

    def trace(self, af: Any, call: Any, trace_fn: Callable[[Any], tuple]) -> tuple:
        """`trace_fn(call)` (AutoFunction._trace), or the program an earlier candidate traced for the same
        signature, tracing mesh, pipeline and stack."""
        if af.pipeline is None:
            return trace_fn(call)
        from shardc.search.integrate import enabled

        mesh = af._mesh()
        provisional = enabled(af.search) and not af._mesh_given  # (how _trace checks the hints' divisibility)
        where = (af._signature(call), tuple(mesh.shape.items()), type(mesh).__name__, af.pipeline, provisional)
        if af._stack is not None and (hit := self.programs.get((*where, af._stack.index))) is not None:
            self.reused += 1
            return hit
        out = trace_fn(call)  # (may raise: a tracing mesh without an axis the program names, retried by the caller)
        self.traced += 1
        if self.stack is None:
            self.stack = af._stack
        self.meshes.setdefault(_axes_key(af.pipeline), mesh)
        self.programs[(*where, af._stack.index)] = out
        return out


def _axes_key(pipeline: Any) -> tuple:
    return (pipeline.axis, tuple(pipeline.data))
