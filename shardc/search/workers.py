"""The search's meshes scored by several processes at once.

Scoring the baselines on each candidate mesh (phase 1 of `shardc.search.driver`) is most of a search's time on
large programs (the 12-layer GPT: 24 of 33 s on 64 devices), and each mesh's work is independent of the others'.
A `MeshPool` gives the meshes round-robin to this process and to `workers - 1` forked children, each running a
`MeshWork` of its own; the driver then takes the results in mesh order and decides exactly as it does alone
(which meshes count under the plan budget, which are searched and with how many plans), so the plan, the
report and every count are the same with one worker or several. A child scores its meshes as soon as it starts
and keeps each mesh's evaluator, so the phase 2 search of a mesh, its final plan and its group comparisons run
where it was scored; the searched meshes run at once (their plan shares are fixed before either starts), and
when one process scored two of them an idle one scores the second again and searches it. With `pcg=True` the
rewriting of a searched mesh's best plan runs there too (`MeshWork.search`), and its PCG comes back with the
JAX primitives and equation parameters its operators hold sent as references (`primitives_and_params`).

Only pure-Python work runs in a child: the user's hints are resolved and the meshes made in this process before
it forks, and no child is forked when the simulator would time ops on this host (the measured `cpu-host`
profile: XLA must not run in a forked child, and a sibling burning a core would skew the timings), in a
multi-process JAX job, off Linux, or when the work is too small to repay a fork. A child that fails or dies
makes the driver search again in this process alone (the same result: nothing depends on which process did
the work). `SHARDC_SEARCH_WORKERS` sets the number of processes (1: never fork); the default is this process's
CPUs, at most 4. With idle work queued (`shardc.search.idle`: JAX traces a caller wants done early), every mesh
goes to a child, one more than usual, and this process runs that work while it waits for them.
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import traceback
import warnings
from collections import deque
from typing import Any, Callable, Mapping, Sequence

import jax

from shardc.search import idle
from shardc.search.mesh_work import MeshScored, MeshSearched, MeshWork

__all__ = ["MeshPool", "WorkerLost", "can_fork", "default_workers", "fork_quietly", "read_exactly"]

MAX_WORKERS = 4


class WorkerLost(RuntimeError):
    """A forked worker failed or died; the driver searches again in this process alone."""


def default_workers() -> int:
    """`SHARDC_SEARCH_WORKERS` if set, else this process's CPUs (at most `MAX_WORKERS`)."""
    env = os.environ.get("SHARDC_SEARCH_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"SHARDC_SEARCH_WORKERS={env!r}: expected a whole number of processes") from None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cpus))


def can_fork(topology: Any) -> bool:
    """Whether a child may do the search's work for plans priced on `topology` (see the module docstring)."""
    import jax

    from shardc.sim import as_topology

    if not sys.platform.startswith("linux") or not hasattr(os, "fork") or jax.process_count() > 1:
        return False
    return not as_topology(topology).device.measured_ops


def fork_quietly() -> int:
    """`os.fork()` with this process's output flushed first (else the child writes it again) and JAX's warning
    of a fork silenced (a child runs no XLA); the child's SIGINT and SIGTERM back to their defaults (not the
    program's handlers, e.g. a checkpoint's)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pid = os.fork()
    if pid == 0:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
        except BaseException:  # (the child must never return into its parent's code)
            os._exit(1)
    return pid


def read_exactly(read: Callable[[int], bytes], size: int) -> bytes | None:
    """`size` bytes from `read` (a pipe's read, which may return fewer); None when the pipe closes first."""
    parts, left = [], size
    while left:
        part = read(left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


_MISSING = object()
Job = tuple[int, Mapping[str, int], Any, list]  # mesh index, sizes, mesh, the user's seeds on it


def primitives_and_params(program: Any) -> list[Any]:
    """Objects a rewritten PCG's operators hold that pickle by value badly or not at all, and that both
    processes hold since the fork: every JAX primitive defined in an imported module (a rule may build any
    `lax` op) and the parameter values of the traced program's equations, sub-programs' included (jaxprs,
    functions of custom derivatives)."""
    from jax.extend.core import Jaxpr, Primitive

    out: list[Any] = [o for m in list(sys.modules.values()) for o in list(getattr(m, "__dict__", {}).values())
                      if isinstance(o, Primitive)]
    stack = [getattr(program, "jaxpr", program)] if program is not None else []
    seen: set[int] = set()
    while stack:
        jaxpr = stack.pop()
        if id(jaxpr) in seen:
            continue
        seen.add(id(jaxpr))
        for eqn in jaxpr.eqns:
            out.append(eqn.primitive)
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    out.append(v)
                    inner = getattr(v, "jaxpr", v)
                    if isinstance(inner, Jaxpr):
                        stack.append(inner)
    return out


def _device_id(o: Any) -> tuple[str, str, int] | None:
    """A JAX device as a reference (a mesh a PCG is built on, e.g. one of sub-axes, holds its devices, which do not
    pickle; both processes have them since the fork). (Asked of every object a message pickles.)"""
    return ("device", o.platform, int(o.id)) if isinstance(o, jax.Device) else None


def _device(pid: tuple[str, str, int]) -> Any:
    _, platform, i = pid
    return next(d for d in jax.devices(platform) if d.id == i)


class _Channel:
    """Pickled messages over a pair of pipes; objects that both processes hold since the fork (the graph, the
    traced program, the meshes) travel as references to themselves."""

    def __init__(self, read_fd: int, write_fd: int, shared: Sequence[Any]) -> None:
        self._r, self._w = os.fdopen(read_fd, "rb", buffering=0), os.fdopen(write_fd, "wb")
        self._shared = {id(o): o for o in shared}

    def send(self, obj: Any) -> None:
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        shared = self._shared
        p.persistent_id = (  # type: ignore[method-assign]
            lambda o: id(o) if shared.get(id(o), _MISSING) is o else _device_id(o))
        try:
            p.dump(obj)
        except (pickle.PicklingError, AttributeError, TypeError) as e:  # (a shardc bug: said, then searched alone)
            raise WorkerLost(f"a message between search workers could not be pickled ({type(e).__name__}: {e})") \
                from None
        data = buf.getvalue()
        self._w.write(len(data).to_bytes(8, "little"))
        self._w.write(data)
        self._w.flush()

    def _read(self, size: int) -> bytes:
        data = read_exactly(self._r.read, size)
        if data is None:
            raise EOFError("the other process closed its pipe")
        return data

    def recv(self) -> Any:
        data = self._read(int.from_bytes(self._read(8), "little"))
        u = pickle.Unpickler(io.BytesIO(data))
        u.persistent_load = lambda pid: _device(pid) if isinstance(pid, tuple) else self._shared[pid]  # type: ignore
        return u.load()

    def ready(self) -> bool:
        import select

        return bool(select.select([self._r], [], [], 0)[0])

    def close(self) -> None:
        for f in (self._r, self._w):
            try:
                f.close()
            except OSError:
                pass


class _Child:
    """This process's handle of one forked worker."""

    def __init__(self, pid: int, channel: _Channel) -> None:
        self.pid, self.channel = pid, channel

    def reply(self) -> Any:
        """The next reply to a command (phase 1 results still in the pipe are dropped: not asked for)."""
        while True:
            kind, value = self._message()
            if kind == "reply":
                return value

    def _message(self) -> tuple[str, Any]:
        """The next message; WorkerLost when the child reports a failure or is gone. (Until it is there, this
        process runs the idle work queued for it: `shardc.search.idle`.)"""
        idle.run_while(lambda: not self.channel.ready())
        try:
            kind, value = self.channel.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            raise WorkerLost(f"a search worker stopped answering ({type(e).__name__}: {e})") from None
        if kind == "error":
            raise WorkerLost(f"a search worker failed:\n{value}")
        return kind, value

    def next_scored(self, index: int) -> MeshScored:
        kind, value = self._message()
        if kind != "scored" or value.index != index:
            raise WorkerLost(f"a search worker sent {kind} out of order (expected mesh {index})")
        return value

    def post(self, method: str, *args: Any) -> None:
        """Ask for `MeshWork.<method>(*args)`; `reply()` gives its result (replies come in the order asked)."""
        try:
            self.channel.send(("call", method, args))
        except OSError as e:
            raise WorkerLost(f"a search worker stopped listening ({e})") from None

    def call(self, method: str, *args: Any) -> Any:
        self.post(method, *args)
        return self.reply()

    def close(self) -> None:
        """Tell the child to exit and reap it; one still busy (scoring a mesh no one asked for) is killed."""
        try:
            self.channel.send(("exit", None, ()))
        except OSError:
            pass
        self.channel.close()
        try:
            if os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        except (ChildProcessError, ProcessLookupError):
            pass


def _serve(work: MeshWork, jobs: Sequence[Job], channel: _Channel) -> None:
    """A child's loop: score its meshes in order while no command waits, then answer commands until told to
    exit (or the parent goes away)."""
    pending = deque(jobs)
    while True:
        if pending and not channel.ready():
            index, sizes, mesh, user = pending.popleft()
            try:
                channel.send(("scored", work.score(index, sizes, mesh, user)))
            except Exception:
                channel.send(("error", traceback.format_exc()))
                return
            continue
        try:
            cmd, method, args = channel.recv()
        except EOFError:
            return
        if cmd == "exit":
            return
        if cmd == "stop":
            pending.clear()
            continue
        try:
            channel.send(("reply", getattr(work, method)(*args)))
        except Exception:
            channel.send(("error", traceback.format_exc()))
            return


class MeshPool:
    """The meshes of one search: scored in this process until `spread` gives the rest round-robin to it and to
    `workers - 1` forked children; every later call on a mesh runs in the process that scored it."""

    def __init__(self, work: MeshWork) -> None:
        self.work = work
        self._owner: dict[int, int] = {}  # mesh index -> 0 (here) or child k
        self._children: list[_Child] = []
        self._meshes: list[Any] = []  # the meshes scored here before a fork (shared with the children)
        self.spread_done = False

    def spread(self, jobs: Sequence[Job], workers: int, here_first: bool = True) -> None:
        """Score `jobs` (the meshes left, in order) here and in `workers - 1` children, round-robin from this
        process (or from the first child, when this one has just scored a mesh). With idle work queued
        (`shardc.search.idle`), in `workers` children and none here: this process runs that work meanwhile."""
        self.spread_done = True
        workers = max(1, min(workers, len(jobs)))
        if idle.pending():
            self._owner.update((j[0], 1 + k % workers) for k, j in enumerate(jobs))
            workers += 1
        else:
            self._owner.update((j[0], (k + (not here_first)) % workers) for k, j in enumerate(jobs))
        work = self.work
        shared = [work.problem, work.problem.graph, work.problem.program, work.problem.topology, *self._meshes,
                  *(j[2] for j in jobs), *primitives_and_params(work.problem.program)]
        shared = [o for o in shared if o is not None]
        try:
            for k in range(1, workers):
                self._children.append(self._fork(work, [j for j in jobs if self._owner[j[0]] == k], shared,
                                                 self._children))
        except OSError:
            raise WorkerLost("could not start a search worker") from None
        if idle.pending():
            idle.yield_to_this_process(c.pid for c in self._children)

    @staticmethod
    def _fork(work: MeshWork, jobs: list[Job], shared: Sequence[Any], siblings: Sequence[_Child]) -> _Child:
        down_r, down_w = os.pipe()  # parent -> child
        up_r, up_w = os.pipe()  # child -> parent
        pid = fork_quietly()
        if pid == 0:  # the child: serve, then leave without running this process's exit handlers
            code = 0
            try:
                for c in siblings:  # (their pipes are the parent's)
                    c.channel.close()
                os.close(down_w)
                os.close(up_r)
                channel = _Channel(down_r, up_w, shared)
                _serve(MeshWork(work.problem, work.baselines, work.method, work.n_devices), jobs, channel)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(down_r)
        os.close(up_w)
        return _Child(pid, _Channel(up_r, down_w, shared))

    def scored(self, job: Job) -> MeshScored:
        """Phase 1's result for `job`'s mesh (scored here now, or the next result of the child that owns it)."""
        index, sizes, mesh, user = job
        owner = self.process_of(index)
        if owner == 0:
            self._meshes.append(mesh)
            return self.work.score(index, sizes, mesh, user)
        return self._children[owner - 1].next_scored(index)

    def stop_scoring(self) -> None:
        """The children score no further meshes (the plan budget ends phase 1)."""
        for c in self._children:
            try:
                c.channel.send(("stop", None, ()))
            except OSError:
                raise WorkerLost("a search worker stopped listening") from None

    def process_of(self, index: int) -> int:
        """The process that holds mesh `index`'s work now (0: this one)."""
        return self._owner.get(index, 0)

    def call(self, index: int, method: str, *args: Any) -> Any:
        """`MeshWork.<method>(*args)` in the process that holds mesh `index`'s work."""
        return self.call_on(self.process_of(index), method, *args)

    def call_on(self, process: int, method: str, *args: Any) -> Any:
        """`MeshWork.<method>(*args)` in `process` (0: this one)."""
        if process == 0:
            return getattr(self.work, method)(*args)
        return self._children[process - 1].call(method, *args)

    def search(self, indices: Sequence[int], job: Callable[[int], Job], share: float, budget: Any, seed: int,
               max_steps: int) -> list[MeshSearched]:
        """Phase 2 (`MeshWork.search`) on the meshes `indices`, each with `share` plans, at once where they are
        in different processes; a mesh whose process already searches another is given to an idle one, which
        scores it again first (the same evaluator state: scoring depends on nothing but the mesh), and with idle
        work queued (`shardc.search.idle`) a mesh of this process goes to an idle child too. Results in the order
        of `indices`."""
        where: dict[int, int] = {}  # mesh index -> the process that searches it
        moved: set[int] = set()
        busy_here = idle.pending() and bool(self._children)  # (this process runs the idle work meanwhile)
        processes = range(1 if busy_here else 0, len(self._children) + 1)
        for n, i in enumerate(indices):
            p = self.process_of(i)
            later = {self.process_of(j) for j in indices[n + 1:]}
            free = [q for q in processes if q not in where.values() and q not in later]
            if (p in where.values() or p == 0 and busy_here) and free:
                p = free[0]
                moved.add(i)
            where[i] = p
        for i in indices:  # the children's first, then this process's, then the children's replies
            if where[i]:
                child = self._children[where[i] - 1]
                if i in moved:
                    child.post("score", *job(i))
                child.post("search", i, share, budget, seed, max_steps)
        results: dict[int, MeshSearched] = {}
        for i in indices:
            if not where[i]:
                if i in moved:
                    self.work.score(*job(i))
                results[i] = self.work.search(i, share, budget, seed, max_steps)
        for i in indices:
            if where[i]:
                child = self._children[where[i] - 1]
                if i in moved:
                    child.reply()
                results[i] = child.reply()
        self._owner.update(where)
        return [results[i] for i in indices]

    def evaluations(self, indices: Sequence[int]) -> int:
        """Simulated plans of the meshes `indices`, over every process."""
        total = self.work.evaluations([i for i in indices if self.process_of(i) == 0])
        for k, c in enumerate(self._children, start=1):
            mine = [i for i in indices if self.process_of(i) == k]
            if mine:
                total += c.call("evaluations", mine)
        return total

    def close(self) -> None:
        """End every child (see `_Child.close`)."""
        for c in self._children:
            c.close()
        self._children = []
