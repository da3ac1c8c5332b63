"""The substitution engine in the planning loop: the searched plan's PCG, rewritten with proved rules,
competes with the plan itself under the same simulator and memory limit (`shardc.auto(pcg=True)`).

The plan's PCG is built with the one reshard model's collectives (`build_pcg(fuse=True)`: one parallel
op per collective XLA would emit for the plan; on the plan's mesh with each axis XLA's collectives act on part
of split into sub-axes, `shardc.pcg.refine`, so those are parallel ops too), rewritten by `optimize` (each
rewrite kept only when the simulated step gets faster, a PCG over the memory limit costing infinity), and
chosen only when

* at least one rewrite was kept, and
* its simulated step is faster than both the plan's (`shardc.sim.simulate(plan)`, what the search
  scored) and its own unrewritten PCG's (so a difference between how the two are priced never decides:
  the gain must come from the rewrites), and its simulated peak memory fits the limit.

The chosen PCG is what runs (`jit_pcg`: its `shard_map` lowering under `jax.jit` with the plan's input
and output shardings and donation), so the compiled collectives are the PCG's.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from shardc.gc_pause import paused_gc
from shardc.pcg.carries import partial_carries
from shardc.pcg.graph import PCG
from shardc.pcg.optimize import Optimized, Step, optimize
from shardc.pcg.refine import refined_pcg
from shardc.pcg.simcost import SimCost

__all__ = ["PCGChoice", "choose_pcg", "jit_pcg", "DEFAULT_EVALUATIONS"]

# Simulations the rewriting may spend per plan (a count, so the choice does not depend on the machine's
# load). A simulation of a PCG costs about 15 ms at 250 nodes, 0.2 s at 1,200 on this machine.
DEFAULT_EVALUATIONS = 60
CARRY_STEP = "partial_sum_carry"  # (the name `plan.explain()` gives a scan rewritten by `partial_carries`)


@dataclasses.dataclass(frozen=True)
class PCGChoice:
    """What the rewriting did for one plan: the simulated steps of the plan, its PCG and the rewritten
    PCG, the rewrites kept, and whether the rewritten PCG runs (`chosen`)."""

    pcg: PCG  # the rewritten PCG (the unrewritten one when no rewrite was kept)
    plan_time: float  # the plan's simulated step (s), as the search scored it
    pcg_time: float  # the unrewritten PCG's simulated step
    time: float  # the rewritten PCG's simulated step
    peak: float  # the rewritten PCG's simulated peak memory per device (bytes)
    comm: float  # the rewritten PCG's simulated communication per device (bytes)
    memory_limit: float
    steps: tuple[Step, ...]
    evaluations: int
    seconds: float
    chosen: bool

    @property
    def gain(self) -> float:
        """plan time / rewritten time (> 1: the rewritten PCG is faster)."""
        return self.plan_time / self.time if self.time > 0 else 1.0

    def summary(self) -> str:
        ms = lambda t: f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"  # noqa: E731
        head = (f"PCG rewrites (proved rules, kept only when the simulated step gets faster): "
                f"plan {ms(self.plan_time)}, its PCG {ms(self.pcg_time)}, rewritten {ms(self.time)}; ")
        if self.chosen:
            head += f"the rewritten PCG runs ({self.gain:.3f}x, shard_map lowering)"
        elif not self.steps:
            head += "no rewrite paid; the plan runs"
        else:
            head += "not faster than the plan; the plan runs"
        lines = [head + f" [{len(self.steps)} rewrites, {self.evaluations} simulations]"]
        for s in self.steps:
            d = s.cost_after - s.cost_before  # (a step of a lookahead sequence may cost before the next pays)
            lines.append(f"  {s.rule}: {'+' if d > 0 else '-'}{ms(abs(d))}  {s.ops or s.where}")
        return "\n".join(lines)


def choose_pcg(plan: Any, closed_jaxpr: Any, topology: Any, *, donated: Sequence[int] = (),
               memory_limit: float | None = None, max_evaluations: int = DEFAULT_EVALUATIONS,
               rules: Any = None, plan_time: float | None = None) -> PCGChoice:
    """Rewrite `plan`'s PCG with proved rules and say whether the result beats the plan (see the module
    docstring). `topology`: what the plan was priced on; `memory_limit`: bytes per device (default: the
    topology's device memory); `plan_time`: the plan's simulated step on `topology` with `donated`, when the
    caller has it (the search's score of the plan), else it is simulated here."""
    from shardc.sim import as_topology, simulate

    t0 = time.perf_counter()
    topo = as_topology(topology)
    limit = float(memory_limit) if memory_limit is not None else float(topo.device.memory)
    donated = tuple(donated)
    if plan_time is None:
        plan_time = simulate(plan, topo, donated=donated).step_time
    # (on the plan's mesh with an axis split where XLA's collectives act on part of it: `refine`)
    pcg = refined_pcg(plan, closed_jaxpr, fuse=True, reduce_scatter=topo.reduce_scatter)
    cost = SimCost(topo, donated=donated, memory_limit=limit)
    with paused_gc():  # (many short-lived PCGs over a large live heap: shardc/gc_pause.py; the search pauses it too)
        carried, loops = partial_carries(pcg, reduce_scatter=topo.reduce_scatter, cost_fn=cost)
        res: Optimized = optimize(carried, rules, cost_fn=cost, max_evaluations=max_evaluations)
    pcg_time = cost(pcg)
    best = res.pcg
    steps = tuple(Step(CARRY_STEP, c.where, c.cost_before, c.cost_after, str(c)) for c in loops) + res.steps
    _, peak, comm = cost.measures(best)  # (simulated by the rewriting already)
    chosen = bool(steps) and res.cost < plan_time * (1 - 1e-9) and res.cost < pcg_time * (1 - 1e-9) \
        and peak <= limit
    return PCGChoice(best, plan_time, pcg_time, res.cost, peak, comm, limit, steps, cost.simulations,
                     time.perf_counter() - t0, chosen)


def jit_pcg(plan: Any, pcg: PCG, donate: Sequence[int] = ()) -> Any:
    """`jax.jit` of the PCG's `shard_map` lowering over the plan's flat inputs, with the plan's input and
    output shardings and donation (what `jit_plan` is for a plan)."""
    import jax

    from shardc.lower import compiler_options, in_out_shardings
    from shardc.pcg.lower import lower_pcg

    ins, outs = in_out_shardings(plan)
    return jax.jit(lower_pcg(pcg, jit=False), in_shardings=ins, out_shardings=outs, donate_argnums=tuple(donate),
                   compiler_options=compiler_options(plan))
