"""Benchmark: the Flax project's own recurrent examples (seq2seq, SST-2) under `@shardc.auto(pcg=True)`, whose
search may restructure their loops (`shardc/loops.py`), against `jax.jit` as their authors run them.

    git clone https://github.com/google/flax /path/to/flax
    python -m bench.upstream_rnn --flax /path/to/flax [--examples seq2seq,sst2] [--topology h100-sxm-8] [--write]
    python -m bench.upstream_rnn --flax /path/to/flax --measure 8

Code nobody here wrote: `examples/seq2seq/{train,models,input_pipeline}.py` (an encoder `nn.LSTMCell` under
`nn.RNN` with sequence lengths, a teacher-forced decoder that samples a token each step, Adam) and
`examples/sst2/{train,models}.py` with `configs/default.py` (a bidirectional `nn.OptimizedLSTMCell` under
`nn.transforms.scan`, word dropout and dropout, SGD with momentum and weight decay), imported from a checkout of
google/flax unmodified. Their `train_step` runs under `jax.jit` (as `train.py` compiles it) and under
`shardc.auto(search=True, pcg=True)` with the plan priced on `--topology` (8 devices) and run on the 8 CPU
devices. Reported per example: whether the search ran the restructured loops and both programs' simulated steps,
the largest difference from `jax.jit` over the new parameters and metrics (relative to each array's scale),
and `shardc.check` (the compiled program's collectives, FLOPs and memory against the plan's). The batch is
built here (seq2seq: the example's own `CharacterTable.get_batch`; SST-2: random token ids and lengths, its
TFDS pipeline not used); modules the steps do not use (CLU, TensorFlow, the SST-2 input pipeline) are stand-ins.
Each example runs in a process of its own (both name their modules `train` and `models`). `--measure ROUNDS`
times the steps instead, on this host's devices with plans priced on them (`cpu-host`): `jax.jit`,
`shardc.auto(pcg=False)` and `shardc.auto(pcg=True)`, round robin in one process (medians).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXAMPLES = ("seq2seq", "sst2")


def _stand_ins() -> None:
    import flax.io  # noqa: F401  (decides now that TensorFlow is absent, before the stand-in exists)

    from bench.upstream_lm1b import _ConfigDict, _stub

    metric_writers = _stub("clu.metric_writers")
    _stub("clu", metric_writers=metric_writers)
    _stub("tensorflow", data=types.SimpleNamespace(Dataset=object))
    tensorboard = _stub("flax.metrics.tensorboard")
    import flax.metrics

    flax.metrics.tensorboard = tensorboard
    try:
        import ml_collections  # noqa: F401
    except ImportError:
        _stub("ml_collections", ConfigDict=_ConfigDict)


def _seq2seq(example: str) -> tuple[Any, tuple, tuple]:
    """The seq2seq step, its arguments and its static argnums."""
    sys.path.insert(0, example)
    import input_pipeline
    import jax
    import train

    train.FLAGS(["upstream_rnn"])  # the example's default flags (batch 128, hidden 512)
    ctable = input_pipeline.CharacterTable("0123456789+= ")
    state = train.get_train_state(jax.random.key(0), ctable)
    batch = ctable.get_batch(train.FLAGS.batch_size)
    return train.train_step.__wrapped__, (state, batch, jax.random.key(1), ctable.eos_id), (3,)


def _sst2(example: str) -> tuple[Any, tuple, tuple]:
    """The SST-2 step and its arguments (a batch of 64 random sentences of up to 60 tokens)."""
    import numpy as np

    _stub_input_pipeline()
    sys.path.insert(0, example)
    import jax
    import jax.numpy as jnp
    import train
    from configs import default

    config = default.get_config()
    config.vocab_size = 20000
    state = train.create_train_state(jax.random.key(0), config, train.model_from_config(config))
    r = np.random.default_rng(0)
    b, length = config.batch_size, config.max_input_length
    lengths = r.integers(5, length + 1, b).astype(np.int32)
    ids = r.integers(2, config.vocab_size, (b, length)).astype(np.int32) * (np.arange(length)[None] < lengths[:, None])
    batch = {"token_ids": jnp.asarray(ids), "length": jnp.asarray(lengths),
             "label": jnp.asarray(r.integers(0, 2, b).astype(np.float32))}
    return train.train_step, (state, batch, {"dropout": jax.random.key(1)}), ()


def _stub_input_pipeline() -> None:
    from bench.upstream_lm1b import _stub

    _stub("input_pipeline")


def run_example(flax_root: str, name: str, topology: str, budget: float) -> dict[str, Any]:
    """One example's row (run in a process of its own)."""
    import jax
    import numpy as np

    import shardc

    example = os.path.join(flax_root, "examples", name)
    if not os.path.exists(os.path.join(example, "train.py")):
        raise SystemExit(f"no examples/{name}/train.py under {flax_root}: pass --flax a checkout of google/flax")
    _stand_ins()
    step, args, static = (_seq2seq if name == "seq2seq" else _sst2)(example)
    want = jax.jit(step, static_argnums=static)(*args)
    t0 = time.perf_counter()
    auto = shardc.auto(step, search=True, pcg=True, topology=topology, budget_s=budget, static_argnums=static,
                       devices=8)
    plan = auto.plan(*args)
    planning = time.perf_counter() - t0
    got = auto(*args)
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        worst = max(worst, float(np.max(np.abs(g - w), initial=0.0)) / (1.0 + float(np.max(np.abs(w), initial=0.0))))
    report = shardc.check(plan)
    loops = plan.loops
    return {"example": name, "mesh": "x".join(f"{k}{v}" for k, v in plan.mesh_sizes.items()),
            "restructured": bool(loops and loops.chosen), "time": loops.time if loops else None,
            "base_time": loops.base_time if loops else None,
            "rewrites": [r.describe().replace(os.path.abspath(flax_root) + os.sep, "") for r in loops.rewrites]
            if loops else [],
            "difference": worst, "planning_s": planning,
            "check": "; ".join(f"{r.quantity} {'ok' if r.ok else 'OUT'} ({_signed(r):+.1%})" for r in report.rows)}


def _signed(row: Any) -> float:
    """A check row's predicted over compiled, minus 1."""
    return (row.predicted - row.compiled) / row.compiled if row.compiled else 0.0


def measure_example(flax_root: str, name: str, budget: float, rounds: int) -> dict[str, Any]:
    """Measured on this host's devices (plans priced on them: `cpu-host`): the step under `jax.jit`, and under
    `shardc.auto` without and with `pcg=True`, round robin; the median of `rounds` steps each."""
    import statistics

    import jax

    import shardc

    _stand_ins()
    step, args, static = (_seq2seq if name == "seq2seq" else _sst2)(os.path.join(flax_root, "examples", name))
    runs: dict[str, Any] = {"jax.jit": jax.jit(step, static_argnums=static)}
    chosen = {}
    for pcg in (False, True):
        af = shardc.auto(step, search=True, pcg=pcg, budget_s=budget, static_argnums=static)
        plan = af.plan(*args)
        runs[f"shardc.auto(pcg={pcg})"] = af
        chosen[pcg] = (plan.loops.chosen, plan.loops.base_time / plan.loops.time) if plan.loops else (False, None)
    for f in runs.values():  # (compiled, and once more warm)
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t)
    return {"example": name, "medians": {k: statistics.median(v) for k, v in times.items()},
            "restructured": chosen[True][0], "simulated_gain": chosen[True][1]}


def measured_table(rows: list[dict[str, Any]]) -> str:
    out = ["| example | jax.jit | shardc.auto | shardc.auto(pcg=True) | pcg=True over pcg=False measured "
           "(simulated) |", "|---|---|---|---|---|"]
    for r in rows:
        m = r["medians"]
        base, new = m["shardc.auto(pcg=False)"], m["shardc.auto(pcg=True)"]
        sim = f"{r['simulated_gain']:.2f}x" if r["simulated_gain"] else "-"
        out.append(f"| {r['example']} | {m['jax.jit'] * 1e3:.1f} ms | {base * 1e3:.1f} ms | {new * 1e3:.1f} ms"
                   f"{' (restructured)' if r['restructured'] else ''} | {base / new:.2f}x ({sim}) |")
    return "\n".join(out)


def table(rows: list[dict[str, Any]], topology: str) -> str:
    ms = lambda t: f"{t * 1e3:.3f} ms" if t is not None else "-"  # noqa: E731
    out = ["| example | mesh | loops | step restructured | step as traced | largest difference to jax.jit "
           "| shardc.check | planning |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gain = f" ({r['base_time'] / r['time']:.2f}x)" if r["time"] and r["base_time"] else ""
        out.append(f"| {r['example']} | {r['mesh']} | {'restructured' if r['restructured'] else 'as traced'} | "
                   f"{ms(r['time'])}{gain} | {ms(r['base_time'])} | {r['difference']:.1e} | {r['check']} | "
                   f"{r['planning_s']:.0f} s |")
    out.append("")
    out += [f"- {r['example']}: " + "; ".join(r["rewrites"]) for r in rows if r["rewrites"]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--flax", required=True, help="a checkout of https://github.com/google/flax")
    ap.add_argument("--examples", default=",".join(EXAMPLES))
    ap.add_argument("--topology", default="h100-sxm-8", help="what the plans are priced on (8 devices)")
    ap.add_argument("--budget", type=float, default=10.0, help="the search's budget_s")
    ap.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    ap.add_argument("--measure", type=int, default=0, metavar="ROUNDS",
                    help="instead: measure each step on this host's devices (plans priced on them), ROUNDS steps "
                         "per variant round robin")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        row = measure_example(a.flax, a.child, a.budget, a.measure) if a.measure else \
            run_example(a.flax, a.child, a.topology, a.budget)
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for name in a.examples.split(","):
        if name not in EXAMPLES:
            raise SystemExit(f"unknown example {name!r}; the examples are {EXAMPLES}")
        proc = subprocess.run([sys.executable, "-m", "bench.upstream_rnn", "--flax", a.flax, "--child", name,
                               "--topology", a.topology, "--budget", str(a.budget), "--measure", str(a.measure)],
                              capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")), None)
        if line is None:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(line[4:]))
        print(f"{name}: done", flush=True)
    if a.measure:
        print(measured_table(rows))
        return
    text = table(rows, a.topology)
    print(text)
    if a.write:
        from bench.propagate import write_section

        write_section("upstream_rnn", f"`python -m bench.upstream_rnn --flax <google/flax checkout> --topology "
                      f"{a.topology} --budget {a.budget:g}` (the examples' own train steps, unmodified; plans priced "
                      f"on {a.topology}, run on the 8 CPU devices; jax {_jax_version()}):\n\n{text}\n")


def _jax_version() -> str:
    import jax

    return jax.__version__


if __name__ == "__main__":
    main()
