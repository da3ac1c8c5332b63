"""Python's cyclic garbage collector paused while shardc allocates many short-lived objects over a large live
heap (the program graph, the simulator's state, memos): each full collection would rescan that heap (0.3-0.5 s
on the 12-layer GPT, every few search evaluations; ~1/3 of a full simulation's time). Reference counting still
frees everything that is not cyclic; the collector runs again as soon as the outermost pause ends.

A simulation leaves behind long-lived state (its schedule, the result it returns), which the collector's next
young-generation pass would scan once more only to move it to an older generation (~1-2 ms after a delta
simulation of the 12-layer GPT, a tenth of the delta's time; ~5 ms after a full one). `gc_paused_long_lived`
moves what is alive at the end of the pause to the oldest generation directly (`gc.freeze()` then
`gc.unfreeze()`): no young pass, and cyclic garbage among those objects is found by the next full collection
instead. It does so only for the outermost pause (inside a search, which pauses the collector for all of its
simulations, nothing changes) and only when the process has frozen no objects of its own (`gc.unfreeze()`
would release them).

`frozen_heap` leaves what is alive when a block starts out of the collections made during it (the collector
still runs, over what the block allocates): planning many candidate pipelines one after another traces and
builds a program for each over the heap the unpipelined search left (its graphs, simulators, memos), which
every full collection would otherwise rescan (~0.4 s each, ~10 of them on the 12-layer GPT's 17 traces)."""
from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["paused_gc", "gc_paused", "gc_paused_long_lived", "frozen_heap"]

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


def _promote_survivors() -> None:
    """Move every object the collector tracks to its oldest generation without a collection (and reset the
    young generation's allocation count)."""
    gc.freeze()
    gc.unfreeze()


def gc_paused_long_lived(fn: _F) -> _F:
    """`fn` run under `paused_gc`; when this is the outermost pause and the process froze nothing itself, what is
    alive at its end goes to the oldest generation without a young-generation pass (see the module docstring)."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if not gc.get_freeze_count():
                _promote_survivors()
            gc.enable()

    return paused  # type: ignore[return-value]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Objects alive at the start of the block are not scanned by the collections made during it (`gc.freeze()`,
    `gc.unfreeze()` after: they are collectable again, cyclic garbage among them included); only when the
    process has frozen no objects of its own, else nothing changes."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
