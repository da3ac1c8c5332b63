"""The `cpu-host` topology: the XLA:CPU devices of this machine, measured by a short micro-benchmark
(a few seconds) the first time and cached on disk (`shardc.cost.cache`), so that the same cache gives
the same topology, and so the same plans. `@shardc.auto` prices plans on it by default on CPU devices
(`shardc.cost.local`); accelerators without a preset get the same measurement (`measured_local`).

All devices run at once, as they do in a sharded step, so the rates are per device under contention:

* matmul FLOP/s: a data-parallel float32 matmul over every device;
* elementwise FLOP/s: a fused chain of multiply-adds on a cache-sized array (the time of a long chain
  minus a short one, so the call's fixed cost cancels);
* memory bandwidth: a data-parallel elementwise op on large arrays (bytes read + written), writing over its
  donated input: a step's buffers are XLA's preallocated temporaries or donated state, and a fresh output
  would add the page faults of a new allocation (priced apart, below), which made the measured rate 1.5-2x lower;
* per-op overhead: a chain of tiny dependent matmuls (one XLA thunk each);
* contention: how much faster one device runs the matmul alone than each device runs it with all busy
  (ops profiled alone, `shardc.cost.profile`, are scaled by it);
* what each collective kind costs (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute):
  chains of 8 collectives of 1 KiB per device over pairs of devices and over all devices, and of 1 MiB over
  all devices, each collective after a tanh pass over 256 KiB per device that it depends on, minus the same
  chains without the collectives, fitted per kind to a fixed cost linear in the group size plus seconds per
  payload byte (`CollectiveFit`). XLA:CPU runs every device on a thread of the host and meets all the threads of a
  group at each collective: a barrier, which costs the rendezvous and the wait for the slowest thread of the
  group, whose work the threads sharing the cores have not finished alike (so the work between collectives counts:
  at load 9, ~110-165 us over 8 devices with none, ~350-500 us with the 256 KiB pass; ~30-190 us over pairs). A
  collective-permute meets every device of the program whatever its pairs. The ring model it replaces
  (`link_bandwidth`, `latency`: 24 us per step) had priced an all-reduce at twice an all-gather's fixed cost and a
  small all-to-all at 7 steps. Its link bandwidth and latency are still derived (from the all-reduce fit over all
  devices) for what `Topology.__str__` shows and for kinds a level has no fit for;
* the cost of fresh memory: XLA:CPU allocates a step's temporaries as one buffer per device with `malloc`,
  and glibc maps an allocation over its mmap threshold (at most 32 MiB) from the OS and unmaps it when it is
  freed, so a step whose temporaries reach the threshold faults every page in again, every step (about 1.5
  us per 4 KiB page here: a third of a 62 MiB-temporary step). Measured as an elementwise op over a
  48 MiB-per-device array writing a fresh output minus the same op writing over its donated input.

* which primitives are priced by timing them on these devices instead (`shardc.cost.host_ops`: XLA:CPU's
  convolutions, whose speed no roofline gives): timed lazily, per op configuration, the first time a plan
  needs one, and cached.

XLA:CPU runs collectives on the compute threads (no overlap), has no reduce-scatter (it all-reduces and
slices) and merges all-reduces without a byte limit; the topology says so. In a multi-process job each
process measures its own devices and every process uses process 0's numbers (the plans must agree).
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import platform
import time
from typing import Any, Callable, Sequence

from shardc.cost.cache import DiskCache
from shardc.cost.host_ops import HOST_MEASURED
from shardc.cost.topology import COLLECTIVE_KINDS, CollectiveFit, Device, Level, Topology

__all__ = ["cpu_host", "measured_local", "measure_cpu_host", "contention", "store", "host_key"]

_VERSION = 7
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
    """Measure this process's devices (a few seconds of work, most of it compiling the collective chains; the
    name is historical: any backend)."""
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
    mm1 = jax.jit(lambda a, b: a @ b)  # one jitted function: a fresh one per call timed its tracing (contention 1.0)
    alone = 2.0 * m * m * m / _best_time(lambda: mm1(x1, w1))

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

    bandwidth = 2.0 * 1024 * 1024 * 4 / _in_place_time(rows, n, 1024 * 1024)

    k = 64
    small = jax.device_put(jnp.ones((n * 8, 8), jnp.float32), rows)
    sw = jax.device_put(jnp.eye(8, dtype=jnp.float32), rep)

    def chain(a, b):
        for _ in range(k):
            a = jnp.tanh(a @ b)
        return a

    ch = jax.jit(chain, out_shardings=rows)
    overhead = _best_time(lambda: ch(small, sw)) / k

    fits = _collective_fits(devs) if n > 1 else {}
    measured = {"flops": flops, "bandwidth": bandwidth, "overhead": overhead, "devices": float(n),
                "contention": max(alone / flops, 1.0), "vector_flops": min(vector, flops),
                "fresh_memory_cost": _fresh_memory_cost(rows, n) if _glibc() else 0.0,
                "host_measured_ops": 1.0}  # price HOST_MEASURED primitives by timing them here (host_ops)
    return {**measured, **_ring_summary(fits, n, bandwidth, overhead), **fits}


def _ring_summary(fits: dict[str, float], n: int, bandwidth: float, overhead: float) -> dict[str, float]:
    """The ring model's link bandwidth and latency that the all-reduce fit gives over all `n` devices
    (2(n-1) steps, 2(n-1)/n of the payload sent), and a collective-permute's fixed cost: what a level prices
    kinds it has no fit for with, and what `Topology.__str__` shows."""
    if n <= 1 or not fits:
        return {"link_bandwidth": bandwidth, "latency": overhead, "permute_latency": overhead}
    ar = _fit_of(fits, "all-reduce")
    per_byte = max(ar.per_byte + ar.per_byte_spread * (n - 1) / n, 1e-13)
    return {"link_bandwidth": 2 * (n - 1) / n / per_byte, "latency": max(ar.fixed(n) / (2 * (n - 1)), 1e-7),
            "permute_latency": _fit_of(fits, "collective-permute").fixed(n)}


def _in_place_time(rows: Any, n: int, elems: int) -> float:
    """Seconds of an elementwise op over `elems` float32 per device writing over its donated input: memory
    traffic alone, without allocating (a step's buffers come from XLA's preallocated temporaries or donated
    state; a fresh output would also fault its pages in, which `_fresh_memory_cost` prices apart)."""
    import jax
    import jax.numpy as jnp

    in_place = jax.jit(lambda a: a * 1.0001 + 0.5, out_shardings=rows, donate_argnums=0)
    box = [jax.device_put(jnp.ones((n * elems,), jnp.float32), rows)]

    def step() -> Any:
        box[0] = in_place(box[0])
        return box[0]

    return _best_time(step)


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
    x = jax.device_put(jnp.ones((n * elems,), jnp.float32), rows)
    t_fresh = _best_time(lambda: fresh(x))
    del x
    return max(t_fresh - _in_place_time(rows, n, elems), 0.0) / (elems * 4)


# Collective fits: float32 elements per device of the small and the large payload, collectives per chain, and
# the work between two collectives (float32 elements per device of a tanh pass: ~0.1-0.4 ms here, about what a
# layer of the models planned on this host computes between two collectives).
_FIT_SMALL, _FIT_LARGE, _FIT_CHAIN, _FIT_WORK = 256, 256 * 1024, 8, 64 * 1024
_FIT_FIELDS = ("base", "per_peer", "per_byte", "per_byte_spread")
_MIN_FIXED = 1e-6  # seconds: the least a collective's rendezvous of device threads is taken to cost
_FIT_RETRIES, _FIT_NOISE = 3, 0.02  # runs again of a chain measured within 2% of its baseline (a busy machine)


def _fit_groups(n: int) -> tuple[int, ...]:
    """The group sizes the fixed costs are measured over: pairs of neighbours and all `n` devices (linear in
    n - 1 between them), or all devices alone when pairs do not tile them."""
    return (2, n) if n > 2 and n % 2 == 0 else (n,)


def _collective_chain(mesh: Any, kind: str | None, axis: Any, group: int, elems: int) -> Callable:
    """A jitted chain of `_FIT_CHAIN` collectives of `kind` over `axis` (groups of `group` devices), each on a
    payload of `elems` float32 per device, after a tanh pass over `_FIT_WORK` elements that depends on the
    collective before it (kind None: the chain without the collectives, whose time is subtracted)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def collective(x: Any) -> Any:
        if kind == "all-reduce":
            return jax.lax.psum(x, axis)
        if kind == "all-gather":
            return jax.lax.all_gather(x[: elems // group], axis, tiled=True)
        if kind == "reduce-scatter":
            return jnp.tile(jax.lax.psum_scatter(x, axis, tiled=True), group)
        if kind == "all-to-all":
            return jax.lax.all_to_all(x.reshape(group, -1), axis, 0, 0, tiled=True).reshape(-1)
        if kind == "collective-permute":
            return jax.lax.ppermute(x, axis, [(j, (j + 1) % group) for j in range(group)])
        return x

    def body(x: Any, w: Any) -> Any:
        for _ in range(_FIT_CHAIN):
            w = jnp.tanh(w * 1.0001 + x[0])  # the work between collectives, after the last one ...
            x = collective(x + w[0]) * 1.0001 + 0.5  # ... and before the next
        return x, w

    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))


def _collective_fits(devs: Sequence[Any], rounds: int = 7) -> dict[str, float]:
    """Fit each collective kind's cost (`CollectiveFit`) on these devices: chains of collectives of a small
    payload over the groups of `_fit_groups` and of a large one over all devices, each minus the chain without
    them, the fastest of `rounds` round-robin runs (`_chain_times`: other processes only ever add time). Keys
    `"<kind>:<field>"`. (The seconds per byte are measured over all devices only: over pairs they differed by
    less than the noise of a busy machine, and each chain compiled costs ~0.2-0.5 s of the first plan.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = len(devs)
    groups = _fit_groups(n)
    pairs = len(groups) == 2
    mesh = Mesh(np.array(devs).reshape(n // 2, 2) if pairs else np.array(devs), ("o", "i") if pairs else ("i",))
    axis = {2: "i", n: mesh.axis_names}  # (pairs: the minor axis, neighbouring devices; all: every axis)
    sizes = tuple(-(-e // n) * n for e in (_FIT_SMALL, _FIT_LARGE))  # (divisible by every group)
    spec = NamedSharding(mesh, P(mesh.axis_names))
    small, large = sizes
    todo = [(None, 0, small), (None, 0, large)] + [(k, g, small) for k in COLLECTIVE_KINDS for g in groups] + \
        [(k, n, large) for k in COLLECTIVE_KINDS]
    inputs = {e: jax.device_put(jnp.ones((n * e,), jnp.float32), spec) for e in sizes}
    work = jax.device_put(jnp.ones((n * max(_FIT_WORK, 1),), jnp.float32), spec)

    def compiled(key: tuple) -> Callable:
        kind, g, e = key
        return functools.partial(_collective_chain(mesh, kind, axis.get(g), g, e).lower(inputs[e], work).compile(),
                                 inputs[e], work)

    with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:  # (XLA compiles off the GIL)
        runs = dict(zip(todo, pool.map(compiled, todo)))
    best = _chain_times(runs, rounds)
    per = {(kind, g, e): max(t - best[(None, 0, e)], 0.0) / _FIT_CHAIN
           for (kind, g, e), t in best.items() if kind is not None}
    out: dict[str, float] = {}
    for kind in COLLECTIVE_KINDS:
        fit = _fit(kind, {g: (4 * small, per[(kind, g, small)]) for g in groups}, (4 * large, per[(kind, n, large)]))
        out.update({f"{kind}:{f}": float(getattr(fit, f)) for f in _FIT_FIELDS})
    return out


def _chain_times(runs: dict[tuple, Callable[[], Any]], rounds: int) -> dict[tuple, float]:
    """The fastest time of each chain (keyed (kind, group, elems); kind None: the baseline without collectives)
    over `rounds` round-robin runs; a chain that came out within `_FIT_NOISE` of its baseline lost to other
    processes (its collectives cost 10-50% of the baseline on a quiet machine) and is run again with its
    baseline, up to `_FIT_RETRIES` times."""
    best = _round_robin(runs, rounds)
    for _ in range(_FIT_RETRIES):
        lost = [k for k in runs if k[0] is not None and best[k] <= (1 + _FIT_NOISE) * best[(None, 0, k[2])]]
        if not lost:
            break
        again = _round_robin({k: runs[k] for k in [(None, 0, e) for e in {k[2] for k in lost}] + lost}, 2 * rounds)
        best.update({k: min(best[k], t) for k, t in again.items()})
    return best


def _fit(kind: str, small: dict[int, tuple[int, float]], large: tuple[int, float]) -> CollectiveFit:
    """The fit of one kind from (payload bytes, seconds) of a small payload per group size (`small`, the
    largest group last) and of a large one over the largest group: seconds per byte from the two payloads over
    the largest group, then the fixed cost per group size (its small payload's time less its bytes), linear in
    n - 1 between the two group sizes. A busy machine only adds time, so a fit never has a larger group meet
    faster than a smaller one (the smaller group's time is then taken as noise and the larger group's fixed
    cost used for both) nor a fixed cost under `_MIN_FIXED`."""
    *_, top = sorted(small)
    per_byte = max((large[1] - small[top][1]) / (large[0] - small[top][0]), 0.0)
    fixed = {g: max(t - per_byte * b, _MIN_FIXED) for g, (b, t) in small.items()}
    if len(fixed) == 1:
        return CollectiveFit(kind, fixed[top], 0.0, per_byte, 0.0)
    lo, hi = sorted(fixed)
    per_peer = max(fixed[hi] - fixed[lo], 0.0) / (hi - lo)
    return CollectiveFit(kind, min(fixed[lo], fixed[hi]) - per_peer * (lo - 1), per_peer, per_byte, 0.0)


def _fit_of(m: dict[str, float], kind: str) -> CollectiveFit:
    return CollectiveFit(kind, *(float(m[f"{kind}:{f}"]) for f in _FIT_FIELDS))


def _fits_of(m: dict[str, float]) -> tuple[CollectiveFit, ...]:
    """The collective fits a measurement holds (none in one taken before they were measured)."""
    return tuple(_fit_of(m, k) for k in COLLECTIVE_KINDS if all(f"{k}:{f}" in m for f in _FIT_FIELDS))


def _round_robin(runs: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, float]:
    """The fastest of `rounds` runs of each function, run round robin after one warm-up run each, so that a busy
    moment on the machine hits all of them alike."""
    import jax

    for fn in runs.values():
        jax.block_until_ready(fn())
    best = {k: float("inf") for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def host_key() -> str:
    """This host, its processor, devices and jax version (what a measurement made here is valid for)."""
    import jax

    d = jax.local_devices()[0]
    raw = (f"{_VERSION}|{platform.node()}|{cpu_model()}|{os.cpu_count()}|{len(jax.local_devices())}|"
           f"{jax.device_count()}|{d.platform}|{getattr(d, 'device_kind', '')}|{jax.__version__}")
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The processor: vendor, family, model, stepping and name from /proc/cpuinfo where there is one (virtual
    machines of one host name may run on different processors; `platform.processor()` is empty on Linux)."""
    fields = ("vendor_id", "cpu family", "model", "stepping", "model name")
    try:
        with open("/proc/cpuinfo") as f:
            found: dict[str, str] = {}
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in fields and name not in found:
                    found[name] = value.strip()
                if not line.strip() and found:
                    break  # (the first processor's block)
        return "/".join(found.get(k, "") for k in fields)
    except OSError:
        return f"{platform.processor()}/{platform.machine()}"


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
    key = (cache.path, host_key())
    m = None if refresh else _MEMO.get(key)
    if m is None:
        m = None if refresh else cache.get(key[1])
        if m is None:
            load = _others_load()
            m = dict(measure_cpu_host(), load_average=load)
            cache.put(key[1], m)
            _warn_if_busy(load, cache.path)
        m = _MEMO[key] = _agreed(m)
    return m


class BusyHostWarning(UserWarning):
    """This host's devices were measured while other processes kept its cores busy."""


def _others_load() -> float:
    """The 1-minute load average as the measurement starts (this process is then mostly idle, so it is
    mostly the other processes'); 0 where the OS does not say."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):  # pragma: no cover
        return 0.0


def _warn_if_busy(load: float, path: str) -> None:
    """Warn when the measurement just cached was taken with more runnable processes than cores: every cost
    then comes out higher and noisier than on a quiet machine, and plans priced on it may differ from a quiet
    machine's (the same cache still gives the same plans)."""
    cores = os.cpu_count() or 1
    if load > cores:
        import warnings

        warnings.warn(f"shardc: measured this host's devices (the cpu-host profile that prices plans) while the "
                      f"machine was busy (load average {load:.1f} on {cores} cores): op and collective costs come "
                      f"out higher and noisier than on a quiet machine, and plans priced on them may differ from a "
                      f"quiet machine's. The measurement is cached in {path}; delete it on a quiet machine (or call "
                      f"shardc.cost.calibrate.cpu_host(refresh=True)) to measure again.", BusyHostWarning,
                      stacklevel=2)


def store(m: dict[str, float]) -> None:
    """Use measurement `m` (the keys `measure_cpu_host` returns) for this host from now on, instead of
    measuring: e.g. one taken on a reference machine, so that plans priced on it match that machine's."""
    cache = DiskCache("cpu-host")
    key = host_key()
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
                 fresh_memory_cost=m.get("fresh_memory_cost", 0.0), fresh_memory_threshold=_GLIBC_MMAP_THRESHOLD_MAX,
                 measured_ops=HOST_MEASURED if m.get("host_measured_ops") else ())
    level = Level("host", n, m["link_bandwidth"], m["latency"], m.get("permute_latency"), _fits_of(m))
    busy = f", load average {m['load_average']:.1f}" if m.get("load_average", 0.0) > (os.cpu_count() or 1) else ""
    return Topology("cpu-host", dev, (level,), overlap=False,
                    reduce_scatter=False, source=f"measured on {platform.node()} ({os.cpu_count()} cores, {n} devices"
                                                 f"{busy})",
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
