"""PCG -> jax: one `shard_map` over the whole mesh in which every node is explicit.

Compute nodes run on the local pieces (shape params such as reshape's `new_sizes` are localised, see
`LOCALIZE`); each parallel op becomes exactly one local slice or one collective (`all_gather`, `psum`,
`psum_scatter`, `all_to_all`, `ppermute`), so the compiled HLO has the collectives the PCG names.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from annotations.errors import ShardingError
from shardc.pcg.graph import PCG, SHARDING_PARAMS, Compute, Node, Region, Tensor
from shardc.pcg.local_ops import RUNNERS
from shardc.pcg.ops import (AllToAll, Combine, CollectivePermute, ParallelOp, Partition, Reduce, ReduceScatter,
                            ReduceScatterDims, Replicate, Shuffle, group_size)
from shardc.sharding import Sharding

__all__ = ["lower_pcg", "pcg_function", "LOCALIZE", "local_slice"]


def _axis(axes: Sequence[str]) -> Any:
    return tuple(axes) if len(axes) > 1 else axes[0]


def local_slice(x: Any, sharding: Sharding, mesh: Mapping[str, int]) -> Any:
    """This device's piece of a replicated array `x` laid out as `sharding`."""
    for d, axes in enumerate(sharding.dims):
        if axes:
            x = _slice_dim(x, d, axes, mesh)
    return x


def _slice_dim(x: Any, d: int, axes: Sequence[str], mesh: Mapping[str, int]) -> Any:
    n = group_size(tuple(axes), mesh)
    if x.shape[d] % n:
        raise ShardingError(f"partition of dim {d} (size {x.shape[d]}) over {tuple(axes)} ({n} ways) is uneven")
    size = x.shape[d] // n
    i = jax.lax.axis_index(_axis(axes))
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, d)


def _parallel(op: ParallelOp, x: Any, mesh: Mapping[str, int]) -> Any:
    if group_size(op.axes, mesh) == 1 or isinstance(op, Replicate):
        return x
    name = _axis(op.axes)
    if isinstance(op, Partition):
        return _slice_dim(x, op.dim, op.axes, mesh)
    if isinstance(op, Combine):
        return jax.lax.all_gather(x, name, axis=op.dim, tiled=True)
    if isinstance(op, Reduce):
        fn = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}.get(op.op)
        if fn is None:
            raise ShardingError(f"{op}: no collective combines partial values with {op.op!r}")
        return fn(x, name)
    if isinstance(op, ReduceScatter):
        return jax.lax.psum_scatter(x, name, scatter_dimension=op.dim, tiled=True)
    if isinstance(op, AllToAll):
        return jax.lax.all_to_all(x, name, op.dst, op.src, tiled=True)
    if isinstance(op, CollectivePermute):
        sizes = [mesh[a] for a in op.axes]

        def lin(c: Sequence[int]) -> int:
            v = 0
            for ci, n in zip(c, sizes):
                v = v * n + ci
            return v

        perm = [(lin(src), lin(dst)) for dst, src in op.source_of(mesh).items()]  # (self pairs keep their piece)
        return jax.lax.ppermute(x, name, perm) if any(a != b for a, b in perm) else x
    if isinstance(op, ReduceScatterDims):
        return _reduce_scatter_dims(op, x, mesh)
    raise NotImplementedError(type(op).__name__)  # pragma: no cover


def _shuffle(op: Shuffle, x: Any, shape: Sequence[int], mesh: Mapping[str, int]) -> Any:
    """Each device slices the piece the device it sends to needs (a table indexed by the device) and one
    ppermute moves every piece (self pairs keep theirs)."""
    axes = tuple(a for a in op.axes if mesh[a] > 1)
    sources = op.sources(mesh, shape)
    if sources is None:
        raise ShardingError(f"{op}: some piece of the target layout lies in no piece of the source layout")
    offsets = op.offsets(mesh, shape)
    piece = Sharding(op.dst).local_shape(shape, mesh)
    n = len(sources)
    table = jnp.asarray([offsets[i] for i in range(n)], dtype=jnp.int32)
    me = jax.lax.axis_index(axes) if axes else 0
    start = table[me]
    x = jax.lax.dynamic_slice(x, [start[d] for d in range(x.ndim)], piece)
    perm = [(i, j) for j, i in sources.items()]
    return jax.lax.ppermute(x, axes, perm) if any(a != b for a, b in perm) else x


def _reduce_scatter_dims(op: ReduceScatterDims, x: Any, mesh: Mapping[str, int]) -> Any:
    """One reduce-scatter over `op.axes` into several dims: each split dim is reshaped into (its new
    axes' sizes, the rest), those factors moved to the front in the order of `op.axes` and merged,
    scattered there, and the rest reshaped back."""
    rank = x.ndim
    per_dim: dict[int, list[str]] = {}
    for a, d in zip(op.axes, op.dims):
        per_dim.setdefault(d, []).append(a)
    shape, where = [], {}
    rest_pos = []
    for d in range(rank):
        for a in per_dim.get(d, []):
            where[a] = len(shape)
            shape.append(mesh[a])
        rest = x.shape[d] // group_size(tuple(per_dim.get(d, [])), mesh)
        rest_pos.append(len(shape))
        shape.append(rest)
    y = x.reshape(shape)
    y = jnp.transpose(y, [where[a] for a in op.axes] + rest_pos)
    n = group_size(op.axes, mesh)
    y = y.reshape((n,) + tuple(shape[p] for p in rest_pos))
    y = jax.lax.psum_scatter(y, _axis(op.axes), scatter_dimension=0, tiled=True)
    return y.reshape(tuple(shape[p] for p in rest_pos))


# -- compute nodes ---------------------------------------------------------------------------------

Localizer = Callable[[Compute, list[Tensor], list[Tensor], Mapping[str, int]], dict]


def _loc_shape(key: str) -> Localizer:
    def fn(node, ins, outs, mesh):
        return {**node.params, key: outs[0].local_shape(mesh)}
    return fn


def _loc_slice(node, ins, outs, mesh):
    """Sharded dims must be taken whole, or as chunk i of k equal chunks (then each device takes chunk i
    of its own piece: the per-device meaning rewrites give it)."""
    p = node.params
    x = ins[0]
    local = x.local_shape(mesh)
    starts, limits = list(p["start_indices"]), list(p["limit_indices"])
    for d, axes in enumerate(x.sharding.dims):
        if not axes:
            continue
        start, stop, size = starts[d], limits[d], limits[d] - starts[d]
        if (p["strides"] and p["strides"][d] != 1) or size <= 0 or x.shape[d] % size or start % size:
            raise ShardingError(f"slice: dim {d} of {x.name or 'operand'} {list(x.shape)} is sharded over {axes} "
                                f"but the op takes [{start}:{stop}] of it")
        k = x.shape[d] // size
        chunk = local[d] // k
        starts[d], limits[d] = (start // size) * chunk, (start // size + 1) * chunk
    return {**p, "start_indices": tuple(starts), "limit_indices": tuple(limits)}


def _loc_pad(node, ins, outs, mesh):
    for d, axes in enumerate(ins[0].sharding.dims):
        if axes and tuple(node.params["padding_config"][d]) != (0, 0, 0):
            raise ShardingError(f"pad: dim {d} is sharded over {axes} and padded")
    return dict(node.params)


LOCALIZE: dict[str, Localizer] = {
    "reshape": _loc_shape("new_sizes"),
    "broadcast_in_dim": _loc_shape("shape"),
    "iota": _loc_shape("shape"),
    "slice": _loc_slice,
    "pad": _loc_pad,
}


def _compute(node: Node, op: Compute, args: list[Any], pcg: PCG) -> list[Any]:
    mesh = pcg.mesh_sizes
    ins = [pcg.tensors[t] for t in node.inputs]
    outs = [pcg.tensors[t] for t in node.outputs]
    runner = RUNNERS.get(op.primitive)
    if runner is not None:  # indexing and convolutions (shardc.pcg.local_ops)
        res = runner(op, args, ins, outs, mesh)
        params = op.params
    else:
        params = LOCALIZE.get(op.primitive, lambda n, i, o, m: dict(n.params))(op, ins, outs, mesh)
        params.update((k, None) for k in SHARDING_PARAMS if k in params)
        res = op.prim.bind(*args, **params)
        res = list(res) if op.prim.multiple_results else [res]
    if op.primitive == "iota":
        res = [_iota_offset(res[0], outs[0], params["dimension"], mesh)]
    for r, t in zip(res, outs):
        want = t.local_shape(mesh)
        if tuple(r.shape) != tuple(want):
            where = f" at {op.source}" if op.source else ""
            raise ShardingError(f"{op.primitive}{where}: local result {tuple(r.shape)} but {t.name or 'the result'} "
                                f"{list(t.shape)} as {t.sharding} needs {want}")
    return res


def _iota_offset(x: Any, t: Tensor, dim: int, mesh: Mapping[str, int]) -> Any:
    axes = t.sharding.dims[dim]
    if not axes:
        return x
    i = jax.lax.axis_index(_axis(axes))
    return x + (i * x.shape[dim]).astype(x.dtype)


# -- loops and branches ----------------------------------------------------------------------------

def _region(op: Region, args: list[Any], strict: bool) -> list[Any]:
    """A scan / while / cond whose bodies are the region's PCGs, run on the local pieces."""
    fns = [pcg_function(b, strict=strict) for b in op.bodies]
    p = op.params
    if op.primitive == "scan":
        nc, nk = p["num_consts"], p["num_carry"]
        consts, init, xs = args[:nc], args[nc:nc + nk], args[nc + nk:]
        body = fns[0]

        def step(carry: Any, x: Any) -> tuple[Any, Any]:
            out = body(*consts, *carry, *x)
            return [o.astype(c.dtype) for o, c in zip(out[:nk], carry)], out[nk:]

        carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"], reverse=p["reverse"],
                                 unroll=p.get("unroll", 1))
        return list(carry) + list(ys)
    if op.primitive == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = args[:cn], args[cn:cn + bn], args[cn + bn:]
        cond, body = fns
        out = jax.lax.while_loop(lambda c: cond(*cc, *c)[0],
                                 lambda c: [o.astype(x.dtype) for o, x in zip(body(*bc, *c), c)], list(init))
        return list(out)
    if op.primitive == "cond":
        return list(jax.lax.switch(args[0], [lambda *a, f=f: list(f(*a)) for f in fns], *args[1:]))
    raise NotImplementedError(op.primitive)  # pragma: no cover


# -- the program -----------------------------------------------------------------------------------

def pcg_function(pcg: PCG, *, strict: bool = True) -> Callable[..., list[Any]]:
    """The per-device body: local input pieces -> local output pieces. With `strict`, each collective's
    operand passes an optimization barrier, so XLA keeps exactly the collectives the PCG names (it
    would otherwise merge all-gathers of values it can prove equal, or fold ones of constants)."""
    mesh = pcg.mesh_sizes
    same = pcg.same_values()

    def body(*args: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(pcg.inputs, args))
        for t, value in pcg.consts.items():
            tensor = pcg.tensors[t]
            env[t] = local_slice(jnp.asarray(value, dtype=tensor.dtype), tensor.sharding, mesh)
        moved: dict[tuple[Any, int], Any] = {}  # (parallel op, the value it moves) -> its result
        for node in pcg.nodes:
            if node.is_region and pcg.duplicate(node):  # (computed by an earlier loop or branch)
                env.update((t, env[same[t]]) for t in node.outputs)
                continue
            vals = [env[t] for t in node.inputs]
            if isinstance(node.op, ParallelOp):
                once = (pcg.physical_op(node), same.get(node.inputs[0], node.inputs[0]))
                if once in moved:  # the same collective of the same value: made once (as the PCG counts it)
                    env[node.outputs[0]] = moved[once]
                    continue
                x = vals[0]
                if strict and node.op.collective not in ("none", "slice") and group_size(node.op.axes, mesh) > 1:
                    x = jax.lax.optimization_barrier(x)
                if isinstance(node.op, Shuffle):
                    outs = [_shuffle(node.op, x, pcg.tensors[node.inputs[0]].shape, mesh)]
                else:
                    outs = [_parallel(node.op, x, mesh)]
                moved[once] = outs[0]
            elif isinstance(node.op, Region):
                outs = _region(node.op, vals, strict)
            else:
                outs = _compute(node, node.op, vals, pcg)
            env.update(zip(node.outputs, outs))
        return [env[t] for t in pcg.outputs]

    return body


def lower_pcg(pcg: PCG, *, jit: bool = True, strict: bool = True) -> Callable[..., list[Any]]:
    """A function of the flat global inputs returning the flat global outputs, computed as the PCG says
    (`strict`: see `pcg_function`)."""
    for t in list(pcg.inputs) + list(pcg.outputs):
        s = pcg.tensors[t].sharding
        if s.partial:
            raise ShardingError(f"PCG input/output {pcg.tensors[t].name} holds partial sums ({s}); reduce it first")
    in_specs = tuple(pcg.tensors[t].sharding.spec() for t in pcg.inputs)
    out_specs = [pcg.tensors[t].sharding.spec() for t in pcg.outputs]
    mapped = jax.shard_map(pcg_function(pcg, strict=strict), mesh=pcg.mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)

    def f(*args: Any) -> list[Any]:
        # under the PCG's (Auto) mesh, also when called under a `jax.set_mesh` of Explicit axes (flax's NNX
        # examples run their train step so): shard_map wants the context mesh to be its own
        with jax.sharding.use_abstract_mesh(pcg.mesh.abstract_mesh):
            return mapped(*args)

    return jax.jit(f) if jit else f
