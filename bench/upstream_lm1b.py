"""Benchmark: the Flax project's own lm1b example, run as its authors run it and under @shardc.auto.

    git clone https://github.com/google/flax /path/to/flax
    python -m bench.upstream_lm1b --flax /path/to/flax [--meshes 1,8,1:1,4,2:2,4,1] [--rounds 8] [--write]

Code nobody here wrote: `examples/lm1b/{train,models,utils}.py` and `configs/default.py` are imported from a
checkout of google/flax, unmodified. Their `train_step` (TransformerLM, dropout, AdamW with a schedule, a
`TrainState`) is compiled three ways on the 8 CPU devices, for each `ici_{data,fsdp,tensor}_parallelism`:

* `jax.jit` exactly as `train.py` does it: `in_shardings=(state_mesh_annotations, data_sharding, None)`,
  `out_shardings`, `static_argnums=(2, 3, 4)`, `donate_argnums=0`, the shardings from
  `utils.setup_initial_state` (`nn.logical_to_mesh_sharding` of the logical axis rules);
* `@shardc.auto` with the same `in_shardings` / `out_shardings` and `rules=config.logical_axis_rules`;
* `@shardc.auto` with nothing but the static and donated arguments (the state arrives committed to the
  authors' mesh);
* with `--pcg`, also `@shardc.auto(pcg=True)` bare: the searched meshes' plans rewritten by the proved rules
  (issue 18); its `shardc.check` column says what the rewriting chose.

Reported: loss and metrics after 3 steps, the largest parameter difference from `jax.jit` (AdamW turns a
rounding-level sign flip of a near-zero gradient into a move of up to 2 lr per step), the compiled collectives,
`shardc.check` of each shardc plan (its simulated collective bytes, FLOPs and memory against the compiled
program: "exact", "within bounds" or what is out, then the peak memory predicted / compiled), the simulated step
of each shardc plan, and the step times measured round-robin in one process (median and fastest; ratio to
`jax.jit`). The model is shrunk to run here (2 layers, d 256, vocab 2048, 32 x 128 tokens) and computes in
float32. Modules the train step does not use (the TFDS input pipeline, CLU writers, TensorFlow) are replaced
by empty stand-ins so that `train.py` imports without them.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import os
import re
import sys
import time
import types
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import shardc  # noqa: E402
from bench.propagate import write_section  # noqa: E402

KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


class _ConfigDict(dict):
    """The part of ml_collections.ConfigDict the example's config uses (attribute access, replace)."""

    __getattr__ = dict.__getitem__

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def replace(self, **kw: Any) -> "_ConfigDict":
        return _ConfigDict({**self, **kw})


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def import_example(flax_root: str) -> tuple[Any, Any, Any, Any]:
    """The example's train, models, utils and configs.default modules, from a google/flax checkout."""
    example = os.path.join(flax_root, "examples", "lm1b")
    if not os.path.exists(os.path.join(example, "train.py")):
        raise SystemExit(f"no examples/lm1b/train.py under {flax_root}: pass --flax a checkout of google/flax")
    import flax.io  # noqa: F401  (decides now that TensorFlow is absent, before the stand-in exists)

    metric_writers, periodic_actions = _stub("clu.metric_writers"), _stub("clu.periodic_actions")
    _stub("clu", metric_writers=metric_writers, periodic_actions=periodic_actions)
    _stub("tensorflow", data=types.SimpleNamespace(Dataset=object))
    _stub("input_pipeline")
    if "ml_collections" not in sys.modules:
        try:
            import ml_collections  # noqa: F401
        except ImportError:
            _stub("ml_collections", ConfigDict=_ConfigDict)
    sys.path.insert(0, example)
    import train  # noqa: E402
    import models  # noqa: E402
    import utils  # noqa: E402
    from configs import default  # noqa: E402
    return train, models, utils, default


def collectives(hlo: str) -> dict[str, int]:
    return {k: sum(1 for line in hlo.splitlines() if re.search(rf" {k}(-start)?\(", line) and " = " in line)
            for k in KINDS}


def run_mesh(mods: tuple, ici: tuple[int, int, int], rounds: int, pcg: bool = False) -> dict[str, Any]:
    train, models, utils, default = mods
    cfg = default.get_config()
    cfg.update(vocab_size=2048, per_device_batch_size=4, max_target_length=128, num_layers=2, qkv_dim=256,
               emb_dim=256, mlp_dim=1024, num_heads=8, use_bfloat16=False, ici_data_parallelism=ici[0],
               ici_fsdp_parallelism=ici[1], ici_tensor_parallelism=ici[2])
    tc = models.TransformerConfig(vocab_size=cfg.vocab_size, output_vocab_size=cfg.vocab_size, emb_dim=cfg.emb_dim,
                                  num_heads=cfg.num_heads, num_layers=cfg.num_layers, qkv_dim=cfg.qkv_dim,
                                  mlp_dim=cfg.mlp_dim, max_len=cfg.max_target_length, deterministic=False)
    mesh = Mesh(utils.create_device_mesh(cfg), cfg.mesh_axes)
    lr_fn = train.create_learning_rate_schedule(learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps)
    tx = optax.adamw(lr_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=cfg.weight_decay)
    batch_size = cfg.per_device_batch_size * jax.device_count()
    cfg.per_device_batch_size = batch_size  # init_train_state traces the model at this batch
    state, annotations = utils.setup_initial_state(models.TransformerLM(tc.replace(deterministic=True)), tx, cfg,
                                                   jax.random.key(0), mesh)
    data_sharding = NamedSharding(mesh, P(cfg.data_sharding))
    tokens = jax.random.randint(jax.random.key(1), (batch_size, cfg.max_target_length), 1, cfg.vocab_size)
    batch = {"inputs": jax.device_put(tokens, data_sharding)}
    rng = jax.random.key(2)
    args = (batch, tc, lr_fn, 0.0, rng)

    steps = {
        "jax.jit (authors)": jax.jit(train.train_step, in_shardings=(annotations, data_sharding, None),
                                     out_shardings=(annotations, None), static_argnums=(2, 3, 4), donate_argnums=0),
        "@shardc.auto, same shardings": shardc.auto(
            train.train_step, mesh=mesh, in_shardings=(annotations, data_sharding, None),
            out_shardings=(annotations, None), static_argnums=(2, 3, 4), donate_argnums=0,
            rules=cfg.logical_axis_rules),
        "@shardc.auto, bare": shardc.auto(train.train_step, static_argnums=(2, 3, 4), donate_argnums=0),
    }
    if pcg:
        steps["@shardc.auto(pcg=True), bare"] = shardc.auto(train.train_step, static_argnums=(2, 3, 4),
                                                            donate_argnums=0, pcg=True)
    out: dict[str, Any] = {"mesh": dict(mesh.shape), "rows": {}}
    states = {}
    for name, f in steps.items():
        s = jax.tree.map(lambda a: a.copy() if hasattr(a, "copy") else a, state)
        for _ in range(3):
            s, metrics = f(s, *args)
        jax.block_until_ready(s)
        row = out["rows"][name] = {"loss": float(metrics["loss"]), "params": jax.tree.map(np.asarray, s.params)}
        if name.startswith("@shardc"):
            plan = f.plan(s, *args)
            row["plan mesh"] = dict(plan.mesh_sizes)
            row["simulated"] = shardc.simulate(plan, shardc.Topology.preset("cpu-host")).step_time
            rep = shardc.check(plan)  # the plan is what runs: compiled vs simulated
            mem = rep.row("peak memory bytes")
            row["check"] = f"{rep.summary()} (peak {mem.predicted / 2**20:.2f} / {mem.compiled / 2**20:.2f} MiB)"
            if plan.pcg is not None:  # (what the rewriting chose; its collectives are the compiled ones below)
                ch = plan.pcg
                row["check"] = (f"rewritten PCG runs: {len(ch.steps)} rewrites, {ch.gain:.3f}x" if ch.chosen else
                                f"plan runs ({len(ch.steps)} rewrites kept, PCG {ch.time * 1e3:.0f} ms, plan "
                                f"{ch.plan_time * 1e3:.0f} ms); " + row["check"])
        row["collectives"] = collectives(f.lower(s, *args).compile().as_text())
        row["times"] = []
        states[name] = s
        print(f"  {name}: 3 steps, loss {row['loss']:.6f}", flush=True)
    ref = out["rows"]["jax.jit (authors)"]["params"]
    for row in out["rows"].values():
        row["max abs diff"] = max(float(np.max(np.abs(a - b))) for a, b in
                                  zip(jax.tree.leaves(row.pop("params")), jax.tree.leaves(ref)))
    for _ in range(rounds):  # round robin: a busy moment on the machine hits every variant alike
        for name, f in steps.items():
            t0 = time.perf_counter()
            states[name], metrics = f(states[name], *args)
            jax.block_until_ready(metrics)
            out["rows"][name]["times"].append(time.perf_counter() - t0)
    out["lr"] = float(lr_fn(2))
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| mesh (data, fsdp, tensor) | variant | plan mesh | loss after 3 steps | max abs param diff | "
             "collectives (AR/AG/A2A/CP) | shardc.check | simulated | median step | fastest | vs jax.jit (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        base = float(np.median(res["rows"]["jax.jit (authors)"]["times"]))
        mesh = "x".join(str(v) for v in res["mesh"].values())
        for name, row in res["rows"].items():
            c = row["collectives"]
            counts = "/".join(str(c[k]) for k in KINDS[:4])
            plan_mesh = "x".join(f"{a}{n}" for a, n in row["plan mesh"].items() if n > 1) if "plan mesh" in row else "-"
            sim = f"{row['simulated'] * 1e3:.0f} ms" if "simulated" in row else "-"
            med, fast = float(np.median(row["times"])), min(row["times"])
            lines.append(f"| {mesh} | {name} | {plan_mesh} | {row['loss']:.6f} | {row['max abs diff']:.1e} | {counts} | "
                         f"{row.get('check', '-')} | {sim} | {med * 1e3:.0f} ms | {fast * 1e3:.0f} ms | "
                         f"{med / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--flax", required=True, help="a checkout of https://github.com/google/flax")
    ap.add_argument("--meshes", default="1,8,1:1,4,2:2,4,1",
                    help="ici data,fsdp,tensor parallelism of each run, colon-separated")
    ap.add_argument("--rounds", type=int, default=8, help="timed steps per variant, round robin")
    ap.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    ap.add_argument("--pcg", action="store_true", help="also @shardc.auto(pcg=True) bare (issue 18)")
    args = ap.parse_args()
    mods = import_example(args.flax)
    results = []
    for spec in args.meshes.split(":"):
        ici = tuple(int(x) for x in spec.split(","))
        print(f"mesh data,fsdp,tensor = {ici}", flush=True)
        results.append(run_mesh(mods, ici, args.rounds, args.pcg))
    text = table(results)
    print(text)
    if args.write:
        import subprocess

        commit = subprocess.run(["git", "-C", args.flax, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "?"
        write_section("upstream_lm1b", f"`python -m bench.upstream_lm1b --flax <google/flax checkout> --rounds "
                      f"{args.rounds}{' --pcg' if args.pcg else ''}` (google/flax at {commit}, its `examples/lm1b` train step unmodified, shrunk "
                      f"config; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end, jax "
                      f"{jax.__version__}). AdamW at lr {results[0]['lr']:.1e}: a parameter difference up to "
                      f"{6 * results[0]['lr']:.1e} after 3 steps is a rounding-level sign flip of a near-zero "
                      "gradient.\n\n" + text)


if __name__ == "__main__":
    main()
