"""Pipeline parallelism on the zoo's memory-tight LM: simulated step time of pipelined plans against the
non-pipelined search and baselines.

    python -m bench.pipeline [--scale tiny|full] [--topology h100-sxm-8x8] [--budget 20]

The model is `bench.gpt.ScanGPT` (the zoo's GPT with its blocks as one `nn.scan`, the form shardc cuts into
stages) at the `gpt12-wide` size. Each pipeline (stages, microbatches, schedule, data shards) is planned by
`shardc.plan_for(..., pipeline=...)`: the search chooses the intra-stage strategies on the meshes the
pipeline implies (stage axis outermost). Not a test: it prints a table.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import shardc
from bench.gpt import ScanGPT, make_train_step
from bench.zoo_models import _abstract, _unbox
from shardc.pipeline import Pipeline
from shardc.sim import as_topology

SIZES = {"full": dict(layers=12, batch=8, seq=512, vocab=32768, d=6144, heads=48),
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


def configs(devices: int, layers: int, batch: int):
    for stages in (2, 4, 8):
        if layers % stages or devices % stages:
            continue
        for shards in (1, 2, 4):
            if devices % (stages * shards):
                continue
            for micro in (stages, 2 * stages, 4 * stages, 8 * stages):
                if micro > batch or batch % micro or (batch // micro) % shards:
                    continue
                for schedule in ("gpipe", "1f1b"):
                    yield Pipeline(stages, micro, schedule, data=("data",) if shards > 1 else (), shards=shards)
                if micro == stages and layers % (2 * stages) == 0:
                    yield Pipeline(stages, micro, "circular", repeats=2, data=("data",) if shards > 1 else (),
                                   shards=shards)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", default="full", choices=sorted(SIZES))
    ap.add_argument("--topology", default="h100-sxm-8x8")
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--only", default="", help="comma-separated indices of the configs to run")
    ap.add_argument("--unpipelined", action="store_true", help="also search without a pipeline (and list the "
                                                                "baselines it scored)")
    a = ap.parse_args()
    n = as_topology(a.topology).num_devices
    step, args = build(a.scale, max(1, n // 8))  # weak scaling, as bench/zoo.py
    if a.unpipelined:
        t = time.time()
        plan = shardc.plan_for(step, *args, topology=a.topology, budget_s=a.budget, donate_argnums=(0, 1))
        print(f"unpipelined search: {dict(plan.mesh_sizes)} {plan.cost.step_time * 1e3:.2f} ms, "
              f"peak {plan.cost.peak_memory / 2**30:.1f} GiB ({time.time() - t:.0f} s)")
        for c in plan.search.baselines:
            print(f"  baseline {c.name} {c.mesh} {c.score.time * 1e3:.2f} ms feasible={c.score.feasible} "
                  f"peak {c.score.peak / 2**30:.1f} GiB")
    cfgs = list(configs(n, SIZES[a.scale]["layers"], SIZES[a.scale]["batch"] * max(1, n // 8)))
    pick = {int(i) for i in a.only.split(",") if i} or set(range(len(cfgs)))
    print("| # | pipeline | mesh | step | bubble | boundary | peak | plan time |")
    print("|---|---|---|---|---|---|---|---|")
    for i, p in enumerate(cfgs):
        if i not in pick:
            continue
        t = time.time()
        try:
            plan = shardc.plan_for(step, *args, topology=a.topology, pipeline=p, budget_s=a.budget,
                                   donate_argnums=(0, 1), remat=False)
        except shardc.ShardingError as e:
            print(f"| {i} | {p.describe()} | – | error: {str(e).splitlines()[0][:120]} |")
            continue
        c, pc = plan.cost, plan.cost.pipeline
        fits = "" if c.fits else " (OOM)"
        print(f"| {i} | {p.schedule} S={p.stages} M={p.microbatches} R={p.repeats} data={p.shards} | "
              f"{dict(plan.mesh_sizes)} | {c.step_time * 1e3:.2f} ms{fits} | {pc.bubble_s * 1e3:.1f} ms | "
              f"{pc.boundary_bytes / 2**20:.1f} MiB, {pc.boundary_s * 1e3:.2f} ms | {c.peak_memory / 2**30:.1f} GiB | "
              f"{time.time() - t:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
