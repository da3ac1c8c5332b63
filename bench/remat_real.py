"""Rematerialization on a model written the way its authors write it: the lm1b-style LM of
`bench/real_models.py`, planned by `@shardc.auto` bare under `memory_limit`s that need recomputation.

    python -m bench.remat_real [--limits 21,18]

For each limit (MiB per device): the remat policy the search chose, the predicted peak, what
`shardc.check` reads from the compiled program (memory and every collective kind), and the largest
difference of the new state against plain `jax.jit(step)` on one device layout (same math).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import shardc  # noqa: E402
from bench import real_models  # noqa: E402


def run(limit_mib: float) -> None:
    m = real_models.lm()
    state = real_models.fresh(m, placed=False)
    step = shardc.auto(m.step, donate_argnums=0, memory_limit=int(limit_mib * 2**20))
    try:
        plan = step.plan(state, m.batch)
    except shardc.ShardingError as e:  # no plan fits this limit: say so (the smallest peak found)
        print(f"limit {limit_mib:g} MiB: {e}\n")
        return
    policies = plan.remat.policies if plan.remat is not None else "none"
    print(f"limit {limit_mib:g} MiB: remat {policies}, predicted peak {plan.cost.peak_memory / 2**20:.1f} MiB")
    print(shardc.check(plan))
    new_state, _ = step(real_models.fresh(m, placed=False), m.batch)
    ref_state, _ = jax.jit(m.step)(real_models.fresh(m, placed=False), m.batch)
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)))
    print(f"largest difference of the new state from jax.jit(step): {diff:.3g}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limits", default="21,18", help="memory limits in MiB per device, comma-separated")
    for limit in ap.parse_args().limits.split(","):
        run(float(limit))


if __name__ == "__main__":
    main()
