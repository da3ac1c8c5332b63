"""The `cpu-host` topology: the XLA:CPU devices of this machine, measured by a short micro-benchmark
(about a second) the first time and cached on disk (`shardc.cost.cache`), so that the same cache gives
the same topology, and so the same plans. `@shardc.auto` prices plans on it by default on CPU devices
(`shardc.cost.local`); accelerators without a preset get the same measurement (`measured_local`).

All devices run at once, as they do in a sharded step, so the rates are per device under contention:

* matmul FLOP/s: a data-parallel float32 matmul over every device;
* elementwise FLOP/s: a fused chain of multiply-adds on a cache-sized array (the time of a long chain
  minus a short one, so the call's fixed cost cancels);
* memory bandwidth: a data-parallel elementwise op on large arrays (bytes read + written);
* per-op overhead: a chain of tiny dependent matmuls (one XLA thunk each);
* contention: how much faster one device runs the matmul alone than each device runs it with all busy
  (ops profiled alone, `shardc.cost.profile`, are scaled by it);
* link bandwidth and latency: all-reduces of two sizes over all devices, fitted to the ring formula
  t = 2(n-1) a + 2(n-1)/n B / bw;
* the fixed cost of a collective-permute: a chain of small permutes (each device sends to the next) minus
  the same chain without them. XLA:CPU meets every device of the program at each permute, so one costs
  several ring steps, not one (issue 14: a plan whose reshards were
  collective-permutes ran slower than the model said);
* the cost of fresh memory: XLA:CPU allocates a step's temporaries as one buffer per device with `malloc`,
  and glibc maps an allocation over its mmap threshold (at most 32 MiB) from the OS and unmaps it when it is
  freed, so a step whose temporaries reach the threshold faults every page in again, every step (about 1.5
  us per 4 KiB page here: a third of a 62 MiB-temporary step). Measured as an elementwise op over a
  48 MiB-per-device array writing a fresh output minus the same op writing over its donated input.

XLA:CPU runs collectives on the compute threads (no overlap), has no reduce-scatter (it all-reduces and
slices) and merges all-reduces without a byte limit; the topology says so. In a multi-process job each
process measures its own devices and every process uses process 0's numbers (the plans must agree).
"""
from __future__ import annotations

import hashlib
import os
import platform
import time
from typing import Any, Callable

from shardc.cost.cache import DiskCache
from shardc.cost.topology import Device, Level, Topology

__all__ = ["cpu_host", "measured_local", "measure_cpu_host", "contention", "store"]

_VERSION = 5
# glibc's largest mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX): allocations at least this
# large are always mapped afresh; below it glibc raises its threshold as mapped chunks are freed and reuses
# its heap, so a buffer allocated every step stops faulting after the first steps.
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20
_MEMO: dict[tuple[str, str], dict[str, float]] = {}  # (cache file, host key) -> measurement, per process


def _best_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 2) -> float:
    """The fastest of `repeats` runs after `warmup`: other processes on the machine only ever add time, so
    the fastest run is the least disturbed (the devices of this process still contend with each other)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return min(ts)


def measure_cpu_host() -> dict[str, float]:
    """Measure this process's devices (about a second of work; the name is historical: any backend)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from shardc.sharding import make_mesh

    devs = jax.local_devices()
    n = len(devs)
    mesh = make_mesh({"d": n}, devs)
    rows = NamedSharding(mesh, P("d"))
    rep = NamedSharding(mesh, P())

    m = 384
    x = jax.device_put(jnp.ones((n * m, m), jnp.float32), rows)
    w = jax.device_put(jnp.ones((m, m), jnp.float32), rep)
    mm = jax.jit(lambda a, b: a @ b, out_shardings=rows)
    t = _best_time(lambda: mm(x, w))
    flops = 2.0 * m * m * m / t
    x1 = jax.device_put(jnp.ones((m, m), jnp.float32), devs[0])
    w1 = jax.device_put(jnp.ones((m, m), jnp.float32), devs[0])
    alone = 2.0 * m * m * m / _best_time(lambda: jax.jit(lambda a, b: a @ b)(x1, w1))

    def fma_chain(steps: int) -> Callable:
        def f(a):
            for _ in range(steps):
                a = a * 1.0001 + 0.5
            return a
        return jax.jit(f, out_shardings=rows)

    v = jax.device_put(jnp.ones((n * 64, 1024), jnp.float32), rows)
    short, long = fma_chain(8), fma_chain(72)
    dt = _best_time(lambda: long(v), repeats=7) - _best_time(lambda: short(v), repeats=7)
    vector = 2.0 * 64 * 64 * 1024 / max(dt, 1e-9)

    big = jax.device_put(jnp.ones((n * 1024, 1024), jnp.float32), rows)
    ew = jax.jit(lambda a: a * 1.5 + 0.5, out_shardings=rows)
    t = _best_time(lambda: ew(big))
    bandwidth = 2.0 * 1024 * 1024 * 4 / t

    k = 64
    small = jax.device_put(jnp.ones((n * 8, 8), jnp.float32), rows)
    sw = jax.device_put(jnp.eye(8, dtype=jnp.float32), rep)

    def chain(a, b):
        for _ in range(k):
            a = jnp.tanh(a @ b)
        return a

    ch = jax.jit(chain, out_shardings=rows)
    overhead = _best_time(lambda: ch(small, sw)) / k

    def allreduce_time(cols: int) -> float:
        part = jax.device_put(jnp.ones((n, cols), jnp.float32), rows)
        f = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=rep)
        return _best_time(lambda: f(part))

    small_b, big_b = 4 * 256, 4 * (1 << 20)
    t_small, t_big = allreduce_time(small_b // 4), allreduce_time(big_b // 4)
    steps = 2 * max(n - 1, 1)
    frac = 2 * (n - 1) / n if n > 1 else 1.0
    link_bw = frac * (big_b - small_b) / max(t_big - t_small, 1e-9)
    latency = max(t_small - frac * small_b / link_bw, 1e-7) / steps
    permute = _permute_latency(mesh, rows, small_b // 4) - small_b / link_bw if n > 1 else latency
    return {"flops": flops, "bandwidth": bandwidth, "overhead": overhead, "link_bandwidth": link_bw,
            "latency": latency, "devices": float(n), "contention": max(alone / flops, 1.0),
            "vector_flops": min(vector, flops), "permute_latency": max(permute, latency),
            "fresh_memory_cost": _fresh_memory_cost(rows, n) if _glibc() else 0.0}


def _glibc() -> bool:
    """Whether this process allocates with glibc's malloc (whose mmap threshold the fresh-memory cost models)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _fresh_memory_cost(rows: Any, n: int, mib: int = 48) -> float:
    """Seconds per byte of a buffer mapped afresh by every device at once: an elementwise op writing a fresh
    `mib`-MiB output per device (over the mmap threshold, so mapped and faulted in every call) minus the same op
    writing over its donated input."""
    import jax
    import jax.numpy as jnp

    elems = mib * 2**20 // 4
    fresh = jax.jit(lambda a: a * 1.0001 + 0.5, out_shardings=rows)
    in_place = jax.jit(lambda a: a * 1.0001 + 0.5, out_shardings=rows, donate_argnums=0)
    x = jax.device_put(jnp.ones((n * elems,), jnp.float32), rows)
    t_fresh = _best_time(lambda: fresh(x))
    box = [jax.device_put(jnp.ones((n * elems,), jnp.float32), rows)]

    def step() -> Any:
        box[0] = in_place(box[0])
        return box[0]

    t_in_place = _best_time(step)
    del x, box
    return max(t_fresh - t_in_place, 0.0) / (elems * 4)


def _permute_latency(mesh: Any, rows: Any, elems: int, k: int = 16) -> float:
    """Seconds per collective-permute of `elems` float32 per device (each device to the next), from a chain of
    `k` of them minus the same chain without them (the call's fixed cost and the chain's arithmetic cancel)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = mesh.size
    pairs = [(i, (i + 1) % n) for i in range(n)]

    def chain(permute: bool) -> Callable:
        def body(a):
            for _ in range(k):
                a = (jax.lax.ppermute(a, "d", pairs) if permute else a) * 1.0001 + 0.5
            return a
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    x = jax.device_put(jnp.ones((n * elems,), jnp.float32), rows)
    with_p, without = chain(True), chain(False)
    return max(_best_time(lambda: with_p(x), repeats=7) - _best_time(lambda: without(x), repeats=7), 0.0) / k


def _host_key() -> str:
    import jax

    d = jax.local_devices()[0]
    raw = (f"{_VERSION}|{platform.node()}|{platform.processor()}|{os.cpu_count()}|{len(jax.local_devices())}|"
           f"{jax.device_count()}|{d.platform}|{getattr(d, 'device_kind', '')}|{jax.__version__}")
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _agreed(m: dict[str, float]) -> dict[str, float]:
    """Process 0's measurement on every process of a multi-process job (each measures its own host; the
    plans, which depend on the numbers, must agree)."""
    import jax

    if jax.process_count() == 1:
        return m
    import numpy as np
    from jax.experimental import multihost_utils

    keys = sorted(m)
    got = multihost_utils.broadcast_one_to_all(np.asarray([m[k] for k in keys], np.float32))
    return {k: float(x) for k, x in zip(keys, np.asarray(got))}


def _measurement(refresh: bool = False) -> dict[str, float]:
    """This host's measurement: from this process's memo, else the disk cache, else measured and cached."""
    cache = DiskCache("cpu-host")
    key = (cache.path, _host_key())
    m = None if refresh else _MEMO.get(key)
    if m is None:
        m = None if refresh else cache.get(key[1])
        if m is None:
            m = measure_cpu_host()
            cache.put(key[1], m)
        m = _MEMO[key] = _agreed(m)
    return m


def store(m: dict[str, float]) -> None:
    """Use measurement `m` (the keys `measure_cpu_host` returns) for this host from now on, instead of
    measuring: e.g. one taken on a reference machine, so that plans priced on it match that machine's."""
    cache = DiskCache("cpu-host")
    key = _host_key()
    cache.put(key, dict(m))
    _MEMO.pop((cache.path, key), None)


def _ram_per_device(n: int) -> float:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        ram = 16 * 2**30
    return ram / max(n, 1)


def cpu_host(*, refresh: bool = False) -> Topology:
    """The measured topology of this host's XLA:CPU devices (cached; `refresh=True` re-measures)."""
    import jax

    m = _measurement(refresh)
    n, local = jax.device_count(), int(m["devices"])
    dev = Device("cpu (measured)", {"float32": m["flops"], "float64": m["flops"] / 2, "bfloat16": m["flops"] / 2,
                                    "float16": m["flops"] / 2, "int8": m["flops"]},
                 mem_bandwidth=m["bandwidth"], memory=_ram_per_device(local), matmul_efficiency=1.0,
                 vector_efficiency=1.0, op_overhead=m["overhead"], vector_flops=m.get("vector_flops", 0.0),
                 fresh_memory_cost=m.get("fresh_memory_cost", 0.0), fresh_memory_threshold=_GLIBC_MMAP_THRESHOLD_MAX)
    level = Level("host", n, m["link_bandwidth"], m["latency"], m.get("permute_latency"))
    return Topology("cpu-host", dev, (level,), overlap=False,
                    reduce_scatter=False, source=f"measured on {platform.node()} ({os.cpu_count()} cores, {n} devices)",
                    combine_bytes=float("inf"), backend="cpu")


def measured_local(*, refresh: bool = False) -> Topology:
    """This process's accelerators, measured as `cpu_host` measures the CPU (for devices without a preset):
    collectives on their own streams, a native reduce-scatter, the device's own memory when it reports it."""
    import jax

    d = jax.local_devices()[0]
    m = _measurement(refresh)
    n = jax.device_count()
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    memory = float((stats or {}).get("bytes_limit", 0)) or _ram_per_device(int(m["devices"]))
    kind = str(getattr(d, "device_kind", d.platform))
    dev = Device(f"{kind} (measured)", {"float32": m["flops"], "bfloat16": m["flops"], "float16": m["flops"],
                                         "int8": m["flops"], "float64": m["flops"] / 2},
                 mem_bandwidth=m["bandwidth"], memory=memory, matmul_efficiency=1.0, vector_efficiency=1.0,
                 op_overhead=m["overhead"], vector_flops=m.get("vector_flops", 0.0))
    return Topology(f"measured-{d.platform}", dev, (Level(d.platform, n, m["link_bandwidth"], m["latency"]),),
                    source=f"measured on {platform.node()} ({n} x {kind})", backend=d.platform)


def contention() -> float:
    """How many times slower an op runs on one device while all devices are busy (from the cpu-host cache)."""
    return float(_measurement().get("contention", 1.0))
