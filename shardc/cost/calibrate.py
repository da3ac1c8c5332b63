"""The `cpu-host` topology: the XLA:CPU devices of this machine, measured by a short micro-benchmark
(a few seconds) the first time and cached on disk (`shardc.cost.cache`).

All devices run at once, as they do in a sharded step, so the rates are per device under contention:

* matmul FLOP/s: a data-parallel float32 matmul over every device;
* memory bandwidth: a data-parallel elementwise op on large arrays (bytes read + written);
* per-op overhead: a chain of tiny dependent matmuls (one XLA thunk each);
* contention: how much faster one device runs the matmul alone than each device runs it with all busy
  (ops profiled alone, `shardc.cost.profile`, are scaled by it);
* link bandwidth and latency: all-reduces of two sizes over all devices, fitted to the ring formula
  t = 2(n-1) a + 2(n-1)/n B / bw.

XLA:CPU runs collectives on the compute threads (no overlap), has no reduce-scatter (it all-reduces and
slices) and merges all-reduces without a byte limit; the topology says so.
"""
from __future__ import annotations

import hashlib
import os
import platform
import statistics
import time
from typing import Any, Callable

from shardc.cost.cache import DiskCache
from shardc.cost.topology import Device, Level, Topology

__all__ = ["cpu_host", "measure_cpu_host", "contention"]

_VERSION = 2


def _median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 2) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_cpu_host() -> dict[str, float]:
    """Measure this host's per-device rates (seconds of work: ~5-10 s)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from shardc.sharding import make_mesh

    devs = jax.devices()
    n = len(devs)
    mesh = make_mesh({"d": n})
    rows = NamedSharding(mesh, P("d"))
    rep = NamedSharding(mesh, P())

    m = 384
    x = jax.device_put(jnp.ones((n * m, m), jnp.float32), rows)
    w = jax.device_put(jnp.ones((m, m), jnp.float32), rep)
    mm = jax.jit(lambda a, b: a @ b, out_shardings=rows)
    t = _median_time(lambda: mm(x, w))
    flops = 2.0 * m * m * m / t
    x1 = jax.device_put(jnp.ones((m, m), jnp.float32), devs[0])
    w1 = jax.device_put(jnp.ones((m, m), jnp.float32), devs[0])
    alone = 2.0 * m * m * m / _median_time(lambda: jax.jit(lambda a, b: a @ b)(x1, w1))

    big = jax.device_put(jnp.ones((n * 1024, 1024), jnp.float32), rows)
    ew = jax.jit(lambda a: a * 1.5 + 0.5, out_shardings=rows)
    t = _median_time(lambda: ew(big))
    bandwidth = 2.0 * 1024 * 1024 * 4 / t

    k = 64
    small = jax.device_put(jnp.ones((n * 8, 8), jnp.float32), rows)
    sw = jax.device_put(jnp.eye(8, dtype=jnp.float32), rep)

    def chain(a, b):
        for _ in range(k):
            a = jnp.tanh(a @ b)
        return a

    ch = jax.jit(chain, out_shardings=rows)
    overhead = _median_time(lambda: ch(small, sw)) / k

    def allreduce_time(cols: int) -> float:
        part = jax.device_put(jnp.ones((n, cols), jnp.float32), rows)
        f = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=rep)
        return _median_time(lambda: f(part))

    small_b, big_b = 4 * 256, 4 * (1 << 20)
    t_small, t_big = allreduce_time(small_b // 4), allreduce_time(big_b // 4)
    steps = 2 * max(n - 1, 1)
    frac = 2 * (n - 1) / n if n > 1 else 1.0
    link_bw = frac * (big_b - small_b) / max(t_big - t_small, 1e-9)
    latency = max(t_small - frac * small_b / link_bw, 1e-7) / steps
    return {"flops": flops, "bandwidth": bandwidth, "overhead": overhead, "link_bandwidth": link_bw,
            "latency": latency, "devices": float(n), "contention": max(alone / flops, 1.0)}


def _host_key() -> str:
    import jax

    n = len(jax.devices())
    raw = f"{_VERSION}|{platform.node()}|{platform.processor()}|{os.cpu_count()}|{n}|{jax.__version__}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def cpu_host(*, refresh: bool = False) -> Topology:
    """The measured topology of this host's XLA:CPU devices (cached; `refresh=True` re-measures)."""
    cache = DiskCache("cpu-host")
    key = _host_key()
    m = None if refresh else cache.get(key)
    if m is None:
        m = measure_cpu_host()
        cache.put(key, m)
    n = int(m["devices"])
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        ram = 16 * 2**30
    dev = Device("cpu (measured)", {"float32": m["flops"], "float64": m["flops"] / 2, "bfloat16": m["flops"] / 2,
                                    "float16": m["flops"] / 2, "int8": m["flops"]},
                 mem_bandwidth=m["bandwidth"], memory=ram / max(n, 1), matmul_efficiency=1.0, vector_efficiency=1.0,
                 op_overhead=m["overhead"])
    topo = Topology("cpu-host", dev, (Level("host", n, m["link_bandwidth"], m["latency"]),), overlap=False,
                    reduce_scatter=False, source=f"measured on {platform.node()} ({os.cpu_count()} cores, {n} devices)",
                    combine_bytes=float("inf"), backend="cpu")
    return topo


def contention() -> float:
    """How many times slower an op runs on one device while all devices are busy (from the cpu-host cache)."""
    cpu_host()
    return float(DiskCache("cpu-host").get(_host_key()).get("contention", 1.0))
