"""Benchmark: trace + build + propagate a 12-layer Transformer LM train step with Adam.

    python bench/propagate.py [--layers 12] [--repeat 5] [--write]

Prints the eqn count and the median time of each phase; `--write` records the table in
docs/benchmarks.md. Target (issue 2): under 1 s in all on a 2-core machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import annotations  # noqa: E402
import shardc  # noqa: E402
from bench.gpt import make_train_step, setup  # noqa: E402
from shardc.ir.build import build_graph  # noqa: E402
from shardc.metadata import input_hints  # noqa: E402
from shardc.plan import build_plan  # noqa: E402
from shardc.propagate import propagate  # noqa: E402
from shardc.seeds import program_seeds  # noqa: E402


def count_eqns(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    n += count_eqns(inner)
                elif hasattr(sub, "eqns"):
                    n += count_eqns(sub)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    mesh = shardc.make_mesh({"data": 2, "model": 4})
    model, tx, params, opt_state, ids = setup(layers=args.layers)
    step = make_train_step(model, tx)
    flat, tree = jax.tree_util.tree_flatten((params, opt_state, ids))

    def make_flat_fun():
        def flat_fun(*xs):
            return jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(tree, xs)))

        return flat_fun

    times: dict[str, list[float]] = {"trace": [], "build": [], "seeds": [], "propagate": [], "plan": []}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        with annotations.mesh_context(mesh), jax.set_mesh(mesh):
            closed = jax.make_jaxpr(make_flat_fun())(*flat)  # a new function: no trace cache hit
        t1 = time.perf_counter()
        g = build_graph(closed)
        t2 = time.perf_counter()
        hints = input_hints((params, opt_state, ids), mesh.axis_names)
        seeds = program_seeds(g, mesh)
        for i, h in enumerate(hints):
            if h is not None:
                seeds.append(shardc.propagate.Seed(g.inputs[i], h.dims, shardc.propagate.Cause("metadata", h.description)))
        t3 = time.perf_counter()
        prop = propagate(g, dict(mesh.shape), seeds)
        t4 = time.perf_counter()
        build_plan(g, mesh, prop)
        t5 = time.perf_counter()
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    total = sum(med.values())
    neqns = count_eqns(closed.jaxpr)
    rows = [
        f"| {args.layers}-layer GPT train step (Adam), {neqns} jaxpr eqns, {len(g.ops)} ops, {len(g.values)} values | "
        + " | ".join(f"{med[k]*1000:.0f}" for k in times) + f" | {total*1000:.0f} |"
    ]
    header = ("| program | trace ms | build ms | seeds ms | propagate ms | plan ms | total ms |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
    print(header)
    print("\n".join(rows))
    print(f"propagation visits: {prop.visits}")
    if args.write:
        write_section("propagate", f"Trace, graph build, seeding, propagation and plan of `bench/propagate.py` "
                      f"(median of {args.repeat}, {os.cpu_count()} cores, jax {jax.__version__}). Target: under 1 s in all.\n\n"
                      + header + "\n" + "\n".join(rows) + "\n")


def write_section(name: str, body: str) -> None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\nWritten by the scripts in `bench/`.\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n## {name}\n\n{body}{end}"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    open(path, "w").write(text)


if __name__ == "__main__":
    main()
