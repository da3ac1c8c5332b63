"""Flax's logical axis rules, with Flax's own semantics.

* linen (`nn.with_logical_partitioning`, `nn.with_logical_constraint`, `nn.logical_to_mesh_axes`): the rules
  are tried in order; rule `(name, mesh axes)` gives its mesh axes to the dim named `name` when that dim has
  none yet and none of those axes is taken by another dim of the tensor — so `('mlp', 'fsdp'), ('mlp',
  'tensor')` falls back to 'tensor' when 'fsdp' is taken. A name no rule gives axes to is replicated; an entry
  that is not a name (a tuple of mesh axes, `PartitionSpec.UNCONSTRAINED`) is kept as it is.
* NNX (`nnx.with_partitioning` names with `sharding_rules`, as `nnx.get_partition_spec` reads them): a name
  with a rule becomes that rule's mesh axes (the last rule of a name wins); any other name is a mesh axis.

`shardc.auto(rules=...)` plays the part of Flax's `nn.logical_axis_rules` context: the step is traced inside
it (`rules_context`), so `nn.with_logical_constraint` on activations applies the rules, as under
`jax.jit` in that context.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any, Iterator, Sequence

from jax.sharding import PartitionSpec
from jax.tree_util import keystr

from annotations.errors import ShardingError

__all__ = ["linen_mesh_axes", "nnx_mesh_axes", "nnx_rules", "rules_context", "UnhintedParamsWarning",
           "warn_unhinted_params"]

Entry = Any  # per dim: a tuple of mesh axes, or None for a dim left open (PartitionSpec.UNCONSTRAINED)


def _as_axes(target: Any) -> tuple[str, ...]:
    if target is None:
        return ()
    if isinstance(target, str):
        return (target,)
    return tuple(target)


def _entry(name: Any) -> Entry:
    """A dim entry that is not a logical name, read as a PartitionSpec entry."""
    if name is PartitionSpec.UNCONSTRAINED:
        return None
    return _as_axes(name)


def linen_mesh_axes(names: Sequence[Any], rules: Sequence[tuple[str, Any]] | None, where: str) -> tuple[Entry, ...]:
    """Per dim the mesh axes Flax linen gives logical `names` under `rules` (see the module docstring)."""
    logical = [n for n in names if isinstance(n, str)]
    if len(set(logical)) != len(logical):
        twice = sorted({n for n in logical if logical.count(n) > 1})
        raise ShardingError(f"{where}: logical axis name(s) {twice} name more than one dim (partitioning "
                            f"{tuple(names)}); Flax rejects a name used twice in one array")
    out: list[Entry] = [() if isinstance(n, str) else _entry(n) for n in names]
    assigned = [not isinstance(n, str) for n in names]
    taken = {a for e in out if e for a in e}
    for name, target in rules or ():
        if name not in logical:
            continue
        d = list(names).index(name)
        axes = _as_axes(target)
        if assigned[d] or taken.intersection(axes):
            continue
        out[d], assigned[d] = axes, True
        taken.update(axes)
    return tuple(out)


def nnx_mesh_axes(names: Sequence[Any], rules: Sequence[tuple[str, Any]] | None) -> tuple[Entry, ...]:
    """Per dim the mesh axes Flax NNX gives `names` under `rules` (see the module docstring)."""
    table = {name: target for name, target in rules or ()}
    out: list[Entry] = []
    for n in names:
        out.append(_as_axes(table[n]) if isinstance(n, str) and n in table else _entry(n))
    return tuple(out)


def nnx_rules(outer: Sequence[tuple[str, Any]] | None, local: Sequence[tuple[str, Any]] | None,
              where: str) -> tuple[tuple[str, Any], ...]:
    """NNX's rules for a variable: the context's (`outer`) and then the variable's own `sharding_rules`;
    with both, a name mapped two ways is an error (as NNX's `composite_rules` raises)."""
    if not outer:
        return tuple(local or ())
    table = {name: target for name, target in outer}
    for name, target in local or ():
        if name in table and _as_axes(table[name]) != _as_axes(target):
            raise ShardingError(f"{where}: the variable's sharding_rules map {name!r} to {target!r} but the rules "
                                f"in effect map it to {table[name]!r}; NNX rejects inconsistent rules")
        table[name] = target
    return tuple(outer) + tuple(local or ())


@contextlib.contextmanager
def rules_context(rules: Sequence[tuple[str, Any]] | None) -> Iterator[None]:
    """Flax's `nn.logical_axis_rules(rules)` while tracing (nothing without rules: Flax's own context stays)."""
    if not rules:
        yield
        return
    import flax.linen as nn

    with nn.logical_axis_rules(tuple(rules)):
        yield


class UnhintedParamsWarning(UserWarning):
    """Logical axis rules were given, but the parameters carry neither Flax metadata nor in_shardings."""


_PARAM_ARGS = re.compile(r"^p$|^w$|param|variables|weights|model", re.IGNORECASE)


def _is_params(path: Sequence[Any], root_names: Sequence[str]) -> bool:
    """A leaf under a `params` key or attribute (a TrainState's), or in an argument named like parameters
    (`params`, `p`, `variables`, ...)."""
    root = getattr(path[0], "idx", None) if path else None
    named = root is not None and root < len(root_names) and _PARAM_ARGS.search(root_names[root]) is not None
    return named or any(getattr(k, "key", None) == "params" or getattr(k, "name", None) == "params" for k in path)


def warn_unhinted_params(paths: Sequence[Sequence[Any]], hinted: Sequence[bool], sizes: Sequence[int],
                         has_logical_boxes: bool, owner: str, root_names: Sequence[str]) -> bool:
    """With `rules=`: warn when parameters (leaves under a `params` key, or of an argument named `params`,
    `variables`, ...; `paths` start at the argument's index, named by `root_names`; `sizes` are element
    counts) have no hint of any kind (no metadata, no in_shardings, not placed on a mesh) and no argument
    carries Flax logical metadata: parameters unboxed before the step, whose logical names the rules can no
    longer reach. Returns whether it warned."""
    if has_logical_boxes:
        return False
    bare = [(n, p) for p, h, n in zip(paths, hinted, sizes) if not h and _is_params(p, root_names)]
    if not bare:
        return False
    first = max(bare, key=lambda b: b[0])[1]  # (name the largest: a kernel rather than a bias)
    name = f"{root_names[first[0].idx]}{keystr(tuple(first[1:]))}" if first[0].idx < len(root_names) \
        else keystr(tuple(first))
    warnings.warn(
        f"shardc.auto(rules=...) was given, but {len(bare)} parameter(s) of {owner} such as {name} carry no Flax "
        f"partitioning metadata (unboxed, e.g. by nn.unbox or nn.meta.unbox) and no in_shardings, so the rules "
        f"cannot reach them and the search lays them out. To keep your rules' layout, pass the parameters boxed "
        f"as init returns them, or pass in_shardings=nn.logical_to_mesh_sharding(nn.get_partition_spec("
        f"boxed_state), mesh, rules) for them (as the Flax examples give jax.jit)",
        UnhintedParamsWarning, stacklevel=6)
    return True
