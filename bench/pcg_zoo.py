"""The substitution engine on the search's plans: on which zoo models does rewriting the searched plan's PCG
with proved rules make the simulated step faster, and by how much?

    python -m bench.pcg_zoo [--scale tiny|full] [--models mlp,gpt12] [--budget 6] [--evaluations 60] [--check]

Per model (bench/zoo_models.py, 8 devices, `h100-sxm-8`): the plan `@shardc.auto(search=True)` chooses,
its simulated step (`shardc.simulate(plan)`, what the search scored), its PCG's (`build_pcg(fuse=True)`:
the plan's collectives, which must agree), and the rewritten PCG's (`shardc.pcg.choice.choose_pcg`:
the engine with at most `--evaluations` simulations, each rewrite kept only when the simulated step
gets faster, under the topology's memory). Speed is the plan's simulated step over the rewritten one's,
both simulated in the same run. The rewrite time is the engine's alone (the planning before it is in
its own column). With `--check` (tiny scale: it runs the step), the rewritten PCG — chosen or not — runs as
`shardc.auto(pcg=True)` runs a chosen one (`jit_pcg`) on the 8 CPU devices against `jax.jit(step)`: the largest
difference over the outputs relative to their scale, and whether the compiled collectives are the PCG's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # 8 local CPU devices, as the tests have
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Any

import jax
import numpy as np

import shardc
from bench.zoo_models import zoo
from shardc.pcg import hlo_collectives
from shardc.pcg.choice import choose_pcg, jit_pcg

TOPOLOGY = "h100-sxm-8"


def _us(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def concrete(args: Any, seed: int = 0) -> Any:
    """Arrays for abstract arguments: floats uniform in [0, 0.1) (an Adam second moment must not be negative),
    integers in [0, 10) (valid labels and token ids of every tiny zoo model)."""
    rng = np.random.default_rng(seed)

    def one(a: Any) -> Any:
        if np.issubdtype(a.dtype, np.floating):
            return jax.numpy.asarray(rng.uniform(0.0, 0.1, a.shape), a.dtype)
        return jax.numpy.asarray(rng.integers(0, 10, a.shape), a.dtype)

    return jax.tree.map(one, args)


def check_numerics(step: Any, args: tuple, plan: Any, pcg: Any) -> tuple[float, str]:
    """The rewritten PCG (chosen or not) run as `shardc.auto(pcg=True)` runs a chosen one (`jit_pcg`) on the 8 CPU
    devices against `jax.jit(step)`: the largest difference over the float outputs relative to their scale (inf
    when the outputs' structure or integer values differ), and "" when the compiled collectives are the PCG's,
    kind by kind, else what differs."""
    flat = jax.tree.leaves(args)
    want = [np.asarray(x) for x in jax.tree.leaves(jax.jit(step)(*args))]
    compiled = jit_pcg(plan, pcg).lower(*flat).compile()
    got = [np.asarray(x) for x in jax.tree.leaves(compiled(*flat))]
    worst = 0.0 if len(got) == len(want) else float("inf")
    for g, w in zip(got, want):
        if g.shape != w.shape or (not np.issubdtype(w.dtype, np.floating) and not np.array_equal(g, w)):
            worst = float("inf")
        elif g.size and np.issubdtype(w.dtype, np.floating):
            worst = max(worst, float(np.max(np.abs(g - w))) / (1.0 + float(np.max(np.abs(w)))))
    have = {k: v for k, v in hlo_collectives(compiled.as_text()).items() if v}
    named = {k: v for k, v in pcg.collectives().items() if v}
    return worst, "" if have == named else f"compiled {have}, PCG {named}"


def run(scale: str, models: list[str] | None, budget: float, evaluations: int, check: bool = False) -> list[str]:
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
        checked = ""
        if check:
            worst, differ = check_numerics(step, concrete(args), c.plan, ch.pcg)
            checked = f" | {worst:.1e} | {differ or 'yes'}"
        rules = ", ".join(sorted({s.rule for s in ch.steps})) or "-"
        mesh_s = "x".join(f"{k}{v}" for k, v in c.plan.mesh_sizes.items())
        row = (f"| {zm.name} | {mesh_s} | {_us(ch.plan_time)} | {_us(ch.pcg_time)} ({ch.pcg_time / ch.plan_time:.3f}) "
               f"| {_us(ch.time)} | {ch.plan_time / ch.time:.3f}x | {'yes' if ch.chosen else 'no'} | {len(ch.steps)} "
               f"| {rules} | {len(ch.pcg.nodes)} | {ch.evaluations} | {t1 - t0:.1f} s | {ch.seconds:.1f} s{checked} |")
        print(row, flush=True)
        for s in ch.steps:
            print(f"    {s.rule}: {_us(s.cost_before)} -> {_us(s.cost_after)}  {s.ops[:200]}", flush=True)
        rows.append(row)
    return rows


COLUMNS = ["model", "mesh", "plan (simulated)", "its PCG (ratio)", "rewritten PCG", "speed", "runs", "rewrites",
           "rules", "PCG nodes", "simulations", "planning", "rewriting"]
CHECK_COLUMNS = ["numerics (max diff / scale)", "collectives as named"]


def header(check: bool) -> str:
    cols = COLUMNS + (CHECK_COLUMNS if check else [])
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--models", default="")
    ap.add_argument("--budget", type=float, default=6.0)
    ap.add_argument("--evaluations", type=int, default=60)
    ap.add_argument("--check", action="store_true",
                    help="also run the rewritten PCG (chosen or not) on the 8 CPU devices against jax.jit(step)")
    a = ap.parse_args()
    print(header(a.check), flush=True)
    run(a.scale, [m for m in a.models.split(",") if m] or None, a.budget, a.evaluations, a.check)


if __name__ == "__main__":
    main()
