"""The fixed cost of one collective on the 8 XLA:CPU devices, by kind and group (issue 14).

    python -m bench.collective_overhead [--elems 256] [--rounds 20]

For each kind (all-reduce, all-gather, all-to-all, collective-permute) over the `t` axis (groups of 2),
the `f` axis (groups of 4) and both (all 8 devices) of a `f=4, t=2` mesh: a chain of 32 of them on a small
buffer, minus the same chain without them, per collective; every chain runs once per round, round robin,
and the table gives the fastest and the median round. The ratio column divides by the all-reduce over all
devices of the same run. It shows what `cpu-host`'s `permute_latency` measures: a collective-permute costs
about what a collective over every device costs, however few pairs it moves (XLA:CPU meets every device of
the program at each one), where an all-reduce or all-gather over a small group costs much less.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

K = 32
KINDS = ("all-reduce", "all-gather", "all-to-all", "collective-permute")


def _chain(mesh: Mesh, kind: str | None, axis, elems: int) -> Callable[[], jax.Array]:
    names = axis if isinstance(axis, tuple) else (axis,)
    g = int(np.prod([mesh.shape[a] for a in names])) if axis else 1

    def body(x):
        for _ in range(K):
            if kind == "all-reduce":
                y = jax.lax.psum(x, axis)
            elif kind == "all-gather":
                y = jax.lax.all_gather(x[: elems // g], axis, tiled=True)
            elif kind == "all-to-all":
                y = jax.lax.all_to_all(x.reshape(g, -1), axis, 0, 0, tiled=True).reshape(-1)
            elif kind == "collective-permute":
                y = jax.lax.ppermute(x, axis, [(j, (j + 1) % g) for j in range(g)])
            else:
                y = x
            x = jnp.tanh(y * 1.0001)
        return x

    spec = P(("f", "t"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((8 * elems,), jnp.float32), NamedSharding(mesh, spec))
    jax.block_until_ready(f(x))
    return lambda: f(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--elems", type=int, default=256, help="float32 elements per device")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("f", "t"))
    chains = {("none", None): _chain(mesh, None, None, args.elems)}
    for axis in ("t", "f", ("f", "t")):
        for kind in KINDS:
            chains[(kind, axis)] = _chain(mesh, kind, axis, args.elems)
    times: dict = {k: [] for k in chains}
    for _ in range(args.rounds):
        for k, fn in chains.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    base_min, base_med = min(times[("none", None)]), float(np.median(times[("none", None)]))
    per = {k: ((min(v) - base_min) / K, (float(np.median(v)) - base_med) / K) for k, v in times.items()}
    ref = per[("all-reduce", ("f", "t"))]
    print(f"{args.elems * 4} bytes per device, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    print("| kind | group | fastest us | median us | median vs all-reduce over 8 |\n| --- | --- | --- | --- | --- |")
    for (kind, axis), (lo, med) in per.items():
        if kind == "none":
            continue
        group = "+".join(axis) if isinstance(axis, tuple) else axis
        print(f"| {kind} | {group} | {lo * 1e6:.0f} | {med * 1e6:.0f} | {med / ref[1]:.2f}x |")


if __name__ == "__main__":
    main()
