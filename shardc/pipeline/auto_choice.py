"""`@shardc.auto(pipeline=True)`: choose the pipeline (or none) on the devices the step runs on, then run it.

On the first call, `choose_pipeline` plans the step on the devices at hand, priced on the topology the
step's plans are priced on (the measured `cpu-host` on CPU devices, the matching preset on accelerators,
or `topology=` when it describes these devices): the unpipelined search, every candidate pipeline
screened, the fastest searched in full. The step then runs the winner — the chosen `Pipeline` on the
chosen mesh, rebuilt from the search's decisions (no second search), so the plan that runs is the one
that was chosen, and `plan.explain()` shows the choice against what it beat. Later calls with other
argument shapes keep the chosen pipeline (or its absence) and search their intra-stage strategies anew.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from annotations.errors import ShardingError
from shardc.pipeline.value import Pipeline

__all__ = ["Chosen", "check_choosing", "choose_for_step"]

# shardc.auto options the choice plans with (the rest are fixed by the choice or meaningless for it)
_PASSED = ("rules", "donate_argnums", "donate_argnames", "seed", "time_cap_s", "remat", "memory_limit",
           "in_shardings", "out_shardings", "search")


@dataclasses.dataclass(frozen=True)
class Chosen:
    """What the step runs after the choice: the pipeline (None: unpipelined), the mesh sizes, the search's
    decisions and remat policy to rebuild the chosen plan from, and the choice itself (`PipelineChoice`)."""

    pipeline: Pipeline | None
    mesh_sizes: Mapping[str, int]
    search: Any
    remat: Any
    choice: Any


def check_choosing(mesh: Any, search: Any) -> None:
    """`pipeline=True` needs the search to choose the mesh: no `mesh=`, the search on, no plan file."""
    from shardc.search import integrate

    if mesh is not None:
        raise ShardingError("shardc.auto(pipeline=True) chooses the mesh with the pipeline (a stage axis and the "
                            "axes inside the stages); leave mesh= out, or pass mesh= with a "
                            "shardc.pipeline.Pipeline (shardc.pipeline.jit.for_mesh) to run a given one")
    if not integrate.enabled(search):
        raise ShardingError("shardc.auto(pipeline=True, search=False): choosing a pipeline needs the search "
                            "(search=True, 'dp' or 'mcmc')")
    if isinstance(search, str) and search.endswith(".json"):
        raise ShardingError(f"shardc.auto(pipeline=True, search={search!r}): a saved plan file is not supported "
                            f"with the pipeline choice yet; plan with search=True, or pass the chosen "
                            f"shardc.pipeline.Pipeline")


def choose_for_step(fun: Any, args: tuple, kwargs: Mapping[str, Any], options: Mapping[str, Any],
                    topology: Any, devices: int, budget_s: float | None) -> Chosen:
    """Run `choose_pipeline` for `fun(*args)` on `devices` devices priced on `topology`, with the step's
    shardc.auto `options`; what the step then runs."""
    from shardc.pipeline.choose import choose_pipeline
    from shardc.sim import as_topology

    if kwargs:
        raise ShardingError(f"shardc.auto(pipeline=True): the step was called with keyword arguments "
                            f"{sorted(kwargs)}; the pipeline choice plans positional arguments only (pass them "
                            f"positionally, or name them in static_argnames)")
    have = as_topology(topology).num_devices
    if have != devices:
        raise ShardingError(f"shardc.auto(pipeline=True): the topology the plans are priced on has {have} devices, "
                            f"this step runs on {devices}; to choose a pipeline for another cluster use "
                            f"shardc.plan_for(step, *args, topology=..., pipeline=True)")
    passed = {k: v for k, v in options.items() if k in _PASSED}
    best, _ = choose_pipeline(fun, args, topology=topology, budget_s=budget_s, **passed)
    pipe = best.pipeline
    if pipe is not None:  # (the unbound value: the step binds it to the stack it finds)
        pipe = dataclasses.replace(pipe, layers=None, stack="")
    return Chosen(pipe, dict(best.mesh_sizes), best.search, best.remat, best.pipeline_choice)

