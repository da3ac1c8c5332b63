"""Compiling afresh: jax's persistent compilation cache off for a compile whose side effects are read.

A program jax loads from its persistent cache (`jax_compilation_cache_dir`, which MaxText and many training
scripts set) is not compiled, so XLA neither logs its warnings nor writes its `--xla_dump_to` dumps (jax leaves
the dump flags out of the cache key). `shardc.check` reads the warnings, `shardc.cost.memdebug` and
`shardc.xla_import` the dumps: they compile inside `uncached()`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import jax

__all__ = ["uncached"]


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """jax's persistent compilation cache off inside the block (as it was after it). jax decides whether it uses
    the cache once per process, so the decision is reset on the way in and out (`compilation_cache.reset_cache`:
    the cache re-opens its directory at the next compile that uses it)."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    _reset()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        _reset()


def _reset() -> None:
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover (a jax without it: its config flag alone decides)
        return
    compilation_cache.reset_cache()
