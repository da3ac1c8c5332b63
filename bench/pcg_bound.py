"""How much could a rewrite that changes only communication gain on the zoo? Per model and topology, the
searched plan's simulated step, its compute (the compute stream's busy time: every task's duration, loop trips
counted) and the bound step / compute: the speed-up of hiding every collective behind compute, the most any
rewrite of collectives (fusing, splitting, reordering, overlapping them) can give without changing the work.

    python -m bench.pcg_bound [--models mlp,cnn] [--topologies h100-sxm-8,tpu-v5e-8] [--budget 60]

The plans are `@shardc.auto(search=True)`'s as `bench.zoo` makes them (the same models, weak scaling, budget).
Issue 18 asks the rewriting for >= 1.05x on three zoo rows: a row whose bound is below 1.05 cannot reach it by
rewriting collectives.
"""
from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # 8 local CPU devices, as the tests have
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADER = ("| model | topology | mesh | step | compute | exposed communication | bound (step / compute) |\n"
          "|---|---|---|---|---|---|---|")


def bound_row(zm, topology: str, budget: float) -> str:
    """One table row: the searched plan of zoo model `zm` on `topology`, simulated."""
    import shardc
    from bench.zoo import _capture_problem, _mesh_str, _trace_mesh
    from shardc.sim import as_topology, simulate

    topo = as_topology(topology)
    n = topo.num_devices
    step, args = zm.build(_trace_mesh(), max(1, n // 8))  # (as bench.zoo: the zoo's batches are for 8 devices)
    with _capture_problem() as box:
        af = shardc.auto(step, search=True, topology=topology, budget_s=budget, donate_argnums=(0, 1), devices=n)
        plan = af.plan(*args)
    problem = box["problems"].get(id(plan.graph), box.get("problem"))
    result = simulate(plan, topo, donated=tuple(problem.donated) if problem is not None else ())
    step_s, compute = result.step_time, result.compute_time
    ms = lambda t: f"{t * 1e3:.3f} ms"  # noqa: E731
    bound = step_s / compute if compute > 0 else float("inf")
    return (f"| {zm.name} | {topology} | {_mesh_str(plan.search.chosen.mesh)} | {ms(step_s)} | {ms(compute)} | "
            f"{ms(max(step_s - compute, 0.0))} ({max(step_s - compute, 0.0) / step_s:.0%}) | {bound:.3f}x |")


def main() -> None:
    from bench.zoo import TOPOLOGIES
    from bench.zoo_models import zoo

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,cnn,lstm,gpt12")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument("--budget", type=float, default=60)
    a = ap.parse_args()
    models = {z.name: z for z in zoo("full")}
    unknown = [m for m in a.models.split(",") if m not in models]
    if unknown:
        raise SystemExit(f"unknown zoo models {unknown}; the zoo has {sorted(models)}")
    print(HEADER, flush=True)
    for topology in a.topologies.split(","):
        for m in a.models.split(","):
            print(bound_row(models[m], topology, a.budget), flush=True)


if __name__ == "__main__":
    main()
