"""Why does (or doesn't) a rewrite pay? Every match of every usable proved rule on a zoo model's searched plan's
PCG, each applied alone and simulated: the rules that match, where, and the simulated gain or loss of each.

    python -m bench.pcg_why --model gpt12 [--scale full|tiny] [--budget 60] [--per-rule 6] [--plan /tmp/p.json]
    python -m bench.pcg_why --model gpt12 --plan /tmp/p.json --apply reduce_split_scatter2:0

The plan is `@shardc.auto(search=True)`'s on `--topology` (default `h100-sxm-8`; with `--plan`, the search's plan is saved there and
loaded on the next run, so the analysis of one plan can be repeated without searching again). Per rule: the
number of matches, how many of them were simulated (at most `--per-rule`, the first in program order), and the
best / worst simulated change of the step (negative = faster). Then the best single rewrites, with the matched
ops and their source lines. With `--apply RULE:I`, only that match: both PCGs' step, communication and the
compute stream's largest idle gaps.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

if __name__ == "__main__":  # 8 local CPU devices, as the tests have
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOPOLOGY = "h100-sxm-8"  # (--topology sets it)


def _us(t: float) -> str:
    return f"{t * 1e6:+.1f} us" if abs(t) < 1e-3 else f"{t * 1e3:+.3f} ms"


def searched(model: str, scale: str, budget: float, plan_file: str | None):
    """(plan, closed jaxpr, donated) of the zoo model's searched plan on h100-sxm-8 (8 devices)."""
    import shardc
    from bench.zoo import _capture_problem, _trace_mesh
    from bench.zoo_models import zoo

    zm = next(z for z in zoo(scale) if z.name == model)
    step, args = zm.build(_trace_mesh(), 1)
    with _capture_problem() as box:
        af = shardc.auto(step, search=plan_file or True, topology=TOPOLOGY, budget_s=budget, donate_argnums=(0, 1),
                         devices=8)
        plan = af.plan(*args)
    problem = box["problems"].get(id(plan.graph), box.get("problem"))
    if problem is None:  # loaded from the plan file: trace the program for its jaxpr
        closed = next(iter(af._cache.values())).closed_jaxpr
        donated = tuple(plan.donated or ())
    else:
        closed, donated = problem.program, tuple(problem.donated)
    return plan, closed, donated


def analyse(plan, closed, donated, per_rule: int, out=print) -> list[tuple]:
    """Simulate each of the first `per_rule` matches of every usable rule applied alone to the plan's PCG."""
    from shardc.pcg.build import build_pcg
    from shardc.pcg.library import all_rules
    from shardc.pcg.match import RewriteError, apply_match, find_matches
    from shardc.pcg.optimize import describe_match, usable_rules
    from shardc.pcg.simcost import SimCost
    from shardc.pcg.verify import verify_rule
    from shardc.sim import as_topology, simulate

    topo = as_topology(TOPOLOGY)
    t0 = time.perf_counter()
    plan_t = simulate(plan, topo, donated=donated).step_time
    pcg = build_pcg(plan, closed, fuse=True, reduce_scatter=topo.reduce_scatter)
    cost = SimCost(topo, donated=donated, memory_limit=float(topo.device.memory))
    base = cost(pcg)
    par = collections.Counter(type(n.op).__name__ for n in pcg.nodes if n.is_parallel)
    out(f"mesh {plan.mesh_sizes}: plan {plan_t * 1e3:.3f} ms, its PCG {base * 1e3:.3f} ms, {len(pcg.nodes)} nodes, "
        f"parallel ops {dict(par)}, regions {len(list(pcg.region_nodes()))} ({time.perf_counter() - t0:.1f} s)")
    rows, results = [], []
    for rule in usable_rules(all_rules()):
        matches = list(find_matches(pcg, rule))
        if not matches or not verify_rule(rule).proved:
            continue
        deltas = []
        for m in matches[:per_rule]:
            try:
                new = apply_match(pcg, m)
            except RewriteError as e:
                deltas.append(None)
                results.append((float("nan"), rule.name, f"RewriteError: {e}"[:160]))
                continue
            d = cost(new) - base
            deltas.append(d)
            results.append((d, rule.name, describe_match(pcg, m)))
        ok = [d for d in deltas if d is not None]
        rows.append((rule.name, len(matches), len(deltas), sum(d is None for d in deltas),
                     min(ok) if ok else None, max(ok) if ok else None))
    out(f"\n{'rule':28s} {'matches':>7s} {'tried':>5s} {'error':>5s} {'best':>12s} {'worst':>12s}")
    for name, n, tried, err, lo, hi in sorted(rows, key=lambda r: (r[4] if r[4] is not None else 1.0)):
        out(f"{name:28s} {n:7d} {tried:5d} {err:5d} {_us(lo) if lo is not None else '-':>12s} "
            f"{_us(hi) if hi is not None else '-':>12s}")
    out(f"\n{cost.simulations} simulations, {time.perf_counter() - t0:.1f} s. Best single rewrites:")
    for d, name, where in sorted((r for r in results if r[0] == r[0]), key=lambda r: r[0])[:12]:
        out(f"  {_us(d)}  {name}: {where[:260]}")
    return results


def compare(plan, closed, donated, rule_name: str, index: int, out=print) -> None:
    """One match of one rule applied: both PCGs' simulated step, communication time and the compute stream's
    largest idle gaps (where a rewrite that shortens a collective can lose)."""
    from shardc.pcg.build import build_pcg
    from shardc.pcg.library import all_rules
    from shardc.pcg.match import apply_match, find_matches
    from shardc.pcg.simcost import simulate_pcg
    from shardc.pcg.verify import verify_rule
    from shardc.sim import as_topology

    topo = as_topology(TOPOLOGY)
    pcg = build_pcg(plan, closed, fuse=True, reduce_scatter=topo.reduce_scatter)
    rule = next(r for r in all_rules() if r.name == rule_name)
    assert verify_rule(rule).proved
    m = list(find_matches(pcg, rule))[index]
    out(f"{m}")
    for label, p in (("before", pcg), ("after", apply_match(pcg, m))):
        r = simulate_pcg(p, topo, donated=donated).result
        tasks = sorted((st, en, t.name) for si, sl in enumerate(r.slots)
                       for t, st, en in zip(sl.tasks, r.starts[si], r.ends[si]) if t.kind == "compute" and t.dur)
        gaps = sorted(((b[0] - a[1], a[1], b[2]) for a, b in zip(tasks, tasks[1:])), reverse=True)[:3]
        out(f"{label}: step {r.step_time * 1e6:.1f} us, communication {r.comm_time * 1e6:.1f} us, compute idle "
            + ", ".join(f"{g / 1e6:.1f} us at {at / 1e6:.1f} us (before {name})" for g, at, name in gaps))


def main() -> None:
    global TOPOLOGY
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--scale", default="full")
    ap.add_argument("--budget", type=float, default=60)
    ap.add_argument("--per-rule", type=int, default=6)
    ap.add_argument("--plan", default=None, help="a .json plan file: saved after the search, loaded if present")
    ap.add_argument("--topology", default=TOPOLOGY)
    ap.add_argument("--apply", default=None, help="RULE:I: only compare the PCG with its I-th match of RULE applied")
    a = ap.parse_args()
    TOPOLOGY = a.topology
    t0 = time.perf_counter()
    plan, closed, donated = searched(a.model, a.scale, a.budget, a.plan)
    print(f"{a.model} ({a.scale}): searched in {time.perf_counter() - t0:.1f} s", flush=True)
    if a.apply:
        name, index = a.apply.rsplit(":", 1)
        compare(plan, closed, donated, name, int(index), out=lambda s: print(s, flush=True))
        return
    analyse(plan, closed, donated, a.per_rule, out=lambda s: print(s, flush=True))


if __name__ == "__main__":
    main()
