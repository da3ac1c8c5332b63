"""Which concrete mesh a hint is written against.

Lookup order (`lookup_mesh`):

1. the mesh of an enclosing `mesh_context(mesh)` (shardc.auto uses it while tracing);
2. the concrete mesh entered with `jax.set_mesh(mesh)` (visible inside `jax.jit` tracing too);
3. the mesh of the deprecated `with mesh:` context manager.

An empty mesh counts as none. When no mesh is found, hints are recorded with `mesh=None` and lower to
the identity (shardc or a later pass decides what they mean).

`mesh_context` is a `jax.make_user_context`, so entering it with a different mesh invalidates JAX's
tracing caches: a function traced without a mesh is re-traced (and its hints re-recorded) under one.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import jax
from jax.sharding import Mesh

__all__ = ["mesh_context", "current_mesh", "lookup_mesh", "provisional_mesh", "mesh_is_provisional"]

_MESH_CONTEXT = jax.make_user_context(default_value=None)
_PROVISIONAL = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None) -> Iterator[Mesh | None]:
    """Make `mesh` the mesh that hints written in this block refer to (`None`: fall back to JAX's)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh_context expects a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if mesh is not None and mesh.empty:
        mesh = None
    with _MESH_CONTEXT(mesh):
        yield mesh


@contextlib.contextmanager
def provisional_mesh(provisional: bool = True) -> Iterator[None]:
    """Hints written in this block are traced on a stand-in mesh whose sizes are not final (shardc's search
    chooses the mesh afterwards and checks each hint on every mesh it tries): axis names are still checked,
    divisibility by the stand-in's sizes is not."""
    with _PROVISIONAL(bool(provisional)):
        yield


def mesh_is_provisional() -> bool:
    return bool(_PROVISIONAL.value)


def current_mesh() -> Mesh | None:
    """The mesh of the innermost `mesh_context`, or None."""
    return _MESH_CONTEXT.value


def _jax_concrete_mesh() -> Mesh | None:
    """The concrete mesh of `jax.set_mesh`, also while tracing under jit (where get_mesh() refuses)."""
    try:
        from jax._src import mesh as mesh_lib

        mesh = mesh_lib.get_concrete_mesh()
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        try:
            mesh = jax.sharding.get_mesh()
        except ValueError:
            return None
    if mesh is None or not isinstance(mesh, Mesh) or mesh.empty:
        return None
    return mesh


def _legacy_mesh() -> Mesh | None:
    """The mesh of the deprecated `with mesh:` context manager, if any."""
    try:
        from jax._src import mesh as mesh_lib

        mesh = mesh_lib.thread_resources.env.physical_mesh
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        return None
    if not isinstance(mesh, Mesh) or mesh.empty:
        return None
    return mesh


def lookup_mesh() -> Mesh | None:
    """The concrete mesh hints written now refer to: mesh_context, then jax.set_mesh, then `with mesh:`."""
    for find in (current_mesh, _jax_concrete_mesh, _legacy_mesh):
        mesh = find()
        if mesh is not None:
            return mesh
    return None
