"""Flax partitioning metadata on the train step's inputs, as hints.

Recognised on any leaf of the arguments:

* linen `nn.Partitioned` (from `nn.with_partitioning`): mesh axis names per dim;
* linen `nn.LogicallyPartitioned` (from `nn.with_logical_partitioning`): logical names, mapped to mesh
  axes as Flax maps them (`shardc.flax_rules`: rules in order, fallback to a later rule when an axis is
  taken, no rule = replicated) by the box's own rules, else those given to `shardc.auto(rules=...)`, else
  Flax's `nn.logical_axis_rules` context;
* NNX variables (`nnx.with_partitioning`): the `out_sharding` / `sharding` / `sharding_names` metadata
  (names with a rule in `rules=` / the context / the variable's `sharding_rules` mapped, as NNX does).

Inputs with no metadata of their own inherit a hint from a hinted input whose path is a suffix of theirs
and whose shape is the same — so Adam's `mu`/`nu` for `['params']['Dense_0']['kernel']` are sharded like
that kernel even when the params were unboxed before `optax.init`.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Sequence

import jax
from jax.tree_util import keystr

from annotations.errors import ShardingError
from annotations.validate import repeated_axis
from shardc.flax_rules import linen_mesh_axes, nnx_mesh_axes, nnx_rules
from shardc.seeds import validate_dims

__all__ = ["InputHint", "input_hints", "named_mesh_axes", "has_logical_boxes"]

Dims = tuple[tuple[str, ...] | None, ...]


@dataclasses.dataclass(frozen=True)
class InputHint:
    """A hint on one flattened input: per dim, the axes (or None for open) and where it came from."""

    dims: Dims
    description: str


def _is_meta(x: Any) -> bool:
    try:
        from flax.core import meta
    except ImportError:  # pragma: no cover
        return False
    if isinstance(x, meta.AxisMetadata):
        return True
    if "flax.nnx" not in sys.modules:  # no nnx.Variable exists before flax.nnx is imported (importing it costs ~1 s)
        return False
    from flax import nnx

    return isinstance(x, nnx.Variable)


def _names_of(node: Any) -> tuple[tuple[Any, ...] | None, Any, str]:
    """(names, rules, kind) of a metadata box; names None when the box carries no partitioning."""
    from flax.core import meta
    from flax.linen import spmd

    if isinstance(node, spmd.LogicallyPartitioned):
        return tuple(node.names), node.rules, "logical"
    if isinstance(node, meta.Partitioned):
        return tuple(node.names), None, "mesh"
    md = node.get_metadata() if hasattr(node, "get_metadata") else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = md.get(key)
        if names is not None:
            return tuple(names), md.get("sharding_rules"), "nnx"
    return None, None, ""


def _axes_of(names: Sequence[Any], kind: str, box_rules: Any, rules: Any, context: Callable[[], Any],
             where: str) -> tuple[tuple[str, ...] | None, ...]:
    """Per dim the mesh axes a box's names stand for, as Flax reads them (shardc.flax_rules): linen logical
    names through the box's own rules, else `rules` (shardc.auto's, Flax's context while tracing), else
    Flax's context; NNX names through `rules` (or the context) and then the box's own; linen
    `nn.Partitioned` names are mesh axes."""
    if kind == "logical":
        use = box_rules if box_rules is not None else (rules if rules is not None else context())
        return linen_mesh_axes(names, use, where)
    if kind == "nnx":
        return nnx_mesh_axes(names, nnx_rules(rules if rules is not None else context(), box_rules, where))
    return nnx_mesh_axes(names, ())


def _check_axes(dims: Dims, names: Sequence[Any], kind: str, rules: Any, mesh_axes: Sequence[str], where: str) -> None:
    """A name that is not a mesh axis (of a linen nn.Partitioned or NNX box, or the target of a rule), and an
    axis named twice, are errors."""
    for d, axes in enumerate(dims):
        for a in axes or ():
            if a in mesh_axes:
                continue
            if kind == "logical":
                raise ShardingError(f"{where}: the rules map logical axis {names[d]!r} (dim {d}) to unknown mesh "
                                    f"axis {a!r}; the mesh has axes {tuple(mesh_axes)}")
            raise ShardingError(
                f"{where}: dim {d} names {a!r}, which is neither a mesh axis {tuple(mesh_axes)} nor a logical "
                f"axis with a rule (rules: {dict(rules or ()) or 'none'}); pass "
                f"shardc.auto(rules=[({a!r}, <mesh axis or None>), ...])")
    if (twice := repeated_axis(dims)) is not None:
        a, first, d = twice
        where_first = f"dim {first}" if first != d else "the same dim"
        raise ShardingError(
            f"{where}: mesh axis {a!r} is named for dim {d} and for {where_first} (partitioning "
            f"{tuple(names)}); an axis can split only one dim of a tensor, once")


def _flax_context_rules() -> Any:
    try:
        import flax.linen as nn

        return nn.get_logical_axis_rules()
    except Exception:  # pragma: no cover
        return ()


def _boxes(args: Any) -> list[tuple[tuple, Any, tuple[Any, ...] | None, Any, str]]:
    """Every leaf or metadata box of `args`: (path, node, names, box rules, kind); names None for a plain leaf."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_meta)
    out = []
    for path, node in pairs:
        names, box_rules, kind = _names_of(node) if _is_meta(node) else (None, None, "")
        out.append((tuple(path), node, names, box_rules, kind))
    return out


def input_hints(args: Any, mesh: Any, rules: Any = None, owner: str = "") -> list[InputHint | None]:
    """One entry per flattened leaf of `args` (in `jax.tree_util` order). `mesh` is a Mesh (then every hint is
    checked against it: axes, divisibility) or its axis names. `owner` (the step, with its source line) is
    named in errors: the metadata itself does not record where the model set it."""
    mesh_axes = tuple(mesh.axis_names) if hasattr(mesh, "axis_names") else tuple(mesh)
    hints: list[InputHint | None] = []
    paths: list[tuple] = []
    shapes: list[tuple] = []
    context = functools.lru_cache(maxsize=None)(_flax_context_rules)
    for path, node, names, box_rules, kind in _boxes(args):
        if kind == "":
            hints.append(None)
            paths.append(path)
            shapes.append(tuple(getattr(node, "shape", ())))
            continue
        inner, _ = jax.tree_util.tree_flatten_with_path(node)
        for sub_path, leaf in inner:
            full = path + tuple(sub_path)
            paths.append(full)
            shapes.append(tuple(getattr(leaf, "shape", ())))
            if names is None:
                hints.append(None)
                continue
            where = f"Flax metadata of {keystr(full)}" + (f" (an argument of {owner})" if owner else "")
            shape = shapes[-1]
            if len(names) > len(shape):
                raise ShardingError(f"{where}: {len(names)} axis names {names} for an array of shape {shape}")
            padded = tuple(names) + (None,) * (len(shape) - len(names))  # as a PartitionSpec: the rest replicated
            dims = _axes_of(padded, kind, box_rules, rules, context, where)
            if kind != "logical" or not hasattr(mesh, "shape"):
                _check_axes(dims, padded, kind, rules, mesh_axes, where)
            if hasattr(mesh, "shape"):  # (a rule's unknown target, divisibility: with the mesh's sizes)
                validate_dims(dims, shape, mesh, tensor=keystr(full), what=where, source=None)
            description = f"{kind} partitioning {padded} of {keystr(full)}"
            hints.append(InputHint(dims, description))
    _inherit_by_path(hints, paths, shapes)
    return hints


def has_logical_boxes(args: Any) -> bool:
    """Whether any leaf of `args` is a linen `nn.LogicallyPartitioned` box."""
    return any(kind == "logical" for *_, kind in _boxes(args))


def named_mesh_axes(args: Any, rules: Any = None) -> list[str]:
    """The mesh axes the arguments' metadata names, in first-seen order: axis names of linen `nn.Partitioned`
    and NNX variables, and the mesh axes the rules (as `input_hints` applies them) give logical names. A
    mesh chosen by the search must have them all."""
    out: list[str] = []
    context = functools.lru_cache(maxsize=None)(_flax_context_rules)
    for path, _, names, box_rules, kind in _boxes(args):
        if names is None:
            continue
        for axes in _axes_of(names, kind, box_rules, rules, context, f"Flax metadata of {keystr(path)}"):
            out.extend(a for a in axes or () if isinstance(a, str) and a not in out)
    return out


def _inherit_by_path(hints: list[InputHint | None], paths: list[tuple], shapes: list[tuple]) -> None:
    """Unhinted leaves take the hint of a hinted leaf whose path (minus its argument index) ends theirs."""
    hinted = [(paths[i][1:], shapes[i], hints[i]) for i in range(len(hints)) if hints[i] is not None]
    hinted = [h for h in hinted if len(h[0]) >= 2]
    if not hinted:
        return
    for i, h in enumerate(hints):
        if h is not None:
            continue
        p = paths[i]
        for suffix, shape, hint in hinted:
            if shape == shapes[i] and len(p) >= len(suffix) and _keys(p[len(p) - len(suffix):]) == _keys(suffix):
                hints[i] = InputHint(hint.dims, f"like {keystr(suffix)} ({hint.description})")
                break


def _keys(path: Sequence[Any]) -> tuple:
    return tuple(keystr((k,)) for k in path)
