"""Gradient accumulation under the substitution engine (partial-sum loop carries, docs/pcg.md).

A 12-layer GPT (the zoo's `gpt12` sizes, bench/gpt.py) whose train step sums the loss and the gradients of M
microbatches in a `jax.lax.scan` over the batch reshaped to [M, batch / M, ...] (as MaxText's `accumulate_gradient`
does), then takes one AdamW step. `@shardc.auto(search=True, pcg=True)` searches it and rewrites each searched
mesh's best plan; the table gives that plan's simulated step, its PCG's, and the rewritten PCG's (the one that runs
when it is faster). Simulated, so the same on any machine; planning time is this machine's.

    python -m bench.grad_accum [--topologies h100-sxm-8,h100-sxm-8x8] [--micro 4] [--budget 30] [--write]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import shardc  # noqa: E402
from bench.gpt import GPT  # noqa: E402
from bench.propagate import write_section  # noqa: E402
from bench.zoo import _trace_mesh  # noqa: E402
from bench.zoo_models import _abstract, _unbox  # noqa: E402
from shardc.sim import as_topology  # noqa: E402

LAYERS, D, HEADS, VOCAB, SEQ, BATCH = 12, 1024, 16, 32768, 1024, 16  # (the zoo's gpt12, batch per 8 devices)


def accumulating_step(model: GPT, tx: optax.GradientTransformation, micro: int):
    """The train step: loss and gradients summed over `micro` microbatches in a scan, then one optimizer step."""
    def loss_fn(params, ids):
        logits = model.apply({"params": params}, ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    def train_step(params, opt_state, ids):
        def one(acc, ids_m):
            loss, grads = jax.value_and_grad(loss_fn)(params, ids_m)
            return (acc[0] + loss, jax.tree.map(jnp.add, acc[1], grads)), None

        init = (0.0, jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(one, init, ids.reshape(micro, -1, ids.shape[-1]))
        grads = jax.tree.map(lambda g: g / micro, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / micro

    return train_step


def run(topology: str, micro: int, budget: float) -> str:
    n = as_topology(topology).num_devices
    model = GPT(layers=LAYERS, seq=SEQ, vocab=VOCAB, d=D, heads=HEADS)
    tx = optax.adamw(1e-3)
    with jax.set_mesh(_trace_mesh()):
        params = _abstract(lambda k: model.init(k, jnp.zeros((BATCH, SEQ), jnp.int32))["params"], jax.random.key(1))
    params = _unbox(params)  # (without the Megatron metadata, as the zoo's gpt12: every strategy open to the search)
    ids = jax.ShapeDtypeStruct((BATCH * max(1, n // 8), SEQ + 1), jnp.int32)
    step = accumulating_step(model, tx, micro)
    t0 = time.perf_counter()
    af = shardc.auto(step, search=True, pcg=True, topology=topology, budget_s=budget, donate_argnums=(0, 1),
                     devices=n)
    plan = af.plan(params, _abstract(tx.init, params), ids)
    seconds = time.perf_counter() - t0
    ch = plan.pcg
    mesh = "x".join(f"{k}{v}" for k, v in plan.mesh_sizes.items())
    ms = lambda t: f"{t * 1e3:.2f} ms"  # noqa: E731
    if ch is None:
        return f"| {topology} | {micro} | {mesh} | {ms(plan.score.time)} | – | – | – | no PCG | {seconds:.0f} s |"
    rules = ", ".join(sorted({s.rule for s in ch.steps})) or "–"
    return (f"| {topology} | {micro} | {mesh} | {ms(ch.plan_time)} | {ms(ch.pcg_time)} | {ms(ch.time)} | "
            f"{ch.plan_time / ch.time:.3f}x{'' if ch.chosen else ' (the plan runs)'} | {rules} | {seconds:.0f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default="h100-sxm-8,h100-sxm-8x8")
    ap.add_argument("--micro", default="4", help="microbatch counts, comma-separated")
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    a = ap.parse_args()
    head = ("| topology | microbatches | mesh | plan | its PCG | rewritten PCG | speed | rewrites kept | planning |\n"
            "|---|---|---|---|---|---|---|---|---|")
    print(head, flush=True)
    rows = []
    for topology in a.topologies.split(","):
        for micro in (int(m) for m in a.micro.split(",")):
            rows.append(run(topology, micro, a.budget))
            print(rows[-1], flush=True)
    if a.write:
        write_section("grad_accum", f"Gradient accumulation under the substitution engine (docs/pcg.md \"Partial-sum "
                      f"loop carries\"): `python -m bench.grad_accum --topologies {a.topologies} --micro {a.micro} "
                      f"--budget {a.budget:g} --write` ({os.cpu_count()} cores, jax {jax.__version__}). A 12-layer "
                      f"GPT (d {D}, seq {SEQ}, vocab {VOCAB}, batch {BATCH} per 8 devices, AdamW) summing the loss "
                      f"and gradients of its microbatches in a scan; `@shardc.auto(search=True, pcg=True)`: the "
                      f"searched plan, its PCG, and the PCG rewritten (partial-sum carries, then the rules), "
                      f"simulated.\n\n{head}\n" + "\n".join(rows) + "\n\n")


if __name__ == "__main__":
    main()
