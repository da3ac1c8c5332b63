"""shardc under JAX's multi-controller runtime (`jax.distributed`): one Python process per host.

Every process traces and plans the same step on its own. Planning is deterministic, so the plans should
be identical; `check_plan_agreement` makes sure of it before anything runs (a process that planned
differently would run a different program and deadlock or compute garbage): it gathers a digest of
every process's plan and raises a ShardingError naming the processes and the first value they plan
differently. `@shardc.auto` calls it on every new plan when `jax.process_count() > 1`.

Inputs: a batch whose rows are spread over the processes is assembled in the standard JAX way,
`jax.make_array_from_process_local_data` (`global_batch` wraps it); any other input that is not
already a global `jax.Array` (numpy arrays, process-local arrays) is taken to hold the same value on
every process — parameters initialised from one seed — and is laid out by `to_global`.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from annotations.errors import ShardingError

__all__ = ["is_multiprocess", "plan_digest", "check_plan_agreement", "global_batch", "to_global"]

_DIGEST_BYTES = 32


def is_multiprocess() -> bool:
    """True when this program is one of several JAX processes."""
    return jax.process_count() > 1


def _mesh_text(mesh: Mesh | AbstractMesh) -> str:
    if isinstance(mesh, AbstractMesh):  # (a plan for more devices than this host has: a shape, no devices)
        return f"{tuple(mesh.axis_names)} {tuple(mesh.axis_sizes)} abstract"
    ids = [int(d.id) for d in mesh.devices.flat]
    return f"{tuple(mesh.axis_names)} {tuple(mesh.devices.shape)} {ids}"


def _value_text(plan: Any, vid: int) -> str:
    v = plan.graph.values[vid]
    return f"{v.shape} {v.dtype} {plan.shardings[vid]}"


def plan_digest(plan: Any) -> bytes:
    """SHA-256 of what must agree across processes: the mesh (axis names, sizes, device ids in mesh
    order), the ops, every value's shape/dtype/sharding, every op's strategy and the reshards."""
    h = hashlib.sha256()
    h.update(_mesh_text(plan.mesh).encode())
    for vid in range(len(plan.shardings)):
        h.update(_value_text(plan, vid).encode())
    for op, strat in zip(plan.graph.ops, plan.strategies):
        h.update(f"{op.primitive} {op.inputs} {op.outputs} {strat.factor_axes}".encode())
    for r in plan.reshards:
        h.update(f"{r.value} {r.src} {r.dst} {r.kind} {r.consumer}".encode())
    return h.digest()


def _value_digests(plan: Any) -> np.ndarray:
    """One 32-bit hash per value's shape/dtype/sharding, to find where two plans part."""
    out = np.empty(len(plan.shardings), np.uint32)
    for vid in range(len(plan.shardings)):
        out[vid] = int.from_bytes(hashlib.sha256(_value_text(plan, vid).encode()).digest()[:4], "little")
    return out


def _allgather(x: np.ndarray) -> np.ndarray:
    """x from every process, stacked on a new leading dim (in process order)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def check_plan_agreement(plan: Any, *, what: str = "plan") -> str:
    """Raise ShardingError unless every process planned exactly this plan; returns the digest (hex).

    A collective: every process must call it for the same step (as `@shardc.auto` does on each new
    signature). With one process it only computes the digest.
    """
    digest = plan_digest(plan)
    if not is_multiprocess():
        return digest.hex()[:16]
    header = np.concatenate([np.frombuffer(digest, np.uint8).astype(np.int64),
                             np.array([len(plan.shardings), len(plan.graph.ops)], np.int64)])
    everyone = _allgather(header)
    if (everyone == everyone[0]).all():
        return digest.hex()[:16]
    me = jax.process_index()
    digests = {p: bytes(everyone[p, :_DIGEST_BYTES].astype(np.uint8)).hex()[:16] for p in range(len(everyone))}
    groups: dict[str, list[int]] = {}
    for p, d in digests.items():
        groups.setdefault(d, []).append(p)
    summary = "; ".join(f"processes {ps} have {d} ({int(everyone[ps[0], -2])} values, "
                        f"{int(everyone[ps[0], -1])} ops)" for d, ps in groups.items())
    detail = ""
    if (everyone[:, -2] == everyone[0, -2]).all():  # same number of values everywhere: find the first difference
        per_value = _allgather(_value_digests(plan))
        differs = np.nonzero((per_value != per_value[0]).any(axis=0))[0]
        if differs.size:
            vid = int(differs[0])
            v = plan.graph.values[vid]
            origin = [str(o) for o in plan.origins[vid] if o is not None] if vid < len(plan.origins) else []
            kind = "input" if vid in plan.graph.inputs else "output" if vid in plan.graph.outputs else "value"
            detail = (f"; the first value planned differently is {kind} {v.name} {v.dtype}{list(v.shape)}, "
                      f"on this process (process {me}) {plan.shardings[vid]}"
                      + (f" from {origin[0]}" if origin else "")
                      + f" ({int(differs.size)} values differ)")
    raise ShardingError(
        f"the processes of this multi-host job planned the step differently ({what} digests differ: {summary})"
        f"{detail}. Every process must trace the same function with the same argument shapes, hints, mesh "
        f"(same devices in the same order) and shardc/jax versions.")


def global_batch(local: Any, mesh: Mesh, axes: str | Sequence[str] | None = None, dim: int = 0) -> Any:
    """A global array (pytree of them) from this process's rows of a batch.

    Each leaf of `local` holds this process's consecutive block of dim `dim`; the global array is split
    over mesh `axes` on that dim (default: every mesh axis that spans processes, else the first axis) —
    `jax.make_array_from_process_local_data` under a `NamedSharding`.
    """
    if axes is None:
        axes = _process_axes(mesh) or (mesh.axis_names[0],)
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ShardingError(f"global_batch: unknown mesh axes {unknown}; the mesh has {list(mesh.axis_names)}")

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        if not 0 <= dim < x.ndim:
            raise ShardingError(f"global_batch: dim {dim} is out of range for a local batch leaf of shape {x.shape}")
        spec = PartitionSpec(*([None] * dim), axes if len(axes) > 1 else axes[0])
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

    return jax.tree_util.tree_map(one, local)


def _process_axes(mesh: Mesh) -> tuple[str, ...]:
    """Mesh axes along which the owning process changes."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out = []
    for i, name in enumerate(mesh.axis_names):
        if mesh.devices.shape[i] > 1 and not (np.diff(procs, axis=i) == 0).all():
            out.append(name)
    return tuple(out)


def to_global(x: Any, sharding: NamedSharding) -> jax.Array:
    """A global array with `sharding` from a value every process holds in full (numpy, a scalar, or a
    process-local jax array): each process supplies its own devices' shards."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ShardingError("to_global: the array is already global (spans processes); reshard it with jax.device_put")
    host = np.asarray(x)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
