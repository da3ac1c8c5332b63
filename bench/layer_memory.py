"""Peak memory of single Flax layers' train steps at MiB scale: the memory model against XLA:CPU.

The zoo models of `bench/fidelity.py` run at a scale where most per-device buffers are a few hundred KiB. Here
each common layer (flax.linen's own Dense, LayerNorm, RMSNorm, Embed, Dropout; attention written as a Flax
user writes it) takes batches of 8 and 16 sequences of 128 tokens of width 256, so that replicated its
activations are 1-8 MiB per device, larger than a CPU's L2 cache, and data parallel (the batch split over
8 devices) they are 8x smaller. The step is `jax.value_and_grad` of a squared-output loss and an SGD update; `shardc.check` compares the
plan's simulated peak memory per device with `memory_analysis()` (argument + output + temp - alias) of the
program shardc compiles.

    python -m bench.layer_memory [--layers "gated mlp,attention"] [--batches 8,16] [--write]

A row is within bounds when memory is within 10% (issue 15's bound). What XLA does in the rows outside is in
docs/simulator.md ("What is not modelled, or not yet checked").
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardc  # noqa: E402

MEMORY_BOUND = 0.10
SEQ, WIDTH, VOCAB = 128, 256, 1024


class Attention(nn.Module):
    """Multi-head self-attention with a fused QKV projection (8 heads), optionally causal."""

    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        qkv = nn.Dense(3 * d)(x).reshape(b, t, 3, 8, d // 8)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // 8)
        if self.causal:
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        return nn.Dense(d)(o)


class GeluMlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(x)))


class GatedMlp(nn.Module):
    """A SiLU-gated MLP (the GLU of Llama-style models)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        return nn.Dense(d)(nn.silu(nn.Dense(2 * d)(x)) * nn.Dense(2 * d)(x))


class PreLnBlock(nn.Module):
    """A pre-LayerNorm Transformer block, optionally with dropout on the attention branch."""

    dropout: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + Attention()(nn.LayerNorm()(x))
        if self.dropout:
            h = nn.Dropout(0.1, deterministic=False)(h)
        return h + GeluMlp()(nn.LayerNorm()(h))


class RmsDense(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(x.shape[-1])(nn.RMSNorm()(x))


class TiedEmbedding(nn.Module):
    """An embedding whose table also gives the logits (`Embed.attend`), as tied-embedding LMs do."""

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, WIDTH)
        return embed.attend(nn.LayerNorm()(embed(ids)))


# name -> (module factory, takes token ids)
LAYERS: dict[str, tuple[Callable[[], nn.Module], bool]] = {
    "layernorm+dense": (lambda: nn.Sequential([nn.LayerNorm(), nn.Dense(WIDTH)]), False),
    "rmsnorm+dense": (RmsDense, False),
    "gelu mlp": (GeluMlp, False),
    "gated mlp": (GatedMlp, False),
    "causal attention": (Attention, False),
    "attention": (lambda: Attention(causal=False), False),
    "pre-ln block": (PreLnBlock, False),
    "pre-ln block + dropout": (lambda: PreLnBlock(dropout=True), False),
    "tied embedding": (TiedEmbedding, True),
}


def train_step(model: nn.Module, ids: bool, data_parallel: bool) -> Callable:
    """value_and_grad of the layer's loss and an SGD update; the batch split over `x` when `data_parallel`."""
    def loss(params, x, key):
        out = model.apply(params, x, rngs={"dropout": key})
        return -jnp.mean(jax.nn.log_softmax(out)[..., 0]) if ids else jnp.mean(out ** 2)

    def step(params, x, key):
        if data_parallel:
            x = shardc.split(x, 0, "x")
        value, grads = jax.value_and_grad(loss)(params, x, key)
        return value, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    return step


Row = tuple[str, int, str, float, float]  # (layer, batch, plan, predicted, compiled peak memory bytes per device)


def measure(name: str, batch: int) -> list[Row]:
    """The replicated and the data-parallel step of layer `name` on `batch` sequences."""
    make, ids = LAYERS[name]
    model = make()
    x = (jnp.arange(batch * SEQ).reshape(batch, SEQ) % VOCAB) if ids else jnp.ones((batch, SEQ, WIDTH))
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    mesh = shardc.make_mesh({"x": 8})
    rows = []
    for data_parallel in (False, True):
        step = shardc.auto(train_step(model, ids, data_parallel), mesh=mesh, search=False)
        row = shardc.check(step, params, x, jax.random.key(2)).row("peak memory bytes")
        rows.append((name, batch, "data parallel" if data_parallel else "replicated", row.predicted, row.compiled))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| layer | batch | plan | memory MiB predicted / compiled | error | within 10% |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, batch, plan, p, c in rows:
        err = p / c - 1
        lines.append(f"| {name} | {batch} x {SEQ} | {plan} | {p / 2**20:.2f} / {c / 2**20:.2f} | {100 * err:+.1f}% | "
                     f"{'yes' if abs(err) <= MEMORY_BOUND else '**no**'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default=",".join(LAYERS), help="comma-separated names of LAYERS")
    ap.add_argument("--batches", default="8,16", help="comma-separated batch sizes (sequences of 128 tokens)")
    ap.add_argument("--write", action="store_true", help="put the table in docs/benchmarks.md")
    o = ap.parse_args()
    unknown = [n for n in o.layers.split(",") if n not in LAYERS]
    if unknown:
        ap.error(f"unknown layers {unknown}; known: {', '.join(LAYERS)}")
    t0 = time.perf_counter()
    rows = []
    for name in o.layers.split(","):
        for batch in map(int, o.batches.split(",")):
            got = measure(name, batch)
            rows += got
            for _, _, plan, p, c in got:
                print(f"{name:24s} {batch:3d} {plan:14s} {p / c:6.3f} ({p:,.0f} / {c:,.0f})", flush=True)
    text = table(rows)
    inside = sum(abs(p / c - 1) <= MEMORY_BOUND for *_, p, c in rows)
    print(text)
    print(f"{inside} of {len(rows)} within 10%, {time.perf_counter() - t0:.0f} s")
    if o.write:
        from bench.propagate import write_section

        write_section("layer_memory", f"`python -m bench.layer_memory` (8 CPU devices, jax {jax.__version__}; "
                      f"sequences of {SEQ} tokens of width {WIDTH}; peak memory per device, `shardc.check` against "
                      "`memory_analysis()`): **" f"{inside} of {len(rows)} within 10%**.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
