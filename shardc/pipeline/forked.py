"""Candidate screens run in forked children while this process traces the next candidates.

`choose_pipeline` screens its candidate pipelines one after another (a screen: the candidate's baselines
scored on its meshes). The screens are independent of each other; what the choice decides from them depends
on their order (the plan in hand a candidate's floor is compared with, the siblings a screen bounds). So
`ForkedScreens` runs screens *ahead* in forked children — at most `limit` at once, each started only once its
candidate is traced in this process (JAX must not run in a forked child) — and `choose_pipeline` takes their
outcomes in its own order, deciding exactly as it does when it screens one candidate at a time here; an
outcome it does not ask for (the candidate floored or bounded by then) is dropped. A child sends back only
what the choice reads (a small picklable value); whatever needs the screen's plan itself makes it again here.

A child that fails, dies or stays silent for `STALL_S` once this process waits on nothing else is replaced by
the screen run here (the same outcome: a screen depends on nothing but its candidate's program). Children run
at a lower priority than this process while it has queued traces to run (`shardc.search.idle`), as the
search's workers do, since the children's next screens wait on them.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import warnings
from typing import Any, Callable, Hashable

from shardc.search import idle
from shardc.search.workers import fork_quietly, read_exactly

__all__ = ["ForkedScreens"]


class ForkedScreens:
    """Outcomes of `run(key)`, computed in up to `limit` forked children at once (started by `start`) or
    here (`take` of a key never started, or `limit` 0)."""

    def __init__(self, run: Callable[[Hashable], Any], limit: int) -> None:
        self._run, self.limit = run, limit
        self._children: dict[Hashable, tuple[int, int]] = {}  # key -> (pid, read end of its pipe)
        self.forked = self.fallbacks = 0  # (counts, for tests and benchmarks)

    def running(self) -> int:
        return len(self._children)

    def started(self, key: Hashable) -> bool:
        return key in self._children

    def start(self, key: Hashable) -> bool:
        """Fork a child computing `run(key)`; False when `limit` children already run (or it runs already)."""
        if key in self._children or len(self._children) >= self.limit:
            return False
        read, write = os.pipe()
        pid = fork_quietly()  # (the child traces nothing: module docstring)
        if pid == 0:  # the child: one outcome down the pipe, then leave without this process's exit handlers
            code = 1
            try:
                os.close(read)
                for _, fd in self._children.values():  # (the other children's pipes are this process's)
                    os.close(fd)
                os.environ["SHARDC_SEARCH_WORKERS"] = "1"  # (its search forks no workers of its own)
                idle.detach()
                with warnings.catch_warnings(record=True) as caught:
                    outcome = self._run(key)
                warned = [(str(w.message), w.category, w.filename, w.lineno) for w in caught]
                data = pickle.dumps((outcome, warned), protocol=pickle.HIGHEST_PROTOCOL)
                with os.fdopen(write, "wb") as out:
                    out.write(len(data).to_bytes(8, "little"))
                    out.write(data)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        self._children[key] = (pid, read)
        self.forked += 1
        if idle.pending():  # (below this process while it traces: see the module docstring)
            idle.yield_to_this_process([pid])
        return True

    def take(self, key: Hashable, meanwhile: Callable[[], bool] = lambda: False) -> Any:
        """`run(key)`'s outcome: from its child (calling `meanwhile()`, then running queued idle work, while
        it is not there yet; `meanwhile` returns False when it has nothing left to do), with the warnings the
        child's run issued issued again here; else computed here."""
        if key not in self._children:
            return self._run(key)
        pid, fd = self._children[key]
        while not _readable(fd) and meanwhile():
            pass
        idle.run_while(lambda: not _readable(fd))
        answered = bool(select.select([fd], [], [], STALL_S)[0])
        if not answered:  # (a child that hangs, e.g. on a lock another thread held at the fork: killed)
            self.drop(key)
            data = None
        else:
            data = _read_message(fd)
            del self._children[key]
            os.close(fd)
            _reap(pid)
        if data is not None:
            try:
                outcome, warned = pickle.loads(data)
            except Exception:  # (a message cut short: as if the child had died)
                pass
            else:
                for message, category, filename, lineno in warned:  # (as if warned here: this process's filters)
                    warnings.warn_explicit(message, category, filename, lineno)
                return outcome
        self.fallbacks += 1
        why = "failed" if answered else f"did not answer in {STALL_S:.0f} s"
        warnings.warn(f"shardc: the forked screen of {key} {why}; screening it again in this process (the same "
                      "outcome, more slowly)", RuntimeWarning, stacklevel=2)
        return self._run(key)

    def drop(self, key: Hashable) -> None:
        """Stop the child computing `key`'s outcome, if any (an outcome no longer asked for)."""
        pid, fd = self._children.pop(key, (None, None))
        if pid is not None:
            os.close(fd)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(pid)

    def close(self) -> None:
        for key in list(self._children):
            self.drop(key)


# Seconds a child may stay silent once this process has nothing else to do before its work is done here instead.
STALL_S = 600.0


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def _read_message(fd: int) -> bytes | None:
    """The child's length-prefixed message, or None when it closed its pipe before sending it whole."""
    def read(size: int) -> bytes:
        return os.read(fd, min(size, 1 << 20))

    head = read_exactly(read, 8)
    return None if head is None else read_exactly(read, int.from_bytes(head, "little"))


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
