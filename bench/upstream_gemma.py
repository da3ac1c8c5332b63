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
per step), the compiled collectives, the simulated step of each shardc plan, and the step times measured
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


def import_example(flax_root: str) -> tuple[Any, Any, Any, Any]:
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
