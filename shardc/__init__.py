"""shardc: a GShard-style SPMD sharding compiler for JAX."""
