"""Train a GShard MoE Transformer translation model on real parallel text, sharded with @shardc.auto.

    python -m moe.translate                       # default: es->en Bible, 500 steps (docs/moe.md: time, BLEU)
    python -m moe.translate --corpus trans-de-en  # German->English example sentences
    python -m moe.translate --data pairs.tsv      # your own "source<TAB>target" file
    python -m moe.translate --corpus synthetic --model tiny --steps 200
    python -m moe.translate --resume              # continue a stopped run bit for bit

Runs on all local devices (8 virtual CPU devices by default: XLA_FLAGS is set before JAX starts). Plans
the train step with shardc's strategy search on those devices and prints the chosen plan against the
baselines (``--no-search``: the layers' hints plus propagation), shows a progress bar with loss and
tokens/s, checkpoints with orbax every ``--ckpt-every`` steps, at the end and on Ctrl-C / SIGTERM (then it
prints the exact ``--resume`` command), and at the end prints BLEU (sacrebleu) on the held-out split next
to a copy-the-source baseline, a few sample translations, and writes a loss curve PNG to ``--out``.
A run trains a fixed number of steps whatever the machine's load; ``--time-limit`` is opt-in.
See docs/moe.md.
"""
from __future__ import annotations

import os
import sys


def _early_device_flag(argv) -> int:
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--devices="):
            return int(a.split("=", 1)[1])
    return 8


# Must happen before JAX initialises its backend (importing jax alone does not).
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_early_device_flag(sys.argv)}"
    ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import flax.linen as nn  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from moe.bpe import BPETokenizer  # noqa: E402
from shardc.search.integrate import SMALL_MESH_BUDGET_S  # noqa: E402
from moe.data import BatchStream, load_corpus  # noqa: E402
from moe.transformer import Transformer, TransformerConfig, greedy_decode, loss_fn, num_moe_layers  # noqa: E402

MODEL_PRESETS = {
    # d_model, heads, mlp_dim, encoder layers, decoder layers, experts
    "tiny": dict(d_model=64, num_heads=2, mlp_dim=128, num_encoder_layers=2, num_decoder_layers=2, num_experts=4),
    "small": dict(d_model=256, num_heads=4, mlp_dim=1024, num_encoder_layers=2, num_decoder_layers=2, num_experts=8),
    "medium": dict(d_model=256, num_heads=4, mlp_dim=1024, num_encoder_layers=4, num_decoder_layers=4, num_experts=8),
    "base": dict(d_model=512, num_heads=8, mlp_dim=2048, num_encoder_layers=6, num_decoder_layers=6, num_experts=16),
}


# ----------------------------------------------------------------------------- shardc hook


def _compile_step(fn, mesh, donate_argnums=(), example_args=None, mode="shardc", in_shardings=None,
                  out_shardings=None, search=True, budget_s=None):
    """The one place where the train step is compiled. Returns ``(step, compiler name, plan or None)``.

    ``mode="shardc"`` (the default): ``@shardc.auto(mesh=..., donate_argnums=...)``; its ``Plan`` is returned
    (``plan.explain()`` prints it). A step shardc cannot plan is an error, never a silent fallback.
    ``mode="jit"``: plain ``jax.jit`` under ``jax.set_mesh(mesh)``, where the layers' split/replicate hints
    lower to sharding constraints (for comparison, or to train past a shardc bug).
    ``search``: let shardc's strategy search choose what the layers' GShard hints leave open, priced on the
    devices at hand (the default; a ``.json`` path: the plan is saved there, or loaded if it exists); False:
    GShard's own layout, the hints plus propagation. ``budget_s``: the search's budget (None: shardc's default
    for the mesh size).
    """
    if mode == "shardc":
        import shardc

        budget = {} if budget_s is None else {"budget_s": budget_s}
        step = shardc.auto(mesh=mesh, donate_argnums=donate_argnums, search=search, **budget)(fn)
        try:
            plan = step.plan(*example_args) if example_args is not None else None
        except shardc.ShardingError:
            print("*** shardc could not plan the train step (error below); `--compiler jit` trains the same model "
                  "with plain jax.jit and the same hints", flush=True)
            raise
        return step, "shardc.auto", plan
    jitted = jax.jit(fn, donate_argnums=donate_argnums, in_shardings=in_shardings, out_shardings=out_shardings)

    def run(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    run.lower = lambda *a: _lower_under(mesh, jitted, *a)
    return run, "jax.jit", None


def _lower_under(mesh, jitted, *args):
    with jax.set_mesh(mesh):
        return jitted.lower(*args)


# ----------------------------------------------------------------------------- helpers


def parse_mesh(spec: str) -> dict[str, int]:
    out = {}
    for part in spec.split(","):
        name, size = part.split("=")
        out[name.strip()] = int(size)
    return out


def make_mesh(shape: dict[str, int]):
    try:
        import shardc

        return shardc.make_mesh(shape)
    except (ImportError, AttributeError):  # pragma: no cover
        from jax.sharding import AxisType

        return jax.make_mesh(tuple(shape.values()), tuple(shape.keys()), axis_types=(AxisType.Auto,) * len(shape))


def build_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists every option with its default)."""
    p = argparse.ArgumentParser(prog="python -m moe.translate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--corpus", default="sparv", choices=["sparv", "trans-de-en", "synthetic"],
                   help="parallel corpus (sparv: Spanish->English Bible from Debian SWORD modules)")
    p.add_argument("--data", default=None, help="a TSV file of 'source<TAB>target' lines (overrides --corpus)")
    p.add_argument("--synthetic-size", type=int, default=20000, help="training pairs of the synthetic task")
    p.add_argument("--test-every", type=int, default=50, help="hold out every N-th pair for BLEU")
    p.add_argument("--holdout-books", default=None, help="sparv: hold out whole books instead, e.g. Ruth,Jude")
    p.add_argument("--vocab-size", type=int, default=4000, help="joint BPE vocabulary size")
    p.add_argument("--max-len", type=int, default=64, help="max subword tokens per side (longer pairs skipped)")
    p.add_argument("--buckets", default="24,40,64", help="length buckets (one compiled shape each)")
    p.add_argument("--model", default="small", choices=sorted(MODEL_PRESETS), help="model size preset")
    p.add_argument("--experts", type=int, default=None, help="experts per MoE layer (None: the preset's)")
    p.add_argument("--layers", type=int, default=None, help="encoder and decoder layers (None: the preset's)")
    p.add_argument("--d-model", type=int, default=None, help="model width (None: the preset's)")
    p.add_argument("--steps", type=int, default=500,
                   help="training steps (the run always trains them all unless --time-limit or --stop-at says "
                        "otherwise; docs/moe.md gives the time and BLEU of the default run)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch and side")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (Adam, warmup + cosine decay)")
    p.add_argument("--warmup", type=int, default=150, help="warmup steps (at most --steps / 5)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout rate (none by default: at 600 steps dropout 0.1 ended at BLEU 16.94 against 20.50 "
                        "without, and its RNG cost a sixth of each step on XLA:CPU; docs/moe.md)")
    p.add_argument("--aux-weight", type=float, default=0.01, help="weight of the MoE load-balancing loss")
    p.add_argument("--capacity-factor", type=float, default=2.0, help="training capacity factor (2.0 = 2S/E)")
    p.add_argument("--group-size", type=int, default=128,
                   help="tokens per MoE routing group (GShard's S; dispatch and combine cost grows with S); "
                        "0: one group per device")
    p.add_argument("--decode-capacity-factor", type=float, default=2.0,
                   help="capacity factor of a decoding step's group (0: C = S, never drop)")
    p.add_argument("--second-expert-policy", default="random", choices=["random", "all"],
                   help="GShard's second-expert policy")
    p.add_argument("--mesh", default="data=2,expert=4", help="mesh axes, e.g. expert=8 or data=2,expert=4")
    p.add_argument("--compiler", default="shardc", choices=["shardc", "jit"],
                   help="shardc: @shardc.auto; jit: plain jax.jit with the same hints, for comparison")
    p.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compiler shardc: shardc's strategy search chooses what the hints leave open, "
                        "priced on the devices at hand; --no-search: the hints plus propagation (GShard's layout)")
    p.add_argument("--search-budget", type=float, default=None,
                   help="the search's budget in seconds of planning on a reference machine (a fixed number of "
                        "simulated plans, so the same plan on a busy machine; None: shardc's default, "
                        f"{SMALL_MESH_BUDGET_S:g} s on up to 8 devices)")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (sets XLA_FLAGS before JAX starts)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation, batches and dropout")
    p.add_argument("--out", default="runs/moe-translate", help="output dir (loss curve, samples, summary, plan)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint dir (None: OUT/checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=200,
                   help="save a checkpoint every N steps (0: only at the end and on Ctrl-C / SIGTERM)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--stop-at", type=int, default=None, help="stop (after checkpointing) at this step")
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss + BLEU on 100 sentences every N steps")
    p.add_argument("--eval-sentences", type=int, default=0, help="BLEU on the first N held-out pairs (0: all)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="opt-in: stop training after this many minutes (checkpointed, resumable) and evaluate the "
                        "partly trained model (0: no limit, train every step)")
    p.add_argument("--log-every", type=int, default=0,
                   help="without a progress bar (--quiet): print the loss every N steps (0: every 30 s)")
    p.add_argument("--no-plot", action="store_true", help="do not write the loss curve PNG")
    p.add_argument("--no-final-eval", action="store_true", help="skip BLEU/decoding at the end")
    p.add_argument("--samples", type=int, default=5, help="sample translations to print")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def resume_command(argv: Sequence[str]) -> str:
    """The shell command that continues this run: the same flags, with ``--resume`` and without ``--stop-at``."""
    kept: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--stop-at":
            skip = True
        elif a != "--resume" and not a.startswith("--stop-at="):
            kept.append(a)
    return shlex.join(["python", "-m", "moe.translate", *kept, "--resume"])


class StopSignals:
    """While active, Ctrl-C (SIGINT) and SIGTERM ask the training loop to stop after the current step (it then
    checkpoints and prints how to resume); a second signal, or any signal once ``immediate`` is set (nothing
    left to save), raises KeyboardInterrupt at once. Outside the main thread (signals cannot be caught
    there) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self.immediate = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        again = self.received is not None
        self.received = self.received or signal.Signals(signum)
        if again or self.immediate:
            raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by the signal: 128 + its number."""
        return 128 + int(self.received) if self.received is not None else 0


def searched_plan_file(out_dir: Path, resume: bool) -> str:
    """Where the searched plan is kept (OUT/plan.json): a run searches and saves it there, a ``--resume``d run
    loads it instead of searching again, so that it continues with the very plan the checkpoints were trained
    under (bit for bit, even if the machine's measured profile changed since) and starts sooner."""
    path = out_dir / "plan.json"
    if not resume and path.exists():
        path.unlink()  # a fresh run plans afresh (its model or mesh may differ from the earlier run's)
    return str(path)


def plan_report(plan) -> str:
    """The top of ``plan.explain()``: mesh, topology, simulated step time and memory, the input layouts, the
    decision groups, and the search's chosen plan against its baselines (the rest goes to OUT/plan.txt)."""
    text = plan.explain(max_rows=0)
    return text.split("\nsimulated cost:")[0].rstrip()


def model_config(args, vocab_size: int, group_axes, max_len: int) -> TransformerConfig:
    preset = dict(MODEL_PRESETS[args.model])
    if args.experts is not None:
        preset["num_experts"] = args.experts
    if args.layers is not None:
        preset["num_encoder_layers"] = preset["num_decoder_layers"] = args.layers
    if args.d_model is not None:
        preset["d_model"] = args.d_model
    return TransformerConfig(
        vocab_size=vocab_size,
        **preset,
        capacity_factor=args.capacity_factor,
        eval_capacity_factor=2.0,
        group_size=args.group_size or None,
        second_expert_policy=args.second_expert_policy,
        aux_loss_weight=args.aux_weight,
        dropout_rate=args.dropout,
        group_axes=group_axes,
        expert_axes=("expert",),
        batch_axes=group_axes,
        max_len=max(max_len, 8) + 8,
    )


def make_optimizer(args):
    warmup = min(args.warmup, max(1, args.steps // 5))
    sched = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=warmup, decay_steps=max(args.steps, warmup + 1), end_value=args.lr * 0.05
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sched, b1=0.9, b2=0.98, eps=1e-9)), sched


def bleu(hyps, refs) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)


class Translator:
    """Greedy decoding of held-out sentences in fixed-shape batches (one compilation).

    Decoding is a long chain of small steps, so it runs unsharded: the parameters are copied to a few
    single devices (one per CPU core) and batches are dispatched to them round robin; JAX's asynchronous
    dispatch runs them concurrently.
    """

    def __init__(self, cfg: TransformerConfig, tok: BPETokenizer, max_len: int, batch: int = 64):
        self.cfg, self.tok, self.max_len, self.batch = cfg, tok, max_len, batch
        self._fn = jax.jit(greedy_decode, static_argnums=(1, 3))
        n = max(1, min(len(jax.local_devices()), os.cpu_count() or 1))
        self.devices = jax.local_devices()[:n]

    def __call__(self, params, sources: list[str]) -> list[str]:
        out = [""] * len(sources)
        enc = [self.tok.encode(s)[: self.max_len] for s in sources]
        order = np.argsort([len(e) for e in enc], kind="stable")
        copies = [jax.device_put(params, d) for d in self.devices]
        pending = []
        for k, start in enumerate(range(0, len(order), self.batch)):
            idx = order[start : start + self.batch]
            src = np.zeros((self.batch, self.max_len), np.int32)
            for r, i in enumerate(idx):
                src[r, : len(enc[i])] = enc[i]
            d = k % len(self.devices)
            ids = self._fn(copies[d], self.cfg, jax.device_put(src, self.devices[d]), self.max_len + 8)
            pending.append((idx, ids))
        for idx, ids in pending:
            ids = np.asarray(ids)
            for r, i in enumerate(idx):
                out[i] = self.tok.decode(ids[r])
        return out


def checkpoint_manager(directory: Path):
    """An orbax manager for the run's state (a pytree of arrays) and its metadata (JSON).

    Arrays are written without orbax's replica-parallel slicing: on one process it only splits each replicated
    array into per-device pieces, and every piece's shape costs a compiled slice (2-8 s per checkpoint here,
    minutes for a model with many differently shaped parameters); without it each array is copied to the host
    whole from one device."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import type_handlers as th

    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()), (jax.Array, th.ArrayHandler(use_replica_parallel=False)))
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
                       "meta": ocp.JsonCheckpointHandler()},
    )


def save_plot(path: Path, history: list[dict], evals: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["nll"] for h in history], lw=0.6, alpha=0.5, label="train NLL (per token)")
    if len(history) >= 20:
        k = max(5, len(history) // 50)
        sm = np.convolve([h["nll"] for h in history], np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], sm, lw=1.5, label=f"train NLL ({k}-step mean)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_nll"] for e in evals], "o-", label="held-out NLL")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / target token")
    ax.set_title("GShard MoE Transformer, translation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the example; returns the step reached, the loss history, the summary (after a final evaluation)
    and ``exit_code`` (128 + the signal's number when Ctrl-C / SIGTERM stopped it, else 0)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_args(argv)
    t_start = time.time()
    cpu_start = time.process_time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else out_dir / "checkpoints"

    # ---- data
    corpus = load_corpus(
        args.corpus, data=args.data, test_every=args.test_every,
        holdout_books=args.holdout_books.split(",") if args.holdout_books else None, seed=args.seed,
        synthetic_size=args.synthetic_size,
    )
    print(f"corpus  {corpus.summary()}")
    tok_path = ckpt_dir / "tokenizer.json"
    if args.resume and tok_path.exists():
        tok = BPETokenizer.load(tok_path)
    else:
        t0 = time.time()
        tok = BPETokenizer.train([s for p in corpus.train for s in p], vocab_size=args.vocab_size)
        print(f"vocab   {tok.vocab_size} BPE pieces learned on the training split in {time.time() - t0:.1f}s")
    src_ids = [tok.encode(s) for s, _ in corpus.train]
    tgt_ids = [tok.encode(t) for _, t in corpus.train]
    buckets = [int(b) for b in args.buckets.split(",") if int(b) <= args.max_len] or [args.max_len]
    if buckets[-1] < args.max_len:
        buckets.append(args.max_len)

    # ---- mesh, model, optimizer
    mesh_shape = parse_mesh(args.mesh)
    if math.prod(mesh_shape.values()) != jax.device_count():
        raise SystemExit(f"--mesh {args.mesh} needs {math.prod(mesh_shape.values())} devices, "
                         f"JAX has {jax.device_count()} (use --devices N)")
    if "expert" not in mesh_shape:
        raise SystemExit("--mesh needs an 'expert' axis (e.g. expert=8 or data=2,expert=4)")
    mesh = make_mesh(mesh_shape)
    group_axes = tuple(mesh_shape)  # G over every device; E over "expert"
    n_dev = math.prod(mesh_shape.values())
    stream = BatchStream(src_ids, tgt_ids, buckets, args.batch_tokens, batch_multiple=n_dev, seed=args.seed)
    cfg = model_config(args, tok.vocab_size, group_axes, args.max_len)
    if cfg.num_experts % mesh_shape["expert"]:
        raise SystemExit(f"{cfg.num_experts} experts cannot be split over expert={mesh_shape['expert']} devices")
    model = Transformer(cfg)
    tx, sched = make_optimizer(args)
    print(f"data    {stream.per_epoch} batches/epoch, shapes {stream.shapes}, "
          f"{stream.skipped} pairs longer than {args.max_len} tokens skipped")

    b0 = {"src": np.ones((n_dev, buckets[0]), np.int32), "tgt_in": np.ones((n_dev, buckets[0]), np.int32)}
    variables = jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, b0["src"], b0["tgt_in"]))
    specs = nn.get_partition_spec(variables)["params"]
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

    @jax.jit
    def init_state(key):
        v = model.init({"params": key}, jnp.asarray(b0["src"]), jnp.asarray(b0["tgt_in"]))
        params = nn.unbox(v)["params"]
        params = jax.lax.with_sharding_constraint(params, param_sh)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    base_key = jax.random.key(args.seed)

    def step_key(step):
        # The rng of step k depends only on (seed, k): nothing to carry over a restart.
        return jax.random.key_data(jax.random.fold_in(base_key, step + 1))
    with jax.set_mesh(mesh):
        state = init_state(jax.random.fold_in(base_key, 0))
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    n_expert = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]
                   if any(getattr(k, "key", None) in ("wi", "wo") for k in p) and x.ndim == 3)
    print(f"model   {args.model}: d={cfg.d_model}, {cfg.num_encoder_layers}+{cfg.num_decoder_layers} layers, "
          f"{num_moe_layers(cfg)} MoE layers x {cfg.num_experts} experts (top-2, capacity factor "
          f"{cfg.capacity_factor}, policy {cfg.second_expert_policy}, "
          f"{f'groups of ~{cfg.group_size} tokens' if cfg.group_size else 'one group per device'}), {n_params / 1e6:.1f}M parameters "
          f"({n_expert / 1e6:.1f}M in experts)")

    needs_rng = cfg.dropout_rate > 0 or cfg.second_expert_policy == "random"

    def train_step(state, batch, key_data):
        # The step's rng arrives as raw uint32 key data (jax.random.key_data), not a typed key array.
        # Without dropout and with the "all" policy the step uses no randomness at all (no key-typed values).
        if needs_rng:
            dkey, gkey = jax.random.split(jax.random.wrap_key_data(key_data))
            rngs = {"dropout": dkey, "gating": gkey}
        else:
            rngs = {}

        def lf(params):
            logits, aux = model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=False,
                                      rngs=rngs)
            return loss_fn(logits, batch["tgt_out"], aux, cfg)

        grads, metrics = jax.grad(lf, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def eval_step(params, batch):
        logits, aux = model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=True)
        _, m = loss_fn(logits, batch["tgt_out"], aux, cfg, label_smoothing=0.0)
        return m

    eval_fn = jax.jit(eval_step)

    # ---- checkpoints
    import orbax.checkpoint as ocp

    # Always a manager: even with --ckpt-every 0 the run checkpoints at the end and when it is stopped.
    manager = checkpoint_manager(ckpt_dir.resolve())
    history: list[dict] = []
    evals: list[dict] = []
    start_step = 0
    old = sorted(manager.all_steps()) if not args.resume else []
    if old:
        # A fresh run over an earlier run's checkpoints: they would clash with this run's (and a later
        # --resume would mix the two runs), so they go; --resume continues the earlier run instead.
        for s in old:
            manager.delete(s)
        print(f"ckpt    removed the earlier run's checkpoints (steps {', '.join(map(str, old))}) in {ckpt_dir}; "
              f"pass --resume to continue a run instead of starting again")
    if args.resume:
        latest = manager.latest_step()
        if latest is None:
            print(f"resume  no checkpoint in {ckpt_dir}; starting from scratch")
        else:
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
            )
            restored = manager.restore(
                latest, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                    abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)),
                    meta=ocp.args.JsonRestore())
            )
            state = restored["state"]
            meta = restored["meta"]
            history, evals = meta["history"], meta["evals"]
            if meta.get("seed") != args.seed:
                raise SystemExit(f"checkpoint was written with --seed {meta.get('seed')}, not {args.seed}")
            saved = meta.get("args", {})
            changed = [k for k in ("corpus", "data", "model", "steps", "lr", "warmup", "batch_tokens", "buckets",
                                   "vocab_size", "max_len", "mesh", "dropout", "capacity_factor",
                                   "second_expert_policy", "aux_weight", "experts", "layers", "d_model",
                                   "group_size")
                       if k in saved and saved[k] != getattr(args, k)]
            if changed:
                print("*** resuming with different " + ", ".join(f"--{k.replace('_', '-')} ({saved[k]} -> "
                                                               f"{getattr(args, k)})" for k in changed)
                      + ": the continuation is not the uninterrupted run")
            start_step = int(state["step"])
            print(f"resume  from step {start_step} in {ckpt_dir}")
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    if not (args.resume and tok_path.exists()):  # a fresh run's tokenizer replaces an earlier run's
        tok.save(tok_path)

    def save(step):
        meta = {"step": step, "seed": args.seed, "history": history, "evals": evals, "args": vars(args)}
        manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
                     force=True)
        manager.wait_until_finished()

    # ---- compile + plan summary (for the first batch shape)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    batch_sh = NamedSharding(mesh, P(group_axes))
    replicated = NamedSharding(mesh, P())
    batch0 = jax.tree.map(jnp.asarray, stream.batch(start_step))
    print(f"plan    mesh {dict(mesh.shape)}, compiler {args.compiler} ...", flush=True)
    t0 = time.time()
    step_fn, compiler, plan = _compile_step(
        train_step, mesh, donate_argnums=(0,), example_args=(state, batch0, step_key(start_step)), mode=args.compiler,
        search=searched_plan_file(out_dir, args.resume) if args.search else False, budget_s=args.search_budget,
        in_shardings=(state_sh, batch_sh, replicated), out_shardings=(state_sh, replicated),
    )
    if plan is not None:
        (out_dir / "plan.txt").write_text(plan.explain(max_rows=100_000))
        print(plan_report(plan))
        if not args.search:
            print("(--no-search: the layers' hints plus propagation; without it the strategy search plans the step)")
        elif getattr(plan, "search", None) is None:
            print(f"(the plan the resumed run searched, loaded from {out_dir / 'plan.json'}: not searched again)")
        print(f"        full plan (every tensor's sharding and its cause): {out_dir / 'plan.txt'}")
    else:
        print("plan    jax.jit: the MoE layers' split/replicate hints + Flax partitioning metadata, XLA propagates")
    print(f"        {compiler} ready in {time.time() - t0:.1f}s")

    # ---- held-out data
    test = corpus.test if not args.eval_sentences else corpus.test[: args.eval_sentences]
    test_src = [s for s, _ in test]
    test_ref = [t for _, t in test]
    tr_src = [tok.encode(s) for s in test_src]
    tr_tgt = [tok.encode(t) for t in test_ref]
    keep = [i for i in range(len(test)) if len(tr_src[i]) <= args.max_len and len(tr_tgt[i]) < args.max_len]
    val_stream = BatchStream([tr_src[i] for i in keep], [tr_tgt[i] for i in keep], [args.max_len],
                             args.max_len * n_dev, batch_multiple=n_dev)
    val_batches = [val_stream.make(np.arange(k, min(k + n_dev * 8, len(keep))), args.max_len)
                   for k in range(0, len(keep), n_dev * 8)]
    translator = Translator(
        dataclasses.replace(cfg, group_axes=None, expert_axes=None, batch_axes=None,
                            decode_capacity_factor=args.decode_capacity_factor or None),
        tok, args.max_len)

    def evaluate(params, n_bleu=None):
        tot, cnt = 0.0, 0.0
        for vb in val_batches:
            pad = (-vb["src"].shape[0]) % n_dev
            if pad:
                vb = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in vb.items()}
            with jax.set_mesh(mesh):
                m = eval_fn(params, jax.tree.map(jnp.asarray, vb))
            tot += float(m["nll"]) * float(m["tokens"])
            cnt += float(m["tokens"])
        src = test_src if n_bleu is None else test_src[:n_bleu]
        ref = test_ref if n_bleu is None else test_ref[:n_bleu]
        hyp = translator(params, src)
        return tot / max(cnt, 1.0), bleu(hyp, ref), hyp

    def final_evaluation(step: int, train_time: float, timed_out: bool) -> dict:
        """BLEU on the held-out split, samples, plot and summary.json; returns the summary."""
        t0 = time.time()
        vnll, test_bleu, hyps = evaluate(state["params"])
        copy_bleu = bleu(test_src, test_ref)
        evals.append({"step": step, "val_nll": vnll, "bleu": test_bleu})
        eval_time = time.time() - t0
        print(f"\nheld-out ({len(test)} pairs): NLL {vnll:.3f} nats/token, BLEU {test_bleu:.2f} "
              f"(copy-the-source baseline: {copy_bleu:.2f})   [decode+score {eval_time:.0f}s]")
        rng = np.random.default_rng(0)
        for i in sorted(rng.choice(len(test), size=min(args.samples, len(test)), replace=False)):
            print(f"  src: {test_src[i]}\n  ref: {test_ref[i]}\n  hyp: {hyps[i]}\n")
        (out_dir / "translations.tsv").write_text(
            "".join(f"{s}\t{r}\t{h}\n" for s, r, h in zip(test_src, test_ref, hyps)), encoding="utf-8")
        if not args.no_plot:
            save_plot(out_dir / "loss.png", history, evals)
            print(f"loss curve: {out_dir / 'loss.png'}")
        total = time.time() - t_start
        summary = {
            "corpus": corpus.name, "train_pairs": len(corpus.train), "test_pairs": len(test), "steps": step,
            "bleu": test_bleu, "copy_bleu": copy_bleu, "val_nll": vnll, "train_time_s": train_time,
            "total_time_s": total, "final_train_loss": history[-1]["loss"] if history else None,
            "epochs": stream.epoch_of(step), "compiler": compiler, "search": args.search,
            "mesh": dict(mesh.shape), "model": args.model, "params_m": n_params / 1e6, "stopped_early": timed_out,
            "cpu_time_s": time.process_time() - cpu_start, "cpus": os.cpu_count(),
            "load_avg_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"done in {total / 60:.1f} min (training {train_time / 60:.1f} min, {step} steps, "
              f"{stream.epoch_of(step):.2f} epochs); summary: {out_dir / 'summary.json'}")
        return summary

    # ---- train
    use_bar = not args.quiet
    bar = None
    if use_bar:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                       file=sys.stdout)
        except ImportError:  # pragma: no cover
            bar = None
    stop_at = min(args.steps, args.stop_at) if args.stop_at is not None else args.steps
    t_train = time.time()
    tok_window: list[tuple[float, float]] = []
    step = start_step
    timed_out = False
    last_log = 0.0
    with StopSignals() as signals:
        while step < stop_at and signals.received is None:
            if args.time_limit and time.time() - t_start > args.time_limit * 60:
                timed_out = True
                break
            nb = stream.batch(step)
            batch = jax.tree.map(jnp.asarray, nb)
            state, metrics = step_fn(state, batch, step_key(step))
            step += 1
            metrics = jax.device_get(metrics)
            now = time.time()
            ntok = float(np.sum(nb["src"] != 0) + np.sum(nb["tgt_out"] != 0))  # real tokens, both sides
            tok_window.append((now, ntok))
            tok_window = tok_window[-20:]
            rate = sum(t for _, t in tok_window[1:]) / max(tok_window[-1][0] - tok_window[0][0], 1e-9) \
                if len(tok_window) > 1 else 0.0
            history.append({"step": step, "loss": float(metrics["loss"]), "nll": float(metrics["nll"]),
                            "aux": float(metrics["aux"]), "lr": float(sched(step - 1)), "time": now - t_train})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", aux=f"{float(metrics['aux']):.3f}",
                                tok_s=f"{rate:,.0f}", epoch=f"{stream.epoch_of(step):.2f}", refresh=False)
            elif (step % args.log_every == 0) if args.log_every else (now - last_log > 30):
                print(f"step {step} loss {float(metrics['loss']):.3f} aux {float(metrics['aux']):.3f} "
                      f"tok/s {rate:,.0f}", flush=True)
                last_log = now
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                vnll, vb, _ = evaluate(state["params"], n_bleu=100)
                evals.append({"step": step, "val_nll": vnll, "bleu100": vb})
                msg = f"eval    step {step}: held-out NLL {vnll:.3f}, BLEU (100 sentences) {vb:.1f}"
                (bar.write(msg) if bar is not None else print(msg))
            if args.ckpt_every and step % args.ckpt_every == 0:
                save(step)
        if bar is not None:
            bar.close()
        train_time = time.time() - t_train
        if manager.latest_step() != step and (step > start_step or not manager.all_steps()):
            save(step)
        (out_dir / "history.json").write_text(json.dumps(history))
        resume = resume_command(argv)
        if signals.received is not None:
            print(f"*** {signals.received.name}: stopped training at step {step} of {args.steps}; checkpoint saved in "
                  f"{ckpt_dir}. Continue with\n    {resume}", flush=True)
            return {"step": step, "history": history, "exit_code": signals.exit_code}
        if timed_out:
            print(f"*** --time-limit {args.time_limit:g} min reached: stopped training at step {step} of {args.steps} "
                  f"(checkpointed). The BLEU below is of a partly trained model; all {args.steps} steps give the "
                  f"documented BLEU. Continue with\n    {resume}", flush=True)
        elif step < args.steps:
            print(f"stopped at step {step} (--stop-at); continue with\n    {resume}")
            return {"step": step, "history": history, "exit_code": 0}
        if args.no_final_eval:
            return {"step": step, "history": history, "exit_code": 0}
        signals.immediate = True  # training is saved: a signal now ends the evaluation at once
        try:
            summary = final_evaluation(step, train_time, timed_out)
        except KeyboardInterrupt:
            name = signals.received.name if signals.received is not None else "SIGINT"
            print(f"\n*** {name}: evaluation interrupted; training finished and is checkpointed at step {step}. "
                  f"Evaluate it with\n    {resume}", flush=True)
            return {"step": step, "history": history, "exit_code": signals.exit_code or 130}
    return {"step": step, "history": history, "summary": summary, "exit_code": 0}


if __name__ == "__main__":
    try:
        sys.exit(main()["exit_code"])
    except KeyboardInterrupt:  # before training started (or a second Ctrl-C): nothing new to save
        print("\n*** interrupted; the checkpoints in the output dir are as they were", file=sys.stderr)
        sys.exit(130)
