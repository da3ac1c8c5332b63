"""The substitution engine on the search's plans: on which zoo models does rewriting the searched plan's PCG
with proved rules make the simulated step faster, and by how much?

    python -m bench.pcg_zoo [--scale tiny|full] [--models mlp,gpt12] [--budget 6] [--evaluations 60]

Per model (bench/zoo_models.py, 8 devices, `h100-sxm-8`): the plan `@shardc.auto(search=True)` chooses,
its simulated step (`shardc.simulate(plan)`, what the search scored), its PCG's (`build_pcg(fuse=True)`:
the plan's collectives, which must agree), and the rewritten PCG's (`shardc.pcg.choice.choose_pcg`:
the engine with at most `--evaluations` simulations, each rewrite kept only when the simulated step
gets faster, under the topology's memory). Speed is the plan's simulated step over the rewritten one's,
both simulated in the same run. The rewrite time is the engine's alone (the planning before it is in
its own column).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # 8 local CPU devices, as the tests have
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

import shardc
from bench.zoo_models import zoo
from shardc.pcg.choice import choose_pcg

TOPOLOGY = "h100-sxm-8"


def _us(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def run(scale: str, models: list[str] | None, budget: float, evaluations: int) -> list[str]:
    rows = []
    for zm in zoo(scale):
        if models and zm.name not in models:
            continue
        mesh = shardc.make_mesh({"data": 2, "model": 2, "expert": 2}, jax.devices()[:8])
        step, args = zm.build(mesh)
        t0 = time.perf_counter()
        af = shardc.auto(step, search=True, topology=TOPOLOGY, budget_s=budget, donate_argnums=(0, 1), devices=8)
        c = af.compiled_info(*args)
        t1 = time.perf_counter()
        ch = choose_pcg(c.plan, c.closed_jaxpr, TOPOLOGY, donated=(c.plan.donated or ()),
                        max_evaluations=evaluations)
        rules = ", ".join(sorted({s.rule for s in ch.steps})) or "-"
        mesh_s = "x".join(f"{k}{v}" for k, v in c.plan.mesh_sizes.items())
        row = (f"| {zm.name} | {mesh_s} | {_us(ch.plan_time)} | {_us(ch.pcg_time)} ({ch.pcg_time / ch.plan_time:.3f}) "
               f"| {_us(ch.time)} | {ch.plan_time / ch.time:.3f}x | {'yes' if ch.chosen else 'no'} | {len(ch.steps)} "
               f"| {rules} | {len(ch.pcg.nodes)} | {ch.evaluations} | {t1 - t0:.1f} s | {ch.seconds:.1f} s |")
        print(row, flush=True)
        for s in ch.steps:
            print(f"    {s.rule}: {_us(s.cost_before)} -> {_us(s.cost_after)}  {s.ops[:200]}", flush=True)
        rows.append(row)
    return rows


HEADER = ("| model | mesh | plan (simulated) | its PCG (ratio) | rewritten PCG | speed | runs | rewrites | rules "
          "| PCG nodes | simulations | planning | rewriting |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--models", default="")
    ap.add_argument("--budget", type=float, default=6.0)
    ap.add_argument("--evaluations", type=int, default=60)
    a = ap.parse_args()
    print(HEADER, flush=True)
    run(a.scale, [m for m in a.models.split(",") if m] or None, a.budget, a.evaluations)


if __name__ == "__main__":
    main()
