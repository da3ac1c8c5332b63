"""Collective costs on a topology: latency–bandwidth (alpha–beta) formulas, ring per level and
hierarchical across levels.

A collective over a set of mesh axes involves, at each topology level, a group of `n_l` devices (the
`MeshMapping` says which). Its *payload* `B` is the size of the logical buffer per device: the operand of
an all-reduce / reduce-scatter / all-to-all / collective-permute, the gathered result of an all-gather.
With `bw_l` the per-device bandwidth of level `l` and `a_l` its per-step latency (see docs/simulator.md):

* ring all-gather on one level:      (n-1)/n * B / bw + (n-1) a
* ring reduce-scatter on one level:  (n-1)/n * B / bw + (n-1) a
* ring all-reduce on one level:      2 (n-1)/n * B / bw + 2 (n-1) a   (reduce-scatter + all-gather)
* all-to-all on one level:           (n-1)/n * B / bw + (n-1) a
* collective-permute:                B / bw + a  on the outermost level the pairs cross (a: the level's
                                     `permute_latency` when it has one: on XLA:CPU every device of the
                                     program meets at each permute, which costs several ring steps, not
                                     one)

A level with measured collective costs (`Level.collectives`, `cpu-host`: `shardc.cost.calibrate`) prices
each kind it lists by its fit instead: a fixed cost by kind and group size plus seconds per payload byte
(`CollectiveFit.seconds`); the bytes each phase sends are the ring formula's either way.

Across levels (innermost l0 .. outermost lk), hierarchically: a reduce-scatter runs level by level outward
on a shrinking buffer (B, B/n0, B/(n0 n1), ...); an all-gather is its mirror (outermost first, on the
shard gathered so far); an all-reduce is reduce-scatter outward, all-reduce on the outermost level,
all-gather inward; an all-to-all sends, at each level, the part of the buffer bound for peers first
reached at that level. Each level's part is a separate *phase*, run on that level's link stream.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

from shardc.cost.topology import Level, MeshMapping, Topology

__all__ = ["Collective", "Phase", "collective_phases", "collective_time", "ring_time", "collectives_time", "level_time",
           "level_fixed", "collective_fixed"]


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One collective of a reshard: its kind, the mesh axes its groups span, its payload per device, and the
    group size when it is not the product of the axes' sizes (a permute or partial gather inside an axis)."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    group: int | None = None
    # A group of part of one axis: the spacing of its devices along the axis (XLA all-gathers among every 4th
    # device of a 16-device axis: group 4, stride 4). 1: consecutive devices, the innermost of the axis.
    stride: int = 1

    def group_size(self, mesh: dict[str, int]) -> int:
        return self.group if self.group is not None else math.prod(mesh[a] for a in self.axes)


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    """The part of a collective that runs on one topology level."""

    level: str
    kind: str
    seconds: float
    bytes: float  # bytes each device sends over this level


def ring_time(kind: str, n: int, payload: float, bandwidth: float, latency: float) -> tuple[float, float]:
    """(seconds, bytes sent per device) of a ring collective of `n` devices on one level."""
    if n <= 1 or payload <= 0:
        return 0.0, 0.0
    frac = (n - 1) / n
    if kind == "all-reduce":
        sent = 2 * frac * payload
        return sent / bandwidth + 2 * (n - 1) * latency, sent
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        sent = frac * payload
        return sent / bandwidth + (n - 1) * latency, sent
    if kind == "collective-permute":
        return payload / bandwidth + latency, payload
    raise ValueError(f"unknown collective kind {kind!r}")


def level_time(level: Level, kind: str, n: int, payload: float) -> tuple[float, float]:
    """(seconds, bytes sent per device) of one collective of `kind` over `n` devices of `level`: the level's
    measured fit for the kind when it has one (`Level.collectives`), else the ring formula on its bandwidth and
    latency (a collective-permute's fixed cost: `Level.permute_fixed`)."""
    if n <= 1 or payload <= 0:
        return 0.0, 0.0
    fit = level.fit(kind)
    t, sent = ring_time(kind, n, payload, level.bandwidth, level.latency)
    if fit is not None:
        return fit.seconds(n, payload), sent
    if kind == "collective-permute":
        return payload / level.bandwidth + level.permute_fixed, payload
    return t, sent


def level_fixed(level: Level, kind: str, n: int) -> float:
    """Seconds of one collective of `kind` over `n` devices of `level` beyond its bytes."""
    if n <= 1:
        return 0.0
    fit = level.fit(kind)
    if fit is not None:
        return fit.fixed(n)
    if kind == "collective-permute":
        return level.permute_fixed
    return (2 if kind == "all-reduce" else 1) * (n - 1) * level.latency


def _levels(c: Collective, topo: Topology, mapping: MeshMapping, mesh: dict[str, int]) -> list[tuple[str, int]]:
    groups = list(mapping.group(c.axes, topo.level_names))
    if c.group is not None and groups:
        total = math.prod(n for _, n in groups)
        if c.group < total:
            return _part_levels(groups, c.group, c.stride)
    return groups


def _part_levels(levels: list[tuple[str, int]], group: int, stride: int) -> list[tuple[str, int]]:
    """The levels (innermost first) a group of `group` devices spaced `stride` apart along an axis spans, the
    axis's devices filling its levels innermost first (device i of the axis is at position i % n0 of its
    innermost group): how many distinct positions the group's devices take at each level."""
    out = []
    members = [stride * k for k in range(group)]
    inner = 1
    for lv, n in levels:
        distinct = len({(m // inner) % n for m in members})
        if distinct > 1:
            out.append((lv, distinct))
        inner *= n
    return out


def collective_phases(c: Collective, topo: Topology, mapping: MeshMapping, mesh: dict[str, int]) -> tuple[Phase, ...]:
    """The per-level phases of a collective, in the order they run."""
    groups = _levels(c, topo, mapping, mesh)
    if not groups or c.bytes <= 0:
        return ()
    B = float(c.bytes)

    def ph(kind: str, level: str, n: int, payload: float) -> Phase:
        t, sent = level_time(topo.level(level), kind, n, payload)
        return Phase(level, kind, t, sent)

    if c.kind == "collective-permute":
        level = groups[-1][0]
        t, sent = level_time(topo.level(level), "collective-permute", math.prod(n for _, n in groups), B)
        return (Phase(level, "collective-permute", t, sent),)
    if c.kind == "all-to-all":
        total = math.prod(n for _, n in groups)
        out, inner = [], 1
        for lv, n in groups:
            share = inner * (n - 1) / total  # fraction of the buffer first reaching peers at this level
            level = topo.level(lv)
            sent = share * B
            fit = level.fit("all-to-all")
            # (a level's all-to-all of payload P sends (n-1)/n P: this one's payload is sent n / (n-1))
            t = (fit.seconds(n, sent * n / (n - 1)) if fit is not None
                 else sent / level.bandwidth + (n - 1) * level.latency)
            out.append(Phase(lv, "all-to-all", t, sent))
            inner *= n
        return tuple(out)
    if c.kind == "reduce-scatter":
        out, size = [], B
        for lv, n in groups:
            out.append(ph("reduce-scatter", lv, n, size))
            size /= n
        return tuple(out)
    if c.kind == "all-gather":
        sizes, size = [], B
        for lv, n in groups:  # result size seen at each level, innermost gets the full buffer
            sizes.append(size)
            size /= n
        return tuple(ph("all-gather", lv, n, s) for (lv, n), s in reversed(list(zip(groups, sizes))))
    if c.kind == "all-reduce":
        if len(groups) == 1:
            return (ph("all-reduce", groups[0][0], groups[0][1], B),)
        down, sizes, size = [], [], B
        for lv, n in groups[:-1]:
            down.append(ph("reduce-scatter", lv, n, size))
            sizes.append(size)
            size /= n
        top = ph("all-reduce", groups[-1][0], groups[-1][1], size)
        up = [ph("all-gather", lv, n, s) for (lv, n), s in reversed(list(zip(groups[:-1], sizes)))]
        return tuple(down) + (top,) + tuple(up)
    raise ValueError(f"unknown collective kind {c.kind!r}")


def collective_fixed(c: Collective, topo: Topology, mapping: MeshMapping, mesh: dict[str, int]) -> float:
    """Seconds of a collective beyond its bytes: the fixed costs of its phases (what a collective that XLA merges
    into another, e.g. one all-reduce of many gradients, does not pay again)."""
    groups = _levels(c, topo, mapping, mesh)
    if not groups:
        return 0.0
    if c.kind == "collective-permute":
        return level_fixed(topo.level(groups[-1][0]), c.kind, math.prod(n for _, n in groups))
    if c.kind == "all-reduce" and len(groups) > 1:
        *inner, (top, n) = groups
        return (level_fixed(topo.level(top), "all-reduce", n)
                + sum(level_fixed(topo.level(lv), k, m) for lv, m in inner for k in ("reduce-scatter", "all-gather")))
    return sum(level_fixed(topo.level(lv), c.kind, n) for lv, n in groups)


def collective_time(c: Collective, topo: Topology, mapping: MeshMapping, mesh: dict[str, int]) -> float:
    """Total seconds of a collective (its phases back to back)."""
    return sum(p.seconds for p in collective_phases(c, topo, mapping, mesh))


def collectives_time(cs: Iterable[Collective], topo: Topology, mapping: MeshMapping, mesh: dict[str, int]) -> float:
    """Seconds of collectives run one after another (e.g. the steps of one reshard)."""
    return sum(collective_time(c, topo, mapping, mesh) for c in cs)
