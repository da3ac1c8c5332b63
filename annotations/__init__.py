"""GShard-style sharding hints for JAX: split, replicate, shard.

`split(x, dim, axes)`, `replicate(x)` and `shard(x, spec)` are identities in value that bind the `hint_p`
primitive ("shardc_hint"); see docs/annotations.md.
"""
from annotations.errors import ShardingError, SourceLine
from annotations.spec import UNCONSTRAINED, HintSpec, resolve_count
from annotations.context import current_mesh, lookup_mesh, mesh_context, mesh_is_provisional, provisional_mesh
from annotations.primitive import bind_hint, hint_p, named_sharding, partition_spec, resolve_dims
from annotations.api import replicate, shard, split

__all__ = [
    "ShardingError", "SourceLine", "UNCONSTRAINED", "HintSpec", "resolve_count",
    "mesh_context", "current_mesh", "lookup_mesh", "provisional_mesh", "mesh_is_provisional",
    "hint_p", "bind_hint", "resolve_dims", "partition_spec", "named_sharding",
    "split", "replicate", "shard",
]
