"""Work this process does while it waits for its search workers.

When a search's meshes are scored by forked children (`shardc.search.workers`), this process mostly waits
for their messages. A caller with optional work that must stay in this process (JAX traces: JAX must not run in
a forked child) can queue it with `idle_work`; while the queue is not empty, a `MeshPool` gives every mesh to
its children (one more child than usual, so the search keeps its processes) and, whenever it would block on a
child, runs queued tasks until a message is there. `choose_pipeline` queues the traces of its candidate
pipelines this way, so they overlap the unpipelined search and the screens' baselines.

A task is an optimisation only: it may fill caches its caller reads later, never decide anything, so the
results are the same whether a task ran early, late or not at all. A task that raises is dropped (the caller
does the same work later in its own order, where an error is reported as usual).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Iterator

__all__ = ["IdleQueue", "current", "detach", "idle_work", "pending", "run_while", "yield_to_this_process"]


class IdleQueue:
    """Tasks by key, run oldest first; `discard` drops one its owner is about to do itself."""

    def __init__(self) -> None:
        self._tasks: OrderedDict[Hashable, Callable[[], None]] = OrderedDict()
        self.ran = 0  # tasks run while waiting

    def add(self, key: Hashable, task: Callable[[], None]) -> None:
        self._tasks[key] = task

    def discard(self, key: Hashable) -> None:
        self._tasks.pop(key, None)

    def __len__(self) -> int:
        return len(self._tasks)

    def run_one(self) -> bool:
        """Run the oldest task (its exceptions dropped); False when there was none."""
        if not self._tasks:
            return False
        _, task = self._tasks.popitem(last=False)
        self.ran += 1
        try:
            task()
        except Exception:  # (the owner does this work again where its errors are reported)
            pass
        return True


_queue: contextvars.ContextVar[IdleQueue | None] = contextvars.ContextVar("shardc_idle_queue", default=None)
_running: contextvars.ContextVar[bool] = contextvars.ContextVar("shardc_idle_running", default=False)
# (per thread: another thread's search never runs this one's tasks; a task's own searches run no others)


@contextlib.contextmanager
def idle_work() -> Iterator[IdleQueue]:
    """A queue of tasks the searches inside this block (in this thread) may run while they wait for their
    workers."""
    token = _queue.set(IdleQueue())
    try:
        yield _queue.get()
    finally:
        _queue.reset(token)


def current() -> IdleQueue | None:
    """The queue of the innermost `idle_work` block (in this thread), if any."""
    return _queue.get()


def detach() -> None:
    """In a forked child: none of the parent's queued tasks runs here (they are the parent's to run)."""
    _queue.set(None)


def pending() -> bool:
    """Whether queued tasks wait (and this process may run them now)."""
    q = _queue.get()
    return q is not None and not _running.get() and len(q) > 0


def run_while(waiting: Callable[[], bool]) -> None:
    """Run queued tasks, one at a time, while `waiting()` holds and tasks are left."""
    q = _queue.get()
    if q is None or _running.get():
        return
    token = _running.set(True)
    try:
        while len(q) and waiting():
            q.run_one()
    finally:
        _running.reset(token)


# How much lower the scheduler ranks children forked while this process has idle work queued: that work (the
# pipeline candidates' traces) is what the children's next work waits for, so under contention for the cores it
# goes first; the children's work fills the rest. Only a ranking: what is computed is the same.
IDLE_NICENESS = 5


def yield_to_this_process(pids: Iterable[int]) -> None:
    """Lower the scheduling priority of the child processes `pids` by `IDLE_NICENESS` (where the OS allows it)."""
    for pid in pids:
        try:
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, pid) + IDLE_NICENESS)
        except (OSError, AttributeError):  # (no such call here, or not permitted: the default ranking)
            pass
