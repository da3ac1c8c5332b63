"""Preset topologies, with where their numbers come from.

| preset | devices | source of the numbers |
| --- | --- | --- |
| `h100-sxm-8`, `h100-sxm-8xN` | NVIDIA H100 SXM5 80GB; 8 per node on NVLink 4 / NVSwitch; N nodes on 8x 400 Gb/s InfiniBand NDR | H100 Tensor Core GPU datasheet (dense BF16/FP16 989.4 TFLOP/s, TF32 494.7, FP32 66.9, FP8 1979; HBM3 3.35 TB/s, 80 GB; NVLink 900 GB/s bidirectional = 450 GB/s per direction); DGX H100 user guide (8x ConnectX-7 400 Gb/s = 50 GB/s per GPU per direction) |
| `a100-40g-8` | NVIDIA A100 SXM4 40GB, 8 on NVLink 3 / NVSwitch | A100 datasheet (dense BF16/FP16 312 TFLOP/s, TF32 156, FP32 19.5; HBM2 1,555 GB/s, 40 GB; NVLink 600 GB/s bidirectional = 300 GB/s per direction) |
| `tpu-v4-N` | Cloud TPU v4, N TensorCores = N/2 chips on ICI (3D torus) | cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16 per chip, 32 GiB HBM2 at 1,200 GB/s; all-reduce bandwidth 1.1 PB/s per 4,096-chip pod = 268 GB/s per chip) |
| `tpu-v5e-N` | Cloud TPU v5e, N chips on ICI (2D torus), 8 chips per host | cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16 per chip, 16 GB HBM2 at 819 GB/s; all-reduce bandwidth 51.2 TB/s per 256-chip pod = 200 GB/s per chip; 400 GB/s bidirectional ICI per chip) |
| `cpu-host` | the XLA:CPU devices of this machine | measured by `shardc.cost.calibrate` on first use, cached on disk |

`float32` matmul rates are those of JAX's default matmul precision: TF32 on H100/A100, one bf16 pass on
TPU. Latencies are assumptions, not datasheet numbers: a few microseconds per collective step on NVLink and
ICI (NCCL's and XLA's per-step overheads), more on InfiniBand. Efficiencies (fraction of peak a roofline
expects: 0.7 for matmuls, 0.8 of memory bandwidth) are also assumptions, in line with what well-tuned
kernels reach; `Topology.from_dict` accepts measured ones.
"""
from __future__ import annotations

import re

from annotations.errors import ShardingError
from shardc.cost.topology import Device, Level, Topology

__all__ = ["preset", "PRESETS"]

_H100 = Device("H100-SXM5-80GB",
               {"float64": 66.9e12, "float32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12,
                "float8_e4m3fn": 1978.9e12, "int8": 1978.9e12},
               mem_bandwidth=3.35e12, memory=80e9, op_overhead=4e-6)
_A100 = Device("A100-SXM4-40GB",
               {"float64": 19.5e12, "float32": 156e12, "bfloat16": 312e12, "float16": 312e12, "int8": 624e12},
               mem_bandwidth=1.555e12, memory=40e9, op_overhead=4e-6)
_V4 = Device("TPU-v4", {"float32": 275e12, "bfloat16": 275e12, "int8": 275e12},
             mem_bandwidth=1.2e12, memory=32 * 2**30, op_overhead=2e-6)
_V5E = Device("TPU-v5e", {"float32": 197e12, "bfloat16": 197e12, "int8": 393e12},
              mem_bandwidth=819e9, memory=16e9, op_overhead=2e-6)

_SOURCES = {
    "h100": "NVIDIA H100 datasheet; DGX H100 user guide (ConnectX-7 400 Gb/s per GPU)",
    "a100": "NVIDIA A100 datasheet",
    "v4": "cloud.google.com/tpu/docs/v4",
    "v5e": "cloud.google.com/tpu/docs/v5e",
}


def _h100(nodes: int) -> Topology:
    levels = [Level("nvlink", 8, 450e9, 3e-6)]
    if nodes > 1:
        levels.append(Level("infiniband", nodes, 50e9, 8e-6))
    name = "h100-sxm-8" if nodes == 1 else f"h100-sxm-8x{nodes}"
    return Topology(name, _H100, tuple(levels), source=_SOURCES["h100"], backend="gpu")


def _tpu(kind: str, n: int) -> Topology:
    if kind == "v4":
        if n % 2 or n < 2:
            raise ShardingError(f"tpu-v4-{n}: the suffix counts TensorCores (2 per chip), so it must be even")
        chips = n // 2
        return Topology(f"tpu-v4-{n}", _V4, (Level("ici", chips, 268e9, 2e-6),), source=_SOURCES["v4"],
                        backend="tpu")
    if n <= 8:
        return Topology(f"tpu-v5e-{n}", _V5E, (Level("ici", n, 200e9, 2e-6),), source=_SOURCES["v5e"],
                        backend="tpu")
    if n % 8:
        raise ShardingError(f"tpu-v5e-{n}: slices above one host come in multiples of 8 chips")
    # ICI spans the whole slice; the per-host split only matters for the mapping's "inside a host" query.
    return Topology(f"tpu-v5e-{n}", _V5E, (Level("ici", n, 200e9, 2e-6),), source=_SOURCES["v5e"],
                    backend="tpu")


PRESETS = ("h100-sxm-8", "h100-sxm-8x2", "h100-sxm-8x8", "h100-sxm-8x64", "a100-40g-8",
           "tpu-v4-8", "tpu-v4-32", "tpu-v5e-8", "tpu-v5e-16", "tpu-v5e-256", "cpu-host")


def preset(name: str) -> Topology:
    """A preset topology by name (see the module docstring for the list and the sources)."""
    key = name.strip().lower()
    if key == "h100-sxm-8":
        return _h100(1)
    m = re.fullmatch(r"h100-sxm-8x(\d+)", key)
    if m:
        return _h100(int(m.group(1)))
    if key == "a100-40g-8":
        return Topology("a100-40g-8", _A100, (Level("nvlink", 8, 300e9, 3e-6),), source=_SOURCES["a100"],
                        backend="gpu")
    m = re.fullmatch(r"tpu-(v4|v5e)-(\d+)", key)
    if m:
        return _tpu(m.group(1), int(m.group(2)))
    if key == "cpu-host":
        from shardc.cost.calibrate import cpu_host

        return cpu_host()
    raise ShardingError(f"unknown topology preset {name!r}; known: {', '.join(PRESETS)} "
                        f"(h100-sxm-8xN, tpu-v4-N, tpu-v5e-N take any size)")
