"""Cluster topologies: the device (peak FLOP/s per dtype, memory bandwidth and capacity) and a hierarchy of
links (bandwidth, latency), innermost first — 8 GPUs on NVLink inside a node, nodes on InfiniBand; TPU
chips on ICI. A plan's mesh axes are mapped onto the levels by a `MeshMapping`.

    topo = Topology.preset("h100-sxm-8x2")          # see shardc.cost.presets for the list and sources
    topo = Topology.from_dict({...}) / Topology.from_file("cluster.json" or ".yaml")
    mapping = topo.map_mesh({"data": 2, "model": 8})  # model inside a node, data across nodes
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

from annotations.errors import ShardingError
from shardc.cost.hlo import COLLECTIVE_KINDS

__all__ = ["Device", "Level", "Topology", "MeshMapping", "CollectiveFit", "COLLECTIVE_KINDS"]



@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """One accelerator. Rates are peaks; `*_efficiency` are the fractions a roofline may expect to reach."""

    name: str
    peak_flops: Mapping[str, float]  # dtype name ("float32", "bfloat16", ...) -> FLOP/s
    mem_bandwidth: float  # bytes/s
    memory: float  # bytes
    matmul_efficiency: float = 0.7
    vector_efficiency: float = 0.8
    op_overhead: float = 0.0  # seconds of fixed cost per op (kernel launch, dispatch)
    # FLOP/s of elementwise work (0: a sixteenth of the float32 matmul peak, as on GPUs, whose tensor cores
    # outrun their vector units; a CPU's vector units run its matmuls too, so cpu-host measures it)
    vector_flops: float = 0.0
    # A buffer a step allocates of at least `fresh_memory_threshold` bytes is freshly mapped from the OS every
    # step (glibc's malloc maps allocations over its mmap threshold and unmaps them when freed), and every
    # page of it is faulted in again: `fresh_memory_cost` seconds per byte (0: not modelled).
    fresh_memory_cost: float = 0.0
    fresh_memory_threshold: float = float("inf")
    # primitives timed on this host's devices rather than modelled (`shardc.cost.host_ops`; the cpu-host
    # topology measured here sets it): only meaningful for the devices this process runs on
    measured_ops: tuple[str, ...] = ()

    def fresh_memory_time(self, *buffer_bytes: float) -> float:
        """Seconds a step spends mapping the buffers it allocates (sizes in bytes) afresh: page faults."""
        if self.fresh_memory_cost <= 0:
            return 0.0
        return sum(b for b in buffer_bytes if b >= self.fresh_memory_threshold) * self.fresh_memory_cost

    @property
    def vector_peak(self) -> float:
        """FLOP/s of elementwise work."""
        return self.vector_flops if self.vector_flops > 0 else self.flops_per_s("float32") / 16

    def flops_per_s(self, dtype: Any) -> float:
        """Peak FLOP/s for a dtype (falls back to float32's, then to the smallest listed)."""
        name = str(dtype)
        if name in self.peak_flops:
            return float(self.peak_flops[name])
        if name.startswith("int") or name.startswith("uint") or name == "bool":
            return float(self.peak_flops.get("int8", self.peak_flops.get("float32", min(self.peak_flops.values()))))
        return float(self.peak_flops.get("float32", min(self.peak_flops.values())))


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveFit:
    """The measured cost of one collective kind on a level (`shardc.cost.calibrate` fits it on XLA:CPU), for a
    group of `n` devices and a payload of `B` bytes per device:

        seconds = base + per_peer (n - 1) + B (per_byte + per_byte_spread (n - 1) / n)

    The first two terms are the fixed cost (on XLA:CPU every device of the group meets at each collective, so it
    grows with the group; a collective-permute meets every device of the program, so its `per_peer` is ~0), the
    last the bytes (seconds per payload byte, which may grow with the share of the buffer that leaves a device)."""

    kind: str
    base: float
    per_peer: float
    per_byte: float
    per_byte_spread: float = 0.0

    def fixed(self, n: int) -> float:
        """Seconds of one collective over `n` devices beyond its bytes."""
        return max(self.base + self.per_peer * (n - 1), 0.0)

    def seconds(self, n: int, payload: float) -> float:
        """Seconds of one collective of `payload` bytes per device over `n` devices."""
        per_byte = max(self.per_byte + self.per_byte_spread * (n - 1) / n, 0.0)
        return self.fixed(n) + payload * per_byte


@dataclasses.dataclass(frozen=True, slots=True)
class Level:
    """One level of the link hierarchy: `size` groups of the level below are joined by links of this class.

    bandwidth: bytes/s each device can send (and receive) at once over this level in a ring collective;
    latency: seconds per step of a collective algorithm on it;
    permute_latency: the fixed seconds of a collective-permute on it, when that is not one step: XLA:CPU
    meets every device of the program at each collective-permute, however few pairs it moves (measured by
    `shardc.cost.calibrate`); None: `latency`.
    collectives: measured costs per collective kind (`CollectiveFit`); a kind listed here is priced by its fit
    instead of the ring formula with `bandwidth` and `latency` (and `permute_latency`).
    """

    name: str
    size: int
    bandwidth: float
    latency: float
    permute_latency: float | None = None
    collectives: tuple[CollectiveFit, ...] = ()

    def fit(self, kind: str) -> CollectiveFit | None:
        """The measured cost of collective `kind` on this level, if it has one."""
        for f in self.collectives:
            if f.kind == kind:
                return f
        return None

    @property
    def permute_fixed(self) -> float:
        """Seconds a collective-permute costs on this level beyond its bytes."""
        return self.latency if self.permute_latency is None else self.permute_latency


@dataclasses.dataclass(frozen=True, slots=True)
class MeshMapping:
    """Which topology levels each mesh axis spans: axis -> ((level name, how many devices of the axis on it), ...),
    innermost level first. An axis of size 16 on 8-GPU nodes spans (("nvlink", 8), ("ib", 2))."""

    axes: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]

    def levels_of(self, axis: str) -> tuple[tuple[str, int], ...]:
        for a, lv in self.axes:
            if a == axis:
                return lv
        raise ShardingError(f"mesh axis {axis!r} is not mapped to the topology (mapped: {[a for a, _ in self.axes]})")

    def group(self, axes: Sequence[str], level_order: Sequence[str]) -> tuple[tuple[str, int], ...]:
        """Group size per level (innermost first, levels of size 1 dropped) of a collective over `axes`."""
        per: dict[str, int] = {}
        for a in axes:
            for lv, n in self.levels_of(a):
                per[lv] = per.get(lv, 1) * n
        return tuple((lv, per[lv]) for lv in level_order if per.get(lv, 1) > 1)

    def inside(self, level: str) -> list[str]:
        """Mesh axes that stay entirely within `level` or below (e.g. the axes inside one node)."""
        return [a for a, lv in self.axes if all(name == level for name, _ in lv) or not lv]

    def __str__(self) -> str:
        return ", ".join(f"{a}->" + "x".join(f"{lv}:{n}" for lv, n in levels) if levels else f"{a}->(size 1)"
                         for a, levels in self.axes)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A cluster: identical devices and a hierarchy of links, innermost first."""

    name: str
    device: Device
    levels: tuple[Level, ...]
    overlap: bool = True  # collectives run on their own streams, overlapping compute
    reduce_scatter: bool = True  # the backend has a native reduce-scatter (XLA:CPU lowers it to an all-reduce)
    source: str = ""
    combine_bytes: float = 30 * 2**20  # XLA merges independent all-reduces up to this many bytes (GPU default)
    combine_count: int = 256
    backend: str = ""  # "cpu", "gpu" or "tpu": selects backend-specific rewrites XLA makes (and counts)

    @property
    def num_devices(self) -> int:
        return math.prod(lv.size for lv in self.levels)

    def level(self, name: str) -> Level:
        for lv in self.levels:
            if lv.name == name:
                return lv
        raise KeyError(name)

    @property
    def level_names(self) -> tuple[str, ...]:
        return tuple(lv.name for lv in self.levels)

    # -- mesh mapping ------------------------------------------------------------------------------
    def map_mesh(self, mesh: Mapping[str, int], order: Sequence[str] | None = None) -> MeshMapping:
        """Lay mesh axes onto levels: the last mesh axis varies fastest over device ids, so it fills the
        innermost level first (jax's device order; `order` overrides, minor axis last). A mesh needing more
        devices than the topology has, or an axis that does not divide a level, is a ShardingError."""
        names = list(order) if order is not None else list(mesh)
        total = math.prod(mesh[a] for a in names)
        if total > self.num_devices:
            raise ShardingError(f"mesh {dict(mesh)} needs {total} devices; "
                                f"topology {self.name!r} has {self.num_devices}")
        free = [[lv.name, lv.size] for lv in self.levels]
        out: list[tuple[str, tuple[tuple[str, int], ...]]] = []
        li = 0
        for a in reversed(names):
            need = mesh[a]
            spans: list[tuple[str, int]] = []
            while need > 1:
                while li < len(free) and free[li][1] == 1:
                    li += 1
                if li == len(free):
                    raise ShardingError(f"mesh axis {a!r} (size {mesh[a]}) does not fit topology {self.name!r}")
                g = math.gcd(need, free[li][1])
                if g == 1:
                    raise ShardingError(
                        f"mesh axis {a!r} of size {mesh[a]} does not divide level {free[li][0]!r} "
                        f"({free[li][1]} devices left) of topology {self.name!r}")
                spans.append((free[li][0], g))
                free[li][1] //= g
                need //= g
            out.append((a, tuple(spans)))
        return MeshMapping(tuple(reversed(out)))

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "Topology":
        from shardc.cost.presets import preset

        return preset(name)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Topology":
        """From a dict: {"name", "device": {"name", "peak_flops": {dtype: FLOP/s}, "mem_bandwidth",
        "memory", ...}, "levels": [{"name", "size", "bandwidth", "latency", optional "permute_latency", optional
        "collectives": [{"kind", "base", "per_peer", "per_byte", "per_byte_spread"}, ...]}, ...] (innermost first),
        optional "overlap", "reduce_scatter", "source"}. Numbers may be strings with SI suffixes
        ("989T", "3.35e12", "80GiB", "450GB", "2us")."""
        try:
            dev = dict(d["device"])
            device = Device(
                name=str(dev.get("name", "device")),
                peak_flops={str(k): _num(v) for k, v in dict(dev["peak_flops"]).items()},
                mem_bandwidth=_num(dev["mem_bandwidth"]),
                memory=_num(dev["memory"]),
                matmul_efficiency=float(dev.get("matmul_efficiency", 0.7)),
                vector_efficiency=float(dev.get("vector_efficiency", 0.8)),
                op_overhead=_num(dev.get("op_overhead", 0.0)),
                vector_flops=_num(dev.get("vector_flops", 0.0)),
                fresh_memory_cost=_num(dev.get("fresh_memory_cost", 0.0)),
                fresh_memory_threshold=_num(dev.get("fresh_memory_threshold", float("inf"))),
                measured_ops=tuple(str(x) for x in dev.get("measured_ops", ())),
            )
            levels = tuple(Level(str(lv["name"]), int(lv["size"]), _num(lv["bandwidth"]), _num(lv.get("latency", 0.0)),
                                 None if lv.get("permute_latency") is None else _num(lv["permute_latency"]),
                                 _fits(lv.get("collectives", ())))
                           for lv in d["levels"])
        except (KeyError, TypeError, ValueError) as e:
            raise ShardingError(f"bad topology description: {type(e).__name__}: {e}") from None
        if not levels or any(lv.size < 1 or lv.bandwidth <= 0 for lv in levels):
            raise ShardingError("a topology needs at least one level, each with size >= 1 and bandwidth > 0")
        if len({lv.name for lv in levels}) != len(levels):
            raise ShardingError(f"topology level names repeat: {[lv.name for lv in levels]}")
        return cls(str(d.get("name", "custom")), device, levels, bool(d.get("overlap", True)),
                   bool(d.get("reduce_scatter", True)), str(d.get("source", "")),
                   _num(d.get("combine_bytes", 30 * 2**20)), int(d.get("combine_count", 256)),
                   str(d.get("backend", "")))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Topology":
        text = open(path).read()
        if str(path).endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:  # pragma: no cover
                raise ShardingError("reading a YAML topology needs PyYAML (pip install pyyaml)") from None
            return cls.from_dict(yaml.safe_load(text))
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": {"name": self.device.name, "peak_flops": dict(self.device.peak_flops),
                       "mem_bandwidth": self.device.mem_bandwidth, "memory": self.device.memory,
                       "matmul_efficiency": self.device.matmul_efficiency,
                       "vector_efficiency": self.device.vector_efficiency, "op_overhead": self.device.op_overhead,
                       "vector_flops": self.device.vector_flops,
                       "fresh_memory_cost": self.device.fresh_memory_cost,
                       "fresh_memory_threshold": self.device.fresh_memory_threshold,
                       "measured_ops": list(self.device.measured_ops)},
            "levels": [_level_dict(lv) for lv in self.levels],
            "overlap": self.overlap, "reduce_scatter": self.reduce_scatter, "source": self.source,
            "combine_bytes": self.combine_bytes, "combine_count": self.combine_count, "backend": self.backend,
        }

    def __str__(self) -> str:
        lv = " x ".join(f"{x.size} on {x.name} ({x.bandwidth / 1e9:.0f} GB/s, {x.latency * 1e6:.1f} us)"
                        for x in self.levels)
        return f"Topology {self.name}: {self.num_devices} x {self.device.name}; {lv}"


def _level_dict(lv: Level) -> dict[str, Any]:
    """A level as `from_dict` reads it (its collective fits only when it has some)."""
    d = dataclasses.asdict(lv)
    d["collectives"] = [dataclasses.asdict(f) for f in lv.collectives]
    if not d["collectives"]:
        del d["collectives"]
    return d


def _fits(rows: Any) -> tuple[CollectiveFit, ...]:
    """Collective fits from a topology description's list of dicts (kinds checked, numbers may carry units)."""
    out = []
    for r in rows:
        kind = str(r["kind"])
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {kind!r} (one of {', '.join(COLLECTIVE_KINDS)})")
        out.append(CollectiveFit(kind, _num(r.get("base", 0.0)), _num(r.get("per_peer", 0.0)),
                                 _num(r.get("per_byte", 0.0)), _num(r.get("per_byte_spread", 0.0))))
    return tuple(out)


_SUFFIX = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _num(v: Any) -> float:
    """A number, or a string like '989T', '80GiB', '450GB/s', '2us'."""
    if isinstance(v, (int, float)):
        return float(v)
    s = str(v).strip().replace(" ", "")
    low = s.lower()
    for unit, k in sorted(_TIME.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(unit) and _is_float(low[: -len(unit)]):
            return float(low[: -len(unit)]) * k
    for tail in ("b/s", "flop/s", "flops", "bps", "b"):
        if low.endswith(tail) and len(low) > len(tail):
            low = low[: -len(tail)]
            break
    for suf, k in sorted(_SUFFIX.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(suf) and _is_float(low[: -len(suf)]):
            return float(low[: -len(suf)]) * k
    return float(low)


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
