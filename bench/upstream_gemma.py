"""Benchmark: the Flax project's own NNX Gemma example, run as its authors run it and under @shardc.auto.

    git clone https://github.com/google/flax /path/to/flax
    python -m bench.upstream_gemma --flax /path/to/flax [--meshes 8,1:4,2] [--rounds 8] [--write]

Code nobody here wrote: `examples/gemma/{train,transformer,modules,layers,...}.py` and `configs/tiny.py` are
imported from a checkout of google/flax, unmodified. Their `jax_train_step` (the Gemma Transformer in NNX,
dropout, AdamW with a schedule, `nnx.capture` of intermediates, an `nnx.MultiMetric`) is compiled three ways
on the 8 CPU devices, for each `(fsdp, tensor)` parallelism:

* `jax.jit` exactly as `train.py` does it: `static_argnames=("label_smoothing", "pad_id")`,
  `donate_argnames=("model", "optimizer")`, called under `jax.set_mesh(mesh)` on the example's mesh
  (`jax.make_mesh`: Explicit axes) with the parameters created there from the example's `ShardingConfig`
  (`fsdp_tp_sharding`: `out_sharding` metadata on every kernel, `out_sharding=` on the activations), and the
  returned state written back with `nnx.update`, as the training loop does;
* `@shardc.auto` with the same options and call, `search=False` (the authors' shardings, propagated);
* `@shardc.auto` with the same options and call, its default search.

Reported: loss and metrics after 3 steps, the largest parameter difference from `jax.jit` relative to the
parameter's scale (AdamW turns a rounding-level sign flip of a near-zero gradient into a move of up to 2 lr
per step), the compiled collectives, `shardc.check` of each shardc plan (simulated collective bytes, FLOPs
and memory against the compiled program), the simulated step of each shardc plan, and the step times measured
round-robin in one process (median and fastest; ratio to `jax.jit`). The model is `configs/tiny.py`'s
(4 layers, d 256, 4 heads of 128, one KV head) with a 2048-token vocabulary, 32 x 128 tokens, float32
activations. Modules the train step does not use (the grain/TF input pipelines, CLU writers, SentencePiece,
jaxtyping's annotations) are replaced by empty stand-ins so that `train.py` imports without them.
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
from jax.sharding import NamedSharding  # noqa: E402

import shardc  # noqa: E402
from bench.propagate import write_section  # noqa: E402

KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def import_example(flax_root: str) -> tuple[Any, ...]:
    """The example's train, transformer, transformer_cfg, sow_lib and configs.tiny modules, from a checkout."""
    example = os.path.join(flax_root, "examples", "gemma")
    if not os.path.exists(os.path.join(example, "train.py")):
        raise SystemExit(f"no examples/gemma/train.py under {flax_root}: pass --flax a checkout of google/flax")
    metric_writers, periodic_actions = _stub("clu.metric_writers"), _stub("clu.periodic_actions")
    _stub("clu", metric_writers=metric_writers, periodic_actions=periodic_actions)
    _stub("grain", IterDataset=object)
    _stub("sentencepiece", SentencePieceProcessor=object, SentencePieceTrainer=object)
    if "jaxtyping" not in sys.modules:
        try:
            import jaxtyping  # noqa: F401
        except ImportError:
            _stub("jaxtyping", Array=jax.Array)
    sys.path.insert(0, example)
    import train  # noqa: E402
    import transformer  # noqa: E402
    import transformer_cfg  # noqa: E402
    import sow_lib  # noqa: E402
    from configs import tiny  # noqa: E402
    return train, transformer, transformer_cfg, sow_lib, tiny


def collectives(hlo: str) -> dict[str, int]:
    return {k: sum(1 for line in hlo.splitlines() if re.search(rf" {k}(-start)?\(", line) and " = " in line)
            for k in KINDS}


def build(mods: tuple, par: tuple[int, int], vocab: int, batch_size: int, length: int) -> dict[str, Any]:
    """The example's mesh, model, optimizer, rngs, metrics and a batch, made as `train_and_evaluate` makes them."""
    from flax import nnx

    train, transformer_lib, transformer_cfg, sow_lib, tiny = mods
    config = tiny.get_config().replace(vocab_size=vocab, use_bfloat16=False, fsdp_parallelism=par[0],
                                       tensor_parallelism=par[1])
    mesh = jax.make_mesh(config.get_mesh_shape(len(jax.devices())), config.mesh_axes)
    data_sharding = NamedSharding(mesh, jax.P(config.data_sharding))
    shd_config = transformer_cfg.ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp",
                                                                 tensor_parallel_axis_name="tensor")
    model_config = transformer_lib.TransformerConfig.from_dict(**config.transformer_params, num_embed=vocab,
                                                               dtype=jax.numpy.float32, shd_config=shd_config)
    lr_fn = train.create_learning_rate_schedule(learning_rate=config.learning_rate,
                                                warmup_steps=config.warmup_steps)
    rngs = nnx.Rngs(params=config.seed, dropout=config.seed)
    with jax.set_mesh(mesh):
        model = transformer_lib.Transformer(model_config, rngs=rngs, sow_config=sow_lib.SowConfig(**config.sow_config))
        optimizer = nnx.Optimizer(model, tx=optax.adamw(lr_fn, b1=0.9, b2=0.98, eps=1e-9,
                                                        weight_decay=config.weight_decay), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    tokens = jax.random.randint(jax.random.key(1), (batch_size, length + 1), 0, vocab)
    # packed examples as the example's grain pipeline makes them: two sequences per row, then padding
    cut, pad = length // 3, length - 8
    pos = np.arange(length)
    positions = np.where(pos < cut, pos, pos - cut) * (pos < pad)
    segments = np.where(pos < cut, 1, 2) * (pos < pad)
    tokens = tokens.at[:, pad:].set(0)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "inputs_position": np.broadcast_to(positions, (batch_size, length)),
             "inputs_segmentation": np.broadcast_to(segments, (batch_size, length))}
    batch = {k: jax.device_put(jax.numpy.asarray(v, jax.numpy.int32), data_sharding) for k, v in batch.items()}
    return {"mesh": mesh, "model": model, "optimizer": optimizer, "rngs": rngs, "metrics": metrics,
            "batch": batch, "lr_fn": lr_fn, "config": config}


def steps(train: Any, config: Any) -> dict[str, Any]:
    """The example's train step, jitted as `train_and_evaluate` jits it, and under @shardc.auto."""
    import functools

    step = functools.partial(train.jax_train_step, with_capture=config.sow_config is not None)
    opts = dict(static_argnames=("label_smoothing", "pad_id"), donate_argnames=("model", "optimizer"))
    return {"jax.jit (authors)": jax.jit(step, **opts),
            "@shardc.auto, search=False": shardc.auto(step, search=False, **opts),
            "@shardc.auto (search)": shardc.auto(step, **opts)}


def call(f: Any, s: dict[str, Any]) -> Any:
    """One training-loop step as `train_and_evaluate` runs it (under `jax.set_mesh`, the state written back)."""
    from flax import nnx

    with jax.set_mesh(s["mesh"]):
        out = f(s["model"], s["optimizer"], s["rngs"], s["batch"], s["metrics"], 0.0, 0)
        if isinstance(out, tuple):
            updates, _ = out
            nnx.update((s["model"], s["optimizer"], s["rngs"], s["metrics"]), updates)
    return out


def lowered(f: Any, s: dict[str, Any]) -> Any:
    with jax.set_mesh(s["mesh"]):
        return f.lower(s["model"], s["optimizer"], s["rngs"], s["batch"], s["metrics"], 0.0, 0)


def run_mesh(mods: tuple, par: tuple[int, int], rounds: int, vocab: int = 2048, batch: int = 32,
             length: int = 128) -> dict[str, Any]:
    from flax import nnx

    train = mods[0]
    states = {}
    fs = None
    out: dict[str, Any] = {"rows": {}}
    for name in ("jax.jit (authors)", "@shardc.auto, search=False", "@shardc.auto (search)"):
        s = build(mods, par, vocab, batch, length)  # each variant from the same seed (the model is donated)
        fs = fs or steps(train, s["config"])
        f = fs[name]
        for _ in range(3):
            call(f, s)
        jax.block_until_ready(nnx.state(s["model"]))
        m = s["metrics"].compute()
        row = out["rows"][name] = {"loss": float(m["loss"]), "accuracy": float(m["accuracy"]),
                                   "params": [np.asarray(p) for p in jax.tree.leaves(nnx.state(s["model"], nnx.Param))],
                                   "kernel": str(s["model"].layers[0].mlp.gate_proj.kernel[...].sharding.spec)}
        if name.startswith("@shardc"):
            with jax.set_mesh(s["mesh"]):
                plan = f.plan(s["model"], s["optimizer"], s["rngs"], s["batch"], s["metrics"], 0.0, 0)
            row["plan mesh"] = dict(plan.mesh_sizes)
            row["simulated"] = shardc.simulate(plan, shardc.Topology.preset("cpu-host")).step_time
            row["check"] = shardc.check(plan).summary()  # the plan is what runs: compiled vs simulated
        row["collectives"] = collectives(lowered(f, s).compile().as_text())
        row["times"] = []
        states[name] = s
        out["mesh"] = dict(s["mesh"].shape)
        print(f"  {name}: 3 steps, loss {row['loss']:.6f}, accuracy {row['accuracy']:.6f}", flush=True)
    ref = out["rows"]["jax.jit (authors)"]["params"]
    ref_loss = out["rows"]["jax.jit (authors)"]["loss"]
    for row in out["rows"].values():
        params = row.pop("params")
        row["max abs diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(params, ref))
        row["loss rel diff"] = abs(row["loss"] - ref_loss) / abs(ref_loss)
    for _ in range(rounds):  # round robin: a busy moment on the machine hits every variant alike
        for name, f in fs.items():
            t0 = time.perf_counter()
            call(f, states[name])
            jax.block_until_ready(nnx.state(states[name]["model"]))
            out["rows"][name]["times"].append(time.perf_counter() - t0)
    out["lr"] = float(states["jax.jit (authors)"]["lr_fn"](2))
    for row in out["rows"].values():
        row["diff in lr"] = row["max abs diff"] / out["lr"]
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| mesh (fsdp, tensor) | variant | plan mesh | loss / accuracy after 3 steps | loss rel diff | "
             "max abs param diff (/ lr of step 3) | "
             "collectives (AR/AG/A2A/CP/RS) | shardc.check | simulated | median step | fastest | "
             "vs jax.jit (median, fastest) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        base = float(np.median(res["rows"]["jax.jit (authors)"]["times"]))
        base_fast = min(res["rows"]["jax.jit (authors)"]["times"])
        mesh = "x".join(str(v) for v in res["mesh"].values())
        for name, row in res["rows"].items():
            c = row["collectives"]
            counts = "/".join(str(c[k]) for k in KINDS)
            plan_mesh = "x".join(f"{a}{n}" for a, n in row["plan mesh"].items() if n > 1) if "plan mesh" in row else "-"
            sim = f"{row['simulated'] * 1e3:.0f} ms" if "simulated" in row else "-"
            med, fast = float(np.median(row["times"])), min(row["times"])
            lines.append(f"| {mesh} | {name} | {plan_mesh or '-'} | {row['loss']:.6f} / {row['accuracy']:.6f} | "
                         f"{row['loss rel diff']:.1e} | {row['max abs diff']:.1e} ({row['diff in lr']:.3f}) | "
                         f"{counts} | {row.get('check', '-')} | {sim} | "
                         f"{med * 1e3:.0f} ms | {fast * 1e3:.0f} ms | {med / base:.2f}x, {fast / base_fast:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--flax", required=True, help="a checkout of https://github.com/google/flax")
    ap.add_argument("--meshes", default="8,1:4,2", help="fsdp,tensor parallelism of each run, colon-separated")
    ap.add_argument("--rounds", type=int, default=8, help="timed steps per variant, round robin")
    ap.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    ap.add_argument("--flax-rev", default=None, help="the checkout's commit, for the record (default: git rev-parse)")
    args = ap.parse_args()
    mods = import_example(args.flax)
    results = []
    for spec in args.meshes.split(":"):
        par = tuple(int(x) for x in spec.split(","))
        print(f"mesh fsdp,tensor = {par}", flush=True)
        results.append(run_mesh(mods, par, args.rounds))
    text = table(results)
    print(text)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores")
    if args.write:
        import subprocess

        commit = args.flax_rev or subprocess.run(["git", "-C", args.flax, "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True).stdout.strip() or "?"
        write_section("upstream_gemma", f"`python -m bench.upstream_gemma --flax <google/flax checkout> --rounds "
                      f"{args.rounds}` (google/flax at {commit}, its `examples/gemma` `jax_train_step` unmodified, "
                      f"`configs/tiny.py` with a 2048-token vocabulary, 32 x 128 packed tokens, float32; "
                      f"{os.cpu_count()} cores, load average {load:.1f} at the end, jax {jax.__version__}). The "
                      f"example's mesh is `jax.make_mesh` (Explicit axes) and its step is written for explicit "
                      f"sharding (`out_sharding=` on every einsum, parameters typed by `out_sharding` metadata). "
                      f"AdamW at lr {results[0]['lr']:.1e} (warm-up): a parameter "
                      f"difference near 2 lr would be a rounding-level sign flip of a near-zero gradient; far "
                      "below one lr is float rounding. Collectives counted in the compiled HLO (all-reduce / all-gather / "
                      "all-to-all / collective-permute / reduce-scatter).\n\n" + text)


if __name__ == "__main__":
    main()
