"""GShard-style sharding hints for JAX: split, replicate, shard."""
from annotations.errors import ShardingError, SourceLine
from annotations.spec import UNCONSTRAINED, HintSpec, resolve_count
