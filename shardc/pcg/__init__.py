"""Parallel Computation Graph: explicit parallel ops, Z3-verified substitutions, rule generation."""
