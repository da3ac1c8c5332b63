"""Seeds for propagation: the hints written in the program (`split`/`replicate`/`shard`, and
`with_sharding_constraint`) and those on the train step's inputs (Flax partitioning metadata).

Every seed is validated against the mesh here — unknown axes, axes used twice, dims not divisible —
and a bad one is a ShardingError naming the tensor, the dim, the sizes and the user's source line.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from annotations.errors import ShardingError, SourceLine
from annotations.primitive import resolve_dims
from annotations.spec import UNCONSTRAINED, HintSpec
from annotations.validate import check_spec, repeated_axis
from shardc.ir.graph import Graph
from shardc.propagate import Cause, Seed

__all__ = ["program_seeds", "validate_dims", "input_seed"]


def validate_dims(dims: Sequence[tuple[str, ...] | None], shape: Sequence[int], mesh: Mesh, *,
                  tensor: str, what: str, source: SourceLine | None) -> None:
    """Axes exist, each is used once in the tensor, and each dim divides by its axes' product."""
    at = f" (at {source})" if source else ""
    sizes = dict(mesh.shape)
    if len(dims) != len(shape):
        raise ShardingError(f"{what} for {tensor} has {len(dims)} entries but the tensor has shape {tuple(shape)}{at}")
    if (twice := repeated_axis([None if axes is None else tuple(axes) for axes in dims])) is not None:
        a, first, d = twice
        raise ShardingError(f"{what}: mesh axis {a!r} used twice in {tensor} {tuple(shape)} (dims {first} and {d}){at}")
    for d, axes in enumerate(dims):
        if axes is None:
            continue
        n = 1
        for a in axes:
            if a not in sizes:
                raise ShardingError(
                    f"{what}: unknown mesh axis {a!r} for dim {d} of {tensor} {tuple(shape)}; the mesh has "
                    f"axes {dict(sizes)}{at}")
            n *= sizes[a]
        if shape[d] % n:
            raise ShardingError(
                f"{what}: dim {d} of {tensor} {tuple(shape)} has size {shape[d]}, not divisible by "
                f"{'*'.join(f'{a}({sizes[a]})' for a in axes)} = {n}{at}")


def _hint_seed(graph: Graph, op, mesh: Mesh) -> Seed:
    spec: HintSpec = op.params["spec"]
    val = graph.values[op.outputs[0]]
    source = spec.source or op.source
    check_spec(spec, val.shape, val.dtype, mesh)
    dims = tuple(None if d is UNCONSTRAINED else tuple(d) for d in resolve_dims(spec, mesh, tensor=val.name))
    validate_dims(dims, val.shape, mesh, tensor=f"tensor {val.dtype}{list(val.shape)}", what=spec.kind, source=source)
    return Seed(op.outputs[0], dims, Cause("hint", f"{spec.describe()}", source), spec.priority)


def _constraint_seed(graph: Graph, op, mesh: Mesh) -> Seed | None:
    sharding = op.params.get("sharding")
    val = graph.values[op.outputs[0]]
    if not isinstance(sharding, NamedSharding):
        return None
    spec = sharding.spec
    unconstrained = set(op.params.get("unconstrained_dims", ()) or ())
    dims: list[tuple[str, ...] | None] = []
    for d in range(val.rank):
        entry = spec[d] if d < len(spec) else None
        if d in unconstrained or entry is PartitionSpec.UNCONSTRAINED:
            dims.append(None)
        elif entry is None:
            dims.append(())
        else:
            dims.append((entry,) if isinstance(entry, str) else tuple(entry))
    source = op.source
    validate_dims(dims, val.shape, mesh, tensor=f"tensor {val.dtype}{list(val.shape)}",
                  what="with_sharding_constraint", source=source)
    return Seed(op.outputs[0], tuple(dims), Cause("constraint", f"with_sharding_constraint {spec}", source), 0)


def program_seeds(graph: Graph, mesh: Mesh) -> list[Seed]:
    """Seeds from every hint and sharding constraint in the program, in program order."""
    seeds = []
    for op in graph.ops:
        if op.primitive == "shardc_hint":
            seeds.append(_hint_seed(graph, op, mesh))
        elif op.primitive == "sharding_constraint":
            s = _constraint_seed(graph, op, mesh)
            if s is not None:
                seeds.append(s)
    return seeds


def input_seed(graph: Graph, index: int, dims: Sequence[tuple[str, ...] | None], mesh: Mesh, cause: Cause) -> Seed:
    """A seed on the graph's `index`-th input (validated)."""
    vid = graph.inputs[index]
    val = graph.values[vid]
    validate_dims(dims, val.shape, mesh, tensor=val.name, what=cause.description, source=cause.source)
    return Seed(vid, tuple(dims), cause, 0)
