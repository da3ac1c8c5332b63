"""Full and delta simulation of one representative device (FlexFlow's assumptions A1-A4, made SPMD).

Streams: one compute stream, and one communication stream per topology level (all on the compute stream
when the topology cannot overlap communication with compute). Tasks run in program order, first in first
out on their stream; a task starts when its stream is free and every key it reads is ready; a "join"
(no work) only waits for its inputs. Times are integer picoseconds.

Delta simulation: a plan that differs from the last one in a few ops changes only the slots of those ops
and of the producers and consumers of the values whose layout changed. Those slots are rebuilt (in
program order, so reshard ownership is what a full build gives); the schedule is replayed from the first
rebuilt slot, starting from the stream state recorded there; everything before it is reused. The integer
arithmetic is the same as a full run's, so the result is identical, not approximately equal.

Memory (`shardc.cost.memory`) is updated for the buffers the rebuilt slots make or read, and for the
all-reduces XLA merges (`shardc.sim.combine`), regrouped on every run (a pass over the all-reduces only).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from shardc.cost.estimator import OpCostEstimator
from shardc.cost.memory import MemoryModel
from shardc.cost.topology import MeshMapping, Topology
from shardc.plan import Plan
from shardc.sim.combine import Combiner
from shardc.sim.result import SimResult
from shardc.sim.tasks import TASKS_PER_SLOT, Slot, TaskBuilder, plan_needs

__all__ = ["Simulator"]

_GAPS = 16  # idle intervals kept per stream for backfilling (see Simulator._schedule)


@dataclasses.dataclass
class _State:
    plan: Plan
    slots: list[Slot]  # one per op
    keys: dict  # key id -> owning slot (-1: inputs)
    ready: list  # key id -> ready time (ps)
    who: list  # key id -> the task that made it (slot * TASKS_PER_SLOT + index)
    starts: list[list[int]]  # per slot, per task
    ends: list[list[int]]
    bind: list[list[int]]  # per slot, per task: the task it waited for last (slot * TASKS_PER_SLOT + index), or -1
    stream_in: list[tuple[int, ...]]  # stream free times before each slot
    stream_last: list[tuple[int, ...]]  # last task on each stream before each slot
    gaps_in: list[tuple]  # per stream, its idle intervals before each slot (see _schedule)
    makespan_before: list[int]  # max end over slots before each slot
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
                 estimator: OpCostEstimator | None = None) -> None:
        self.builder = TaskBuilder(graph, topology, mapping, mesh, estimator)
        self.memory = MemoryModel(graph, self.builder.info, mesh, self.builder)
        self.topology = topology
        self.mapping = mapping
        self._last: _State | None = None
        self._users_cache: dict[int, list[int]] | None = None
        self._combiner: Combiner | None = None

    @property
    def graph(self) -> Any:
        return self.builder.graph

    # -- public --------------------------------------------------------------------------------------
    def full(self, plan: Plan, donated: tuple[int, ...] = ()) -> SimResult:
        """Simulate a plan from scratch."""
        b = self.builder
        keys = b.initial_keys(plan)
        needs = plan_needs(plan)
        slots = [b.build_slot(plan, i, keys, needs) for i in range(len(self.graph.ops))]
        b.chain_keys.clear()
        for s in slots:
            self._chained(s, 1)
        n = len(slots)
        state = _State(plan, slots, keys, [], [], [[] for _ in slots], [[] for _ in slots],
                       [[] for _ in slots], [()] * n, [()] * n, [()] * n, [0] * n)
        state.totals = _Totals.of(slots)
        state.inputs = {k for k, owner in keys.items() if owner == -1}
        state.ar_slots = {s.op for s in slots if s.ars}
        self._schedule(state, 0)
        state.groups = self._groups(state)
        self.memory.full(plan, slots, donated, Combiner.lifetimes(slots, state.groups, self.builder.info.order))
        self._last = state
        return self._result(state)

    def delta(self, plan: Plan, donated: tuple[int, ...] = ()) -> SimResult:
        """Simulate a plan that differs from the previous one in a few ops or values: the same result as
        `full(plan)`, computed from the previous run."""
        old = self._last
        if old is None or old.plan.graph is not plan.graph:
            return self.full(plan, donated)
        found = self._affected(old.plan, plan)
        if found is None:
            return self.full(plan, donated)
        affected, values = found
        b = self.builder
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
        needs = plan_needs(plan)
        old_slots = {}
        for s in affected:
            new = b.build_slot(plan, s, keys, needs)
            if new is old.slots[s]:  # the memoised slot of this state: same tasks, same keys
                continue
            old_slots[s] = old.slots[s]
            old.totals.add(old.slots[s], -1)
            old.totals.add(new, 1)
            self._chained(old.slots[s], -1)
            self._chained(new, 1)
            old.slots[s] = new
            (old.ar_slots.add if new.ars else old.ar_slots.discard)(s)
        old.plan = plan
        # Slots before the first one that changed replay exactly as before (same tasks, same inputs).
        changed = sorted(old_slots)
        if changed:
            self._schedule(old, changed[0])
        old.groups = self._groups(old)
        # Compare the lifetimes, not the groups: equal groups may hold rebuilt all-reduces of other keys.
        after = Combiner.lifetimes(old.slots, old.groups, self.builder.info.order)
        bounds = None if after == self.memory.bounds else (self.memory.bounds, after)
        self.memory.update(plan, old.slots, changed, old_slots, donated, values, bounds)
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
        return self._combiner.groups(st.slots, sorted(st.ar_slots), self.topology.combine_bytes,
                                     self.topology.combine_count)

    # -- internals -----------------------------------------------------------------------------------
    def _affected(self, a: Plan, b: Plan) -> tuple[list[int], set[int]] | None:
        """Slots to rebuild going from plan a to plan b, and the (canonical) values whose keys change;
        None when the plans are too different to be worth it."""
        g = self.graph
        if len(a.strategies) != len(b.strategies) or a.mesh_sizes != b.mesh_sizes:
            return None
        canon = self.builder.info.canon
        sa, sb = a.shardings, b.shardings
        values = {canon[v] for v in range(len(sa)) if sa[v] is not sb[v] and sa[v] != sb[v]}
        ta, tb = a.strategies, b.strategies
        ops = {i for i in range(len(ta)) if ta[i] is not tb[i] and ta[i] != tb[i]}
        if a.reshards is not b.reshards:
            ra, rb = plan_needs(a), plan_needs(b)
            for key in set(ra) ^ set(rb) | {k for k in set(ra) & set(rb) if ra[k] != rb[k]}:
                ops.add(key[0])
        for i in ops:
            op = g.ops[i]
            values.update(canon[v] for v in op.inputs + op.outputs)
        slots = set(ops)
        users = self._users()
        for c in values:
            slots.update(users.get(c, ()))
        if len(slots) > len(g.ops) * 9 // 10:
            return None
        return sorted(slots), values

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

    def _schedule(self, st: _State, first: int) -> None:
        """List-schedule slots `first`.. in program order, from the stream state recorded before `first`.

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
        if first == 0:
            free = [0] * nstreams
            last = [-1] * nstreams
            gaps: list[tuple] = [()] * nstreams  # per stream: idle intervals (start, end, task before), in time order
            makespan = 0
        else:
            free = list(st.stream_in[first])
            last = list(st.stream_last[first])
            gaps = list(st.gaps_in[first])
            makespan = st.makespan_before[first]
        slots, stream_in, stream_last, mk_before = st.slots, st.stream_in, st.stream_last, st.makespan_before
        gaps_in = st.gaps_in
        all_starts, all_ends, all_binds = st.starts, st.ends, st.bind
        for si in range(first, len(slots)):
            stream_in[si] = tuple(free)
            stream_last[si] = tuple(last)
            gaps_in[si] = tuple(gaps)  # (tuples: shared until a stream's intervals change)
            mk_before[si] = makespan
            starts, ends, binds = [], [], []
            here = si * TASKS_PER_SLOT
            for deps, s, dur, outs in slots[si].sched:
                start, bind = 0, -1
                for d in deps:
                    r = ready[d]
                    if r > start:
                        start, bind = r, who[d]
                if s >= 0:
                    idle = gaps[s] if dur else ()
                    for gi, (a, b, before) in enumerate(idle):
                        at = start if start > a else a
                        if at + dur <= b:  # fits in an idle interval of its stream
                            if a > start:
                                bind = before
                            start, end = at, at + dur
                            gaps[s] = idle[:gi] + tuple(g for g in ((a, at, before), (end, b, here)) if g[1] > g[0]) \
                                + idle[gi + 1:]
                            break
                    else:  # after the stream's last task
                        if free[s] > start:
                            start, bind = free[s], last[s]
                        elif start > free[s] and dur:
                            gaps[s] = (gaps[s] + ((free[s], start, last[s]),))[-_GAPS:]
                        end = start + dur
                        free[s] = end
                        last[s] = here
                else:
                    end = start
                for k in outs:
                    ready[k] = end
                    who[k] = here
                if end > makespan:
                    makespan = end
                starts.append(start)
                ends.append(end)
                binds.append(bind)
                here += 1
            all_starts[si], all_ends[si], all_binds[si] = starts, ends, binds
        st.makespan = makespan

    def _result(self, st: _State) -> SimResult:
        t = st.totals
        return SimResult(
            plan=st.plan, topology=self.topology, mapping=self.mapping, streams=tuple(self.builder.streams),
            makespan_ps=st.makespan, slots=st.slots, starts=st.starts, ends=st.ends, binds=st.bind,
            payload=dict(t.payload), xla_payload=dict(t.xla_payload), wire=dict(t.wire), flops=t.flops,
            xla_flops=t.xla_flops, transcendentals=t.transcendentals, memory=self.memory.result())
