"""`hint_p`: the JAX primitive behind split / replicate / shard.

In value it is the identity. It carries two parameters:

* `spec`: a `HintSpec` (per dim: closed axes tuple, GShard int count, or UNCONSTRAINED);
* `mesh`: the concrete `jax.sharding.Mesh` in force when the hint was written, or None.

Rules (the same shape as `jax.lax.with_sharding_constraint`'s, which it lowers to):

* abstract eval: the input's aval;
* eager impl: identity; with a mesh, the value placed by `with_sharding_constraint`;
* jvp / transpose: linear; the tangent and the cotangent carry the same hint (as in GShard);
* batching: the batch dim is inserted into the spec as UNCONSTRAINED (or as `spmd_axis_name`'s axes
  when vmap is given one); the output batch dim is the input's;
* lowering: identity without a mesh, else a sharding constraint to `NamedSharding(mesh, partition_spec(...))`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from annotations.errors import ShardingError
from annotations.spec import UNCONSTRAINED, DimHint, HintSpec, resolve_count

__all__ = ["hint_p", "bind_hint", "resolve_dims", "partition_spec", "named_sharding"]

hint_p = Primitive("shardc_hint")


def bind_hint(x, spec: HintSpec, mesh: Mesh | None):
    """Apply `hint_p` to one array (no validation; the user API validates first)."""
    return hint_p.bind(x, spec=spec, mesh=mesh)


# ----------------------------------------------------------------------------- spec -> jax sharding


def resolve_dims(spec: HintSpec, mesh: Mesh, *, tensor: str = "tensor",
                 exclude: frozenset[str] = frozenset()) -> tuple[DimHint, ...]:
    """The spec's dims with every int count replaced by the mesh axes `resolve_count` picks.

    Deterministic: int dims are resolved left to right, each skipping the axes named by the tuple dims,
    the axes already picked for earlier int dims and `exclude` (e.g. shard_map's manual axes).
    A count of 1 resolves to `()` (replicated).
    """
    taken = {a for d in spec.dims if isinstance(d, tuple) for a in d} | set(exclude)
    out: list[DimHint] = []
    for i, d in enumerate(spec.dims):
        if isinstance(d, int) and d is not UNCONSTRAINED:
            axes: tuple[str, ...] = ()
            if d != 1:
                axes = resolve_count(d, dict(mesh.shape), frozenset(taken), tensor=tensor, dim=i,
                                     source=spec.source)
            taken.update(axes)
            out.append(axes)
        else:
            out.append(d)
    return tuple(out)


def _entry(d: DimHint):
    if d is UNCONSTRAINED:
        return PartitionSpec.UNCONSTRAINED
    if not d:
        return None
    return d[0] if len(d) == 1 else tuple(d)


def partition_spec(spec: HintSpec, mesh: Mesh, exclude: frozenset[str] = frozenset()) -> PartitionSpec:
    """The `PartitionSpec` of a hint on `mesh` (tuple dims -> axis names, () -> None, ? -> UNCONSTRAINED)."""
    return PartitionSpec(*(_entry(d) for d in resolve_dims(spec, mesh, exclude=exclude)))


def named_sharding(spec: HintSpec, mesh: Mesh, exclude: frozenset[str] = frozenset()) -> NamedSharding:
    """`NamedSharding(mesh, partition_spec(spec, mesh, exclude))`."""
    return NamedSharding(mesh, partition_spec(spec, mesh, exclude))


# ----------------------------------------------------------------------------- rules


def _check_rank(spec: HintSpec, aval) -> None:
    if len(spec.dims) != aval.ndim:
        raise ShardingError(
            f"{spec.kind} hint {spec.describe()} has {len(spec.dims)} dims but the tensor "
            f"{aval.str_short()} has {aval.ndim}{spec.where()}"
        )


def _abstract_eval(x_aval, *, spec: HintSpec, mesh: Mesh | None):
    _check_rank(spec, x_aval)
    return x_aval


def _constrain(x, *, spec: HintSpec, mesh: Mesh | None):
    """The hint as a `with_sharding_constraint` (identity when there is no mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(spec, mesh))


def _impl(x, *, spec: HintSpec, mesh: Mesh | None):
    _check_rank(spec, jax.typeof(x))
    if mesh is None:
        return x if isinstance(x, jax.Array) else jnp.asarray(x)
    return _constrain(x, spec=spec, mesh=mesh)


def _transpose(ct, x, *, spec: HintSpec, mesh: Mesh | None):
    """The cotangent of a hinted value carries the same hint (symbolic zeros are handled by deflinear2)."""
    del x
    return [hint_p.bind(ct, spec=spec, mesh=mesh)]


def _batch(axis_data, vals_in, dims_in, *, spec: HintSpec, mesh: Mesh | None):
    (x,), (d,) = vals_in, dims_in
    if d is None:
        return hint_p.bind(x, spec=spec, mesh=mesh), d
    spmd = getattr(axis_data, "spmd_name", None)
    if spmd:
        spmd = tuple(spmd) if isinstance(spmd, (tuple, list)) else (spmd,)
        used = {a for dim in spec.dims if isinstance(dim, tuple) for a in dim}
        if used & set(spmd):
            raise ShardingError(
                f"vmap spmd_axis_name {spmd} is also used by the {spec.kind} hint "
                f"{spec.describe()}{spec.where()}"
            )
        new_spec = dataclasses.replace(spec, dims=spec.dims[:d] + (spmd,) + spec.dims[d:])
    else:
        new_spec = spec.insert_dim(d)
    return hint_p.bind(x, spec=new_spec, mesh=mesh), d


# ----------------------------------------------------------------------------- lowering


def _jax_constraint_rule():
    """JAX's own lowering rule of `sharding_constraint_p` (handles Shardy/GSPMD and shard_map's manual
    axes), or None on a JAX without it."""
    try:
        from jax._src import pjit

        return pjit._sharding_constraint_hlo_lowering
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        return None


_JAX_RULE = _jax_constraint_rule()
_LOWER_FUN_RULE = mlir.lower_fun(_constrain, multiple_results=False)


def _emit_constraint(ctx, x, *, spec: HintSpec, mesh: Mesh):
    """Emit `sharding_constraint(x, NamedSharding(mesh, partition_spec(spec, mesh)))` into the module.

    Uses JAX's lowering rule directly: re-tracing `with_sharding_constraint` at lowering time (the
    `mlir.lower_fun` fallback) loses the tracing-time mesh context, which breaks inside `shard_map`.
    """
    if _JAX_RULE is None:  # pragma: no cover
        return _LOWER_FUN_RULE(ctx, x, spec=spec, mesh=mesh)
    manual = frozenset(getattr(ctx.module_context.axis_context, "manual_axes", ()) or ())
    sharding = named_sharding(spec, mesh, exclude=manual)
    unconstrained = frozenset(i for i, p in enumerate(sharding.spec) if p is PartitionSpec.UNCONSTRAINED)
    return _JAX_RULE(ctx, x, sharding=sharding, layout=None, context_mesh=mesh,
                     unconstrained_dims=unconstrained)


def _module_device_count(ctx) -> int | None:
    """How many devices the computation being lowered runs on (None if the context does not say)."""
    axis_ctx = ctx.module_context.axis_context
    n = getattr(axis_ctx, "num_devices", None)
    if n is None and getattr(axis_ctx, "mesh", None) is not None:
        n = axis_ctx.mesh.size
    return n


def _lowering(ctx, x, *, spec: HintSpec, mesh: Mesh | None):
    """Identity without a mesh; otherwise the hint as a sharding constraint on `mesh`.

    A computation compiled for a different number of devices than the hint's mesh (typically: uncommitted
    inputs under `mesh_context` without `jax.set_mesh`) would drop the constraint silently, so it is an error.
    """
    if mesh is None:
        return [x]
    n = _module_device_count(ctx)
    if n is not None and n != mesh.size:
        raise ShardingError(
            f"{spec.kind} hint {spec.describe()} on {ctx.avals_in[0].str_short()} refers to mesh "
            f"{dict(mesh.shape)} ({mesh.size} devices), "
            f"but the computation is compiled for {n} device(s); enter the mesh with jax.set_mesh(mesh) "
            f"or place the inputs on it (jax.device_put / jit in_shardings){spec.where()}"
        )
    return _emit_constraint(ctx, x, spec=spec, mesh=mesh)


# ----------------------------------------------------------------------------- registration

hint_p.def_impl(_impl)
hint_p.def_abstract_eval(_abstract_eval)
ad.deflinear2(hint_p, _transpose)
batching.fancy_primitive_batchers[hint_p] = _batch
mlir.register_lowering(hint_p, _lowering)
