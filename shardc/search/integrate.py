"""`@shardc.auto(search=...)`: plan a traced program by strategy search instead of hint propagation alone.

search: True (DP then MCMC), "dp", "mcmc", "baselines" (the fastest baseline), or a path ending in ".json"
(load the plan saved there when it matches the program, else search with DP+MCMC and save it). mesh=None
lets the search choose the mesh shape over all the devices; a given mesh is the only one tried. topology:
what the simulator models (default: the devices this process runs on, `shardc.cost.local`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from typing import Any, Callable, Sequence

import jax

from annotations.errors import ShardingError
from shardc.plan import Plan
from shardc.search.budget import SearchTimeCapWarning
from shardc.search.driver import graph_key, hints_key, load_plan, save_plan, search_plan
from shardc.search.evaluate import Problem, plan_from_seeds
from shardc.search.space import mesh_candidates
from shardc.sharding import mesh_shape
from shardc.sim import as_topology

__all__ = ["enabled", "default_topology", "pricing_topology", "plan_by_search", "trace", "mesh_for_metadata",
           "AxisNameWarning"]

_PLAN_CACHE: dict[tuple, Any] = {}  # (graph key, mesh, topology, method, seed) -> (mesh sizes, seeds)


def enabled(search: Any) -> bool:
    return search not in (False, None)


def plan_file(search: Any) -> str | None:
    """The plan file `search=` names (decisions saved and reloaded: `save_plan`), or None."""
    return search if isinstance(search, str) and search.endswith(".json") else None


# Default search budgets (seconds of search after tracing, turned into a number of simulated plans by
# `shardc.search.budget`), chosen so that planning a ~6,000-eqn train step takes <= 10 s on 8 devices and
# about 20 s on 64 on a quiet 2-core machine (bench/search_speed.py); a busy machine takes longer to reach
# the same plan (there is no wall-clock cap unless time_cap_s asks for one). Pass budget_s to search
# longer (bench/zoo.py uses 60-150 s).
SMALL_MESH_BUDGET_S = 6.0
LARGE_MESH_BUDGET_S = 36.0  # (24 scored the baselines on a third of a 64-device program's meshes)


def default_budget(num_devices: int) -> float:
    return SMALL_MESH_BUDGET_S if num_devices <= 8 else LARGE_MESH_BUDGET_S


def default_topology(num_devices: int) -> Any:
    """The topology plans are priced on without `topology=`: the devices this process runs on."""
    from shardc.cost.local import local_topology

    return local_topology(num_devices)


def pricing_topology(af: Any, num_devices: int) -> tuple[Any, str]:
    """The topology `af`'s plans are priced on, and why (for `plan.explain()`)."""
    if af.topology is not None:
        return af.topology, "topology= given"
    topo = default_topology(num_devices)
    return topo, f"the devices this step runs on: {topo.source}" if topo.source else "the devices this step runs on"


def _topology_key(topology: Any) -> str:
    """The topology as a cache key: its whole description (a re-measured cpu-host is another topology)."""
    return json.dumps(as_topology(topology).to_dict(), sort_keys=True, default=str)


_AXIS_ERR = re.compile(r"unknown mesh axis '([^']+)'|Resource axis: ([\w-]+) of")


class AxisNameWarning(UserWarning):
    """A mesh axis the program names looks like a misspelt standard one (the search creates it anyway)."""


def _check_axis_names(named: Sequence[str], where: str) -> None:
    """With mesh=None every axis the program names becomes a mesh axis, so a typo ('modle') silently makes
    a new axis instead of failing: warn when a name is close to a standard one but not it."""
    import difflib

    from shardc.search.space import DEFAULT_AXIS_NAMES

    for name in named:
        if name in DEFAULT_AXIS_NAMES:
            continue
        close = difflib.get_close_matches(name, DEFAULT_AXIS_NAMES, n=1, cutoff=0.75)
        if close:
            warnings.warn(f"mesh axis {name!r} named by {where} is not a standard axis name; did you mean "
                          f"{close[0]!r}? (with mesh=None, shardc creates an axis named {name!r})",
                          AxisNameWarning, stacklevel=4)


def trace(af: Any, trace_fn: Callable, call: Any, metadata_axes: Sequence[str] = ()) -> Any:
    """Trace `call`; when the search chooses the mesh and the program names an axis the tracing mesh lacks
    (hints, sharding constraints), retry on a mesh that has every axis named so far, and the axes the
    arguments' metadata names (`metadata_axes`, from `mesh_for_metadata`)."""
    from shardc.sharding import make_mesh

    required: list[str] = list(metadata_axes)
    n = len(jax.devices())
    while True:
        try:
            return trace_fn(call)
        except Exception as e:
            m = _AXIS_ERR.search(str(e))
            if getattr(af, "_mesh_given", True) or not enabled(af.search) or m is None:
                raise
            axis = m.group(1) or m.group(2)
            if axis in required:
                raise
            _check_axis_names([axis], "a hint or sharding constraint in the program")
            required.append(axis)
            _check_axis_count(required)
            # the axes the failed mesh splits stay (the program may name them too: one retry per axis, not two)
            kept = [a for a in af.mesh.axis_names if af.mesh.shape[a] > 1 and a not in required]
            cands = mesh_candidates(n, required + kept[:3 - len(required)])
            full = [c for c in cands if all(c[a] > 1 for a in required)]
            af.mesh = make_mesh((full or cands)[0], jax.devices()[:n])


def _check_axis_count(named: Sequence[str]) -> None:
    """The search's meshes have at most 3 axes (`mesh_candidates`), so a program that names more needs a mesh."""
    if len(named) > 3:
        raise ShardingError(
            f"the program and its arguments name {len(named)} mesh axes {list(named)}, but with mesh=None the search "
            f"builds meshes of at most 3 axes; pass mesh=shardc.make_mesh({{...}}) with every axis named (the search "
            f"still chooses the strategies on it), or name fewer axes")


def mesh_for_metadata(af: Any, args: Any, extra_axes: Sequence[str] = ()) -> list[str]:
    """The mesh axes the arguments' Flax metadata names (and `extra_axes`: those in_shardings/out_shardings
    name); when the search chooses the mesh and the tracing mesh lacks one of them, trace on a mesh that has
    them all (as `trace` does for axes named in the program)."""
    from shardc.metadata import named_mesh_axes
    from shardc.sharding import make_mesh

    named = list(dict.fromkeys(named_mesh_axes(args, af.rules) + list(extra_axes)))
    mesh_given = getattr(af, "_mesh_given", True)
    if named and not mesh_given:
        _check_axis_names(named, "the Flax partitioning metadata or rules")
    if not named or mesh_given or not enabled(af.search):
        return named
    _check_axis_count(named)
    if af.mesh is not None and all(a in af.mesh.axis_names for a in named):
        return named
    n = len(jax.devices())
    required = list(dict.fromkeys(list(af.mesh.axis_names if af.mesh is not None else ()) + named))
    required = [a for a in required if a in named or (af.mesh is not None and af.mesh.shape[a] > 1)][:3]
    cands = mesh_candidates(n, required)
    full = [c for c in cands if all(c[a] > 1 for a in named)]
    af.mesh = make_mesh((full or cands)[0], jax.devices()[:n])
    return named


def _hinted_axes(graph: Any) -> list[str]:
    out: list[str] = []
    for op in graph.ops:
        spec = op.params.get("spec") if op.primitive == "shardc_hint" else None
        for d in getattr(spec, "dims", None) or ():
            for a in (d if isinstance(d, (tuple, list)) else (d,)):
                if isinstance(a, str) and a not in out:
                    out.append(a)
    return out


def plan_by_search(af: Any, graph: Any, user_seeds: Callable, in_paths: Sequence[str], out_paths: Sequence[str],
                   notes: Sequence[str], closed: Any, donate: Sequence[int], mesh_given: bool,
                   required_axes: Sequence[str] = ()) -> Plan:
    """The searched plan of this program (its mesh may differ from `af.mesh` when mesh_given is False).
    `required_axes`: mesh axes the inputs' metadata names (every candidate mesh has them)."""
    n = getattr(af, "devices", None) or len(jax.devices())
    topology, why = pricing_topology(af, n)
    pipe, stack = getattr(af, "pipeline", None), getattr(af, "_stack", None)
    problem = Problem(graph, user_seeds, topology, list(in_paths), list(out_paths), list(notes), tuple(donate), closed,
                      memory_limit=getattr(af, "memory_limit", None),
                      pipeline=pipe.bind(stack.layers, stack.name) if pipe is not None and stack is not None else None,
                      pcg=bool(getattr(af, "pcg", False)) and pipe is None)
    resume, af._search_resume = getattr(af, "_search_resume", None), None
    if resume is not None:  # retraced under the mesh the search chose: rebuild its plan
        user = list(user_seeds(af.mesh))
        plan = plan_from_seeds(problem, af.mesh, user + list(resume.seeds), layout_cost=resume.layout_cost)
        return dataclasses.replace(plan, search=resume)
    path = plan_file(af.search)
    topology_name = as_topology(topology).name
    if path is not None and os.path.exists(path):  # (a program or hints not in the file: searched and added)
        saved = load_plan(path, problem, mesh=mesh_shape(af.mesh) if mesh_given else None, topology=topology_name,
                          missing_ok=True)
        if saved is not None:
            return saved
    fixed = mesh_shape(af.mesh) if mesh_given else None
    required = list(dict.fromkeys(list(required_axes) + _hinted_axes(graph)))
    if pipe is not None and fixed is None:  # a pipelined step: the meshes its stage and data axes imply
        from shardc.pipeline.jit import pipeline_meshes

        meshes = pipeline_meshes(pipe, n)
    else:
        meshes = mesh_candidates(n, required, fixed=fixed, topology=topology)
    method = True if path is not None else af.search
    user = list(user_seeds(af.mesh)) if mesh_given else None
    key = (graph_key(graph), None if user is None else hints_key(user), tuple(tuple(m.items()) for m in meshes),
           _topology_key(topology), str(method), af.seed, af.budget_s, getattr(af, "time_cap_s", None),
           getattr(af, "memory_limit", None))
    cached = _PLAN_CACHE.get(key)
    if cached is not None and user is not None:  # the same traced program and hints planned before here
        return dataclasses.replace(plan_from_seeds(problem, af.mesh, user + list(cached.seeds),
                                                   layout_cost=cached.layout_cost), search=cached)
    budget = af.budget_s if af.budget_s is not None else default_budget(n)
    cap = getattr(af, "time_cap_s", None)
    from shardc.distributed import is_multiprocess

    # The budget is a number of simulated plans, so the plan does not depend on the machine's load; a
    # wall-clock cap only when asked for, and never in multi-process jobs (every process must agree).
    plan, report = search_plan(problem, meshes, method=method, budget_s=budget, seed=af.seed,
                               time_cap=cap if cap is not None and not is_multiprocess() else None)
    report.topology = f"{as_topology(topology).name} ({why})"
    if report.capped:
        warnings.warn(f"shardc: the strategy search stopped at time_cap_s={cap:g} s before spending its budget of "
                      f"{report.plan_budget} simulated plans, so this plan may differ from another run's with the same "
                      "seed (the machine is slower or busier than the budget assumes). Without time_cap_s the search "
                      "counts plans, not seconds, and the same seed gives the same plan.", SearchTimeCapWarning,
                      stacklevel=4)
    _PLAN_CACHE[key] = report
    if path is not None:
        save_plan(plan, path, topology=topology_name, hints=user if mesh_given else list(user_seeds(plan.mesh)))
    return plan
