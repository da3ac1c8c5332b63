"""The execution simulator: how fast and how big a plan is on a cluster.

    result = shardc.simulate(plan, "h100-sxm-8x2")      # or a Topology, a dict, a JSON/YAML path
    result.step_time, result.peak_memory, result.comm_bytes, result.comm_by_level
    result.per_op(), result.critical_path(), result.to_chrome_trace("step.json"), result.gantt("step.png")

For many plans of one program (search), keep a `Simulator` and call `delta(plan)`: it re-simulates only
what changed and returns exactly what `full(plan)` would.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from annotations.errors import ShardingError
from shardc.cost.estimator import OpCostEstimator
from shardc.cost.topology import MeshMapping, Topology
from shardc.sim.engine import Simulator
from shardc.sim.result import OpTime, SimResult

__all__ = ["simulate", "Simulator", "SimResult", "OpTime", "as_topology", "simulator_for"]


def as_topology(topology: Any) -> Topology:
    """A Topology from a Topology, a preset name, a dict, or a path to a JSON/YAML file."""
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, Mapping):
        return Topology.from_dict(topology)
    if isinstance(topology, (str, os.PathLike)):
        s = str(topology)
        if s.endswith((".json", ".yaml", ".yml")) or os.path.exists(s):
            return Topology.from_file(s)
        return Topology.preset(s)
    raise ShardingError("a topology is a shardc.Topology, a preset name, a dict or a file path; "
                        f"got {type(topology).__name__}")


def _mapping(topo: Topology, mesh: Mapping[str, int], mapping: Any) -> MeshMapping:
    if isinstance(mapping, MeshMapping):
        return mapping
    if mapping is None:
        return topo.map_mesh(mesh)
    if isinstance(mapping, Sequence) and not isinstance(mapping, str):
        return topo.map_mesh(mesh, order=list(mapping))
    raise ShardingError(f"mapping is a MeshMapping or a mesh-axis order (minor axis last), got {mapping!r}")


def simulator_for(plan: Any, topology: Any, *, mapping: Any = None, estimator: OpCostEstimator | None = None,
                  device_shapes: bool = True) -> Simulator:
    """A Simulator for plans of `plan`'s graph and mesh (keep it to delta-simulate variants; `device_shapes`: see
    `Simulator`)."""
    topo = as_topology(topology)
    mesh = plan.mesh_sizes
    return Simulator(plan.graph, topo, _mapping(topo, mesh, mapping), mesh, estimator, device_shapes=device_shapes)


def simulate(plan: Any, topology: Any = "cpu-host", *, mapping: Any = None,
             estimator: OpCostEstimator | None = None, donated: Sequence[int] | None = None) -> SimResult:
    """Simulate one step of `plan` on `topology` (one representative device).

    mapping: a MeshMapping, or mesh axes in order from major to minor (the minor ones go on the innermost
    links); default: the mesh's own order. estimator: an op-cost estimator (default: the roofline of the
    topology's device). donated: flat input indices whose buffers the step may reuse (default: the
    plan's own, when it records them)."""
    sim = simulator_for(plan, topology, mapping=mapping, estimator=estimator)
    d = tuple(donated) if donated is not None else tuple(getattr(plan, "donated", ()) or ())
    return sim.full(plan, d)
