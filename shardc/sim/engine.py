"""Full and delta simulation of one representative device (FlexFlow's assumptions A1-A4, made SPMD).

Streams: one compute stream, and one communication stream per topology level (all on the compute stream
when the topology cannot overlap communication with compute). Tasks run in program order, first in first
out on their stream; a task starts when its stream is free and every key it reads is ready; a "join"
(no work) only waits for its inputs. Times are integer picoseconds.

Delta simulation: a plan that differs from the last one in a few ops changes only the slots of those ops
and of the producers and consumers of the values whose layout changed. Those slots are rebuilt (in
program order, so reshard ownership is what a full build gives); the schedule is replayed from the first
rebuilt slot, starting from the stream state recorded there; everything before it is reused. Past the
last rebuilt slot the replay stops as soon as the rest of the old schedule, shifted by one amount D, is
what replaying it would give: every stream's state (free time, idle intervals) is the old one plus D, its
last task the same, and every value made earlier that a later task on a stream reads either moved by D too
or was not what that task waited for and still is not, and, if it is now ready earlier, the task still fits
no idle interval it passed before (checked read by read; values ready at time 0 by one bound). A join holds
no stream: its time is only the latest of its inputs', so a join of the tail reading such a value is
computed again from its inputs, and when it does not move by D (Adam's fused `integer_pow` of a gradient
the backward pass made before the change) its time is recorded apart (`Simulator._pin`) and the values it
makes are checked in turn. The old tail is then kept with a pending offset of D per slot
(`_State.offset`), applied where times are read. The integer arithmetic is the same as a full run's, so the
result is identical, not approximately equal (tests/sim/test_delta_equals_full.py compares every task's
start and end).

Memory (`shardc.cost.memory`) is updated for the buffers the rebuilt slots make or read, and for the
all-reduces XLA merges (`shardc.sim.combine`), regrouped when a rebuilt slot's all-reduces changed.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import operator
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from shardc.cost.device_shapes import DeviceShapes, Signature, info_for
from shardc.cost.estimator import OpCostEstimator
from shardc.cost.memory import MemoryModel
from shardc.cost.op_collectives import OP_COLLECTIVES
from shardc.cost.topology import MeshMapping, Topology
from shardc.gc_pause import gc_paused_long_lived
from shardc.plan import Plan
from shardc.sim.combine import Combiner
from shardc.sim.result import SimResult
from shardc.sim import queued as queued_module
from shardc.sim.tasks import PS, TASKS_PER_SLOT, Slot, TaskBuilder, is_static, plan_needs

__all__ = ["Simulator"]

_GAPS = 16  # idle intervals kept per stream for backfilling (see Simulator._schedule)
_gap_end = operator.itemgetter(1)  # (an idle interval's end)
_NEVER = 1 << 62  # "no task" in a slot's earliest start
# Slots a delta replays after a failed check before it checks again (a check of the streams costs about
# five slot replays, one of reads far more; overshooting the first slot that would do costs only replays).
_RETRY_STREAMS = 8
_RETRY_READS = 32
_NONE_MOVED: Mapping[int, int] = MappingProxyType({})  # (no join of a kept tail moved off its shift)


def _moves_earlier(st: "_State", si: int, ti: int, start: int, shift: int, from_j: int,
                   moved: Mapping[int, int] = _NONE_MOVED) -> bool:
    """Whether task ti of slot si, in the old tail shifted by `shift` (so starting at `start`), would run
    earlier: its inputs are ready earlier than the shifted old ones, and it now fits an idle interval
    it came to before the one it ran in (first fit, in time order; see `_schedule`). Its inputs' ready
    times are those the kept tail would give (keys the tail makes move with it, but those of `moved`, made by
    joins of the tail that do not, are ready when it says); its stream's idle
    intervals those recorded before the slot, updated by the slot's earlier tasks on the stream as
    `_schedule` did. Tasks of no stream or duration only wait for their inputs: the caller checks them."""
    deps, s, dur, _outs = st.slots[si].sched[ti]
    if s < 0 or not dur:
        return False
    ready, who = st.ready, st.who
    inputs_at = 0
    for d in deps:
        r = moved.get(d)
        if r is None:
            r = ready[d]
            if r and who[d] >= from_j:
                r += shift
        if r > inputs_at:
            inputs_at = r
    if inputs_at + dur > start:  # (an interval it came to before ends by `start`: it could not finish in one)
        return False
    by = int(st.offset[si]) + shift  # (compared in the slot's recorded times: the same integers, less `by`)
    start -= by
    inputs_at -= by
    sched = st.slots[si].sched
    idle = st.gaps_in[si][s]
    if any(sched[tj][1] == s and sched[tj][2] for tj in range(ti)):
        idle = _idle_found(st, si, ti, s)
        if idle is None:  # (not as recorded: replay to be sure)
            return True
    for g in idle:
        a, b = g[0], g[1]
        if b > start:
            break
        if max(inputs_at, a) + dur <= b:
            return True
    return False


def _idle_found(st: "_State", si: int, ti: int, s: int) -> list[tuple[int, int]] | None:
    """Stream s's idle intervals as task ti of slot si found them (recorded times): those recorded before the
    slot, updated by the slot's earlier tasks on the stream as `_schedule` did; None when one of those did not
    run where the recorded intervals allow."""
    idle = [(a, b) for a, b, _ in st.gaps_in[si][s]]
    free = st.stream_in[si][s]
    sched, starts, ends = st.slots[si].sched, st.starts[si], st.ends[si]
    for tj in range(ti):
        if sched[tj][1] == s and sched[tj][2]:
            at, end = starts[tj], ends[tj]
            if at >= free:  # after the stream's last task
                if at > free:
                    idle = (idle + [(free, at)])[-_GAPS:]
                free = end
            else:  # in an idle interval
                gi = next((g for g, (a, b) in enumerate(idle) if a <= at and end <= b), None)
                if gi is None:
                    return None
                a, b = idle[gi]
                idle[gi:gi + 1] = [g for g in ((a, at), (end, b)) if g[1] > g[0]]
    return idle


def _differing(a: Sequence[Any], b: Sequence[Any], chunk: int = 256) -> list[int]:
    """The indices at which sequences a and b (of one length) hold unequal items: chunks compared whole first
    (in C, identical items at once), items only in the chunks that differ."""
    out: list[int] = []
    for lo in range(0, len(a), chunk):
        x, y = a[lo:lo + chunk], b[lo:lo + chunk]
        if x != y:
            out.extend(itertools.compress(range(lo, lo + len(x)), map(operator.ne, x, y)))
    return out


@dataclasses.dataclass
class _Probe:
    """One replay's attempts to keep the old tail: the first replayed slot, when to try next, the keys
    made before the replay that later slots read (computed at the first check of reads), and the keys the
    replay made that a slot at or after the last check still reads (`live`; the replay's keys are taken in
    from `seen` on). A check at slot j only looks at keys read at or after j, and j only grows during one
    replay, so a key read last before it is dropped for good."""

    first: int
    next_try: int = 0
    crossing: np.ndarray | None = None
    live: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    seen: int = 0
    makers: dict = dataclasses.field(default_factory=dict)  # key the replay remade -> the task that made it before
    bound_at: int = -1  # the slot of the last check's failing read whose start the moved key decided


class _Remade:
    """The keys a replay from slot `first` made in slots `first` .. `done` - 1: per key its ready time before the
    replay (`before`; None: the old schedule did not make it) and the task that made it then (`makers`).
    Gathered from the replayed slots' outputs when a check asks (`upto`), against copies of the ready times
    and makers taken when the replay began, rather than key by key in the replay's inner loop (a key's value
    before the replay does not depend on when the replay wrote it)."""

    def __init__(self, slots: list[Slot], first: int, ready: list[int], who: list[int]) -> None:
        self.slots = slots
        self.done = first
        self.ready0 = ready[:]
        self.who0 = who[:]
        self.before: dict[int, int | None] = {}
        self.makers: dict[int, int] = {}

    def upto(self, j: int) -> dict[int, int | None]:
        """`before` for the keys slots `first` .. j - 1 made."""
        if j > self.done:
            outs = [k for si in range(self.done, j) for task in self.slots[si].sched for k in task[3]]
            ready0, who0 = self.ready0, self.who0
            self.before.update({k: (ready0[k] if who0[k] >= 0 else None) for k in outs})
            self.makers.update({k: who0[k] for k in outs})
            self.done = j
        return self.before


class _Reads:
    """Which tasks read each key (sorted); per key (arrays, for vectorised selection) the last slot reading it (a
    bound: reads of rebuilt slots are added, not removed), the task that made it and whether it is ready
    after time 0; the last slot using each stream (a bound too) — what a delta checks before keeping an old
    tail. Built by the first delta after a full simulation, then kept up to date."""

    def __init__(self, slots: list[Slot], nstreams: int, who: list[int], ready: list[int]) -> None:
        self.readers: dict[int, list[int]] = {}
        self.last_read = np.full(len(who), -1, np.int64)
        self.maker = np.array(who, np.int64)
        self.live = np.array(ready, np.int64) > 0
        self.stream_end = [-1] * nstreams
        for si, slot in enumerate(slots):
            self._add(si, slot)

    def _grow(self, n: int) -> None:
        if n > len(self.maker):
            extra = n - len(self.maker) + 1024
            self.last_read = np.concatenate([self.last_read, np.full(extra, -1, np.int64)])
            self.maker = np.concatenate([self.maker, np.full(extra, -1, np.int64)])
            self.live = np.concatenate([self.live, np.zeros(extra, bool)])

    def _add(self, si: int, slot: Slot) -> None:
        here = si * TASKS_PER_SLOT
        last = self.last_read
        readers = self.readers
        for ti, (deps, s, _dur, _outs) in enumerate(slot.sched):
            t = here + ti
            for d in deps:
                tasks = readers.get(d)
                if tasks is None:
                    readers[d] = [t]
                elif not tasks or tasks[-1] < t:  # (slots are added in program order when built)
                    tasks.append(t)
                else:
                    at = bisect.bisect_left(tasks, t)
                    if at == len(tasks) or tasks[at] != t:
                        tasks.insert(at, t)
                if d >= len(last):
                    self._grow(d + 1)
                    last = self.last_read
                if last[d] < si:
                    last[d] = si
            if s >= 0 and self.stream_end[s] < si:
                self.stream_end[s] = si

    def replace(self, si: int, old: Slot, new: Slot) -> None:
        here = si * TASKS_PER_SLOT
        for ti, (deps, _s, _dur, _outs) in enumerate(old.sched):
            for d in deps:
                tasks = self.readers.get(d, [])
                at = bisect.bisect_left(tasks, here + ti)
                if at < len(tasks) and tasks[at] == here + ti:
                    del tasks[at]
        self._add(si, new)

    def remade(self, keys: Any, who: list[int], ready: list[int]) -> None:
        """Keys a replay made (their maker and readiness changed)."""
        ks = np.fromiter(keys, np.int64, len(keys))
        if not len(ks):
            return
        if ks.max() >= len(self.maker):
            self._grow(int(ks.max()) + 1)
        self.maker[ks] = [who[k] for k in keys]
        self.live[ks] = [ready[k] > 0 for k in keys]

    def crossing(self, first: int, replaced: dict[int, int]) -> np.ndarray:
        """Keys made before slot `first` by a task (not the inputs; not ready at 0) that a slot from
        `first` on reads."""
        n = len(self.maker)
        hit = (self.last_read[:n] >= first) & (self.maker >= 0) & (self.maker < first * TASKS_PER_SLOT) & self.live
        return np.array([k for k in np.flatnonzero(hit).tolist() if k not in replaced], np.int64)

    def keys_made_from(self, j: int, replaced: dict[int, int]) -> list[int]:
        """Keys made by tasks of slots j.. that move with them (not those of static tasks, ready at 0; not
        those the replay made)."""
        hit = (self.maker >= j * TASKS_PER_SLOT) & self.live
        return [k for k in np.flatnonzero(hit).tolist() if k not in replaced]


@dataclasses.dataclass
class _State:
    plan: Plan
    slots: list[Slot]  # one per op
    keys: dict  # key id -> owning slot (-1: inputs)
    ready: list  # key id -> ready time (ps)
    who: list  # key id -> the task that made it (slot * TASKS_PER_SLOT + index)
    starts: list[list[int]]  # per slot, per task (plus the slot's offset)
    ends: list[list[int]]
    bind: list[list[int]]  # per slot, per task: the task it waited for last (slot * TASKS_PER_SLOT + index), or -1
    stream_in: list[tuple[int, ...]]  # stream free times before each slot (plus the slot's offset)
    stream_last: list[tuple[int, ...]]  # last task on each stream before each slot
    gaps_in: list[tuple]  # per stream, its idle intervals before each slot (see _schedule; plus the offset)
    offset: np.ndarray  # per slot: the shift of its recorded times (a delta that kept the old tail, shifted)
    slot_max: np.ndarray  # per slot: its latest end (plus the offset; -_NEVER: no tasks)
    slot_min: np.ndarray  # per slot: its earliest start (plus the offset; a large number: no tasks)
    makespan: int = 0
    totals: "_Totals | None" = None
    inputs: set = dataclasses.field(default_factory=set)  # key ids of the inputs
    ar_slots: set = dataclasses.field(default_factory=set)  # slots with all-reduces that may merge
    groups: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Totals:
    """Sums over slots (integers, so adding and removing slots in any order is exact)."""

    payload: dict
    xla_payload: dict
    wire: dict
    flops: int = 0
    xla_flops: int = 0
    transcendentals: int = 0

    @classmethod
    def of(cls, slots) -> "_Totals":
        t = cls({}, {}, {})
        for s in slots:
            t.add(s, 1)
        return t

    def add(self, s: Slot, sign: int) -> None:
        for src, dst in ((s.payload, self.payload), (s.xla_payload, self.xla_payload), (s.wire, self.wire)):
            for k, v in src.items():
                n = dst.get(k, 0) + sign * v
                if n:
                    dst[k] = n
                else:
                    dst.pop(k, None)
        self.flops += sign * s.flops
        self.xla_flops += sign * s.xla_flops
        self.transcendentals += sign * s.transcendentals


class Simulator:
    """Simulates plans of one graph on one topology; `delta(plan)` reuses the previous run."""

    def __init__(self, graph: Any, topology: Topology, mapping: MeshMapping, mesh: dict[str, int],
                 estimator: OpCostEstimator | None = None, device_shapes: bool = True) -> None:
        self._graph = graph
        self.topology = topology
        self.mapping = mapping
        self._mesh = dict(mesh)
        self._estimator = estimator
        # Per signature of per-device shapes (`shardc.cost.device_shapes`): the task builder and memory model of
        # the ProgramInfo XLA's passes on one device amount to, made at their first use; the current plan's
        # signature, as a dict. Off (`device_shapes=False`: the graph's own ProgramInfo for every plan) in the
        # search's evaluators.
        self._shapes = DeviceShapes(graph, mesh) if device_shapes else None
        # With them, on XLA:CPU, the reshards the breadth-first schedule queues (`shardc.sim.queued`) are part of the
        # signature.
        self._queues = device_shapes and queued_module.QUEUED_RESHARDS and topology.backend == "cpu"
        self._variants: dict[Signature, tuple[TaskBuilder, MemoryModel]] = {}
        self._builder: TaskBuilder | None = None
        self._memory: MemoryModel | None = None
        self._signature: Signature = frozenset()
        self._local: dict[int, tuple[int, ...]] = {}
        self._last: _State | None = None
        self._users_cache: dict[int, list[int]] | None = None
        self._combiner: Combiner | None = None
        self._reads: _Reads | None = None  # who reads each key (built by the first delta)
        self._needs: dict | None = None  # plan_needs of the last plan simulated
        self._timed: _State | None = None  # the timeline of the last plan `step_time_only` simulated

    @property
    def graph(self) -> Any:
        return self._graph

    @property
    def builder(self) -> TaskBuilder:
        """The task builder of the last plan's per-device shapes (the graph's own before any plan)."""
        if self._builder is None:
            self._switch(frozenset())
        return self._builder

    @property
    def memory(self) -> MemoryModel:
        """The memory model of the last plan's per-device shapes (the graph's own before any plan)."""
        if self._memory is None:
            self._switch(frozenset())
        return self._memory

    def _use_shapes_of(self, plan: Plan) -> None:
        """Simulate with the task builder and memory model of `plan`'s per-device shapes (and the queued reshards of
        the last plan simulated, which `_queued` checks once the slots are built)."""
        sig = self._shapes.signature(plan.shardings) if self._shapes is not None else frozenset()
        sig = sig | self._queued_items()
        if self._builder is None or sig != self._signature:
            self._switch(sig)

    def _queued_items(self) -> Signature:
        return frozenset(item for item in self._signature if item[0] == "queued")

    def _queued(self, slots: Sequence[Slot]) -> Signature | None:
        """The queued reshards of `slots` when they are not those of the signature in use (None when they are, or
        when the simulator does not look for them)."""
        if not self._queues:
            return None
        found = queued_module.queued_reshards(slots, self.builder)
        return None if found == self._queued_items() else found

    def _switch(self, sig: Signature) -> None:
        """Use the task builder and memory model of signature `sig` (made at their first use)."""
        variant = self._variants.get(sig)
        if variant is None:
            info = info_for(self._graph, self.topology.backend, sig) if sig else None
            builder = TaskBuilder(self._graph, self.topology, self.mapping, self._mesh, self._estimator, info=info)
            variant = self._variants[sig] = (builder, MemoryModel(self._graph, builder.info, self._mesh, builder))
        self._builder, self._memory = variant
        self._signature, self._local = sig, {item[0]: item[1] for item in sig if item[0] != "queued"}
        self._last = self._reads = self._combiner = self._users_cache = None

    def _same_shapes(self, plan: Plan, values: set[int]) -> bool:
        """Whether `plan`, which differs from the last plan simulated in the shardings of `values`, has its
        per-device shape signature."""
        if self._shapes is None:
            return True
        differing, local, sh = self._shapes.differing, self._local, plan.shardings
        return all(differing(v, sh[v]) == local.get(v) for v in values)

    # -- public --------------------------------------------------------------------------------------
    @gc_paused_long_lived  # (see shardc/gc_pause.py)
    def full(self, plan: Plan, donated: tuple[int, ...] = ()) -> SimResult:
        """Simulate a plan from scratch (from the timeline `step_time_only` made of this plan object, if it was the
        last simulated)."""
        timed, self._timed = self._timed, None
        state = timed if timed is not None and timed.plan is plan else self._timeline(plan)
        self.memory.full(plan, state.slots, donated,
                         Combiner.lifetimes(state.slots, state.groups, self.builder.info.order), state.groups)
        self._last = state
        self._reads = None
        return self._result(state)

    @gc_paused_long_lived  # (see shardc/gc_pause.py)
    def step_time_only(self, plan: Plan) -> float:
        """`full(plan).step_time` without the memory model: seconds. Only where the step time does not read it (the
        device charges nothing for fresh memory, `Device.fresh_memory_cost`); a later `delta` starts from scratch."""
        if self.topology.device.fresh_memory_cost > 0:
            raise ValueError(f"{self.topology.name}: the step time reads the memory model (fresh memory is charged)")
        state = self._timeline(plan)
        self._last = self._reads = None  # (the memory model has not seen this plan)
        self._timed = state  # (what `full` of this plan completes)
        return (state.makespan - self._merged_ps(state)) / PS

    def _timeline(self, plan: Plan) -> _State:
        """The slots and the schedule of `plan`, built from scratch (and its all-reduce groups)."""
        self._timed = None
        self._use_shapes_of(plan)
        needs = self._needs = plan_needs(plan)
        keys, slots = self._build(plan, needs)
        queued = self._queued(slots)
        if queued is not None:  # (the schedule of this plan's queued reshards: built again with its ProgramInfo)
            self._switch(frozenset(item for item in self._signature if item[0] != "queued") | queued)
            keys, slots = self._build(plan, needs)
        b = self.builder
        b.chain_keys.clear()
        for s in slots:
            self._chained(s, 1)
        n = len(slots)
        state = _State(plan, slots, keys, [], [], [[] for _ in slots], [[] for _ in slots],
                       [[] for _ in slots], [()] * n, [()] * n, [()] * n, np.zeros(n, np.int64),
                       np.full(n, -_NEVER, np.int64), np.full(n, _NEVER, np.int64))
        state.totals = _Totals.of(slots)
        state.inputs = {k for k, owner in keys.items() if owner == -1}
        state.ar_slots = {s.op for s in slots if s.ars}
        self._schedule(state, 0)
        state.groups = self._groups(state)
        return state

    def _build(self, plan: Plan, needs: dict) -> tuple[dict, list[Slot]]:
        """The initial keys and every op's slot of `plan`, built by the task builder in use."""
        b = self.builder
        keys = b.initial_keys(plan)
        b.set_broadcasts(plan, needs)
        b.set_drops(plan, needs)
        b.set_gathered(plan, needs)
        return keys, [b.build_slot(plan, i, keys, needs) for i in range(len(self.graph.ops))]

    @gc_paused_long_lived  # (see shardc/gc_pause.py)
    def delta(self, plan: Plan, donated: tuple[int, ...] = ()) -> SimResult:
        """Simulate a plan that differs from the previous one in a few ops or values: the same result as
        `full(plan)`, computed from the previous run."""
        old, self._timed = self._last, None
        if old is None or old.plan.graph is not plan.graph:
            return self.full(plan, donated)
        b = self.builder
        needs = plan_needs(plan)
        diff = self._diff(old.plan, plan, needs)
        if diff is None or not self._same_shapes(plan, diff[0]):
            return self.full(plan, donated)
        bc = b.set_broadcasts(plan, needs, diff)  # ops whose chains start from or make broadcasts differently
        bc = bc | b.set_drops(plan, needs)  # ops whose operands XLA drops, or that it removes, differently
        bc = bc | b.set_gathered(plan, needs, diff, bc)  # ops reading a value a collective writes, or no longer
        found = self._affected(diff, bc)
        if found is None:
            return self.full(plan, donated)
        affected, values = found
        keys = old.keys
        drop = {k for s in affected for k in old.slots[s].made if keys.get(k) == s}
        for c in values:
            drop.update(k for k in b.value_keys.get(c, ()) if keys.get(k, -1) >= 0)
        for k in drop:
            del keys[k]
        inputs = b.initial_keys(plan)
        for k in old.inputs - inputs.keys():
            del keys[k]
        old.inputs = set(inputs)
        for k in inputs:
            keys[k] = -1
            if k < len(old.ready):
                old.ready[k] = 0
                old.who[k] = -1
        old_slots = {}
        for s in affected:
            new = b.build_slot(plan, s, keys, needs)
            if new is old.slots[s]:  # the memoised slot of this state: same tasks, same keys
                continue
            old_slots[s] = old.slots[s]
            if self._reads is not None:
                self._reads.replace(s, old.slots[s], new)
            old.totals.add(old.slots[s], -1)
            old.totals.add(new, 1)
            self._chained(old.slots[s], -1)
            self._chained(new, 1)
            old.slots[s] = new
            (old.ar_slots.add if new.ars else old.ar_slots.discard)(s)
        if old_slots and self._queued(old.slots) is not None:
            return self.full(plan, donated)  # (another schedule)
        old.plan = plan
        # Slots before the first one that changed replay exactly as before (same tasks, same inputs).
        changed = sorted(old_slots)
        if changed:
            if self._reads is None:
                self._reads = _Reads(old.slots, len(self.builder.streams), old.who, old.ready)
            self._schedule(old, changed[0], changed[-1])
        bounds = None
        if any(old_slots[s].ars != old.slots[s].ars for s in changed):  # (else the same groups, the same lifetimes)
            old.groups = self._groups(old)
            # Compare the lifetimes, not the groups: equal groups may hold rebuilt all-reduces of other keys.
            after = Combiner.lifetimes(old.slots, old.groups, self.builder.info.order)
            if after != self.memory.bounds:
                bounds = (self.memory.bounds, after)
        self.memory.update(plan, old.slots, changed, old_slots, donated, values, bounds, old.groups)
        return self._result(old)

    def _chained(self, slot: Any, sign: int) -> None:
        """Count the keys `slot` makes by collectives in (sign 1) or out of (sign -1) the builder's chain_keys."""
        ck = self.builder.chain_keys
        for k in slot.chained:
            n = ck.get(k, 0) + sign
            if n:
                ck[k] = n
            else:
                del ck[k]

    def _groups(self, st: _State) -> list:
        if self._combiner is None:
            self._combiner = Combiner(self.graph, self.builder.info.canon, self.builder.key_list)
        post = self.builder.info.post
        return self._combiner.groups(st.slots, sorted(st.ar_slots, key=post.__getitem__), self.topology.combine_bytes,
                                     self.topology.combine_count)

    # -- internals -----------------------------------------------------------------------------------
    def _diff(self, a: Plan, b: Plan, needs_b: dict) -> tuple[set[int], set[int]] | None:
        """The values whose sharding differs between plans a and b, and the ops whose strategy or needed
        operand layouts differ; None when the plans do not share a mesh and graph shape."""
        if len(a.strategies) != len(b.strategies) or a.mesh_sizes != b.mesh_sizes:
            return None
        values = set(_differing(a.shardings, b.shardings))
        ops = set(_differing(a.strategies, b.strategies))
        needs_a = self._needs
        if a.reshards is not b.reshards:
            if needs_a is None:
                needs_a = plan_needs(a)
            for key in needs_a.keys() ^ needs_b.keys() | {k for k in needs_a.keys() & needs_b.keys()
                                                         if needs_a[k] != needs_b[k]}:
                ops.add(key[0])
        self._needs = needs_b
        return values, ops

    def _affected(self, diff: tuple[set[int], set[int]], also: set[int] = frozenset()
                  ) -> tuple[list[int], set[int]] | None:
        """Slots to rebuild for a plan change `diff` (see `_diff`; and ops `also`), and the (canonical)
        values whose keys change; None when the plans are too different to be worth it."""
        g = self.graph
        canon = self.builder.info.canon
        values = {canon[v] for v in diff[0]}
        ops = diff[1] | set(also)
        for i in ops:
            op = g.ops[i]
            values.update(canon[v] for v in op.inputs + op.outputs)
        info = self.builder.info  # (how a loop-invariant value entered its loop, or was made, prices its reshards)
        values.update([c for m in (info.entered, info.named) for c, src in m.items() if src in values])
        slots = set(ops)
        users = self._users()
        for c in values:
            slots.update(users.get(c, ()))
        slots.update(self._sharing_permutes(slots))
        if len(slots) > len(g.ops) * 9 // 10:
            return None
        return sorted(slots), values

    def _sharing_permutes(self, slots: set[int]) -> set[int]:
        """The ops that may share an operand permute with one of `slots` (`TaskBuilder.shared_keys`: ops with
        collectives of their own reading one canonical value): which slot makes it, and which reads it, can
        change with any of them."""
        users, ops, canon = self._users(), self.graph.ops, self.builder.info.canon
        return {u for s in slots if ops[s].primitive in OP_COLLECTIVES for v in ops[s].inputs
                for u in users.get(canon[v], ()) if ops[u].primitive in OP_COLLECTIVES}

    def _users(self) -> dict[int, list[int]]:
        """Canonical value -> ops that read or make it (any value CSE merged into it)."""
        if self._users_cache is None:
            canon = self.builder.info.canon
            users: dict[int, list[int]] = {}
            for op in self.graph.ops:
                for v in op.inputs + op.outputs:
                    users.setdefault(canon[v], []).append(op.id)
            self._users_cache = users
        return self._users_cache

    def _schedule(self, st: _State, first: int, last_changed: int = -1) -> None:
        """List-schedule slots `first`.. in program order, from the stream state recorded before `first`
        (a delta: slots up to `last_changed` were rebuilt; past it, stop where the old tail, shifted, is
        what the replay would give — see the module docstring).

        Each stream runs its tasks in program order, and backfills, as XLA's latency-hiding scheduler
        orders a step: when a task waits for its inputs (an op for a collective, a collective for the op
        making its operand), its stream is idle until they arrive, and a later task whose inputs are ready
        runs in that idle interval if it fits there (the newest `_GAPS` intervals per stream are kept)."""
        nstreams = len(self.builder.streams)
        nkeys = len(self.builder.key_list)
        ready, who = st.ready, st.who
        if len(ready) < nkeys:
            ready.extend([0] * (nkeys - len(ready)))
            who.extend([-1] * (nkeys - len(who)))
        offset, slot_max, slot_min = st.offset, st.slot_max, st.slot_min
        if first == 0:
            free = [0] * nstreams
            last = [-1] * nstreams
            gaps: list[tuple] = [()] * nstreams  # per stream: idle intervals (start, end, task before), in time order
        else:
            off = int(offset[first])
            free = [f + off for f in st.stream_in[first]]
            last = list(st.stream_last[first])
            gaps = [tuple((a + off, b + off, t) for a, b, t in g) for g in st.gaps_in[first]]
        slots, stream_in, stream_last = st.slots, st.stream_in, st.stream_last
        gaps_in = st.gaps_in
        all_starts, all_ends, all_binds = st.starts, st.ends, st.bind
        remade = _Remade(slots, first, ready, who) if last_changed >= 0 else None  # (what a delta's replay made)
        probe = _Probe(first)
        maxes: list[int] = []  # slot_max and slot_min of the replayed slots, written to the arrays at once
        mins: list[int] = []

        def write_arrays() -> None:  # (what reads them before then reads only slots not replayed yet)
            upto = first + len(maxes)
            slot_max[first:upto], slot_min[first:upto], offset[first:upto] = maxes, mins, 0

        if remade is not None:
            probe.makers = remade.makers
        # (recorded per slot; the tuples are shared until a slot's tasks change them)
        free_in, last_in, gaps_now = tuple(free), tuple(last), tuple(gaps)
        for si in range(first, len(slots)):
            if si > last_changed >= 0 and si >= probe.next_try and self._converged(st, si, free, last, gaps,
                                                                                 remade, probe, write_arrays):
                self._reads.remade(remade.upto(si), who, ready)
                return
            stream_in[si], stream_last[si], gaps_in[si] = free_in, last_in, gaps_now
            starts, ends, binds = [], [], []
            here = si * TASKS_PER_SLOT
            lo = _NEVER  # earliest start of a task that is not static (`is_static`, inlined below)
            hi = -_NEVER
            moved = idled = False  # whether a stream's free time, or its idle intervals, changed in this slot
            for deps, s, dur, outs in slots[si].sched:
                start, bind = 0, -1
                for d in deps:
                    r = ready[d]
                    if r > start:
                        start, bind = r, who[d]
                if s >= 0 and dur:  # (a task of no duration, such as a bitcast, holds no stream: as a join)
                    idle = gaps[s]
                    # (intervals in time order, so their ends too: none ending before start + dur fits)
                    near = bisect.bisect_left(idle, start + dur, key=_gap_end) if idle and idle[-1][1] >= start + dur \
                        else len(idle)
                    for gi in range(near, len(idle)):
                        a, b, before = idle[gi]
                        at = start if start > a else a
                        if at + dur <= b:  # fits in an idle interval of its stream
                            if a > start:
                                bind = before
                            start, end = at, at + dur
                            gaps[s] = idle[:gi] + tuple(g for g in ((a, at, before), (end, b, here)) if g[1] > g[0]) \
                                + idle[gi + 1:]
                            idled = True
                            break
                    else:  # after the stream's last task
                        if free[s] > start:
                            start, bind = free[s], last[s]
                        elif start > free[s]:
                            gaps[s] = (gaps[s] + ((free[s], start, last[s]),))[-_GAPS:]
                            idled = True
                        end = start + dur
                        free[s] = end
                        last[s] = here
                        moved = True
                else:
                    end = start
                for k in outs:
                    ready[k] = end
                    who[k] = here
                if start < lo and (start or end or (s >= 0 and dur)):
                    lo = start
                if end > hi:
                    hi = end
                starts.append(start)
                ends.append(end)
                binds.append(bind)
                here += 1
            all_starts[si], all_ends[si], all_binds[si] = starts, ends, binds
            maxes.append(hi)
            mins.append(lo)
            if moved:
                free_in, last_in = tuple(free), tuple(last)
            if idled:
                gaps_now = tuple(gaps)
        write_arrays()
        st.makespan = max(int((slot_max + offset).max()), 0) if len(slots) else 0
        if remade is not None and self._reads is not None:
            self._reads.remade(remade.upto(len(slots)), who, ready)

    def _converged(self, st: _State, j: int, free: list[int], last: list[int], gaps: list[tuple],
                   remade: _Remade, probe: "_Probe", write_arrays: Any) -> bool:
        """Whether slots j.. of the old schedule, shifted by one amount, are what replaying them gives; if
        so the shift is applied (offsets, the ready times of the keys they make, the makespan), after
        `write_arrays()` has recorded the replayed slots' bounds."""
        probe.next_try = j + _RETRY_STREAMS
        if tuple(last) != st.stream_last[j]:
            return False
        off = int(st.offset[j])
        reads = self._reads
        shift = None
        for s, (new, old) in enumerate(zip(free, st.stream_in[j])):
            if reads.stream_end[s] < j and new == old + off == 0:
                continue  # a stream no later slot uses
            d = new - (old + off)
            if shift is None:
                shift = d
            elif d != shift:
                return False
        shift = shift or 0
        total = off + shift
        for new_g, old_g in zip(gaps, st.gaps_in[j]):
            if len(new_g) != len(old_g):
                return False
            if not total:
                if new_g != old_g:
                    return False
                continue
            for (a, b, t), (c, d, u) in zip(new_g, old_g):  # (oldest first: where a replay's intervals differ)
                if a != c + total or b != d + total or t != u:
                    return False
        replaced = remade.upto(j)
        held = self._reads_hold(st, j, shift, replaced, probe)
        if held is None:
            probe.next_try = max(j + _RETRY_READS, probe.bound_at + 1)
            return False
        write_arrays()
        if shift:
            st.offset[j:] += shift
            ready = st.ready
            for k in reads.keys_made_from(j, replaced):
                ready[k] += shift
        if held[0]:
            self._pin(st, *held)
        st.makespan = int((st.slot_max + st.offset).max())
        return True

    def _reads_hold(self, st: _State, j: int, shift: int, replaced: dict[int, int], probe: "_Probe"
                    ) -> tuple[dict[int, tuple[int, int]], dict[int, int]] | None:
        """Whether every read by a task of slots j.. of a key whose ready time does not move by `shift` with them
        (made before j, or by a join of the tail that does not move with it) is consistent with keeping the old
        tail, shifted by `shift`; None if not, else the joins of the tail that do not move with it and the keys
        they make (`pinned`: join task -> (its time, the task it waited for last); `moved`: key -> ready time).

        A task on a stream keeps its shifted start if the key did not decide it before and does not now (its
        ready time below the shifted start) and, if the key is ready earlier than the shifted tail expects, the
        task still fits no idle interval it passed (`_moves_earlier`). A join (no stream or no duration) is only
        the latest of its inputs: its time is computed again from them, in program order (a heap), and if it
        differs from the shifted old one, the keys it makes are checked the same way."""
        ready, who, reads = st.ready, st.who, self._reads
        if shift:  # values ready at 0 (inputs, static keys) must not decide a shifted start
            tail_first = int((st.slot_min[j:] + st.offset[j:]).min())
            if not (tail_first > 0 and tail_first + shift > 0):
                return None
        last_read = reads.last_read
        if probe.seen < len(replaced):
            made = np.fromiter(itertools.islice(replaced, probe.seen, None), np.int64, len(replaced) - probe.seen)
            probe.live = np.concatenate([probe.live, made])
            probe.seen = len(replaced)
        n = len(last_read)
        live = probe.live[probe.live < n]
        live = probe.live = live[last_read[live] >= j]
        makers = probe.makers  # (a key made by another task now: a later task bound to its old maker is stale)
        suspects = [k for k in live.tolist() if (before := replaced[k]) is None or ready[k] - before != shift
                    or makers.get(k, who[k]) != who[k]]
        if shift:
            if probe.crossing is None:
                probe.crossing = reads.crossing(probe.first, replaced)
            probe.crossing = probe.crossing[last_read[probe.crossing] >= j]
            suspects.extend(k for k in probe.crossing.tolist() if k not in replaced)
        from_j = j * TASKS_PER_SLOT
        joins: list[int] = []  # (a heap: program order) joins reading a key off the shift, to compute again
        queued: set[int] = set()
        earlier: set[int] = set()  # tasks on a stream reading a key ready earlier than the tail expects

        def readers_hold(k: int, r: int, sooner: bool, off_shift: bool) -> bool:
            """Check the tasks on a stream reading key k (ready at r; `sooner`: earlier than the shifted tail
            expects; `off_shift`: not where the shifted tail has it); queue the joins reading it."""
            maker = who[k]
            old_maker = makers.get(k, maker)
            for t in self._readers_from(k, from_j):
                si, ti = divmod(t, TASKS_PER_SLOT)
                _deps, s, dur, _outs = st.slots[si].sched[ti]
                if s < 0 or not dur:
                    if t not in queued:
                        queued.add(t)
                        heapq.heappush(joins, t)
                    continue
                bind = st.bind[si][ti]
                if bind >= 0 and (bind == maker or bind == old_maker):
                    probe.bound_at = si  # (its start is decided by the key: only a replay past it can keep the tail)
                    return False
                start = st.starts[si][ti] + int(st.offset[si]) + shift
                # (a key that moved off the shift and is ready right at the shifted start would decide it now)
                if not (r < start or (shift >= 0 and not off_shift and r <= start)):
                    return False
                if sooner:
                    earlier.add(t)
            return True

        for k in suspects:
            r = ready[k]
            before = replaced.get(k, r)  # (None: a key the old schedule did not make)
            if not readers_hold(k, r, before is None or r < before + shift, before is None or r != before + shift):
                return None
        pinned: dict[int, tuple[int, int]] = {}
        moved: dict[int, int] = {}
        while joins:  # (in program order: a join's inputs are final when it is computed)
            t = heapq.heappop(joins)
            si, ti = divmod(t, TASKS_PER_SLOT)
            time, bind = self._join_time(st, st.slots[si].sched[ti][0], shift, from_j, moved)
            expected = self._tail_time(st, si, ti, shift)
            if time == expected and bind == st.bind[si][ti]:
                continue
            if time and time == int(st.offset[si]) + shift:
                return None  # (recorded relative to its slot's new offset it would be 0: read as static)
            pinned[t] = (time, bind)
            if time != expected:
                for o in st.slots[si].sched[ti][3]:
                    moved[o] = time
                    if not readers_hold(o, time, time < expected, True):
                        return None
        for t in sorted(earlier):  # (with every join's time known)
            si, ti = divmod(t, TASKS_PER_SLOT)
            if _moves_earlier(st, si, ti, st.starts[si][ti] + int(st.offset[si]) + shift, shift, from_j, moved):
                return None
        return pinned, moved

    def _readers_from(self, k: int, from_j: int) -> list[int]:
        """The tasks reading key k from task `from_j` on, in program order."""
        tasks = self._reads.readers.get(k, ())
        return tasks[bisect.bisect_left(tasks, from_j):]

    @staticmethod
    def _tail_time(st: _State, si: int, ti: int, shift: int) -> int:
        """The time task ti of slot si has in the old tail shifted by `shift` (a static one stays at 0)."""
        start, end = st.starts[si][ti], st.ends[si][ti]
        _deps, s, dur, _outs = st.slots[si].sched[ti]
        return 0 if is_static(start, end, s, dur) else start + int(st.offset[si]) + shift

    def _join_time(self, st: _State, deps: tuple[int, ...], shift: int, from_j: int, moved: dict[int, int]
                   ) -> tuple[int, int]:
        """A join's time and the task it waited for last, computed from its inputs `deps` as `_schedule` does:
        keys the tail makes at their shifted ready times (static ones at 0), those of `moved` at theirs."""
        ready, who, live = st.ready, st.who, self._reads.live
        time, bind = 0, -1
        for d in deps:
            r = moved.get(d)
            if r is None:
                r = ready[d]
                if who[d] >= from_j and live[d]:
                    r += shift
            if r > time:
                time, bind = r, who[d]
        return time, bind

    def _pin(self, st: _State, pinned: dict[int, tuple[int, int]], moved: dict[int, int]) -> None:
        """Record the joins of a kept tail that do not move with it (`_reads_hold`): their times relative to their
        slots' offsets (0 when at time 0: static), binds, the slots' bounds, and the ready times of the keys
        they make. A slot's lists are copied first (earlier results share them)."""
        slots = sorted({t // TASKS_PER_SLOT for t in pinned})
        for si in slots:
            st.starts[si], st.ends[si], st.bind[si] = list(st.starts[si]), list(st.ends[si]), list(st.bind[si])
        for t, (time, bind) in pinned.items():
            si, ti = divmod(t, TASKS_PER_SLOT)
            st.starts[si][ti] = st.ends[si][ti] = time - int(st.offset[si]) if time else 0
            st.bind[si][ti] = bind
        for si in slots:
            starts, ends = st.starts[si], st.ends[si]
            st.slot_max[si] = max(ends, default=-_NEVER)
            st.slot_min[si] = min((a for (_d, s, dur, _o), a, b in zip(st.slots[si].sched, starts, ends)
                                   if not is_static(a, b, s, dur)), default=_NEVER)
        for k, time in moved.items():
            st.ready[k] = time
        self._reads.remade(list(moved), st.who, st.ready)

    def _merged_ps(self, st: _State) -> int:
        """Picoseconds the schedule over-counts for merged all-reduces: XLA runs each group as one all-reduce,
        which pays one fixed cost, where the schedule has one task per member, each paying its own. Only where
        collectives run on the compute stream (no overlap: the step is the sum of its tasks, so the saving
        is exact); each group keeps its dearest member's fixed cost."""
        if self.topology.overlap:
            return 0
        total = 0
        for g in st.groups:
            fixed = [st.slots[s].ars[e].fixed_ps for s, e in g.members]
            total += sum(fixed) - max(fixed)
        return total

    def _result(self, st: _State) -> SimResult:
        t = st.totals
        return SimResult(
            plan=st.plan, topology=self.topology, mapping=self.mapping, streams=tuple(self.builder.streams),
            makespan_ps=st.makespan, slots=st.slots, recorded_starts=st.starts, recorded_ends=st.ends,
            offsets=st.offset.copy(), binds=st.bind,
            payload=dict(t.payload), xla_payload=dict(t.xla_payload), wire=dict(t.wire), flops=t.flops,
            xla_flops=t.xla_flops, transcendentals=t.transcendentals, memory=self.memory.result(),
            merged_ps=self._merged_ps(st))
