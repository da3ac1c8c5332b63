"""Flax partitioning metadata on the train step's inputs, as hints.

Recognised on any leaf of the arguments:

* linen `nn.Partitioned` (from `nn.with_partitioning`): mesh axis names per dim;
* linen `nn.LogicallyPartitioned` (from `nn.with_logical_partitioning`): logical names, mapped to mesh
  axes by the rules given to `shardc.auto(rules=...)`, else the box's own rules, else Flax's
  `nn.logical_axis_rules` context;
* NNX variables (`nnx.with_partitioning`): the `out_sharding` / `sharding` / `sharding_names` metadata.

Inputs with no metadata of their own inherit a hint from a hinted input whose path is a suffix of theirs
and whose shape is the same — so Adam's `mu`/`nu` for `['params']['Dense_0']['kernel']` are sharded like
that kernel even when the params were unboxed before `optax.init`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax.tree_util import keystr

from annotations.errors import ShardingError
from annotations.validate import repeated_axis

__all__ = ["InputHint", "input_hints", "named_mesh_axes"]

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
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover
        return False
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


def _as_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _map_names(names: Sequence[Any], rules: Any, mesh_axes: Sequence[str], where: str) -> Dims:
    """Per dim mesh axes; logical names go through `rules`. A name with no rule is an error."""
    rule_map: dict[str, Any] = {}
    if rules:
        for logical, physical in rules:
            rule_map.setdefault(logical, physical)
    out = []
    for d, entry in enumerate(names):
        axes: list[str] = []
        for name in _as_axes(entry):
            if name in mesh_axes and name not in rule_map:
                axes.append(name)
            elif name in rule_map:
                axes.extend(_as_axes(rule_map[name]))
            else:
                raise ShardingError(
                    f"{where}: dim {d} names {name!r}, which is neither a mesh axis {tuple(mesh_axes)} nor a "
                    f"logical axis with a rule (rules: {dict(rule_map) or 'none'}); pass "
                    f"shardc.auto(rules=[({name!r}, <mesh axis or None>), ...])")
        out.append(tuple(axes))
    if (twice := repeated_axis(out)) is not None:
        a, first, d = twice
        where_first = f"dim {first}" if first != d else "the same dim"
        raise ShardingError(
            f"{where}: mesh axis {a!r} is named for dim {d} and for {where_first} (partitioning "
            f"{tuple(names)}); an axis can split only one dim of a tensor, once")
    return tuple(out)


def _flax_context_rules() -> Any:
    try:
        import flax.linen as nn

        return nn.get_logical_axis_rules()
    except Exception:  # pragma: no cover
        return ()


def input_hints(args: Any, mesh_axes: Sequence[str], rules: Any = None, owner: str = "") -> list[InputHint | None]:
    """One entry per flattened leaf of `args` (in `jax.tree_util` order). `owner` (the step, with its source
    line) is named in errors: the metadata itself does not record where the model set it."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_meta)
    hints: list[InputHint | None] = []
    paths: list[tuple] = []
    shapes: list[tuple] = []
    context_rules = None
    for path, node in pairs:
        if not _is_meta(node):
            hints.append(None)
            paths.append(tuple(path))
            shapes.append(tuple(getattr(node, "shape", ())))
            continue
        names, box_rules, kind = _names_of(node)
        inner, _ = jax.tree_util.tree_flatten_with_path(node)
        for sub_path, leaf in inner:
            full = tuple(path) + tuple(sub_path)
            paths.append(full)
            shapes.append(tuple(getattr(leaf, "shape", ())))
            if names is None:
                hints.append(None)
                continue
            where = f"Flax metadata of {keystr(full)}" + (f" (an argument of {owner})" if owner else "")
            use_rules = rules
            if use_rules is None and kind != "mesh":
                use_rules = box_rules
                if use_rules is None:
                    if context_rules is None:
                        context_rules = _flax_context_rules()
                    use_rules = context_rules
            shape = shapes[-1]
            if len(names) > len(shape):
                raise ShardingError(f"{where}: {len(names)} axis names {names} for an array of shape {shape}")
            names = tuple(names) + (None,) * (len(shape) - len(names))  # as a PartitionSpec: the rest replicated
            dims = _map_names(names, use_rules, mesh_axes, where)
            hints.append(InputHint(dims, f"{kind} partitioning {tuple(names)} of {keystr(full)}"))
    _inherit_by_path(hints, paths, shapes)
    return hints


def named_mesh_axes(args: Any, rules: Any = None) -> list[str]:
    """The mesh axes the arguments' metadata names, in first-seen order: axis names of linen `nn.Partitioned`
    and NNX variables, and the targets of the logical-axis rules (`rules`, else a box's own, else Flax's
    context) for logical names. A mesh chosen by the search must have them all."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_meta)
    out: list[str] = []
    context_rules = None
    for _, node in pairs:
        if not _is_meta(node):
            continue
        names, box_rules, kind = _names_of(node)
        if names is None:
            continue
        use_rules = rules
        if use_rules is None and kind != "mesh":
            use_rules = box_rules
            if use_rules is None:
                context_rules = _flax_context_rules() if context_rules is None else context_rules
                use_rules = context_rules
        rule_map: dict[str, Any] = {}
        for logical, physical in use_rules or ():
            rule_map.setdefault(logical, physical)
        for entry in names:
            for name in _as_axes(entry):
                axes = _as_axes(rule_map[name]) if name in rule_map else (() if kind == "logical" else (name,))
                out.extend(a for a in axes if isinstance(a, str) and a not in out)
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
