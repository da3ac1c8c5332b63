"""Op cost estimators: how long one op takes on one device at its local shard shapes.

The simulator asks an estimator for `op_time(key)`, where an `OpKey` holds everything the cost depends
on (primitive, hashable params, local shapes and dtypes of operands and results, which of them stay in
registers because XLA fuses them). Estimators are interchangeable (FlexFlow-train's ICostEstimator):

* `AnalyticalEstimator` — roofline: max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency))
  plus a fixed per-kernel overhead, FLOPs counted as XLA counts them (`shardc.cost.flops`);
* `ProfilingEstimator` (shardc.cost.profile) — runs the op at its local shape on the local backend and
  caches the median on disk;
* `FakeEstimator` — fixed or computed times, for tests.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from shardc.cost.flops import OpCount, count_op, dot_rewrite
from shardc.cost.topology import Device

__all__ = ["OpKey", "OpCostEstimator", "AnalyticalEstimator", "FakeEstimator", "MATMUL_PRIMITIVES", "params_key",
           "params_dict"]

Shape = tuple[int, ...]
MATMUL_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True, slots=True)
class OpKey:
    """Everything one op's cost depends on (hashable, so estimators can memoise)."""

    primitive: str
    params: Any  # the params as a hashable tuple of items (or their repr when unhashable)
    in_shapes: tuple[Shape, ...]
    out_shapes: tuple[Shape, ...]
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    fused_in: tuple[bool, ...] = ()  # operand read from registers (its producer was fused into this op)
    fused_out: tuple[bool, ...] = ()  # result kept in registers (fused into its consumers)

    def bytes_accessed(self) -> int:
        total = 0
        for shapes, dtypes, fused in ((self.in_shapes, self.in_dtypes, self.fused_in),
                                      (self.out_shapes, self.out_dtypes, self.fused_out)):
            for i, (s, d) in enumerate(zip(shapes, dtypes)):
                if fused and i < len(fused) and fused[i]:
                    continue
                total += _itemsize(d) * math.prod(s)
        return total

    @property
    def kernel_boundary(self) -> bool:
        """Whether the op ends a kernel (some result is written to memory)."""
        return not self.fused_out or not all(self.fused_out)


def params_key(params: Mapping[str, Any]) -> Any:
    """Params as a hashable value (sorted items; their repr when something in them is unhashable)."""
    try:
        key = tuple(sorted(params.items()))
        hash(key)
        return key
    except TypeError:
        return repr(sorted(params.items(), key=lambda kv: kv[0]))


def params_dict(key: OpKey) -> dict[str, Any]:
    return dict(key.params) if isinstance(key.params, tuple) else {}


def _itemsize(dtype: str) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 4


class OpCostEstimator(Protocol):
    """Seconds one device spends on one op."""

    def op_time(self, key: OpKey, params: Any = None) -> float: ...


@dataclasses.dataclass
class AnalyticalEstimator:
    """Roofline on a device: compute-bound or memory-bound, whichever is slower, plus kernel overhead."""

    device: Device
    _memo: dict[OpKey, float] = dataclasses.field(default_factory=dict, repr=False)

    def count(self, key: OpKey, params: Any = None) -> OpCount:
        p = params if params is not None else params_dict(key)
        return count_op(key.primitive, key.in_shapes, key.out_shapes, p)

    def op_time(self, key: OpKey, params: Any = None) -> float:
        t = self._memo.get(key)
        if t is not None:
            return t
        p = params if params is not None else params_dict(key)
        c = self.count(key, p)
        dev = self.device
        dtype = key.in_dtypes[0] if key.in_dtypes else (key.out_dtypes[0] if key.out_dtypes else "float32")
        matmul = key.primitive in MATMUL_PRIMITIVES and not (
            key.primitive == "dot_general" and dot_rewrite(p, [len(s) for s in key.in_shapes]))
        if matmul:
            compute = c.flops / (dev.flops_per_s(dtype) * dev.matmul_efficiency)
        else:
            # Vector units (`Device.vector_peak`: far below the matmul peak on GPUs); a transcendental ~8 FLOPs.
            compute = (c.flops + 8 * c.transcendentals) / (dev.vector_peak * dev.vector_efficiency)
        memory = key.bytes_accessed() / (dev.mem_bandwidth * dev.vector_efficiency)
        t = max(compute, memory) + (dev.op_overhead if key.kernel_boundary else 0.0)
        self._memo[key] = t
        return t


@dataclasses.dataclass
class FakeEstimator:
    """Test double: `times[primitive]` seconds per op (or `fn(key)`), `default` otherwise."""

    times: Mapping[str, float] = dataclasses.field(default_factory=dict)
    default: float = 0.0
    fn: Callable[[OpKey], float] | None = None

    def op_time(self, key: OpKey, params: Any = None) -> float:
        if self.fn is not None:
            return float(self.fn(key))
        return float(self.times.get(key.primitive, self.default))
