"""Benchmark: how long shardc's strategy search takes to plan the 12-layer GPT train step (Adam).

    python bench/search_speed.py [--layers 12] [--write]
    python bench/search_speed.py --pipeline [--layers 12] [--topology h100-sxm-8x8 ...]
    python bench/search_speed.py --workers 3 [--scan]
    python bench/search_speed.py --pcg 2 [--topology h100-sxm-8]

For each target — 8 devices on `h100-sxm-8` and 64 devices on `h100-sxm-8x8` (more than this host has:
the plan is made on a mesh shape without devices, `shardc.plan_for`) — it plans with `search=True` and
reports the time to trace, to search and in all, the simulated plans evaluated per second, and the cost
of one evaluation: a full one (a baseline, on a fresh mesh) and an incremental one (a one-decision move,
as MCMC proposes). `--write` records the table in docs/benchmarks.md. Targets (issue 6): ≤ 10 s in all on
8 devices and ≤ 30 s on 64 on a 2-core machine.

`--workers ROUNDS` plans each target with one process (`SHARDC_SEARCH_WORKERS=1`) and with the default
workers (`shardc.search.workers`), alternately, and prints the medians, the speedup and whether every run chose
the same plan (`--scan`: the LM with its blocks as one `nn.scan`, as `--pipeline` plans it).

`--pcg ROUNDS` plans each target with `pcg=False` and `pcg=True` (the searched meshes' best plans rewritten by
the proved rules, issue 18), alternately, and prints the medians, the rewriting's extra time as a ratio of the
same run's plain planning, whether every run chose the same layouts, and what the rewriting found. Target
(issue 18): planning with `pcg=True` within the search's targets.

`--pipeline` plans the same LM with its blocks as one `nn.scan` (`bench.gpt.ScanGPT`, the form shardc cuts
into stages) with the pipeline dimension on (`shardc.plan_for(..., pipeline=True)`: the unpipelined search,
every candidate pipeline screened, two finalists searched, default budgets) for 8, 64 and 256 devices
(`h100-sxm-8`, `-8x8`, `-8x32`), each in a process of its own (as a user plans one model on one topology: a
row after others in one process ran ~5 s slower on 256 devices), and reports where the time goes. Targets
(issue 16): ≤ 10 s on 8 devices, ≤ 30 s on 64 and on 256. It prints its table (docs/benchmarks.md `pipeline`
records it by hand).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import shardc  # noqa: E402
import shardc.search.integrate as integrate  # noqa: E402
from shardc.search.integrate import default_budget  # noqa: E402
from bench.gpt import make_train_step, setup  # noqa: E402
from bench.propagate import count_eqns, write_section  # noqa: E402
from shardc.search.baselines import BASELINES, baseline_seeds  # noqa: E402
from shardc.search.driver import _mesh_of  # noqa: E402
from shardc.gc_pause import paused_gc  # noqa: E402
from shardc.search.evaluate import Evaluator  # noqa: E402
from shardc.search.space import build_space, seeds_for  # noqa: E402

TARGETS = (("h100-sxm-8", 8, 10.0), ("h100-sxm-8x8", 64, 30.0))  # topology, devices, target (s); default budget_s
PIPELINE_TARGETS = TARGETS + (("h100-sxm-8x32", 256, 30.0),)  # (issue 16: with the pipeline dimension)


def plan_pipelined(step, args, topology: str) -> dict:
    """Plan with the pipeline dimension on (default budgets); seconds per phase of the choice, from the rows
    `choose_pipeline` reports as it makes them."""
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}
    last = [time.perf_counter()]
    phase_of = {"unpipelined": "unpipelined", "screened": "screens", "floored": "screens", "pipelined": "finalists"}

    def on_choice(c) -> None:
        now = time.perf_counter()
        name = phase_of.get(c.name, "screens" if c.name.startswith("error") else None)
        if name is not None:
            phases[name] = phases.get(name, 0.0) + now - last[0]
            last[0] = now
        counts[c.name.split(":")[0]] = counts.get(c.name.split(":")[0], 0) + 1

    t0 = time.perf_counter()
    plan = shardc.plan_for(step, *args, topology=topology, pipeline=True, on_choice=on_choice, progress=False)
    total = time.perf_counter() - t0
    return {"plan": plan, "total": total, "phases": phases, "counts": counts}


def pipeline_rows(layers: int, topologies: list[str] | None = None) -> list[str]:
    """One row per PIPELINE_TARGETS entry (those named in `topologies`, when given): planning time with the
    pipeline dimension, by phase, and the CPU seconds of this process and of its children (search workers and
    forked screens) together."""
    from bench.zoo_models import _unbox

    model, tx, params, _, ids = setup(layers=layers, scan=True)
    params = _unbox(params)  # (no partitioning metadata: its "layers" axis would be a 4th mesh axis beside the stage)
    step, args = make_train_step(model, tx), (params, tx.init(params), ids)
    rows = []
    for topology, devices, target in PIPELINE_TARGETS:
        if topologies and topology not in topologies:
            continue
        cpu = _cpu_with_children()
        r = plan_pipelined(step, args, topology)
        cpu = _cpu_with_children() - cpu
        plan, ph, n = r["plan"], r["phases"], r["counts"]
        unpiped = next(c for c in plan.pipeline_choice.choices if c.name == "unpipelined")
        chosen = plan.pipeline.describe() if plan.pipeline is not None else "no pipeline"
        cands = len({dataclasses.replace(c.pipeline, layers=None, stack="") for c in plan.pipeline_choice.choices
                     if c.name in ("screened", "bounded", "floored") or c.name.startswith("error")})  # (once each)
        row = (f"| {devices} / `{topology}` | {cands} ({n.get('screened', 0)} screened, {n.get('bounded', 0)} "
               f"bounded, {n.get('floored', 0)} floored) | {ph.get('unpipelined', 0):.1f} | {ph.get('screens', 0):.1f} | {ph.get('finalists', 0):.1f} "
               f"| {r['total']:.1f} (≤ {target:.0f}; CPU {cpu:.1f}) | {chosen}: {plan.cost.step_time * 1e3:.3f} ms (unpipelined "
               f"{unpiped.time * 1e3:.3f} ms) |")
        print(row, flush=True)
        rows.append(row)
    return rows


def _cpu_with_children() -> float:
    """CPU seconds of this process and of its children that have ended (all of a plan's, once it returns)."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def plan_once(step, args, topology: str, devices: int, budget_s: float | None = None) -> dict:
    """Plan with search=True; capture the search problem to time single evaluations afterwards."""
    seen: dict = {}
    real = integrate.search_plan

    def spy(problem, meshes, **kw):
        seen["problem"] = problem
        t = time.perf_counter()
        out = real(problem, meshes, **kw)
        seen["search_s"] = time.perf_counter() - t
        return out

    integrate.search_plan = spy
    try:
        t0 = time.perf_counter()
        af = shardc.auto(step, search=True, topology=topology, devices=devices, budget_s=budget_s)
        plan = af.plan(*args)
        total = time.perf_counter() - t0
    finally:
        integrate.search_plan = real
    rep = plan.search
    best_base = min((c.score.time for c in rep.baselines if c.score.feasible), default=float("nan"))
    return {"plan": plan, "report": rep, "total": total, "search": seen["search_s"], "problem": seen["problem"],
            "best_baseline": best_base}


def evaluation_costs(problem, sizes: dict, moves: int = 12) -> tuple[float, float]:
    """Median seconds of a full evaluation (the baselines on a fresh Evaluator) and of an incremental one
    (one-decision moves from the best baseline's projection)."""
    from shardc.search.driver import project

    mesh = _mesh_of(sizes)
    user = list(problem.user_seeds(mesh))
    space = build_space(problem.graph, sizes, user)
    ev = Evaluator(problem, mesh, space, user)
    full, inc = [], []
    with paused_gc():
        start = space.neutral()
        for name in BASELINES:
            extra = baseline_seeds(name, problem.graph, sizes, user)
            if extra is None:
                continue
            t = time.perf_counter()
            plan = ev.plan_with(extra)
            ev.score_plan(plan)
            full.append(time.perf_counter() - t)
            start = project(space, plan)
        ev.score(start)
        rng = random.Random(0)
        for _ in range(moves):
            gi = rng.randrange(len(space.groups))
            a = start[:gi] + (rng.randrange(space.groups[gi].size),) + start[gi + 1:]
            t = time.perf_counter()
            ev.score_plan(ev.plan_with(seeds_for(space, a, user)))
            inc.append(time.perf_counter() - t)
            ev.score_plan(ev.plan_with(seeds_for(space, start, user)))  # back to the start
    return statistics.median(full), statistics.median(inc)


def workers_rows(step, args: tuple, rounds: int) -> list[str]:
    """Per target: the plan made with one process (`SHARDC_SEARCH_WORKERS=1`) and with the default workers,
    alternately `rounds` times in this process (medians: the machine's speed drifts), and whether every run
    chose the same plan (the report's decisions and counts, the plan's shardings, strategies and reshards)."""
    rows = []
    for topology, devices, target in TARGETS:
        runs: dict[str, list[dict]] = {"1": [], "default": []}
        for _ in range(rounds):
            for name in runs:
                if name == "1":
                    os.environ["SHARDC_SEARCH_WORKERS"] = "1"
                else:
                    os.environ.pop("SHARDC_SEARCH_WORKERS", None)
                runs[name].append(plan_once(step, args, topology, devices))
        os.environ.pop("SHARDC_SEARCH_WORKERS", None)
        digests = {_decisions(r["plan"], r["report"]) for rs in runs.values() for r in rs}
        one, many = ({k: statistics.median(r[k] for r in rs) for k in ("total", "search")} for rs in runs.values())
        from shardc.search.workers import default_workers

        rows.append(f"| {devices} / `{topology}` | {one['search']:.1f} / {one['total']:.1f} | {default_workers()}: "
                    f"{many['search']:.1f} / {many['total']:.1f} (≤ {target:.0f}) | {one['total'] / many['total']:.2f}x "
                    f"| {'yes' if len(digests) == 1 else f'NO ({len(digests)} different)'} |")
        print(rows[-1], flush=True)
    return rows


def pcg_rows(step, args: tuple, rounds: int, topologies: list[str] | None = None) -> list[str]:
    """Per target (those named in `topologies`, when given): the plan made with `pcg=False` and with `pcg=True`
    (issue 18: each searched mesh's best plan rewritten by the proved rules), alternately `rounds` times in this
    process with the default workers (medians), the extra time as a ratio of the same run's plain planning (the
    machine's speed drifts), CPU seconds with the forked workers', and what the rewriting chose."""
    rows = []
    for topology, devices, target in TARGETS:
        if topologies and topology not in topologies:
            continue
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(rounds):
            for pcg in runs:
                cpu = _cpu_with_children()
                t0 = time.perf_counter()
                plan = shardc.auto(step, search=True, pcg=pcg, topology=topology, devices=devices).plan(*args)
                runs[pcg].append({"total": time.perf_counter() - t0, "cpu": _cpu_with_children() - cpu, "plan": plan})
        plain, rewritten = ({k: statistics.median(r[k] for r in rs) for k in ("total", "cpu")} for rs in runs.values())
        same = len({repr((r["plan"].mesh_sizes, r["plan"].shardings, r["plan"].strategies, r["plan"].reshards))
                    for rs in runs.values() for r in rs}) == 1  # (the layouts; the rewritten PCG comes on top)
        ch = runs[True][-1]["plan"].pcg
        what = "no rewrite paid" if ch is None or not ch.steps else \
            f"{len(ch.steps)} rewrites, {ch.gain:.3f}x{' (runs)' if ch.chosen else ''}"
        rows.append(f"| {devices} / `{topology}` | {plain['total']:.1f} ({plain['cpu']:.1f}) "
                    f"| {rewritten['total']:.1f} ({rewritten['cpu']:.1f}) (≤ {target:.0f}) "
                    f"| +{rewritten['total'] - plain['total']:.1f} ({rewritten['total'] / plain['total']:.2f}x) "
                    f"| {'yes' if same else 'NO'} | {what} |")
        print(rows[-1], flush=True)
    return rows


def _decisions(plan, report) -> str:
    import hashlib

    d = (report.chosen, report.baselines, report.meshes, report.evaluations, report.seeds, report.searched,
         report.groups, plan.shardings, plan.strategies, plan.reshards)
    return hashlib.sha256(repr(d).encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--pipeline", action="store_true", help="plan with the pipeline dimension on (issue 16)")
    ap.add_argument("--topology", action="append", help="with --pipeline or --pcg: only this target (repeatable)")
    ap.add_argument("--workers", type=int, metavar="ROUNDS",
                    help="plan with one process and with the default workers, alternately ROUNDS times")
    ap.add_argument("--scan", action="store_true", help="with --workers: the LM's blocks as one nn.scan")
    ap.add_argument("--pcg", type=int, metavar="ROUNDS",
                    help="plan with pcg=False and pcg=True (issue 18), alternately ROUNDS times")
    ap.add_argument("--row-only", action="store_true", help=argparse.SUPPRESS)  # (a row's own process)
    args = ap.parse_args()
    if args.pipeline:
        if not args.row_only:
            print("| devices / topology | candidates | unpipelined search | screens | finalists "
                  "| total (target; CPU with children) | chosen |")
            print("|---|---|---|---|---|---|---|", flush=True)
        if args.row_only or args.topology and len(args.topology) == 1:
            pipeline_rows(args.layers, args.topology)
        else:  # each row in a process of its own, as a user plans one model on one topology
            for topology, _, _ in PIPELINE_TARGETS:
                if not args.topology or topology in args.topology:
                    subprocess.run([sys.executable, os.path.abspath(__file__), "--pipeline", "--row-only",
                                    "--layers", str(args.layers), "--topology", topology], check=True)
        if not args.row_only:
            print(f"(seconds; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end)")
        return

    model, tx, params, opt_state, ids = setup(layers=args.layers, scan=args.scan)
    if args.scan:  # (as pipeline_rows plans it)
        from bench.zoo_models import _unbox

        params = _unbox(params)
        opt_state = tx.init(params)
    step = make_train_step(model, tx)
    if args.pcg:
        print("| devices / topology | pcg=False: total (CPU) | pcg=True: total (CPU) (target) | extra | same layouts "
              "| the chosen mesh's rewriting |\n|---|---|---|---|---|---|")
        pcg_rows(step, (params, opt_state, ids), args.pcg, args.topology)
        print(f"(seconds, medians of {args.pcg}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              "at the end)")
        return
    if args.workers:
        print("| devices / topology | one process: search / total | workers: search / total (target) | speedup "
              "| same plan |\n|---|---|---|---|---|")
        workers_rows(step, (params, opt_state, ids), args.workers)
        print(f"(seconds, medians of {args.workers}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              "at the end)")
        return
    closed = jax.make_jaxpr(step)(params, opt_state, ids)
    eqns = count_eqns(closed.jaxpr)
    rows = []
    for topology, devices, target in TARGETS:
        budget = default_budget(devices)  # what @shardc.auto uses when budget_s is not given
        r = plan_once(step, (params, opt_state, ids), topology, devices)
        rep = r["report"]
        full, inc = evaluation_costs(r["problem"], r["plan"].mesh_sizes)
        chosen = rep.chosen
        mesh = ",".join(f"{a}={n}" for a, n in chosen.mesh.items())
        row = (f"| {devices} / `{topology}` | {budget:.0f} | {r['search']:.1f} | {r['total'] - r['search']:.1f} | {r['total']:.1f} "
               f"(≤ {target:.0f}) | {rep.evaluations} over {len(rep.meshes)} meshes | {rep.evaluations / r['search']:.1f} "
               f"| {full * 1e3:.0f} / {inc * 1e3:.0f} | {chosen.name}, mesh({mesh}), {chosen.score.time * 1e3:.3f} ms "
               f"(best baseline {r['best_baseline'] * 1e3:.3f} ms) |")
        print(row, flush=True)
        rows.append(row)
    body = (f"12-layer GPT train step with Adam ({eqns} jaxpr eqns), `search=True` (DP + MCMC) with the default budget (`budget_s` not given), planned with "
            f"`shardc.plan_for` / `@shardc.auto(search=True, devices=...)`; the 64-device plan is made on 8 CPU "
            f"devices (a mesh shape without devices). Times in seconds on the shared 2-core machine; the rest = "
            f"tracing, building the graph, retracing under the chosen mesh (8 devices), the final plan and its "
            f"simulation, lowering; one "
            f"evaluation = propagation + plan + simulation of one candidate (ms, median; full = a baseline on "
            f"the chosen mesh, incremental = a one-decision move).\n\n"
            "| devices / topology | budget_s | search | the rest | total (target) | simulated plans | plans/s "
            "| one evaluation: full / incremental (ms) | chosen |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows)
            + "\n\nCommand: `python bench/search_speed.py --write`. Before the incremental evaluation (issue 6), "
              "one candidate took 1–1.4 s and planning the 8-device case took ~38 s.\n")
    if args.write:
        write_section("search_speed", body)
    print(body)


if __name__ == "__main__":
    main()
