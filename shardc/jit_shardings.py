"""`in_shardings` / `out_shardings` as `jax.jit` takes them, read as user hints.

`shardc.auto(f, in_shardings=..., out_shardings=...)`: a pytree prefix of the positional arguments that are
not static (resp. of the outputs) whose leaves are `NamedSharding`, `PartitionSpec` or `None`. A sharding
pins every dim of the leaves under it (closed dims, priority 0: the search never overrides them; a
`PartitionSpec.UNCONSTRAINED` entry leaves its dim to shardc); `None` leaves them to shardc, and then an
array already placed on the mesh keeps its layout (`shardc.placement`), as under `jax.jit`. Keyword
arguments are not covered (shardc decides them; `jax.jit` refuses keyword arguments with `in_shardings`).

A `PartitionSpec` is read on the plan's mesh; a `NamedSharding` must be on that mesh (with `mesh=None` the
NamedShardings choose it). Every mistake is a `ShardingError` naming the argument path, the dim, the
sizes and the line that wrote the option.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import keystr

from annotations.errors import ShardingError, SourceLine
from shardc.seeds import validate_dims

__all__ = ["JitShardings", "spec_dims", "same_mesh", "auto_mesh", "Dims"]

Dims = tuple[tuple[str, ...] | None, ...]


def is_spec_leaf(x: Any) -> bool:
    """A leaf of an in_shardings/out_shardings tree: a sharding, a PartitionSpec or None."""
    return x is None or isinstance(x, (NamedSharding, PartitionSpec))


def spec_dims(spec: PartitionSpec, rank: int) -> Dims | None:
    """Per dim the mesh axes of `spec` on a tensor of `rank` dims (missing entries replicated, as in a
    PartitionSpec; `UNCONSTRAINED` open: None); None when the spec has more entries than dims."""
    entries = tuple(spec)
    if len(entries) > rank:
        return None
    out: list[tuple[str, ...] | None] = []
    for entry in entries + (None,) * (rank - len(entries)):
        if entry is PartitionSpec.UNCONSTRAINED:
            out.append(None)
        elif entry is None:
            out.append(())
        else:
            out.append((entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


def same_mesh(a: Any, b: Any) -> bool:
    """The same devices in the same order under the same axis names and sizes (axis types aside)."""
    if a is b:
        return True
    if a is None or b is None or tuple(a.axis_names) != tuple(b.axis_names) or dict(a.shape) != dict(b.shape):
        return False
    da, db = getattr(a, "devices", None), getattr(b, "devices", None)
    if da is None or db is None:
        return False
    return [d.id for d in np.asarray(da).flat] == [d.id for d in np.asarray(db).flat]


def auto_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with Auto axes (shardc plans with GSPMD semantics; `jax.make_mesh` defaults to Explicit)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _at(source: SourceLine | None) -> str:
    return f" (at {source})" if source is not None else ""


def _describe_tree(x: Any) -> str:
    if x is None:
        return "None"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of {len(x)}"
    if isinstance(x, dict):
        return f"dict with keys {sorted(map(str, x))}"
    if hasattr(x, "shape"):
        return f"array {getattr(x, 'dtype', '')}{list(x.shape)}"
    return type(x).__name__


def _one_level(x: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """The children of pytree node `x` with their keys, and its node (type and static data)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    return [(p[0], c) for p, c in pairs], treedef.node_data()


def broadcast_prefix(prefix: Any, full: Any, option: str, path: str, what: str,
                     source: SourceLine | None) -> list[tuple[Any, str]]:
    """For every leaf of `full`, the leaf of `prefix` above it and that leaf's path in `prefix`.
    A prefix that does not match `full` is a ShardingError naming the first place where they differ."""
    if is_spec_leaf(prefix):
        return [(prefix, path)] * len(jax.tree_util.tree_leaves(full))
    children, node = _one_level(prefix)
    structure = jax.tree_util.tree_structure(full)  # (an empty container, e.g. optax.EmptyState(), is no leaf)
    if structure.num_leaves == 1 and jax.tree_util.treedef_is_leaf(structure) and full is not None:
        raise ShardingError(f"{option}{path} is a {_describe_tree(prefix)} but {what}{path} is "
                            f"{_describe_tree(full)}: {option} must be a pytree prefix of {what}{_at(source)}")
    full_children, full_node = _one_level(full)
    if node != full_node or len(children) != len(full_children):
        raise ShardingError(f"{option}{path} is a {_describe_tree(prefix)} but {what}{path} is a "
                            f"{_describe_tree(full)}: {option} must be a pytree prefix of {what} (the same "
                            f"containers, with a NamedSharding, PartitionSpec or None where a subtree shares one)"
                            f"{_at(source)}")
    out: list[tuple[Any, str]] = []
    for (key, child), (_, full_child) in zip(children, full_children):
        out += broadcast_prefix(child, full_child, option, path + keystr((key,)), what, source)
    return out


@dataclasses.dataclass(frozen=True)
class JitShardings:
    """The `in_shardings` / `out_shardings` options of one `@shardc.auto` function and where they were given."""

    in_shardings: Any = None
    out_shardings: Any = None
    source: SourceLine | None = None

    @classmethod
    def make(cls, in_shardings: Any, out_shardings: Any, source: SourceLine | None) -> "JitShardings":
        """Checked options: every leaf a NamedSharding, PartitionSpec or None; the NamedShardings on one mesh."""
        if isinstance(in_shardings, list):
            in_shardings = tuple(in_shardings)  # (as jax.jit reads a list)
        for option, tree in (("in_shardings", in_shardings), ("out_shardings", out_shardings)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec_leaf)[0]:
                if not is_spec_leaf(leaf):
                    raise ShardingError(
                        f"shardc.auto({option}=...): the entry at {option}{keystr(path)} is {type(leaf).__name__} "
                        f"{leaf!r:.60}; expected a jax.sharding.NamedSharding, a PartitionSpec or None (None: "
                        f"shardc decides){_at(source)}")
        made = cls(in_shardings, out_shardings, source)
        made.mesh()  # two meshes among the NamedShardings: an error now, not at the first call
        return made

    def __bool__(self) -> bool:
        return any(x is not None for x in jax.tree_util.tree_leaves((self.in_shardings, self.out_shardings)))

    def _named(self) -> list[tuple[str, NamedSharding]]:
        out = []
        for option, tree in (("in_shardings", self.in_shardings), ("out_shardings", self.out_shardings)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec_leaf)[0]:
                if isinstance(leaf, NamedSharding):
                    out.append((f"{option}{keystr(path)}", leaf))
        return out

    def mesh(self) -> Mesh | None:
        """The mesh of the NamedShardings (with Auto axes), None without any; two meshes are an error."""
        named = self._named()
        if not named:
            return None
        first_where, first = named[0]
        for where, s in named[1:]:
            if not same_mesh(s.mesh, first.mesh):
                raise ShardingError(
                    f"{where} is a NamedSharding on mesh {dict(s.mesh.shape)} but {first_where} is on mesh "
                    f"{dict(first.mesh.shape)} (or the same shape over other devices); one program runs on one "
                    f"mesh: build every NamedSharding on the same mesh{_at(self.source)}")
        return auto_mesh(first.mesh)

    def check_mesh(self, mesh: Any, owner: str) -> None:
        """Every NamedSharding is on `mesh` (the plan's)."""
        for where, s in self._named():
            if not same_mesh(s.mesh, mesh):
                raise ShardingError(
                    f"{where} is a NamedSharding on mesh {dict(s.mesh.shape)} (devices "
                    f"{[d.id for d in np.asarray(s.mesh.devices).flat]}), but {owner} is planned on mesh "
                    f"{dict(mesh.shape)}" + (f" (devices {[d.id for d in np.asarray(mesh.devices).flat]})"
                                            if hasattr(mesh, "devices") else "")
                    + f"; give shardc.auto that mesh (mesh=...), or pass a PartitionSpec, which is read on the "
                    f"plan's mesh{_at(self.source)}")

    def named_axes(self) -> list[str]:
        """The mesh axes the shardings name, in first-seen order (a mesh the search chooses must have them)."""
        out: list[str] = []
        for leaf in jax.tree_util.tree_leaves((self.in_shardings, self.out_shardings), is_leaf=is_spec_leaf):
            spec = leaf.spec if isinstance(leaf, NamedSharding) else leaf
            for entry in spec if spec is not None else ():
                if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                    continue
                out += [a for a in ((entry,) if isinstance(entry, str) else entry) if a not in out]
        return out

    def for_static(self, positions: Sequence[int], num_args: int, owner: str) -> "JitShardings":
        """The options of one static value's step, whose arguments keep `None` at the static `positions`:
        a tuple over the other positional arguments gets `None` put in at those positions."""
        ins = self.in_shardings
        if not isinstance(ins, tuple) or not positions:
            return self
        dynamic = num_args - len(positions)
        if len(ins) != dynamic:
            raise ShardingError(
                f"in_shardings has {len(ins)} entries but {owner} was called with {dynamic} positional argument(s) "
                f"that are not static; as in jax.jit, in_shardings covers the positional arguments without the "
                f"static ones{_at(self.source)}")
        it = iter(ins)
        full = tuple(None if i in positions else next(it) for i in range(num_args))
        return dataclasses.replace(self, in_shardings=full)

    def for_nnx(self, num_nodes: int) -> "JitShardings":
        """The options of an NNX call's pure step, which returns `(result, node states...)`."""
        if self.out_shardings is None:
            return self
        return dataclasses.replace(self, out_shardings=(self.out_shardings,) + (None,) * num_nodes)

    def covers(self, args: tuple, kwargs: dict) -> list[bool]:
        """Per flattened leaf of `(args, kwargs)`: whether in_shardings gives it a sharding (not None)."""
        n_kw = len(jax.tree_util.tree_leaves(kwargs))
        ins = self.in_shardings
        if ins is None or (isinstance(ins, tuple) and len(ins) != len(args)):
            return [False] * (len(jax.tree_util.tree_leaves(args)) + n_kw)
        try:
            pairs = broadcast_prefix(ins, tuple(args), "in_shardings", "", "the positional arguments", self.source)
        except ShardingError:
            return [False] * (len(jax.tree_util.tree_leaves(args)) + n_kw)
        return [spec is not None for spec, _ in pairs] + [False] * n_kw

    def input_dims(self, args: tuple, kwargs: dict, mesh: Any, owner: str) -> list[tuple[Dims, str] | None]:
        """Per flattened leaf of `(args, kwargs)`: the dims in_shardings pins and a description, or None."""
        n_kw = len(jax.tree_util.tree_leaves(kwargs))
        if self.in_shardings is None:
            return [None] * (len(jax.tree_util.tree_leaves(args)) + n_kw)
        ins = self.in_shardings
        if isinstance(ins, tuple) and len(ins) != len(args):
            raise ShardingError(
                f"in_shardings is a tuple of {len(ins)} but {owner} was called with {len(args)} positional "
                f"argument(s); as in jax.jit it needs one entry per positional argument (or one sharding for "
                f"all){_at(self.source)}")
        if not isinstance(ins, tuple) and not is_spec_leaf(ins):
            raise ShardingError(
                f"in_shardings is a {_describe_tree(ins)}; as in jax.jit it is a tuple with one entry per positional "
                f"argument, or one NamedSharding / PartitionSpec for all of them{_at(self.source)}")
        pairs = broadcast_prefix(ins, tuple(args), "in_shardings", "", "the positional arguments", self.source)
        leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
        out = [self._dims(spec, where, leaf, f"argument {keystr(path)}", "in_shardings", mesh)
               for (spec, where), (path, leaf) in zip(pairs, leaves)]
        return out + [None] * n_kw

    def output_dims(self, out_tree: Any, shapes: Sequence[tuple[int, ...]], mesh: Any) -> list[tuple[Dims, str] | None]:
        """Per output leaf: the dims out_shardings pins and a description, or None."""
        if self.out_shardings is None:
            return [None] * out_tree.num_leaves
        dummy = jax.tree_util.tree_unflatten(out_tree, [jax.ShapeDtypeStruct(s, np.int8) for s in shapes])
        pairs = broadcast_prefix(self.out_shardings, dummy, "out_shardings", "", "the outputs", self.source)
        leaves = jax.tree_util.tree_flatten_with_path(dummy)[0]
        return [self._dims(spec, where, leaf, f"output out{keystr(path)}", "out_shardings", mesh)
                for (spec, where), (path, leaf) in zip(pairs, leaves)]

    def _dims(self, spec: Any, where: str, leaf: Any, tensor: str, option: str, mesh: Any) -> tuple[Dims, str] | None:
        if spec is None:
            return None
        shape = tuple(leaf.shape) if hasattr(leaf, "shape") else tuple(np.shape(leaf))
        pspec = spec.spec if isinstance(spec, NamedSharding) else spec
        dims = spec_dims(pspec, len(shape))
        if dims is None:
            raise ShardingError(f"{option}{where}: {pspec} has {len(tuple(pspec))} entries but {tensor} has shape "
                                f"{shape} ({len(shape)} dims){_at(self.source)}")
        what = f"{option}{where} {pspec}"
        validate_dims(dims, shape, mesh, tensor=tensor, what=what, source=self.source)
        return dims, what
