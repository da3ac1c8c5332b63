"""Benchmark: full and delta simulation of the 12-layer GPT train step (Adam).

    python bench/simulate.py [--layers 12] [--changes 200] [--topology h100-sxm-8] [--write]

Full simulation: `shardc.simulate(plan, topology)` from scratch (a new Simulator: cold caches), and
`Simulator.full(plan)` again (warm op-cost and reshard caches). Delta: one random op's strategy is
changed (a legal factor->axis assignment of a random dot_general), `Simulator.delta(new_plan)` is timed,
then a warm full simulation of the same plan, which it must equal; the speedup is the ratio of the two,
per change (both measured back to back, so machine load affects both alike). Target (issues 3, 15):
delta >= 10x faster than full (FlexFlow reports 2.2-6.9x for its delta simulation). `--write` records
the table in docs/benchmarks.md.
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
            and a.memory == b.memory and a.starts == b.starts and a.ends == b.ends)


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
    sim = simulator_for(plan, topo)
    check = simulator_for(plan, topo)
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        base = sim.full(plan)
        warm.append(time.perf_counter() - t0)
    full_cold, full_warm = statistics.median(cold), statistics.median(warm)

    rng = random.Random(args.seed)
    dots = [op.id for op in plan.graph.ops if op.primitive == "dot_general" and not op.region]
    cur, deltas, fulls, equal = plan, [], [], 0
    for _ in range(args.changes):
        i = rng.choice(dots)
        cur = with_strategy(cur, i, rng.choice(legal_strategies(cur, i)))
        t0 = time.perf_counter()
        rd = sim.delta(cur)
        t1 = time.perf_counter()
        rf = check.full(cur)
        t2 = time.perf_counter()
        deltas.append(t1 - t0)
        fulls.append(t2 - t1)
        equal += same(rd, rf)
    d_med = statistics.median(deltas)
    speed = [f / d for f, d in zip(fulls, deltas)]
    rows = [
        ("program", f"{args.layers}-layer GPT train step (Adam), {neqns} jaxpr eqns, {len(plan.graph.ops)} ops, "
                    f"mesh data=2 x model=4, {args.topology}"),
        ("simulated step time",
         f"{base.step_time * 1e3:.3f} ms, peak memory {base.peak_memory / 2**20:.1f} MiB/device"),
        ("full simulation, cold caches (`shardc.simulate`)", f"{full_cold * 1e3:.0f} ms"),
        ("full simulation, warm caches (`Simulator.full`)", f"{full_warm * 1e3:.0f} ms"),
        ("full simulation of each plan of the walk (median)", f"{statistics.median(fulls) * 1e3:.0f} ms"),
        ("delta simulation, one-op change (median of {})".format(args.changes), f"{d_med * 1e3:.2f} ms"),
        ("delta speedup over warm full: median / p10 / p90",
         f"{statistics.median(speed):.1f}x / {sorted(speed)[len(speed) // 10]:.1f}x / "
         f"{sorted(speed)[9 * len(speed) // 10]:.1f}x"),
        ("delta speedup over cold full (median)", f"{full_cold / d_med:.1f}x"),
        ("delta result identical to full", f"{equal}/{args.changes}"),
    ]
    table = "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows) + "\n"
    print(table)
    if args.write:
        write_section("simulate", f"`python bench/simulate.py --layers {args.layers} --changes {args.changes} "
                      f"--topology {args.topology}` ({os.cpu_count()} cores, jax {jax.__version__}). One random "
                      f"dot_general's strategy changes per step of a random walk; target: delta >= 10x faster "
                      f"than full (FlexFlow: 2.2-6.9x).\n\n" + table)


if __name__ == "__main__":
    main()
