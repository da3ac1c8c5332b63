"""A profiling op-cost estimator: runs an op at its local shard shape on the local backend and caches the
median time on disk, as FlexFlow measures each distinct op configuration once.

The cache key is the primitive, its params, the local shapes and dtypes, and the backend (platform and
device kind); the value is seconds. Ops that cannot be run alone at a local shape (shape-carrying params
that would need localising, effects, unknown primitives) fall back to the analytical roofline.

    est = ProfilingEstimator(topology.device)     # the device only matters for the fallback
    shardc.simulate(plan, topology, estimator=est)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from typing import Any, Mapping

import numpy as np

from shardc.cost.cache import DiskCache
from shardc.cost.estimator import AnalyticalEstimator, OpKey, params_dict
from shardc.cost.topology import Device

__all__ = ["ProfilingEstimator", "find_primitive", "PROFILED"]

# Ops worth measuring (the rest are data movement XLA fuses away, or take shape params).
PROFILED = frozenset({
    "dot_general", "conv_general_dilated", "add", "sub", "mul", "div", "max", "min", "neg", "exp", "log", "tanh",
    "logistic", "sqrt", "rsqrt", "pow", "integer_pow", "erf", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
    "reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "cumsum", "sort", "abs", "sign", "square",
    "convert_element_type", "add_any", "exp2", "log1p", "expm1", "sin", "cos", "transpose", "and", "or", "not",
})
_SHAPE_PARAMS = ("shape", "new_sizes", "slice_sizes", "start_indices", "limit_indices", "sizes")
_PRIMS: dict[str, Any] = {}


def find_primitive(name: str) -> Any:
    """The jax Primitive called `name` (searched once in jax's lax modules), or None."""
    if not _PRIMS:
        import importlib

        from jax.extend.core import Primitive

        for mod in ("jax._src.lax.lax", "jax._src.lax.slicing", "jax._src.lax.convolution", "jax._src.lax.special",
                    "jax._src.lax.windowed_reductions", "jax._src.lax.control_flow.loops", "jax._src.ad_util",
                    "jax._src.lax.parallel", "jax._src.prng", "jax._src.random"):
            try:
                m = importlib.import_module(mod)
            except ImportError:  # pragma: no cover
                continue
            for v in vars(m).values():
                if isinstance(v, Primitive):
                    _PRIMS.setdefault(v.name, v)
    return _PRIMS.get(name)


def _backend() -> tuple[str, str]:
    import jax

    d = jax.local_devices()[0]
    return d.platform, str(getattr(d, "device_kind", ""))


@dataclasses.dataclass
class ProfilingEstimator:
    """Measured op times (warm-up, then the median of `repeats` runs), cached on disk by op configuration."""

    device: Device
    repeats: int = 7
    warmup: int = 2
    cache: DiskCache | None = None
    fallback: Any = None
    scale: float = 1.0  # multiplies measured times (e.g. shardc.cost.calibrate.contention() on the CPU host)
    measured: int = 0  # ops measured in this process (cache misses)
    _memo: dict[OpKey, float] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.cache is None:
            self.cache = DiskCache("op-profiles")
        if self.fallback is None:
            self.fallback = AnalyticalEstimator(self.device)

    def cache_key(self, key: OpKey) -> str:
        platform, kind = _backend()
        raw = json.dumps([key.primitive, repr(key.params), key.in_shapes, key.in_dtypes, platform, kind],
                         sort_keys=True, default=repr)
        return hashlib.sha1(raw.encode()).hexdigest()

    def profilable(self, key: OpKey, params: Mapping[str, Any]) -> bool:
        return key.primitive in PROFILED and not any(p in params for p in _SHAPE_PARAMS) \
            and find_primitive(key.primitive) is not None

    def op_time(self, key: OpKey, params: Any = None) -> float:
        t = self._memo.get(key)
        if t is not None:
            return t
        p = dict(params) if params is not None else params_dict(key)
        if not self.profilable(key, p):
            t = self.fallback.op_time(key, p)
        else:
            ck = self.cache_key(key)
            hit = self.cache.get(ck)
            if hit is None:
                try:
                    hit = self.measure(key, p)
                except Exception:  # not runnable alone at this shape: use the model
                    hit = -1.0
                self.cache.put(ck, hit)
                self.measured += 1
            t = self.seconds(float(hit), key) if hit >= 0 else self.fallback.op_time(key, p)
        self._memo[key] = t
        return t

    def seconds(self, measured: float, key: OpKey) -> float:
        """The op's time from its (cached) measurement."""
        return measured * self.scale

    def measure(self, key: OpKey, params: Mapping[str, Any]) -> float:
        """Median seconds of one run of the op at its local shapes on the first local device."""
        import jax
        import jax.numpy as jnp

        prim = find_primitive(key.primitive)
        bind = {k: v for k, v in params.items()}
        for k in ("sharding", "out_sharding"):
            if k in bind:
                bind[k] = None
        dev = jax.local_devices()[0]
        args = [jax.device_put(jnp.ones(s, dtype=np.dtype(d)), dev) for s, d in zip(key.in_shapes, key.in_dtypes)]
        fn = jax.jit(lambda *xs: prim.bind(*xs, **bind))
        for _ in range(self.warmup):
            jax.block_until_ready(fn(*args))
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
