"""A small model trained for a few steps under `@shardc.auto`, as one process of a multi-host job or alone.

    python tests/multihost/mh_train.py --process-id 0 --num-processes 2 --port 12345 --out p0.json

Each process holds 8 // num_processes CPU devices; the mesh spans the 8 global devices. Every process
builds the same parameters from one seed; each reads only its own rows of every batch and the global
batch is assembled with `shardc.distributed.global_batch`. The result file holds the losses, the plan
digest and, with `--disagree`, the message of the plan-agreement check on deliberately different plans.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

STEPS = 4
BATCH, D_IN, HIDDEN, D_OUT = 16, 32, 64, 8
MESH = {"data": 4, "model": 2}


def model_and_step() -> tuple[Any, Any, Any]:
    """An MLP with Megatron-style partitioning (hidden dim over "model"), the batch over "data"; Adam."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from shardc import split

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = split(x, 0, "data")
            h = nn.Dense(HIDDEN, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")))(x)
            h = nn.gelu(h)
            return nn.Dense(D_OUT, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None)))(h)

    model, tx = MLP(), optax.adam(1e-2)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            pred = model.apply({"params": p}, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return model, tx, train_step


def batch_rows(step: int, rows: slice) -> dict[str, Any]:
    """Rows `rows` of global batch `step` (numpy; every process can make any rows)."""
    import numpy as np

    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
    return {"x": x[rows], "y": y[rows]}


def train(steps: int = STEPS, search: bool = False) -> dict[str, Any]:
    """Train on the global devices (whatever jax.distributed set up); returns losses and plan digest.
    With `search`, shardc's strategy search plans the step (bounded by steps on a multi-process job)."""
    import jax
    import numpy as np

    import shardc
    from shardc.distributed import check_plan_agreement, global_batch

    mesh = shardc.make_mesh(MESH)
    model, tx, train_step = model_and_step()
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), np.ones((BATCH, D_IN), np.float32))["params"],
                          is_leaf=lambda x: hasattr(x, "shape"))
    opt_state = tx.init(params)
    step = shardc.auto(train_step, mesh=mesh, search=True, budget_s=1.0) if search else \
        shardc.auto(train_step, mesh=mesh, search=False)
    n, p = jax.process_count(), jax.process_index()
    per = BATCH // n
    losses, digest, fingerprint, searched = [], None, None, False
    for i in range(steps):
        batch = global_batch(batch_rows(i, slice(p * per, (p + 1) * per)), mesh, "data")
        if digest is None:
            plan = step.plan(params, opt_state, batch)
            digest, fingerprint = check_plan_agreement(plan), plan.fingerprint()
            searched = getattr(plan, "search", None) is not None
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return {"process": p, "processes": n, "losses": losses, "digest": digest, "fingerprint": fingerprint,
            "searched": searched,
            "devices": [d.id for d in jax.local_devices()]}


def disagree() -> str:
    """Plan a step whose hint depends on the process index and return the agreement check's error."""
    import jax
    import numpy as np

    import shardc
    from shardc.distributed import check_plan_agreement

    mesh = shardc.make_mesh(MESH)
    axis = "data" if jax.process_index() == 0 else "model"

    def f(x):
        return shardc.split(x, 0, axis) * 2

    try:  # @shardc.auto checks new plans itself; the explicit call covers a single-process build too
        check_plan_agreement(shardc.auto(f, mesh=mesh, search=False).plan(np.ones((8, 4), np.float32)))
    except shardc.ShardingError as e:
        return str(e)
    return ""


def _gloo_on_loopback() -> None:
    """Make JAX's gloo CPU collectives listen on 127.0.0.1 only (by default gloo binds the address the
    machine's hostname resolves to); a test must not open ports on a real interface."""
    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives

    def on_loopback(distributed_client: Any, hostname: Any = None, interface: Any = None) -> Any:
        return make(distributed_client=distributed_client, hostname="127.0.0.1")

    xla_bridge._jax = _Proxy(xla_bridge._jax, make_gloo_tcp_collectives=on_loopback)


class _Proxy:
    """A module stand-in with some attributes replaced."""

    def __init__(self, module: Any, **overrides: Any) -> None:
        self._module, self._overrides = module, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else getattr(self._module, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--disagree", action="store_true")
    ap.add_argument("--search", action="store_true")
    args = ap.parse_args()
    local = 8 // args.num_processes
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import jax

    jax.config.update("jax_num_cpu_devices", local)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _gloo_on_loopback()
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=60,
                               coordinator_bind_address=f"127.0.0.1:{args.port}")
    result = train(search=args.search)
    if args.disagree:
        result["disagree"] = disagree()
    with open(args.out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
