"""Arrays already placed on the mesh keep their layout, as under `jax.jit`.

A committed `jax.Array` whose sharding is a non-replicated `NamedSharding` on the plan's mesh (the same
devices in the same order, axis names and sizes) is a hint for its input: every dim pinned as placed,
unless `in_shardings` or the Flax metadata say otherwise. With `mesh=None` the mesh of such arrays (or
the mesh `jax.set_mesh` entered) is the plan's mesh. A plan made for other layouts is not reused for
these (`fits`); when an argument must still be re-placed (another mesh, or a hint that overrides its
layout), `replacement_note` says so, for a `PlacementWarning` naming the argument.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from shardc.jit_shardings import Dims, auto_mesh, same_mesh, spec_dims

__all__ = ["PlacementWarning", "is_laid_out", "is_placed", "placed_dims", "call_mesh", "fits", "replacement_note"]


class PlacementWarning(UserWarning):
    """An argument placed on devices in one layout is re-placed (copied) into the plan's layout."""


def is_laid_out(x: Any) -> bool:
    """A committed array split over several devices (a layout the user chose)."""
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed \
        and not x.sharding.is_fully_replicated


def is_placed(x: Any) -> bool:
    """A committed array on a mesh (replicated or not): the user chose where it lives."""
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed \
        and isinstance(x.sharding, NamedSharding)


def placed_dims(x: Any, mesh: Any) -> Dims | None:
    """The layout of `x` as per-dim mesh axes when it is a committed, non-replicated NamedSharding on `mesh`."""
    if not is_laid_out(x) or not isinstance(x.sharding, NamedSharding) or not same_mesh(x.sharding.mesh, mesh):
        return None
    return spec_dims(x.sharding.spec, x.ndim)


def _devices(mesh: Any) -> list[int]:
    return sorted(d.id for d in np.asarray(mesh.devices).flat)


def call_mesh(leaves: Sequence[Any], devices: Sequence[Any]) -> Mesh | None:
    """With `mesh=None`: the mesh over exactly `devices` that this call's placed arguments are on (the
    first one's), else the one `jax.set_mesh` entered; None when neither."""
    ids = sorted(d.id for d in devices)
    for x in leaves:
        if is_laid_out(x) and isinstance(x.sharding, NamedSharding) and _devices(x.sharding.mesh) == ids:
            return auto_mesh(x.sharding.mesh)
    ambient = jax.sharding.get_mesh()
    if ambient is not None and not ambient.empty and _devices(ambient) == ids:
        return auto_mesh(ambient)
    return None


def fits(shardings: Sequence[Any], mesh: Any, leaves: Sequence[Any], overridden: Mapping[int, str]) -> bool:
    """Whether a plan with these input `shardings` on `mesh` keeps every placed argument's layout (those
    whose layout a stronger hint overrides aside)."""
    for i, x in enumerate(leaves):
        if i in overridden:
            continue
        dims = placed_dims(x, mesh)
        if dims is not None and dims != shardings[i].dims:
            return False
    return True


def replacement_note(x: Any, target: NamedSharding, name: str, reason: str = "") -> str | None:
    """A sentence saying that the argument `name`, placed in a layout of its own, is re-placed into
    `target`; None when nothing the user laid out is moved."""
    if not is_laid_out(x) or x.sharding.is_equivalent_to(target, x.ndim):
        return None
    current = x.sharding
    where = f"{current.spec} on mesh {dict(current.mesh.shape)}" if isinstance(current, NamedSharding) \
        else str(current)
    if not reason:
        reason = ("it is on another mesh than the plan's" if not isinstance(current, NamedSharding)
                  or not same_mesh(current.mesh, target.mesh) else "the plan lays it out differently")
    return (f"argument {name} is placed as {where}, but the plan takes it as {target.spec} on mesh "
            f"{dict(target.mesh.shape)} ({reason}): shardc copies it into that layout at every call (and "
            f"donating it does not free your buffer). Place it as the plan does (plan.input_shardings()), or give "
            f"the step that mesh (mesh=...)")
