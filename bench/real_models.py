"""Models written the way their authors wrote them, run as the authors run them (`jax.jit` with the shardings
their logical-axis rules give, on an 8-device mesh) and as `@shardc.auto` on the same 8 CPU devices.

* `lm`: a Transformer LM in the style of flax `examples/lm1b` (`nn.with_logical_partitioning` on every kernel,
  lm1b's logical names — `'kv'` has no rule —, `nn.with_logical_constraint` on activations, a `TrainState`,
  unboxed parameters and `nn.logical_to_mesh_sharding` for `in_shardings`), on lm1b's single-host mesh:
  `data=1, fsdp=8, tensor=1` (its `ici_fsdp_parallelism=-1`), the batch on `P('data')`.
* `resnet`: a small ResNet with BatchNorm in the style of flax `examples/imagenet` (`ResNetBlock`, `batch_stats`
  in the `TrainState`, SGD with Nesterov momentum, weight decay in the loss), data parallel as the example
  is: state replicated, batch on `P('data')` of a `data=8` mesh.
* `scan`: a MaxText-style decoder: the layers an `nn.scan` over `nn.remat` (full rematerialisation), a
  `'layers'` partition name on the stacked weights, MaxText-like rules on a `fsdp=4, tensor=2` mesh, the batch
  on `P(('data', 'fsdp'))`.

Variants per model, timed round robin in one process (median of `--steps` steps each, warmup excluded):
`jax.jit` with the authors' `in_shardings`/`out_shardings` under `jax.set_mesh` and their rules; `shardc.auto`
with its defaults and the same `rules`, `in_shardings`, `out_shardings` (the search decides what they leave
open); `shardc.auto` bare (defaults, no rules or shardings, the state not placed: the search chooses the mesh
and every layout). Also: the compiled program's collectives (`shardc.cost.hlo.collectives`) and peak memory
per device (`compiled.memory_analysis()`), the loss after 3 steps from the same state (equal numerics), and
`shardc.check` of each shardc plan (its simulated collective bytes, FLOPs and memory against the compiled program).

    python -m bench.real_models [--models lm,resnet,scan] [--steps 12] [--write]
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import shardc  # noqa: E402
from shardc.check import compiled_stats  # noqa: E402


def _logical(init: Callable, names: tuple) -> Callable:
    return nn.with_logical_partitioning(init, names)


def _xent(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    if weights is None:
        return loss.mean()
    return jnp.sum(loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)


@dataclasses.dataclass
class RealModel:
    """A model as its authors run it: the train step `step(state, batch) -> (state, loss)`, the unboxed state
    placed in the authors' layout, the batch, the mesh, the logical rules, and the authors' shardings."""

    name: str
    description: str
    step: Callable
    state: Any
    batch: dict
    mesh: jax.sharding.Mesh
    rules: tuple
    state_shardings: Any
    batch_sharding: Any


def _create(model_init: Callable, tx: optax.GradientTransformation, apply_fn: Callable, mesh, rules,
            state_cls=train_state.TrainState) -> tuple[Any, Any]:
    """The Flax examples' way: the state's shape with its boxed metadata, the shardings Flax computes from it
    (`nn.logical_to_mesh_sharding`), and the unboxed state created straight into them."""
    def create(key):
        variables = model_init(key)
        extra = {k: v for k, v in variables.items() if k != "params"}
        return state_cls.create(apply_fn=apply_fn, params=variables["params"], tx=tx, **extra)

    abstract = jax.eval_shape(create, jax.random.key(0))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: nn.meta.unbox(create(k)), out_shardings=shardings)(jax.random.key(0))
    return state, shardings


# ---------------------------------------------------------------- lm1b-style Transformer LM ------------------

LM_RULES = (  # lm1b's (MaxText-derived) rules; 'kv' has none
    ("activation_batch", ("data", "fsdp")), ("activation_length", None), ("activation_embed", "tensor"),
    ("activation_mlp", "tensor"), ("activation_heads", "tensor"), ("activation_kv", None),
    ("activation_vocab", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"),
)


@dataclasses.dataclass(frozen=True)
class LmConfig:
    vocab: int = 1024
    emb: int = 256
    heads: int = 8  # (lm1b's; the output projection's heads dim takes the 'embed' -> fsdp=8 rule)
    mlp: int = 1024
    layers: int = 2
    max_len: int = 64


class LmBlock(nn.Module):
    cfg: LmConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        c = self.cfg
        init, bias = nn.initializers.xavier_uniform(), nn.initializers.normal(1e-6)
        norm = functools.partial(nn.LayerNorm, bias_init=_logical(nn.initializers.zeros, ("embed",)),
                                 scale_init=_logical(nn.initializers.ones, ("embed",)))
        x = nn.with_logical_constraint(x, ("activation_batch", "activation_length", "activation_embed"))
        h = nn.SelfAttention(num_heads=c.heads, qkv_features=c.emb, use_bias=False, deterministic=True,
                             kernel_init=_logical(init, ("embed", "kv")))(norm()(x), mask)
        x = x + h
        h = nn.Dense(c.mlp, kernel_init=_logical(init, ("embed", "mlp")), bias_init=_logical(bias, ("mlp",)))(norm()(x))
        h = nn.with_logical_constraint(nn.relu(h), ("activation_batch", "activation_length", "activation_mlp"))
        h = nn.Dense(c.emb, kernel_init=_logical(init, ("mlp", "embed")), bias_init=_logical(bias, ("embed",)))(h)
        return x + h


class TransformerLM(nn.Module):
    cfg: LmConfig

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        c = self.cfg
        mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs))
        y = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]  # shift right, as lm1b's shift_inputs
        y = nn.Embed(c.vocab, c.emb, embedding_init=_logical(nn.initializers.normal(1.0), ("vocab", "embed")))(y)
        pos = self.param("pos", _logical(nn.initializers.normal(0.02), (None, "embed")), (c.max_len, c.emb))
        y = y + pos[None, : y.shape[1]]
        for i in range(c.layers):
            y = LmBlock(c, name=f"block_{i}")(y, mask)
        y = nn.LayerNorm(bias_init=_logical(nn.initializers.zeros, ("embed",)),
                         scale_init=_logical(nn.initializers.ones, ("embed",)))(y)
        logits = nn.Dense(c.vocab, kernel_init=_logical(nn.initializers.xavier_uniform(), ("embed", "vocab")),
                          bias_init=_logical(nn.initializers.normal(1e-6), ("vocab",)))(y)
        return nn.with_logical_constraint(logits, ("activation_batch", "activation_length", "activation_vocab"))


def lm(batch: int = 32, cfg: LmConfig = LmConfig()) -> RealModel:
    mesh = shardc.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
    model = TransformerLM(cfg)
    tokens = jax.random.randint(jax.random.key(1), (batch, cfg.max_len), 1, cfg.vocab)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 1000)
    tx = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    with jax.set_mesh(mesh):
        state, shardings = _create(lambda k: model.init(k, tokens), tx, model.apply, mesh, LM_RULES)

    def train_step(state, batch):
        inputs = batch["inputs"]

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs)
            return _xent(logits, inputs, (inputs > 0).astype(jnp.float32))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return RealModel("lm", f"lm1b-style Transformer LM, {cfg.layers} layers, d {cfg.emb}, mlp {cfg.mlp}, vocab "
                     f"{cfg.vocab}, batch {batch}x{cfg.max_len}, AdamW", train_step, state, {"inputs": tokens},
                     mesh, LM_RULES, shardings, NamedSharding(mesh, P("data")))


# ---------------------------------------------------------------- imagenet-style ResNet ----------------------


class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 16

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        x = nn.relu(norm(name="bn_init")(conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)],
                                              name="conv_init")(x)))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, conv=conv, norm=norm, act=nn.relu, strides=strides)(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class BNTrainState(train_state.TrainState):
    batch_stats: Any = None


def resnet(batch: int = 64, image: int = 32, classes: int = 10) -> RealModel:
    mesh = shardc.make_mesh({"data": 8})
    model = ResNet(stage_sizes=(2, 2, 2, 2), num_classes=classes)
    images = jax.random.normal(jax.random.key(1), (batch, image, image, 3))
    labels = jax.random.randint(jax.random.key(2), (batch,), 0, classes)
    tx = optax.sgd(optax.cosine_decay_schedule(0.1, 1000), momentum=0.9, nesterov=True)
    state, _ = _create(lambda k: model.init(k, images[:1], train=False), tx, model.apply, mesh, (), BNTrainState)
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()), state)  # the example replicates the state
    state = jax.device_put(state, replicated)

    def train_step(state, batch):
        def loss_fn(params):
            logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                     batch["image"], mutable=["batch_stats"])
            decay = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
            return _xent(logits, batch["label"]) + 1e-4 * 0.5 * decay, new_model_state

        (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"]), loss

    return RealModel("resnet", f"imagenet-style ResNet-18 (16 filters), BatchNorm, {image}x{image} images, batch "
                     f"{batch}, SGD Nesterov", train_step, state, {"image": images, "label": labels}, mesh, (),
                     replicated, NamedSharding(mesh, P("data")))


# ---------------------------------------------------------------- MaxText-style scan + remat stack -----------

SCAN_RULES = (
    ("activation_batch", ("data", "fsdp")), ("activation_length", None), ("activation_embed", "tensor"),
    ("activation_mlp", "tensor"), ("activation_heads", "tensor"), ("activation_kv", None), ("embed", "fsdp"),
    ("mlp", "tensor"), ("heads", "tensor"), ("kv", None), ("vocab", "tensor"), ("layers", None), ("norm", None),
)


class DecoderLayer(nn.Module):
    emb: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        hd = self.emb // self.heads
        init = nn.initializers.lecun_normal()
        acts = ("activation_batch", "activation_length", "activation_embed")
        x = nn.with_logical_constraint(x, acts)
        h = nn.RMSNorm(scale_init=_logical(nn.initializers.ones, ("norm",)))(x)
        # (MaxText's own DenseGeneral: the kernel is a param of its N-d shape, applied by a contraction)
        qkv = [jnp.einsum("bte,ehd->bthd", h, self.param(n, _logical(init, ("embed", "heads", "kv")),
                                                          (self.emb, self.heads, hd))) for n in ("query", "key", "value")]
        q, k, v = (nn.with_logical_constraint(t, ("activation_batch", "activation_length", "activation_heads",
                                                  "activation_kv")) for t in qkv)
        t = x.shape[1]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(x.dtype)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
        x = x + jnp.einsum("bthd,hde->bte", a, self.param("out", _logical(init, ("heads", "kv", "embed")),
                                                          (self.heads, hd, self.emb)))
        h = nn.RMSNorm(scale_init=_logical(nn.initializers.ones, ("norm",)))(x)
        h = nn.Dense(self.mlp, use_bias=False, kernel_init=_logical(init, ("embed", "mlp")), name="wi")(h)
        h = nn.with_logical_constraint(nn.gelu(h), ("activation_batch", "activation_length", "activation_mlp"))
        x = x + nn.Dense(self.emb, use_bias=False, kernel_init=_logical(init, ("mlp", "embed")), name="wo")(h)
        return nn.with_logical_constraint(x, acts), None


class ScannedDecoder(nn.Module):
    vocab: int = 1024
    emb: int = 256
    heads: int = 4
    mlp: int = 1024
    layers: int = 4

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.emb, embedding_init=_logical(nn.initializers.normal(1.0), ("vocab", "embed")))
        layer = nn.remat(DecoderLayer, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(self.emb, self.heads, self.mlp, name="layers")(embed(ids), None)
        x = nn.RMSNorm(scale_init=_logical(nn.initializers.ones, ("norm",)))(x)
        return embed.attend(x) / jnp.sqrt(self.emb)  # (lm1b's normalisation of logits via the embedding)


def scan(batch: int = 16, seq: int = 64) -> RealModel:
    mesh = shardc.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    model = ScannedDecoder()
    ids = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, model.vocab)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    with jax.set_mesh(mesh):
        state, shardings = _create(lambda k: model.init(k, ids[:, :-1]), tx, model.apply, mesh, SCAN_RULES)

    def train_step(state, batch):
        ids = batch["ids"]

        def loss_fn(params):
            return _xent(state.apply_fn({"params": params}, ids[:, :-1]), ids[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return RealModel("scan", f"MaxText-style decoder: nn.scan over nn.remat (full), {model.layers} layers, d "
                     f"{model.emb}, mlp {model.mlp}, batch {batch}x{seq}, AdamW", train_step, state, {"ids": ids}, mesh,
                     SCAN_RULES, shardings, NamedSharding(mesh, P(("data", "fsdp"))))


MODELS: dict[str, Callable[[], RealModel]] = {"lm": lm, "resnet": resnet, "scan": scan}

# ---------------------------------------------------------------- the variants and their measurements --------


@dataclasses.dataclass
class Variant:
    """One way to run a model's step: `call(state, batch)`, `lower(state, batch)`, its mesh and plan."""

    name: str
    call: Callable
    lower: Callable
    mesh: Any
    placed: bool  # whether it takes the state in the authors' layout (False: host arrays, shardc places them)
    plan: Any = None


def variants(m: RealModel) -> list[Variant]:
    """The authors' `jax.jit`, `shardc.auto` with their rules and shardings, and `shardc.auto` bare."""
    jitted = jax.jit(m.step, in_shardings=(m.state_shardings, m.batch_sharding), out_shardings=(m.state_shardings, None),
                     donate_argnums=0)

    def under_mesh(f: Callable) -> Callable:
        def run(*args: Any) -> Any:
            with jax.set_mesh(m.mesh), nn.logical_axis_rules(m.rules):
                return f(*args)
        return run

    pinned = shardc.auto(m.step, rules=m.rules or None, in_shardings=(m.state_shardings, m.batch_sharding),
                         out_shardings=(m.state_shardings, None), donate_argnums=0)
    bare = shardc.auto(m.step, donate_argnums=0)
    return [Variant("jax.jit (authors' shardings)", under_mesh(jitted), under_mesh(jitted.lower), m.mesh, True),
            Variant("shardc.auto (same rules + in/out_shardings)", pinned, pinned.lower, m.mesh, True),
            Variant("shardc.auto (bare: no rules, no shardings)", bare, bare.lower, None, False)]


def fresh(m: RealModel, placed: bool) -> Any:
    """A copy of the initial state: in the authors' layout, or on the host (not placed: shardc decides)."""
    if placed:
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), m.state)
    return jax.device_get(m.state)


@dataclasses.dataclass
class Row:
    model: str
    variant: str
    mesh: str
    median_ms: float
    spread_ms: tuple[float, float]
    collectives: int
    collective_mib: float
    peak_mib: float | None
    loss3: float
    plan: str
    check: str = "-"  # shardc.check of a shardc plan: its simulation against the compiled program


def measure(m: RealModel, steps: int, check_steps: int = 3) -> list[Row]:
    """Loss after `check_steps` steps from the same state, compiled stats, then interleaved step times."""
    vs = variants(m)
    batch = m.batch
    losses, states, stats, checks = {}, {}, {}, {}
    for v in vs:
        s = fresh(m, v.placed)
        for _ in range(check_steps):
            s, loss = v.call(s, batch)
        losses[v.name] = float(loss)
        states[v.name] = s
        compiled = v.lower(s, batch).compile()
        if isinstance(v.call, shardc.AutoFunction):
            v.plan = v.call.plan(s, batch)
            v.mesh = v.plan.mesh
            checks[v.name] = shardc.check(v.plan).summary()
        stats[v.name] = compiled_stats(compiled, list(v.mesh.shape.items()))
    times: dict[str, list[float]] = {v.name: [] for v in vs}
    for _ in range(steps + 2):  # round robin; the first two rounds are warmup
        for v in vs:
            t0 = time.perf_counter()
            states[v.name], loss = v.call(states[v.name], batch)
            jax.block_until_ready((states[v.name], loss))
            times[v.name].append(time.perf_counter() - t0)
    rows = []
    for v in vs:
        if v.plan is not None and v.plan.search is not None:
            print(f"{m.name} / {v.name}:\n{v.plan.search.summary()}", flush=True)
        t = sorted(times[v.name][2:])
        st = stats[v.name]
        kinds: dict[str, int] = {}
        for c in st["collectives"]:
            kinds[c.kind] = kinds.get(c.kind, 0) + c.count
        print(f"{m.name} / {v.name}: collectives " + ", ".join(
            f"{k} x{kinds[k]} {b / 2**20:.2f} MiB" for k, b in sorted(st["bytes"].items())), flush=True)
        chosen = v.plan.search.chosen if v.plan is not None and v.plan.search is not None else None
        rows.append(Row(m.name, v.name, ",".join(f"{a}={n}" for a, n in v.mesh.shape.items()),
                        1e3 * statistics.median(t), (1e3 * t[len(t) // 4], 1e3 * t[(3 * len(t)) // 4]),
                        sum(c.count for c in st["collectives"]), sum(st["bytes"].values()) / 2**20,
                        None if st["memory"] is None else st["memory"] / 2**20, losses[v.name],
                        "" if v.plan is None else (f"{chosen.name}" if chosen is not None else "hints"),
                        checks.get(v.name, "-")))
    return rows


HEADER = ("| model | variant | mesh | step ms (median, IQR) | vs jax.jit | collectives (count, MiB/device) | "
          "peak MiB/device | loss after 3 steps | plan | shardc.check |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table(rows: list[Row]) -> str:
    base = {r.model: r for r in rows if r.variant.startswith("jax.jit")}
    out = [HEADER]
    for r in rows:
        b = base[r.model]
        same = np.isclose(r.loss3, b.loss3, rtol=1e-5, atol=1e-6)
        out.append(f"| {r.model} | {r.variant} | {r.mesh} | {r.median_ms:.1f} ({r.spread_ms[0]:.1f}-{r.spread_ms[1]:.1f}) "
                   f"| {r.median_ms / b.median_ms:.2f}x | {r.collectives}, {r.collective_mib:.2f} | "
                   f"{'n/a' if r.peak_mib is None else f'{r.peak_mib:.1f}'} | {r.loss3:.6f}"
                   f"{'' if same else ' (differs)'} | {r.plan} | {r.check} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per variant (after 2 warmup rounds)")
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = ap.parse_args()
    rows, descriptions = [], []
    load = [os.getloadavg()[0]]
    for name in args.models.split(","):
        m = MODELS[name]()
        descriptions.append(f"- `{m.name}`: {m.description}; authors' mesh "
                            f"{','.join(f'{a}={n}' for a, n in m.mesh.shape.items())}")
        rows += measure(m, args.steps)
        load.append(os.getloadavg()[0])
        print(table(rows), flush=True)
    text = table(rows)
    if args.write:
        from bench.propagate import write_section

        write_section("real_models", f"`python -m bench.real_models --write` ({os.cpu_count()} cores shared with other "
                      f"jobs, 1-minute load average {min(load):.1f}-{max(load):.1f} during the run, jax "
                      f"{jax.__version__}, 8 CPU devices; {args.steps} timed steps per variant, round robin). Models "
                      f"written as their authors write them (`bench/real_models.py`):\n\n" + "\n".join(descriptions)
                      + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
