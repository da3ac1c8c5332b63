"""Steps written for JAX's explicit sharding mode (`jax.make_mesh`'s default Explicit axes), as shardc hints.

Code such as Flax's NNX Gemma example types its activations: `jnp.einsum(..., out_sharding=P("fsdp", None,
"tensor"))`, `jax.sharding.reshard(x, P(...))`. JAX refuses those PartitionSpecs on the Auto-axis mesh shardc
plans on ("cannot contain axis names that are of type Auto"), so such a step cannot be traced the usual way.
`trace_explicit` traces it as `jax.jit` does, under the mesh with the caller's Explicit axes and the arguments'
shardings in their types, then `to_auto` rewrites the program for the Auto mesh:

- an `out_sharding` the user wrote on a `dot_general` (einsum, matmul, `nnx.Linear(..., out_sharding=)`) and
  the target of a `reshard` become shardc hints (`shard`: what the spec names is split, a None dim is
  replicated), with the user's source line;
- every other sharding in the types (`broadcast_in_dim`, `reshape`, `iota`, `reduce_sum`, ... which JAX
  infers from the operands) is dropped: propagation and the search decide those, as GSPMD would;
- calls (`jit`, `custom_jvp_call`, `custom_vjp_call`, `checkpoint`) are inlined, as shardc's graph builder
  and lowering inline them anyway; loop and branch bodies are rewritten in place.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax._src import source_info_util
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from annotations.api import _hint
from annotations.errors import ShardingError, SourceLine
from annotations.spec import UNCONSTRAINED
from shardc.ir.jaxpr_env import JaxprEnv, open_jaxpr

__all__ = ["caller_mesh", "explicit_axes", "is_explicit_mode_error", "retype", "trace_explicit", "to_auto"]

_TYPED_PARAMS = ("sharding", "out_sharding")  # params that only carry a type's sharding
_INLINED = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat")


def explicit_axes(leaves: Sequence[Any]) -> frozenset[str]:
    """Mesh axes of Explicit type in the mesh `jax.set_mesh` entered or in the arguments' shardings."""
    names: set[str] = set()
    meshes = [jax.sharding.get_abstract_mesh()]
    meshes += [x.sharding.mesh for x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               and isinstance(x.sharding, NamedSharding)]
    for m in meshes:
        if m is not None and not getattr(m, "empty", False):
            names |= {n for n, t in zip(m.axis_names, m.axis_types) if t == AxisType.Explicit}
    return frozenset(names)


def caller_mesh(leaves: Sequence[Any], plan_mesh: Any) -> Mesh | None:
    """The mesh with Explicit axes the call came from (`jax.set_mesh`'s, else an argument's) when it is the
    plan's mesh but for the axis types; None otherwise."""
    candidates = [jax.sharding.get_mesh()]
    candidates += [x.sharding.mesh for x in leaves if isinstance(x, jax.Array)
                   and not isinstance(x, jax.core.Tracer) and isinstance(x.sharding, NamedSharding)]
    for m in candidates:
        if isinstance(m, Mesh) and not m.empty and AxisType.Explicit in m.axis_types and isinstance(plan_mesh, Mesh) \
                and m.axis_names == plan_mesh.axis_names and m.devices.shape == plan_mesh.devices.shape \
                and (m.devices == plan_mesh.devices).all():
            return m
    return None


def retype(outs: Sequence[Any], mesh: Mesh) -> list[Any]:
    """Outputs laid out on the plan's (Auto) mesh, typed on the caller's Explicit `mesh` as `jax.jit` would
    return them there (the same buffers: a device_put between two meshes of the same devices copies nothing)."""
    return [jax.device_put(x, NamedSharding(mesh, x.sharding.spec))
            if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) else x for x in outs]


def is_explicit_mode_error(e: Exception) -> bool:
    """JAX's error for an explicit-mode PartitionSpec (einsum/reshard `out_sharding`) met on Auto axes."""
    return isinstance(e, ValueError) and "of type Auto" in str(e)


def trace_explicit(flat_fun: Callable, flat: Sequence[Any], mesh: Mesh, axes: frozenset[str]) -> Any:
    """The ClosedJaxpr of `flat_fun` traced as `jax.jit` traces it under `mesh` with `axes` Explicit (each
    argument placed on a mesh with those names typed with its layout), rewritten for `mesh` by `to_auto`."""
    types = tuple(AxisType.Explicit if n in axes else AxisType.Auto for n in mesh.axis_names)
    emesh = Mesh(mesh.devices, mesh.axis_names, axis_types=types)

    def typed(x: Any) -> jax.ShapeDtypeStruct:
        a = jax.typeof(x)
        sharding = None
        s = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == \
                tuple(mesh.axis_names) and dict(s.mesh.shape) == dict(mesh.shape):
            sharding = NamedSharding(emesh, s.spec)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False), sharding=sharding)

    with jax.set_mesh(emesh):
        closed = jax.make_jaxpr(flat_fun)(*[typed(x) for x in flat])
    with jax.set_mesh(mesh):
        return to_auto(closed)


def to_auto(closed: Any) -> Any:
    """`closed` without explicit sharding types: user-written out_shardings and reshards as hints."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=getattr(v.aval, "weak_type", False))
             for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, a))(*avals)


def _source(eqn: Any) -> SourceLine | None:
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return None if frame is None else SourceLine(frame.file_name, frame.start_line, frame.function_name)


def _as_hint(x: Any, sharding: Any, eqn: Any) -> Any:
    """`x` with the hint a written sharding means. On Explicit axes a spec is a type: what it names is split, a
    None dim replicated. Where the sharding's mesh has Auto axes (`auto_axes` enters such a region through a
    `reshard`), an unnamed dim is left open, and a sharding on Auto axes only is no hint at all."""
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    if not isinstance(spec, PartitionSpec) or not hasattr(x, "shape"):
        return x
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if types and AxisType.Explicit not in types:
        return x
    unnamed = UNCONSTRAINED if AxisType.Auto in types else ()
    dims = tuple(unnamed if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in spec)
    dims += (unnamed,) * (len(x.shape) - len(dims))
    return _hint(x, "shard", dims, x.shape, x.dtype, _source(eqn))


def _closed_sub(value: Any) -> Any:
    """A param rewritten for the Auto mesh: ClosedJaxprs (and tuples of them) re-traced; else unchanged."""
    if isinstance(value, jcore.ClosedJaxpr):
        return to_auto(value)
    if isinstance(value, tuple) and value and all(isinstance(v, jcore.ClosedJaxpr) for v in value):
        return tuple(to_auto(v) for v in value)
    if isinstance(value, jcore.Jaxpr):
        new = to_auto(jcore.ClosedJaxpr(value, ()))
        if new.consts:
            raise ShardingError("shardc: a loop or branch body of an explicit-sharding step captured constants "
                                "while rewritten for shardc's mesh; this is a shardc limitation, please report it")
        return new.jaxpr
    return value


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env = JaxprEnv(jaxpr, consts, args)
    for eqn in jaxpr.eqns:
        ins = env.reads(eqn.invars)
        name = eqn.primitive.name
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
            if name in _INLINED:
                outs = _eval(*open_jaxpr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))), ins)
            elif name == "reshard":
                outs = [_as_hint(ins[0], eqn.params["dst_sharding"], eqn)]
            else:
                params = {k: (None if k in _TYPED_PARAMS else _closed_sub(v)) for k, v in eqn.params.items()}
                # (not under eqn.ctx: it would enter the Explicit mesh the eqn was traced under again)
                out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(params))
                outs = list(out) if eqn.primitive.multiple_results else [out]
                if name == "dot_general" and eqn.params.get("out_sharding") is not None:
                    outs = [_as_hint(outs[0], eqn.params["out_sharding"], eqn)]
        env.write(eqn.outvars, outs)
    return env.reads(jaxpr.outvars)
