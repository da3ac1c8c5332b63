"""A plan on a finer mesh: each mesh axis that XLA's collectives for the plan's reshards act on part of, split
into factors (sub-axes), so that every collective is over whole (sub-)axes and the PCG can name it.

XLA reshards some layouts with collectives inside groups of part of an axis: `[model, data] -> [-, model]` on a
(model 4, data 16) mesh is a collective-permute that swaps the model coordinate with the major 4 of `data`, then
an all-gather among the minor 4 of `data` and one among its major 4 (its replica groups, read from the compiled
program). No parallel op over named axes makes those, so the PCG took the per-axes path, gathering over `model`
and all of `data` (other collectives over other links than the plan's: docs/pcg.md). On the mesh (model 4, data.0 4,
data.1 4) — the same devices in the same order, `data` = (data.0, data.1) major to minor — the three are a
Shuffle and two Combines, as the one reshard model says when given that mesh.

The refined plan has the same graph, values, layouts and strategies (each axis written as its factors), so
`build_pcg` of it is the plan's PCG on the finer mesh; its `shard_map` lowering runs on the finer mesh inside a
`jax.jit` whose input and output shardings are the plan's (the same devices and tiling: no collective between).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from jax.sharding import Mesh

from shardc.cost.collectives import Collective
from shardc.plan import OpStrategy, Plan, Reshard, abstract_mesh, is_abstract
from shardc.sharding import Sharding

__all__ = ["axis_factors", "refined_plan", "refined_pcg", "SEPARATOR", "REFINED_MAX_RANK", "REFINED_MAX_AXES"]

SEPARATOR = "."  # a factor of axis `data` is named `data.0` (major), `data.1`, ...
# Where the op searches of a refined plan's PCG stay affordable: each ask for XLA's path on a mesh of sub-axes
# costs about 6 ms, and a step's search asks once per move (every layout of the value over the mesh's axes): the
# 8x8 LSTM's (rank 3, three axes) ask 180 times in all, one generated program's (rank 4, three axes) over 6,000
# (80 s). Plans beyond these get their PCG on their own mesh.
REFINED_MAX_RANK = 3
REFINED_MAX_AXES = 3

Axes = tuple[str, ...]


def _partial_groups(plan: Plan) -> Iterator[tuple[Reshard, Collective]]:
    """Each collective of the plan's reshards among part of one mesh axis (a collective-permute's pairs aside)."""
    sizes = plan.mesh_sizes
    for r in plan.reshards:
        for c in r.collectives:
            if (c.kind != "collective-permute" and c.group is not None and len(c.axes) == 1
                    and 1 < c.group < sizes[c.axes[0]]):
                yield r, c


def axis_factors(plan: Plan) -> dict[str, tuple[int, ...]]:
    """The mesh axes some collective of the plan's reshards acts on part of, each with its factors (major to
    minor): a group of `g` devices `stride` apart is the sub-axis between the cuts `stride` and `stride * g` of
    the axis (positions counted minor first), so the axis is cut at every such point (groups of 4 consecutive
    devices and of every 4th on a 16-device axis: (4, 4); of 2 consecutive and of every 2nd 8: (8, 2); of every
    8th pair: (2, 8))."""
    sizes = plan.mesh_sizes
    cuts: dict[str, set[int]] = {}
    for _, c in _partial_groups(plan):
        if sizes[c.axes[0]] % (c.group * c.stride) == 0:
            cuts.setdefault(c.axes[0], set()).update((c.stride, c.stride * c.group))
    out = {}
    for axis, at in cuts.items():
        chain = sorted(at | {1, sizes[axis]})
        if any(b % a for a, b in zip(chain, chain[1:])):
            continue  # (cuts that do not nest: no factoring makes each group a whole sub-axis)
        out[axis] = tuple(b // a for a, b in zip(chain, chain[1:]))[::-1]
    return out


def _names(axis: str, factors: Sequence[int]) -> Axes:
    return tuple(f"{axis}{SEPARATOR}{i}" for i in range(len(factors)))


def _axes(axes: Sequence[str], split: Mapping[str, Axes]) -> Axes:
    return tuple(b for a in axes for b in split.get(a, (a,)))


def _sharding(s: Sharding, split: Mapping[str, Axes]) -> Sharding:
    return Sharding(tuple(_axes(d, split) for d in s.dims), frozenset(_axes(sorted(s.partial), split)))


def refined_plan(plan: Plan, factors: Mapping[str, Sequence[int]] | None = None) -> Plan:
    """`plan` on the mesh with each axis of `factors` (default: `axis_factors(plan)`) split into its factors; the
    plan itself when there are none."""
    factors = axis_factors(plan) if factors is None else dict(factors)
    if not factors:
        return plan
    split = {a: _names(a, f) for a, f in factors.items()}
    sizes = _refined_sizes(plan.mesh_sizes, factors)
    if is_abstract(plan.mesh):
        mesh = abstract_mesh(sizes)
    else:
        types = dict(zip(plan.mesh.axis_names, plan.mesh.axis_types))  # (a sub-axis has its axis's type)
        mesh = Mesh(np.asarray(plan.mesh.devices).reshape(tuple(sizes.values())), tuple(sizes),
                    axis_types=tuple(types[a] for a in plan.mesh.axis_names for _ in split.get(a, (a,))))

    def reshard(r: Reshard) -> Reshard:
        return dataclasses.replace(r, src=_sharding(r.src, split), dst=_sharding(r.dst, split), collectives=())

    return dataclasses.replace(
        plan, mesh=mesh, shardings=tuple(_sharding(s, split) for s in plan.shardings),
        strategies=tuple(OpStrategy(tuple(_axes(fa, split) for fa in st.factor_axes)) for st in plan.strategies),
        reshards=tuple(map(reshard, plan.reshards)), unrun=tuple(map(reshard, plan.unrun)))


def _refined_sizes(sizes: Mapping[str, int], factors: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """The mesh axis sizes with each axis of `factors` replaced by its sub-axes (`_names`), in mesh order."""
    out: dict[str, int] = {}
    for a, n in sizes.items():
        out.update(zip(_names(a, factors[a]), factors[a]) if a in factors else ((a, n),))
    return out


def refined_pcg(plan: Plan, closed_jaxpr: Any = None, **build: Any) -> Any:
    """`build_pcg` of `refined_plan(plan)` (keyword arguments: `build_pcg`'s), or of the plan itself when it has no
    axis to refine, or when the refined mesh has more than `REFINED_MAX_AXES` axes of more than one device or a
    value resharded among part of an axis more than `REFINED_MAX_RANK` dims (the op searches' cost)."""
    from shardc.pcg.build import build_pcg

    factors = axis_factors(plan)
    if factors and _affordable(plan, factors):
        return build_pcg(refined_plan(plan, factors), closed_jaxpr, **build)
    return build_pcg(plan, closed_jaxpr, **build)


def _affordable(plan: Plan, factors: Mapping[str, Sequence[int]]) -> bool:
    if sum(1 for n in _refined_sizes(plan.mesh_sizes, factors).values() if n > 1) > REFINED_MAX_AXES:
        return False
    return all(len(plan.graph.values[r.value].shape) <= REFINED_MAX_RANK for r, c in _partial_groups(plan)
               if c.axes[0] in factors)
