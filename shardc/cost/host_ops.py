"""Ops whose cost on XLA:CPU no roofline gives, timed on this host the way a sharded step runs them.

XLA:CPU's convolutions are the case in point: the kernel-gradient convolution of a 3x3 conv (the output
gradient is its 32x32 "window") runs at a fraction of the matmul rate once its patches outgrow the cache, and
the fraction falls off a cliff with the batch (on a Zen 3 host, 64 -> 64 channels at 32x32: 0.65x the roofline's
time at batch 4, 4.6x at batch 32, a 56x jump for 8x the FLOPs), while the forward convolution runs faster than
the roofline. A plan that replicates a CNN's work over devices (or splits its height) was priced 3x too cheap.

`HostMeasuredEstimator` times each such op at its local shapes **on every local device at once** (a
`shard_map` over all devices, each running the op on its own copy: the contention of a step in which every
device computes), keeps the median of 3-5 runs (the fastest was sometimes a run 2x faster than the op ever
runs inside a step) minus the time of the same call with no work, and caches it on disk per op configuration and
host (`op-profiles-host`), so the same host prices the same plan alike from then on. Everything else is the
roofline's (`AnalyticalEstimator`), and so are ops it prices under `min_time` (1 ms): timing one costs more
planning than its error costs the plan.

Matmuls can be timed too (`primitives=`), but are not by default: with them timed the plans of
`bench/sim_vs_measured.py` ranked better (tau 0.87), yet on the Flax Gemma example (`bench.upstream_gemma`,
fsdp 4 x tensor 2) the search then preferred, by 1.3% of simulated time, a plan with 100 all-gathers, 17
all-to-alls and 21 permutes that ran 1.09-1.21x slower than the authors' jax.jit (the hints' plan, which it
chose with matmuls on the roofline, ran 1.00x): such plans' all-gathers of non-major dims cost XLA:CPU two
transpose copies each, which were not priced then (they are now: `RELAYOUT_COPY` below), and sharper compute
prices let that error decide.

Relayout copies are timed too (`RELAYOUT_COPY`, `HostMeasuredEstimator.relayout_time`): XLA:CPU copies an
all-gather's operand into an order with the gathered dim most major and the result back (docs/simulator.md);
each copy is a transpose kernel, timed at its local shape and order, every device at once.

Narrow matmuls are (`NARROW_MATMUL`): a dot_general with a contracted or result dim of at most 64 elements per
device, such as a Megatron split of 32-wide attention heads, runs far below the roofline on XLA:CPU (packing
overhead, partly in Eigen: 15% of the CPU samples of such a step; timed from a tenth of `min_time`, since their
error is a factor), and the roofline priced the Transformer's
Megatron-on-8 plan of `bench/sim_vs_measured.py` at 0.63-0.70x its measured time. Timing them, against the
same measurements, ranked that benchmark's 28 plans better in two runs (Kendall tau 0.814 -> 0.841 and 0.820 ->
0.846; within each model 0.686 -> 0.752 and 0.653 -> 0.719), and left the Flax Gemma example's plans (no narrow
matmul of 1 ms there) unchanged.

Strided reads are timed too (`STRIDED_READ`, `HostMeasuredEstimator.strided_read_time`): a loop fusion reading an
operand through a transpose that moves its minor dim reads it element by element across its memory order, 15-50x
a streaming read per byte at a few MiB, and more when the row stride is a large power of two (cache-set
conflicts), so its price depends on the shape and is measured at it: an elementwise op reading the operand
transposed minus the same op reading it in order, every device at once.

Known limit: the kernel-gradient convolution's time is bimodal across processes on the Zen 3 host (the same op
at the same shapes ~1.3 s in one process, ~3.2 s in another, stable within each), as is the step that runs it;
the cache keeps whichever the first timing saw.

The measured `cpu-host` topology uses it for the primitives in `HOST_MEASURED` (its measurement records them,
`shardc.cost.calibrate`); a stored reference measurement without them (the tests') stays purely analytical.
Multi-process jobs do not use it: every process must price plans alike.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import sys
import time
from typing import Any, Mapping

import numpy as np

from shardc.cost.cache import DiskCache
from shardc.cost.estimator import AnalyticalEstimator, OpKey
from shardc.cost.profile import ProfilingEstimator, find_primitive
from shardc.cost.topology import Device

__all__ = ["HOST_MEASURED", "STRIDED_READ", "NARROW_MATMUL", "RELAYOUT_COPY", "HostMeasuredEstimator",
           "contended_time", "contended_strided_read", "contended_relayout", "default_estimator", "relayout_seconds"]

# Not a primitive: a loop fusion reading an operand across its memory order (a transpose moving the minor dim
# fused into it: `shardc.cost.program.strided_readers`), timed as such a read beyond reading the operand in order.
STRIDED_READ = "strided_read"
# What the cpu-host topology measures rather than models (matmuls: see the module docstring).
# Not a primitive either: dot_generals with a dim of at most `_NARROW` elements per device (`_narrow`).
NARROW_MATMUL = "narrow_matmul"
# Not a primitive: XLA:CPU's copy of a buffer into another memory order (a transpose kernel), as it makes around an
# all-gather of a non-major dim (`shardc.cost.program.gathered_order`).
RELAYOUT_COPY = "relayout_copy"
HOST_MEASURED = ("conv_general_dilated", STRIDED_READ, NARROW_MATMUL, RELAYOUT_COPY)
_NARROW = 64
_MIN_STRIDED_BYTES = 64 * 1024  # a smaller operand stays in the core's cache: its strided read costs ~nothing
_RUNS, _BUDGET_S = 5, 1.0  # at most this many timed runs, fewer once they have taken the budget
_MIN_TIME_S = 1e-3
# Narrow matmuls run at a fraction of the roofline's rate (2-3x its time), so one the roofline prices well under
# `min_time` still moves a step by milliseconds: a 32-wide head's projection on 8 devices is ~0.9 ms on the
# roofline of a host measured at 2e10 FLOP/s, and was left untimed there (the plan priced at 0.54x its time).
_NARROW_MIN_TIME_FRACTION = 0.1
_TIMING_VERSION = 2  # in the cache key: 2 = the median of runs (1 kept the fastest)
_IDLE: dict[int, float] = {}  # devices -> seconds of a call with no work (per process)
_ANNOUNCED = False


def _mesh() -> Any:
    import jax
    from jax.sharding import Mesh

    return Mesh(np.asarray(jax.local_devices()), ("devices",))


def _typical(fn: Any, args: list[Any]) -> float:
    """The median of 3-5 timed runs after a warm-up. Not the fastest: a cache-bound op (the kernel-gradient
    convolution) now and then runs 2x faster than it does inside a step, and the fastest run priced a plan at half
    its measured time."""
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times: list[float] = []
    while len(times) < 3 or (len(times) < _RUNS and sum(times) < _BUDGET_S):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _on_every_device(body: Any, shapes: tuple, dtypes: tuple) -> float:
    """Seconds one call of `body` takes when every local device runs it at once on its own operands."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _mesh()
    n = mesh.devices.size
    spec = NamedSharding(mesh, P("devices"))
    args = [jax.device_put(jnp.ones((n, *s), dtype=jnp.dtype(d)), spec) for s, d in zip(shapes, dtypes)]

    def per_device(*xs: Any) -> Any:
        out = body(*(x[0] for x in xs))
        return jax.tree.map(lambda o: o[None], out)

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("devices"), out_specs=P("devices")))
    with jax.set_mesh(mesh):  # (its own mesh, whatever mesh the user's step is planned under: `jax.set_mesh`)
        return _typical(fn, args)


def _idle_call() -> float:
    """Seconds of a call with no work on every local device (measured once per process and device count)."""
    import jax

    n = jax.local_device_count()
    if n not in _IDLE:
        _IDLE[n] = _on_every_device(lambda x: x, ((1,),), ("float32",))
    return _IDLE[n]


def contended_time(primitive: Any, params: Mapping[str, Any], in_shapes: tuple, in_dtypes: tuple) -> float:
    """Seconds `primitive` takes on one device at these local shapes while every local device runs it."""
    bind = {k: (None if k in ("sharding", "out_sharding") else v) for k, v in params.items()}
    total = _on_every_device(lambda *xs: primitive.bind(*xs, **bind), in_shapes, in_dtypes)
    return max(total - _idle_call(), 0.0)


def contended_strided_read(shape: tuple, dtype: str, perm: tuple) -> float:
    """Seconds a loop fusion spends reading an operand of `shape` through transpose `perm` beyond reading it in
    order (an elementwise op of it and a second operand, one way and the other), every local device at once."""
    import jax.numpy as jnp

    out_shape = tuple(shape[p] for p in perm)

    def update(read: Any) -> Any:
        return lambda m, a: m * 0.9 + read(a) * 0.1

    across = _on_every_device(update(lambda a: jnp.transpose(a, perm)), (out_shape, shape), (dtype, dtype))
    along = _on_every_device(update(lambda a: a.reshape(out_shape)), (out_shape, shape), (dtype, dtype))
    return max(across - along, 0.0)


def contended_relayout(shape: tuple, dtype: str, perm: tuple) -> float:
    """Seconds a copy of an operand of `shape` into memory order `perm` (a transpose kernel of its own) takes,
    every local device at once, beyond a call with no work."""
    import jax.numpy as jnp

    return max(_on_every_device(lambda a: jnp.transpose(a, perm), (tuple(shape),), (dtype,)) - _idle_call(), 0.0)


@dataclasses.dataclass
class HostMeasuredEstimator(ProfilingEstimator):
    """The roofline, except for `primitives`, which are timed on this host's devices under contention (the
    caching and fallback of `ProfilingEstimator`; `repeats`, `warmup` and `scale` do not apply)."""

    primitives: frozenset[str] = frozenset(HOST_MEASURED)
    # ops the roofline prices under this many seconds keep its price: timing one costs more planning time than
    # its error costs the step (and a few big ops are what set the step time)
    min_time: float = _MIN_TIME_S

    def __post_init__(self) -> None:
        if self.cache is None:
            self.cache = DiskCache("op-profiles-host")
        super().__post_init__()

    def cache_key(self, key: OpKey) -> str:
        import jax

        from shardc.cost.calibrate import host_key

        raw = json.dumps([_TIMING_VERSION, key.primitive, repr(key.params), key.in_shapes, key.in_dtypes, host_key(),
                          jax.local_device_count()], sort_keys=True, default=repr)
        return hashlib.sha1(raw.encode()).hexdigest()

    def profilable(self, key: OpKey, params: Mapping[str, Any]) -> bool:
        if key.primitive in (STRIDED_READ, RELAYOUT_COPY):  # (no roofline prices them: timed unless cache-sized)
            return key.primitive in self.primitives and _strided_bytes(key) >= _MIN_STRIDED_BYTES
        if key.primitive == "dot_general" and NARROW_MATMUL in self.primitives and _narrow(key, params):
            return self.fallback.op_time(key, params) >= self.min_time * _NARROW_MIN_TIME_FRACTION
        return key.primitive in self.primitives and self.fallback.op_time(key, params) >= self.min_time

    def measure(self, key: OpKey, params: Mapping[str, Any]) -> float:
        """Seconds of the op on one device while every local device runs it (an error: the roofline prices it)."""
        _announce(self.cache.path)
        if key.primitive in (STRIDED_READ, RELAYOUT_COPY):
            timer = contended_strided_read if key.primitive == STRIDED_READ else contended_relayout
            try:
                return timer(key.in_shapes[0], key.in_dtypes[0], params["permutation"])
            except Exception:  # not runnable here: unpriced, as on a host that does not time it
                return 0.0
        prim = find_primitive(key.primitive)
        if prim is None:
            raise LookupError(f"no jax primitive {key.primitive!r}")
        return contended_time(prim, params, key.in_shapes, key.in_dtypes)

    def seconds(self, measured: float, key: OpKey) -> float:
        if key.primitive == STRIDED_READ:  # (time inside the reading fusion: no kernel of its own)
            return measured
        # The measured call wrote its result to memory: a kernel boundary, as the roofline's overhead assumes.
        return measured + (self.device.op_overhead if key.kernel_boundary else 0.0)

    def strided_read_time(self, shape: tuple, dtype: str, perm: tuple) -> float:
        """Seconds a loop fusion spends reading a local operand of `shape` through transpose `perm` beyond a read
        in order (timed once per configuration and host and cached, as ops are; 0 when not measured or
        cache-sized)."""
        key = OpKey(STRIDED_READ, (("permutation", tuple(perm)),), (tuple(shape),), (), (str(dtype),), ())
        return self.op_time(key) if self.profilable(key, {}) else 0.0


    def relayout_time(self, shape: tuple, dtype: str, perm: tuple) -> float | None:
        """Seconds of XLA:CPU's copy of a local buffer of `shape` into memory order `perm` (`RELAYOUT_COPY`), timed
        once per configuration and host and cached; None when not measured here (the caller prices a copy)."""
        out = tuple(shape[p] for p in perm)
        key = OpKey(RELAYOUT_COPY, (("permutation", tuple(perm)),), (tuple(shape),), (out,), (str(dtype),),
                    (str(dtype),))
        return self.op_time(key) if self.profilable(key, {}) else None


def relayout_seconds(estimator: Any, shape: tuple, dtype: str, perm: tuple) -> float:
    """Seconds of a copy of a local buffer of `shape` into memory order `perm`: timed on the host when the
    estimator times relayouts (`HostMeasuredEstimator.relayout_time`), else a copy on its roofline."""
    timed = getattr(estimator, "relayout_time", None)
    seconds = timed(tuple(shape), dtype, tuple(perm)) if timed is not None else None
    if seconds is None:
        out = tuple(shape[p] for p in perm)
        seconds = estimator.op_time(OpKey("copy", (), (tuple(shape),), (out,), (dtype,), (dtype,)))
    return seconds


def _narrow(key: OpKey, params: Mapping[str, Any]) -> bool:
    """A matmul with a contracted or result dim of at most `_NARROW` elements per device."""
    try:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lhs, rhs = key.in_shapes[:2]
    except (KeyError, ValueError, TypeError):
        return False
    k = int(np.prod([lhs[d] for d in lc]))
    m = int(np.prod([n for d, n in enumerate(lhs) if d not in lc and d not in lb]))
    n = int(np.prod([n for d, n in enumerate(rhs) if d not in rc and d not in rb]))
    return min(k, m, n) <= _NARROW


def _strided_bytes(key: OpKey) -> int:
    """Bytes of a strided read's operand (0 for one without a numpy dtype: a PRNG key array)."""
    try:
        return int(np.prod(key.in_shapes[0])) * np.dtype(key.in_dtypes[0]).itemsize
    except TypeError:
        return 0


def _announce(path: str) -> None:
    """Say once per process why planning pauses: ops are being timed (progress output of a long first plan)."""
    global _ANNOUNCED
    if not _ANNOUNCED:
        _ANNOUNCED = True
        print(f"shardc: timing convolutions, narrow matmuls and transposed reads on this host's devices at the shapes "
              f"the plans need (once per host; cached in {path})", file=sys.stderr, flush=True)


def default_estimator(device: Device) -> Any:
    """The estimator a simulation uses when given none: the roofline, with the device's `measured_ops` timed
    on this host when it names some (the measured cpu-host) and this is a single-process job."""
    import jax

    if device.measured_ops and jax.process_count() == 1:
        return HostMeasuredEstimator(device, primitives=frozenset(device.measured_ops))
    return AnalyticalEstimator(device)
