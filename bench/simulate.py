"""Benchmark: full and delta simulation of the 12-layer GPT train step (Adam).

    python bench/simulate.py [--layers 12] [--changes 200] [--topology h100-sxm-8] [--write]

Full simulation: `shardc.simulate(plan, topology)` from scratch (a new Simulator: cold caches), and
`Simulator.full(plan)` again (warm op-cost and reshard caches). Delta: one random op's strategy is
changed per step of a random walk (a legal factor->axis assignment of a random dot_general);
`Simulator.delta(new_plan)` is timed and so is a warm full simulation of the same plan by a second
Simulator, which the delta must equal. Both simulators price every plan with the graph's own ProgramInfo, as
the search's evaluators do (`device_shapes=False`; `shardc.cost.device_shapes`: with per-device shapes, a change of
their signature is a full simulation). The speedup is full / delta per change, timed twice over the same
walk: alternating (each delta, then its full: the full's working set evicts the delta simulator's from the
CPU caches before every delta) and in blocks (10 deltas back to back, as a search calls them, then the full
simulations of the same 10 plans: both within about a second, so machine load affects them alike). Target
(issues 3, 15): delta >= 10x faster than full (FlexFlow reports 2.2-6.9x for its delta simulation).
`--write` records the table in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardc  # noqa: E402
from bench.gpt import make_train_step, setup  # noqa: E402
from bench.propagate import count_eqns, write_section  # noqa: E402
from shardc.sim import simulate, simulator_for  # noqa: E402
from shardc.sim.variants import legal_strategies, with_strategy  # noqa: E402


def same(a, b) -> bool:
    return (a.makespan_ps == b.makespan_ps and a.payload == b.payload and a.wire == b.wire and a.flops == b.flops
            and a.memory == b.memory and a.starts == b.starts and a.ends == b.ends and a.binds == b.binds)


def timed_walk(sim, check, plans, size: int) -> tuple[list[float], list[float], int]:
    """Seconds of `sim.delta` and of `check.full` per plan, timed in blocks of `size` plans (the deltas, then
    the fulls of the same plans), and how many deltas equal their full."""
    deltas, fulls, equal = [], [], 0
    for b in range(0, len(plans), size):
        got = []
        for p in plans[b:b + size]:
            t0 = time.perf_counter()
            got.append(sim.delta(p))
            deltas.append(time.perf_counter() - t0)
        for p, rd in zip(plans[b:b + size], got):
            t0 = time.perf_counter()
            rf = check.full(p)
            fulls.append(time.perf_counter() - t0)
            equal += same(rd, rf)
    return deltas, fulls, equal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--changes", type=int, default=200)
    ap.add_argument("--topology", default="h100-sxm-8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    mesh = shardc.make_mesh({"data": 2, "model": 4})
    model, tx, params, opt_state, ids = setup(layers=args.layers)
    step = shardc.auto(make_train_step(model, tx), mesh=mesh, donate_argnums=(0, 1), search=False)
    plan = step.plan(params, opt_state, ids)
    closed = step.compiled_info(params, opt_state, ids).closed_jaxpr
    neqns = count_eqns(closed.jaxpr)
    topo = shardc.Topology.preset(args.topology)

    cold = []
    for _ in range(3):
        t0 = time.perf_counter()
        simulate(plan, topo)
        cold.append(time.perf_counter() - t0)
    # (as the search's evaluators simulate: one ProgramInfo for every plan, `shardc.cost.device_shapes`)
    sim = simulator_for(plan, topo, device_shapes=False)
    check = simulator_for(plan, topo, device_shapes=False)
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        base = sim.full(plan)
        warm.append(time.perf_counter() - t0)
    full_cold, full_warm = statistics.median(cold), statistics.median(warm)

    rng = random.Random(args.seed)
    dots = [op.id for op in plan.graph.ops if op.primitive == "dot_general" and not op.region]
    cur, plans = plan, []
    for _ in range(args.changes):
        i = rng.choice(dots)
        cur = with_strategy(cur, i, rng.choice(legal_strategies(cur, i)))
        plans.append(cur)
    runs = {}
    for mode, size in (("alternating", 1), ("in blocks of 10", 10)):
        sim.full(plan)
        runs[mode] = timed_walk(sim, check, plans, size)
    d_med = statistics.median(runs["alternating"][0])
    rows = [
        ("program", f"{args.layers}-layer GPT train step (Adam), {neqns} jaxpr eqns, {len(plan.graph.ops)} ops, "
                    f"mesh data=2 x model=4, {args.topology}"),
        ("simulated step time",
         f"{base.step_time * 1e3:.3f} ms, peak memory {base.peak_memory / 2**20:.1f} MiB/device"),
        ("full simulation, cold caches (`shardc.simulate`)", f"{full_cold * 1e3:.0f} ms"),
        ("full simulation, warm caches (`Simulator.full`)", f"{full_warm * 1e3:.0f} ms"),
    ]
    for mode, (ds, fs, equal) in runs.items():
        speed = sorted(f / d for f, d in zip(fs, ds))
        rows += [
            (f"{mode}: full / delta simulation per plan of the walk (median)",
             f"{statistics.median(fs) * 1e3:.0f} ms / {statistics.median(ds) * 1e3:.2f} ms"),
            (f"{mode}: delta speedup over warm full, median / p10 / p90",
             f"**{statistics.median(speed):.1f}x** / {speed[len(speed) // 10]:.1f}x / "
             f"{speed[9 * len(speed) // 10]:.1f}x"),
            (f"{mode}: delta result identical to full", f"{equal}/{args.changes}"),
        ]
    rows.append(("delta speedup over cold full (median delta, alternating)", f"{full_cold / d_med:.1f}x"))
    table = "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows) + "\n"
    print(table)
    if args.write:
        write_section("simulate", f"`python bench/simulate.py --layers {args.layers} --changes {args.changes} "
                      f"--topology {args.topology}` ({os.cpu_count()} cores, jax {jax.__version__}). One random "
                      f"dot_general's strategy changes per step of a random walk, seed {args.seed}; each delta is "
                      f"timed against a warm full simulation of the same plan, alternating (delta, full, delta, "
                      f"...) and in blocks (10 deltas, then the 10 fulls); target: delta >= 10x faster than full "
                      f"(FlexFlow: 2.2-6.9x).\n\n" + table)


if __name__ == "__main__":
    main()
