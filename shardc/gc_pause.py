"""Python's cyclic garbage collector paused while shardc allocates many short-lived objects over a large live
heap (the program graph, the simulator's state, memos): each full collection would rescan that heap (0.3-0.5 s
on the 12-layer GPT, every few search evaluations; ~1/3 of a full simulation's time). Reference counting still
frees everything that is not cyclic; the collector runs again as soon as the outermost pause ends."""
from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["paused_gc", "gc_paused"]

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the block (re-enabled after only if it was enabled before)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def gc_paused(fn: _F) -> _F:
    """`fn` run under `paused_gc`."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        with paused_gc():
            return fn(*args, **kwargs)

    return paused  # type: ignore[return-value]
