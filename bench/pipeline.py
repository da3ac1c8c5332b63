"""Pipeline parallelism on the zoo's memory-tight LM: simulated step time of the pipelines
`shardc.pipeline.choose_pipeline` chooses from, against the non-pipelined search and its baselines.

    python -m bench.pipeline [--scale tiny|full|xl|gpt48] [--topology h100-sxm-8x8] [--budget 15] [--stages 4]
                             [--screen-budget S] [--finalists 2]

The model is `bench.gpt.ScanGPT` (the zoo's GPT with its blocks as one `nn.scan`, the form shardc cuts into
stages) at the `gpt12-wide` size (`--scale full`; `xl`: gpt12-xl, `gpt48`: the 48-layer LM), with the zoo's weak scaling (8 sequences per 8 devices). The unpipelined
step is searched with `--budget`; every candidate pipeline (stages, microbatches, schedule, data shards:
`shardc.pipeline.choose.candidates`, `--stages` keeps some stage counts) is screened (by
its baselines inside the stages, megatron-3d among them; `--screen-budget S`: and a search from them) and the
`--finalists` best screened get the full search. Not a test: it prints a table.
"""
from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import optax

import shardc
from bench.gpt import ScanGPT, make_train_step
from bench.zoo_models import _abstract, _unbox
from shardc.pipeline.choose import Choice, candidates, choose_pipeline
from shardc.sim import as_topology

# the zoo's memory-tight LMs (bench/zoo_models.py), batches per 8 devices: "full" is gpt12-wide
SIZES = {"full": dict(layers=12, batch=8, seq=512, vocab=32768, d=6144, heads=48),
         "xl": dict(layers=12, batch=16, seq=2048, vocab=32768, d=4096, heads=32),
         "gpt48": dict(layers=48, batch=32, seq=2048, vocab=32768, d=2048, heads=16),
         "tiny": dict(layers=4, batch=8, seq=32, vocab=256, d=64, heads=4)}


def build(scale: str, batch_scale: int = 1):
    """The step and abstract arguments; the batch is `batch_scale` times the size's (the zoo scales its
    8-device batches with the device count: 64 sequences on 64 devices)."""
    kw = dict(SIZES[scale])
    batch, seq = kw.pop("batch") * batch_scale, kw["seq"]
    model = ScanGPT(**kw)
    tx = optax.adamw(1e-3)
    # no mesh: Flax applies no partitioning constraint; the metadata is dropped (every strategy is the search's)
    params = _unbox(_abstract(lambda k: model.init(k, jnp.zeros((batch, seq), jnp.int32))["params"],
                              jax.random.key(1)))
    ids = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    return make_train_step(model, tx), (params, _abstract(tx.init, params), ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", default="full", choices=sorted(SIZES))
    ap.add_argument("--topology", default="h100-sxm-8x8")
    ap.add_argument("--budget", type=float, default=15.0, help="search budget of the unpipelined step and finalists")
    ap.add_argument("--screen-budget", type=float, default=None,
                    help="search budget of each candidate's screen (default: its baselines only, no search)")
    ap.add_argument("--finalists", type=int, default=2)
    ap.add_argument("--stages", default="", help="comma-separated stage counts to keep (default: all)")
    ap.add_argument("--unpipelined", action="store_true", help="(kept for old command lines: always searched)")
    ap.add_argument("--remat", action="store_true",
                    help="let the search rematerialize (off by default: the zoo's memory-tight rows without it)")
    ap.add_argument("--prune-siblings", action="store_true",
                    help="do not screen the usually slower siblings of a candidate that fits (faster planning)")
    ap.add_argument("--screen-all", action="store_true",
                    help="screen every candidate, those bounded by a faster sibling too (bound_siblings=False)")
    ap.add_argument("--no-floors", action="store_true",
                    help="screen candidates whose floor is above a plan in hand too (floors=False)")
    a = ap.parse_args()
    n = as_topology(a.topology).num_devices
    step, args = build(a.scale, max(1, n // 8))  # weak scaling, as bench/zoo.py
    size = SIZES[a.scale]
    keep = {int(s) for s in a.stages.split(",") if s}
    pipes = [p for p in candidates(n, size["layers"], size["batch"] * max(1, n // 8)) if not keep or p.stages in keep]
    print(f"{len(pipes)} candidate pipelines on {a.topology}; unpipelined and {a.finalists} finalists searched with "
          f"budget {a.budget} s, candidates screened "
          + (f"with {a.screen_budget} s" if a.screen_budget is not None else "by their baselines"))
    print("| plan | pipeline | mesh | step | peak | wall |")
    print("|---|---|---|---|---|---|")
    t = [time.time()]
    phases: dict[str, list[float]] = {}  # wall seconds per phase of the choice (rows arrive as they are made)
    phase_of = {"unpipelined": "unpipelined search", "screened": "screens", "floored": "screens",
                "pipelined": "finalists' searches"}

    def row(c: Choice) -> None:
        p = c.pipeline
        what = (f"{p.schedule} S={p.stages} M={p.microbatches}" + (f" R={p.repeats}" if p.repeats > 1 else "")
                + f" data={p.shards}" + (" W after loop" if p.defer_wgrad else "")) if p is not None else "–"
        fits = "" if c.feasible else " (OOM)"
        when = ("not screened" if c.name == "bounded" else f"floor {c.time * 1e3:.2f} ms" if c.name == "floored"
                else f"{c.time * 1e3:.2f} ms{fits}")
        print(f"| {c.name} | {what} | {c.mesh} | {when} | {c.peak / 2**30:.1f} GiB | "
              f"{time.time() - t[0]:.0f} s |", flush=True)
        if c.name in phase_of or c.name.startswith("error"):
            phases.setdefault(phase_of.get(c.name, "screens"), []).append(time.time() - t[0])
        t[0] = time.time()

    t0 = time.time()
    best, choices = choose_pipeline(step, args, topology=a.topology, budget_s=a.budget, pipelines=pipes,
                                    screen_budget_s=a.screen_budget, finalists=a.finalists, on_choice=row,
                                    prune_siblings=a.prune_siblings, bound_siblings=not a.screen_all,
                                    floors=not a.no_floors,
                                    donate_argnums=(0, 1), remat=a.remat)
    base = min((c for c in choices if c.name.startswith("baseline ") and c.feasible), key=lambda c: c.time,
               default=None)
    m3d = min((c for c in choices if c.name == "megatron-3d" and c.feasible), key=lambda c: c.time, default=None)
    total = time.time() - t0
    print(f"\nchosen: {best.pipeline.describe() if best.pipeline is not None else 'no pipeline'}, mesh "
          f"{dict(best.mesh_sizes)}: {best.cost.step_time * 1e3:.2f} ms ({total:.0f} s in all)")
    bounded = sum(c.name == "bounded" for c in choices)
    floored = sum(c.name == "floored" for c in choices)
    print("planning: " + ", ".join(f"{k} {sum(v):.0f} s ({len(v)})" for k, v in phases.items())
          + (f"; {bounded} candidates not screened (bounded by a faster sibling)" if bounded else "")
          + (f"; {floored} floored (floor above a plan in hand)" if floored else "")
          + f"; {total:.0f} s in all; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    pc = best.cost.pipeline
    if pc is not None:
        print(f"  bubble {pc.bubble_s * 1e3:.1f} ms of loop compute {pc.loop_compute_s * 1e3:.1f} ms; stage boundary "
              f"{pc.boundary_bytes / 2**20:.0f} MiB in {pc.boundary_s * 1e3:.2f} ms")
    versus = (f"{base.time / best.cost.step_time:.2f}x the best unpipelined baseline ({base.name}, "
              f"{base.time * 1e3:.2f} ms)") if base is not None else "no unpipelined plan fits"
    print(f"  {versus}" + (f"; {m3d.time / best.cost.step_time:.2f}x the best megatron-3d ({m3d.time * 1e3:.2f} ms)"
                          if m3d is not None else ""))
    print(best.cost.summary(top=6))


if __name__ == "__main__":
    main()
