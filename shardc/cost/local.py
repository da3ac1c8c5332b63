"""The topology of the devices this process runs on: what plans are priced on when no `topology=` is given.

| devices (`jax.devices()[0].device_kind`) | topology |
| --- | --- |
| CPU | `cpu-host`: measured on this host (`shardc.cost.calibrate`, about a second, cached on disk) |
| NVIDIA H100 | `h100-sxm-8`, or `h100-sxm-8xN` above 8 devices |
| NVIDIA A100 | `a100-40g-8` (up to 8 devices) |
| TPU v4 | `tpu-v4-2N` for N chips (the preset counts TensorCores) |
| TPU v5e ("TPU v5 lite") | `tpu-v5e-N` |
| anything else | `measured-<platform>`: measured as the CPU host is (`calibrate.measured_local`) |

A plan for another cluster names it (`@shardc.auto(topology=...)`, `shardc.plan_for`).
"""
from __future__ import annotations

import math
from typing import Callable

from annotations.errors import ShardingError
from shardc.cost.topology import Topology

__all__ = ["preset_for", "local_topology"]


def _h100(n: int) -> str | None:
    return "h100-sxm-8" if n <= 8 else f"h100-sxm-8x{math.ceil(n / 8)}"


def _a100(n: int) -> str | None:
    return "a100-40g-8" if n <= 8 else None


def _tpu_v4(n: int) -> str | None:
    return f"tpu-v4-{2 * n}"


def _tpu_v5e(n: int) -> str | None:
    return f"tpu-v5e-{n}" if n <= 8 or n % 8 == 0 else None


# (words all found in the lower-cased device kind, the preset for n devices of it or None)
_KINDS: tuple[tuple[tuple[str, ...], Callable[[int], str | None]], ...] = (
    (("h100",), _h100),
    (("a100",), _a100),
    (("tpu", "v4"), _tpu_v4),
    (("tpu", "v5", "lite"), _tpu_v5e),
    (("tpu", "v5e"), _tpu_v5e),
)


def preset_for(device_kind: str, num_devices: int) -> str | None:
    """The preset matching `num_devices` devices of this kind (`jax.Device.device_kind`), or None."""
    kind = device_kind.lower()
    for words, make in _KINDS:
        if all(w in kind for w in words):
            return make(num_devices)
    return None


def local_topology(num_devices: int | None = None) -> Topology:
    """The topology of this process's devices (all of `jax.devices()`): the matching preset on known
    accelerators, the measured `cpu-host` on CPU devices, a measured profile otherwise. `num_devices`
    beyond the devices at hand is a ShardingError: that is another cluster, which only its name describes."""
    import jax

    from shardc.cost.calibrate import cpu_host, measured_local
    from shardc.cost.presets import preset

    have = jax.device_count()
    n = have if num_devices is None else num_devices
    d = jax.devices()[0]
    if n > have:
        raise ShardingError(
            f"planning for {n} devices, but this process has {have} ({d.platform}), so there is no hardware at hand "
            f"to price the plan on: name the cluster it will run on with topology=... (e.g. 'h100-sxm-8x{-(-n // 8)}'; "
            f"see shardc.cost.presets), as shardc.plan_for(f, *args, topology=...) does")
    if d.platform == "cpu":
        return cpu_host()
    name = preset_for(str(getattr(d, "device_kind", "")), have)
    return preset(name) if name is not None else measured_local()
