"""Per-call cost of `@shardc.auto` against `jax.jit` on a train-step-like function with many small leaves.

    python -m bench.dispatch [--leaves 16,168,512] [--calls 200] [--write]

The step updates every leaf of a parameter dict from a sharded batch (an all-reduce of its mean) and returns the
new parameters, which the next call takes (donated), as a training loop does; a fresh numpy batch each call.
Per call: the time from the call to its results being ready, for `jax.jit` with the shardings the plan chose,
`@shardc.auto` (its fast path, `shardc/fast_call.py`) and `@shardc.auto` with the fast path turned off (the full
route every call, as before it); the three run round robin, call by call, in one process, and the table gives the
median per call and the difference to jax.jit (shardc's Python work per call: XLA:CPU runs these tiny programs
inline, so the program's own time is in all three).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import shardc  # noqa: E402
from shardc.fast_call import FastCall  # noqa: E402


def _update(params: dict, x: Any) -> tuple[dict, Any]:
    scale = 1e-3 * jnp.mean(x)
    return jax.tree.map(lambda p: p - scale * p, params), scale


def _step(params: dict, x: Any) -> tuple[dict, Any]:
    return _update(params, shardc.split(x, 0, "data"))  # (jax.jit gets the same layout from in_shardings)


def _params(n: int) -> dict:
    return {f"w{i}": np.full((8, 16), 1.0 + i, np.float32) for i in range(n)}


def _variants(n: int) -> dict[str, tuple[Callable, Any]]:
    mesh = shardc.make_mesh({"data": 8})
    auto = shardc.auto(_step, mesh=mesh, search=False, donate_argnums=0)
    full = shardc.auto(_step, mesh=mesh, search=False, donate_argnums=0)
    plan = auto.plan(_params(n), np.ones((64, 16), np.float32))
    shardings = [s.named(plan.mesh) for s in plan.input_shardings()]
    p_sh = jax.tree.unflatten(jax.tree.structure(_params(n)), shardings[:n])
    jitted = jax.jit(_update, in_shardings=(p_sh, shardings[n]), donate_argnums=0)
    return {"jax.jit": (jitted, jax.device_put(_params(n), p_sh)), "shardc.auto": (auto, _params(n)),
            "shardc.auto, full route": (full, _params(n))}


def measure(n: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each variant over `calls` round-robin calls (after 3 warm-up calls each)."""
    variants = _variants(n)
    state = {k: p for k, (_, p) in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    original = FastCall.placed
    rng = np.random.default_rng(0)
    for i in range(calls + 3):
        x = rng.normal(size=(64, 16)).astype(np.float32)
        for name, (f, _) in variants.items():
            if name.endswith("full route"):
                FastCall.placed = lambda self, tree, leaves: None  # type: ignore[method-assign]
            try:
                t = time.perf_counter()
                state[name], out = f(state[name], x)
                jax.block_until_ready((state[name], out))
                if i >= 3:
                    times[name].append(time.perf_counter() - t)
            finally:
                FastCall.placed = original  # type: ignore[method-assign]
    return {k: float(np.median(v)) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", default="16,168,512", help="comma-separated leaf counts")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    a = ap.parse_args()
    rows = ["| leaves | jax.jit us/call | shardc.auto us/call (over jax.jit) | full route us/call (over jax.jit) |",
            "| --- | --- | --- | --- |"]
    for n in (int(s) for s in a.leaves.split(",")):
        m = measure(n, a.calls)
        j, f, s = m["jax.jit"], m["shardc.auto"], m["shardc.auto, full route"]
        rows.append(f"| {n} | {j * 1e6:.0f} | {f * 1e6:.0f} (+{(f - j) * 1e6:.0f}) | {s * 1e6:.0f} (+{(s - j) * 1e6:.0f}) |")
        print(rows[-1], flush=True)
    text = "\n".join(rows)
    print(text)
    if a.write:
        from bench.propagate import write_section

        write_section("dispatch", f"`python -m bench.dispatch --calls {a.calls}` ({os.cpu_count()} cores, load "
                      f"average {os.getloadavg()[0]:.1f} at the end, jax {jax.__version__}, 8 CPU devices): median "
                      f"time per call of a step updating N small parameter leaves from a data-split batch, "
                      f"results ready, the three variants round robin in one process. The difference to jax.jit "
                      f"is shardc's Python work per call.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
