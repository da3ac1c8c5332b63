"""Resident memory of the PCG rewriting, simulation by simulation, with Python's cyclic collector paused as the
search runs it (issue 18: the 48-layer GPT's `search+pcg` row was killed at 21 GB).

    python -m bench.pcg_mem --model gpt48 [--mesh data=4,model=2,expert=1] [--evaluations 60] [--gc]

The zoo model's plan on the mesh from its hints alone (`search=False`: no search, so the run takes minutes), then
`choose_pcg` on `h100-sxm-8` with at most `--evaluations` simulations; each simulation prints the process's
resident set. `--gc` leaves the collector on (what a run outside the search sees). A rewriting that keeps nothing
per candidate grows by the few candidates it holds at once (its lookahead beam), not by the simulations.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import resource
import sys
import time

if __name__ == "__main__":  # 8 local CPU devices, as the tests have
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mib() -> float:
    """The process's resident set now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt48")
    ap.add_argument("--mesh", default="data=4,model=2,expert=1")
    ap.add_argument("--evaluations", type=int, default=60)
    ap.add_argument("--gc", action="store_true", help="leave the cyclic collector on")
    a = ap.parse_args()

    import jax

    import shardc
    from bench.zoo_models import zoo
    from shardc.pcg import choice
    from shardc.pcg.simcost import SimCost

    t0 = time.perf_counter()

    class Logged(SimCost):
        def __call__(self, pcg):  # type: ignore[override]
            n = self.simulations
            cost = super().__call__(pcg)
            if self.simulations != n:
                print(f"simulation {self.simulations:3d}  {time.perf_counter() - t0:6.1f} s  "
                      f"{rss_mib():7.0f} MiB resident  ({len(pcg.nodes)} nodes)", flush=True)
            return cost

    sizes = {k: int(v) for k, v in (kv.split("=") for kv in a.mesh.split(","))}
    mesh = shardc.make_mesh(sizes, jax.devices()[:8])
    zm = next(m for m in zoo("full") if m.name == a.model)
    step, args = zm.build(mesh, 1)
    c = shardc.auto(step, mesh=mesh, search=False, topology="h100-sxm-8", donate_argnums=(0, 1)).compiled_info(*args)
    print(f"plan on {sizes}: {time.perf_counter() - t0:.0f} s, {rss_mib():.0f} MiB resident", flush=True)
    real, choice.SimCost = choice.SimCost, Logged
    gc.collect()
    was = gc.isenabled()
    if not a.gc:
        gc.disable()
    try:
        ch = choice.choose_pcg(c.plan, c.closed_jaxpr, "h100-sxm-8", donated=(0, 1), max_evaluations=a.evaluations)
    finally:
        choice.SimCost = real
        if was:
            gc.enable()
    print(ch.summary().splitlines()[0])
    print(f"rewritten PCG {hashlib.sha1(str(ch.pcg).encode()).hexdigest()[:16]}; "
          f"peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB resident")


if __name__ == "__main__":
    main()
