"""Plan -> tasks of one representative device.

Every device runs the same program, so one device's tasks describe the step. Each op of the graph gets a
*slot* (program order) holding its tasks: the collectives that bring its operands to the layouts its
strategy needs, its compute task, and the collectives that take its results (partial sums, other
layouts) to their planned shardings. A task reads and writes *keys* — (canonical value, sharding) pairs —
so a reshard needed by several consumers (or by CSE-merged values) is built once, by the first slot that
needs it, as XLA's CSE does.

Costs: compute tasks from the op-cost estimator at the op's local shapes; collectives from
`shardc.cost.reshard` (which collectives XLA emits) and `shardc.cost.collectives` (their per-level
phases, each a task on that level's stream). Durations are integer picoseconds, so full and delta
simulation do exactly the same arithmetic.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from shardc.cost.aliases import ALIASES
from shardc.cost.collectives import collective_fixed, collective_phases
from shardc.cost.dropped import BranchScopes, branch_scopes, dead_ops, plan_drops
from shardc.cost.estimator import OpCostEstimator, OpKey
from shardc.cost.flops import count_op
from shardc.cost.host_ops import default_estimator, relayout_seconds
from shardc.cost.op_collectives import NONE as NO_COLLECTIVES, OP_COLLECTIVES, OwnCollectives, op_collectives
from shardc.cost.program import (FREE_PRIMITIVES, ProgramInfo, broadcast_dims, broadcast_transfer, enters_a_constant,
                                 gather_relayouts, loop_exit, moves_no_data, per_info, program_info, rewritten_dot)
from shardc.cost.reshard_path import kept_after, reshard_steps
from shardc.cost.topology import MeshMapping, Topology
from shardc.cost.wire import wire_itemsize
from shardc.plan import Plan, planned_apart, reshard_needs
from shardc.sharding import Sharding

__all__ = ["Task", "Slot", "TaskBuilder", "PS", "TASKS_PER_SLOT", "is_static", "plan_needs"]

PS = 10**12  # picoseconds per second
TASKS_PER_SLOT = 1 << 12  # a task is named by slot * TASKS_PER_SLOT + index


def is_static(start: int, end: int, stream: int, dur: int) -> bool:
    """A join at time 0 (of values ready at 0; a task of no duration holds no stream, so it is one too): it
    stays at 0 whatever the rest of the schedule does (a delta's shifted tail leaves it there)."""
    return start == 0 and end == 0 and (stream < 0 or not dur)
# A value key: (canonical value id, sharding, origin). origin 0: the value in its planned layout or a
# layout resharded from it (what consumers read; identical reshards of it are one, as XLA's CSE makes
# them); origin 1: the layout an op's strategy makes before it is resharded to the planned one (a
# separate buffer, never reused by consumers); origin 2: a loop carry resharded after the loop by its exit tie
# (the while's result is another instruction than the body's parameter: none of the body's reshards of the
# carry serve it, however alike); origin 3 + k: a value made outside cond branch k (`BranchScopes`) and
# resharded inside it (a branch is a computation of its own: XLA neither shares a reshard with another
# branch or the code around the cond, nor hoists it out). Keys are interned to ints by the builder.
Key = tuple[int, Sharding, int]
HOME, MADE, EXIT = 0, 1, 2  # (HOME as `shardc.cost.dropped.HOME`)


def leaves_one_loop_only(steps: Sequence[tuple[Sharding, tuple]], src: Sharding, shape: Sequence[int],
                         itemsize: int, mesh: Mapping[str, int]) -> bool:
    """Whether XLA's loop-invariant code motion takes reshard `steps` (from `src`) of a value invariant in
    nested loops, made in the innermost loop's body, out of that loop only: its first collective reads a smaller
    piece than the value's local one, which XLA slices first at offsets computed from the partition id (a
    collective-permute or an all-to-all of part of the piece, seed 154017: over a sub-axis; or an all-gather after
    a step that only slices, seed 163006: [y+x, -] -> [x, z] -> [-, z]). One pass of the motion takes those offsets
    out of the outer loop too, as new loop state, while it brings the slice and the collective into the outer
    body; the next pass no longer sees the offsets as invariant (it only takes the loop state the body's root
    passes on as it is), so the collective runs once per outer trip. (A collective of the whole piece reads the
    value alone and leaves every loop it is invariant in.)"""
    local = itemsize
    for n in src.local_shape(shape, mesh):
        local *= n
    for _, collectives in steps:
        if collectives:
            first = collectives[0]
            read = first.bytes // first.group_size(dict(mesh)) if first.kind == "all-gather" else first.bytes
            return first.kind in ("collective-permute", "all-to-all", "all-gather") and read < local
    return False


@dataclasses.dataclass(slots=True)
class Task:
    name: str
    kind: str  # "compute", "join" (no work: hints, ties), or a collective phase kind
    stream: int  # index into TaskBuilder.streams; -1 for joins
    dur: int  # picoseconds
    deps: tuple[int, ...]  # interned keys it reads
    outs: tuple[int, ...]  # interned keys it makes
    op: int
    level: str = ""
    collective: str = ""  # the collective this phase belongs to


@dataclasses.dataclass(frozen=True, slots=True)
class ArEntry:
    """A reshard that is a single all-reduce: tasks [first, first + count) of its slot (phases and the
    final join), reading `src` and making `dst`."""

    first: int
    count: int
    axes: tuple[str, ...]
    bytes: int
    src: int
    dst: int
    name: str
    region: str = ""  # the loop or branch body it runs in (XLA merges all-reduces of one computation only)
    fixed_ps: int = 0  # the fixed cost of its phases (all trips): what it does not pay again merged into another


@dataclasses.dataclass(slots=True)
class Slot:
    """The tasks of one op, and what they add to the step's totals."""

    op: int
    tasks: list[Task]
    flops: int = 0  # per step (loop trips included)
    xla_flops: int = 0  # as XLA's cost analysis counts them (loop bodies once, all-reduce elements added)
    transcendentals: int = 0
    compute_ps: int = 0
    comm_ps: int = 0
    payload: dict[str, int] = dataclasses.field(default_factory=dict)  # collective kind -> bytes per step
    xla_payload: dict[str, int] = dataclasses.field(default_factory=dict)  # per kind, loop bodies once
    wire: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)  # (kind, level) -> bytes sent
    made: tuple[int, ...] = ()  # value keys this slot made (for ownership in delta rebuilds and memory)
    sched: tuple = ()  # (deps, stream, dur, outs) per task: what the scheduler reads
    ars: tuple["ArEntry", ...] = ()  # all-reduces XLA may combine with others (see shardc.sim.combine)
    at: int = 0  # index of the op's own task: tasks after it take its results to their planned layouts
    chained: tuple[int, ...] = ()  # value keys this slot makes by collectives
    memory: Any = None  # (makes, reads) of value keys, cached by shardc.cost.memory (a sealed slot never changes)

    def seal(self) -> "Slot":
        if len(self.tasks) >= TASKS_PER_SLOT:
            raise AssertionError(f"op {self.op} has {len(self.tasks)} tasks (at most {TASKS_PER_SLOT - 1})")
        self.sched = tuple((t.deps, t.stream, t.dur, t.outs) for t in self.tasks)
        return self


def _shared(graph: Any, what: str, topology: Topology, make: Any) -> Any:
    """An object shared by the simulators of one graph on one device type and backend (the default op-cost
    estimator and its memo, FLOP counts: they depend on local shapes only, not on the mesh), kept on the graph."""
    cache: dict = graph.analysis("sim_shared", dict)
    key = (what, repr(topology.device), topology.backend)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = make()
    return hit


class TaskBuilder:
    """Builds slots for plans of one graph on one topology/mapping with one estimator."""

    def __init__(self, graph: Any, topology: Topology, mapping: MeshMapping, mesh: Mapping[str, int],
                 estimator: OpCostEstimator | None = None, info: ProgramInfo | None = None) -> None:
        self.graph = graph
        # (`info`: of the plans' per-device shapes, `shardc.cost.device_shapes`; default: of the graph's)
        self.info: ProgramInfo = info if info is not None else program_info(graph, topology.backend)
        self.topology = topology
        self.mapping = mapping
        self.mesh = dict(mesh)
        self.estimator = estimator if estimator is not None else _shared(graph, "estimator", topology,
                                                                         lambda: default_estimator(topology.device))
        self.streams: list[str] = ["compute"]
        if topology.overlap:
            self.streams += [f"comm:{lv}" for lv in topology.level_names]
        self._stream_of = {name: i for i, name in enumerate(self.streams)}
        self._phase_memo: dict[Any, tuple] = {}
        self._coll_memo: dict[Any, tuple] = {}
        self._count_memo: dict[OpKey, Any] = _shared(graph, "counts", topology, dict)
        self._cost_class: dict[int, int] = {}  # op id -> class of ops with the same cost at the same layouts
        self._cost_classes: dict[tuple, int] = {}
        self._cost_memo: dict[tuple, tuple[float, Any]] = {}
        self._shape_memo: dict[Any, tuple[int, ...]] = {}
        self._slot_memo: dict[int, dict[tuple, Slot]] = {}
        self._canon_in: list | None = None
        self._scopes: BranchScopes | None = None
        # Of the current plan: per op, the operands XLA's simplifier drops as one buffer with another, and the
        # ops only they read (`shardc.cost.dropped`; `set_drops`)
        self.drops: dict[int, tuple[int, ...]] = {}
        self.dead: frozenset[int] = frozenset()
        self.gathered: set[int] | None = None  # (canonical values a collective writes in the plan: `set_gathered`)
        self._plan_class: list[int] | None = None
        self._made_memo: dict[tuple, tuple[Sharding, ...]] = {}
        self._layout_memo: dict[Sharding, Sharding] = {}
        self._unit_axes = frozenset(a for a, n in self.mesh.items() if n == 1)  # (none: `layout` is the identity)
        self.key_of: dict[Any, int] = {}
        self._input_keys: dict[int, tuple[Sharding, int]] = {}  # input value -> (sharding, its key id)
        self.key_list: list[Any] = []
        self.is_value_key: list[bool] = []
        # Keys made by collectives in the current plan's slots (always written to memory), with the number
        # of slots making them so; kept by the Simulator from `Slot.chained` (full and delta runs alike).
        self.chain_keys: dict[int, int] = {}
        self.value_keys: dict[int, list[int]] = {}  # canonical value -> ids of its keys
        # Broadcast dims (XLA copies instead of permuting data along them; `broadcasts`): of the operand a
        # chain starts from, (op, operand index) -> dims, and of the layout an op makes, (op, result) -> dims,
        # for the current plan (only non-empty ones).
        self.bc_start: dict[tuple[int, int], frozenset[int]] = {}
        self.bc_made: dict[tuple[int, int], frozenset[int]] = {}
        self._bc_static = broadcast_dims(graph)
        self._bc_ops: list[int] | None = None
        self._bc_rec: list[tuple] | None = None  # per op of _bc_ops: its part of `broadcasts` for the current plan
        self._bc_home: dict[int, frozenset[int]] = {}  # value -> broadcast dims in its planned layout (non-empty)
        self._bc_pos: dict[int, int] | None = None
        self._bc_users: dict[int, list[int]] = {}
        self._bc_maker: dict[int, int] = {}
        vals = graph.values
        by_dtype: dict[Any, tuple[str, int]] = {}  # str(numpy dtype) is slow: once per distinct dtype
        for v in vals:
            if v.dtype not in by_dtype:
                by_dtype[v.dtype] = (str(v.dtype), wire_itemsize(v.dtype, topology.backend))
        self._dtype = [by_dtype[v.dtype][0] for v in vals]
        self._itemsize = [by_dtype[v.dtype][1] for v in vals]  # as the backend's collectives carry them

    # -- keys ----------------------------------------------------------------------------------------
    def canon(self, v: int) -> int:
        return self.info.canon[v]

    def kid(self, key: Any) -> int:
        """The interned id of a key (a value key's layout as `layout` gives it)."""
        if len(key) == 3:
            key = self.vkey(key)
        i = self.key_of.get(key)
        if i is None:
            i = self.key_of[key] = len(self.key_list)
            self.key_list.append(key)
            self.is_value_key.append(len(key) == 3)
            if len(key) == 3:
                self.value_keys.setdefault(key[0], []).append(i)
        return i

    def layout(self, s: Sharding) -> Sharding:
        """`s` without the mesh axes of size 1: one layout, however many such axes name it ([y+x] and [x],
        [y] and [-] with y of size 1 are the same HloSharding: XLA makes it once)."""
        one = self._unit_axes
        if not one:
            return s
        hit = self._layout_memo.get(s)
        if hit is None:
            hit = Sharding(tuple(tuple(a for a in d if a not in one) for d in s.dims), frozenset(s.partial - one))
            self._layout_memo[s] = hit
        return hit

    def vkey(self, key: Key) -> Key:
        """A value key with its layout as `layout` gives it."""
        if not self._unit_axes and type(key) is tuple:
            return key
        return (key[0], self.layout(key[1]), key[2])

    def initial_keys(self, plan: Plan) -> dict[int, int]:
        """Keys ready before the step: the inputs at their planned shardings (owner -1)."""
        memo, sh, out = self._input_keys, plan.shardings, {}
        for v in self.graph.inputs:
            hit = memo.get(v)
            if hit is None or hit[0] is not sh[v]:
                hit = memo[v] = (sh[v], self.kid((self.canon(v), sh[v], HOME)))
            out[hit[1]] = -1
        return out

    def local_shape(self, v: int, s: Sharding) -> tuple[int, ...]:
        shape = self.graph.values[v].shape
        key = (shape, s.dims)
        hit = self._shape_memo.get(key)
        if hit is None:
            hit = self._shape_memo[key] = s.local_shape(shape, self.mesh)
        return hit

    def comm_stream(self, level: str) -> int:
        return self._stream_of.get(f"comm:{level}", 0)

    # -- collectives ---------------------------------------------------------------------------------
    def path(self, src: Sharding, dst: Sharding, v: int, groups: tuple = (), bcast: frozenset[int] = frozenset()
             ) -> tuple:
        """The reshard model's steps taking value `v` from `src` to `dst`: ((layout, collectives), ...)."""
        val = self.graph.values[v]
        key = (src, dst, val.shape, self._itemsize[v], groups, bcast)
        hit = self._coll_memo.get(key)
        if hit is None:
            hit = self._coll_memo[key] = reshard_steps(src, dst, val.shape, self._itemsize[v], self.mesh,
                                                       self.topology.reduce_scatter, groups, bcast)
        return hit

    # -- broadcasts ----------------------------------------------------------------------------------
    def broadcasts(self, plan: Plan, needs: Mapping[tuple[int, int], Sharding]
                   ) -> tuple[dict[tuple[int, int], frozenset[int]], dict[tuple[int, int], frozenset[int]]]:
        """Which chains of `plan` start from a value that is a broadcast, and along which dims (XLA's
        partitioner tracks broadcasts through the instructions it makes, `broadcast_transfer`; a reshard
        with a collective makes a new value), and which layouts an op makes are: ((op, operand) -> dims,
        (op, result) -> dims), the non-empty ones. Loop and branch parameters are no broadcasts."""
        home: dict[int, frozenset[int]] = {}
        start: dict[tuple[int, int], frozenset[int]] = {}
        made: dict[tuple[int, int], frozenset[int]] = {}
        self._broadcast_index()
        for at, op_id in enumerate(self._bc_ops):
            starts, mades, homes = self._op_broadcasts(op_id, plan, needs, home, at)
            start.update(((op_id, i), b) for i, b in starts)
            made.update(((op_id, k), b) for k, b in mades)
            home.update(homes)
        return start, made

    def _broadcast_ops(self) -> list[int]:
        """The ops (program order) whose operands or results can be broadcasts."""
        if self._bc_ops is None:
            st, live, dup = self._bc_static, self.info.live, self.info.duplicate
            self._bc_ops = [op.id for op in self.graph.ops if live[op.id] and not dup[op.id]
                            and not (op.primitive == "tie" and op.region == "io")
                            and any(st[v] for v in op.inputs + op.outputs)]
        return self._bc_ops

    def _op_broadcasts(self, op_id: int, plan: Plan, needs: Mapping[tuple[int, int], Sharding],
                       home: Mapping[int, frozenset[int]], at: int) -> tuple[tuple, tuple, tuple]:
        """One op's part of `broadcasts`, given the broadcast dims of the values made before it in their
        planned layouts (`home`): its chains' start dims ((operand, dims), ...), the dims of the layouts it
        makes ((result, dims), ...) and those of its results in their planned layouts ((value, dims), ...);
        non-empty ones only. `at`: its position in `_broadcast_ops` (only values made before it count)."""
        g, info, sh = self.graph, self.info, plan.shardings
        op = g.ops[op_id]
        boundary = op.primitive in ("tie", "scan_slice", "scan_stack")
        param = op.primitive == "tie" and op.params.get("at") in ("out", "arg")
        after, starts, mades, homes = [], [], [], []
        for i, u in enumerate(op.inputs):
            c = info.canon[u]
            b = frozenset() if param or (op_id, i) in info.unread else \
                self._bc_static[c] if info.constant[c] else \
                home.get(c, frozenset()) if self._bc_maker.get(c, at) < at else frozenset()
            if b:
                starts.append((i, b))
                need = needs.get((op_id, i), sh[u])
                if need != sh[c]:
                    b = kept_after(self.path(sh[c], need, u, (), b), sh[c], g.values[u].shape, self.mesh, b)
            after.append(b)
        if op.primitive == "tie":
            out = [after[0]]
        elif boundary:
            out = [frozenset()] * len(op.outputs)
        else:
            out = broadcast_transfer(g, op, after)
        strat = plan.strategies[op_id]
        groups = strat.partial_groups(op.rule)
        for k, (v, m, b) in enumerate(zip(op.outputs, self._made_layouts(op, strat), out)):
            if m.partial or not b:
                continue
            mades.append((k, b))
            if boundary:
                continue  # (its result is a loop's or branch's: a new value)
            if m != sh[v]:
                b = kept_after(self.path(m, sh[v], v, groups, b), m, g.values[v].shape, self.mesh, b)
            if b:
                homes.append((v, b))
        return tuple(starts), tuple(mades), tuple(homes)

    def set_broadcasts(self, plan: Plan, needs: Mapping[tuple[int, int], Sharding],
                       changed: "tuple[set[int], set[int]] | None" = None) -> set[int]:
        """Take `plan`'s broadcasts (`broadcasts`); returns the ops whose chains they change.

        `changed`: (values whose sharding changed, ops whose strategy or needed operand layouts changed)
        since the plan of the last call: only those ops, and the ops reading a value whose broadcast dims
        they change, are recomputed (in program order; the same result as from scratch)."""
        if changed is None or self._bc_rec is None:
            return self._set_all_broadcasts(plan, needs)
        values, ops = changed
        pos, users = self._broadcast_index()
        heap = [pos[i] for i in ops if i in pos]
        for v in values:
            heap.extend(users.get(v, ()))
        heapq.heapify(heap)
        order, rec, home = self._bc_ops, self._bc_rec, self._bc_home
        bc_start, bc_made = self.bc_start, self.bc_made
        out: set[int] = set()
        for at in _in_order(heap):
            op_id = order[at]
            new = self._op_broadcasts(op_id, plan, needs, home, at)
            old = rec[at]
            if new == old:
                continue
            rec[at] = new
            if new[0] != old[0] or new[1] != old[1]:
                out.add(op_id)
                for i, _ in old[0]:
                    del bc_start[(op_id, i)]
                for k, _ in old[1]:
                    del bc_made[(op_id, k)]
                bc_start.update(((op_id, i), b) for i, b in new[0])
                bc_made.update(((op_id, k), b) for k, b in new[1])
            if new[2] != old[2]:
                was, now = dict(old[2]), dict(new[2])
                for v in was.keys() | now.keys():
                    if was.get(v) != now.get(v):
                        if v in now:
                            home[v] = now[v]
                        else:
                            del home[v]
                        for r in users.get(v, ()):
                            if r > at:
                                heapq.heappush(heap, r)
        return out

    def _set_all_broadcasts(self, plan: Plan, needs: Mapping[tuple[int, int], Sharding]) -> set[int]:
        home: dict[int, frozenset[int]] = {}
        rec = []
        self._broadcast_index()
        for at, op_id in enumerate(self._bc_ops):
            r = self._op_broadcasts(op_id, plan, needs, home, at)
            rec.append(r)
            home.update(r[2])
        start = {(op_id, i): b for op_id, r in zip(self._bc_ops, rec) for i, b in r[0]}
        made = {(op_id, k): b for op_id, r in zip(self._bc_ops, rec) for k, b in r[1]}
        changed = {k[0] for d, e in ((start, self.bc_start), (made, self.bc_made)) for k in d.keys() ^ e.keys()}
        changed |= {k[0] for d, e in ((start, self.bc_start), (made, self.bc_made)) for k in d.keys() & e.keys()
                    if d[k] != e[k]}
        self.bc_start, self.bc_made = start, made
        self._bc_rec, self._bc_home = rec, home
        return changed

    def _broadcast_index(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        """Op id -> its position in `_broadcast_ops`, and value -> the positions of the ops whose part of
        `broadcasts` reads its sharding or broadcast dims (operands, their canonical values, results); also
        value -> the position of the op making it (`_bc_maker`)."""
        if self._bc_pos is None:
            canon = self.info.canon
            users: dict[int, list[int]] = {}
            for at, op_id in enumerate(self._broadcast_ops()):
                op = self.graph.ops[op_id]
                for v in {*op.inputs, *(canon[u] for u in op.inputs), *op.outputs}:
                    users.setdefault(v, []).append(at)
                for v in op.outputs:
                    self._bc_maker.setdefault(v, at)
            self._bc_pos = {op_id: at for at, op_id in enumerate(self._bc_ops)}
            self._bc_users = users
        return self._bc_pos, self._bc_users

    def fixed_ps(self, c: Any, trips: int) -> int:
        """Picoseconds of collective `c`'s fixed costs over `trips` runs."""
        return int(round(collective_fixed(c, self.topology, self.mapping, self.mesh) * trips * PS))

    def phases(self, c: Any) -> tuple:
        hit = self._phase_memo.get(c)
        if hit is None:
            hit = self._phase_memo[c] = collective_phases(c, self.topology, self.mapping, self.mesh)
        return hit

    def collective_tasks(self, slot: Slot, colls: tuple, deps: tuple[int, ...], c: int, v: int, op: int,
                         trips: int) -> tuple[int, ...]:
        """Append to `slot` the per-level phases of `colls` on value `v` (canonical `c`), run one after the other
        from `deps`, and add their bytes to the slot's totals; returns the key the last phase makes (`deps`
        when there is none)."""
        name_of = self.graph.values[v].name
        for coll in colls:
            slot.payload[coll.kind] = slot.payload.get(coll.kind, 0) + coll.bytes * trips
            slot.xla_payload[coll.kind] = slot.xla_payload.get(coll.kind, 0) + coll.bytes
            if coll.kind == "all-reduce":
                slot.xla_flops += coll.bytes // self._itemsize[v]
            name = f"{coll.kind}({','.join(coll.axes)}) {name_of}"
            for ph in self.phases(coll):
                dur = int(round(ph.seconds * trips * PS))
                stream = self.comm_stream(ph.level)
                k = self.kid(("phase", c, len(slot.tasks), op))
                slot.tasks.append(Task(name, ph.kind, stream, dur, deps, (k,), op, ph.level, coll.kind))
                wk = (coll.kind, ph.level)
                slot.wire[wk] = slot.wire.get(wk, 0) + int(round(ph.bytes * trips))
                slot.comm_ps += dur
                deps = (k,)
        return deps

    def read_origin(self, op: Any, c: int, need: Sharding, planned: Sharding) -> int:
        """The origin of the key `op` reads canonical value `c` from at layout `need` (`Key`): HOME unless
        the read reshards it after a loop (EXIT) or inside a cond branch it was not made in."""
        if need is planned or need == planned:
            return HOME
        if loop_exit(op):
            return EXIT
        if self._scopes is None:
            self._scopes = branch_scopes(self.graph)
        return self._scopes.origin(op.id, c)

    def chain(self, slot: Slot, src_key: Key, steps: tuple, v: int, op: int, trips: int,
              origin: int | None = None) -> list[Key]:
        """Tasks taking value `v` from `src_key` through `steps` (a reshard path, or its tail); returns the
        keys of the layouts they make, one per step: the last is a home key (consumers read it), the others
        keep `src_key`'s origin (a later consumer whose path goes through one of them starts there, as the
        lowering reuses a layout it made of one traced value). `origin`: every key's origin instead."""
        c, _, src_origin = src_key
        final = HOME if origin is None else origin
        origin = src_origin if origin is None else origin
        val = self.graph.values[v]
        made: list[Key] = []
        deps = (self.kid(src_key),)
        src = src_key[1]
        for n, (layout, colls) in enumerate(steps):
            key = (c, layout, final if n == len(steps) - 1 else origin)
            src_id = deps[0]
            first = len(slot.tasks)
            copies = self._relayouts(v, src, layout, colls)
            if copies:  # (XLA:CPU) the operand copied into the gathered order
                deps = self._relayout_task(slot, v, *copies[0], deps, op, trips, "operand")
            deps = self.collective_tasks(slot, colls, deps, c, v, op, trips)
            if copies:  # ... and the gathered buffer back into row-major order
                deps = self._relayout_task(slot, v, *copies[1], deps, op, trips, "result")
            src = layout
            out = self.kid(key)
            if colls:
                slot.chained += (out,)
            slot.tasks.append(Task(f"{val.name} as {layout}", "join", -1, 0, deps, (out,), op))
            if len(colls) == 1 and colls[0].kind == "all-reduce" and len(slot.tasks) - first > 1:
                slot.ars += (ArEntry(first, len(slot.tasks) - first, colls[0].axes, colls[0].bytes, src_id, out,
                                     slot.tasks[first].name, self.graph.ops[op].region,
                                     self.fixed_ps(colls[0], trips)),)
            deps = (out,)
            made.append(key)
        return made

    def _relayouts(self, v: int, src: Sharding, dst: Sharding, colls: tuple) -> tuple:
        """On XLA:CPU, the copies around reshard step `src -> dst` of value `v` when its collectives all-gather a
        non-major dim (`shardc.cost.program.gather_relayouts`); none otherwise."""
        if self.topology.backend != "cpu" or not any(cl.kind == "all-gather" for cl in colls):
            return ()
        return gather_relayouts(src.dims, dst.dims, self.local_shape(v, src), self.local_shape(v, dst))

    def _relayout_task(self, slot: Slot, v: int, shape: tuple[int, ...], perm: tuple[int, ...],
                       deps: tuple[int, ...], op: int, trips: int, what: str) -> tuple[int, ...]:
        """A compute task copying value `v`'s local buffer of `shape` into memory order `perm` (an all-gather's
        relayout on XLA:CPU: `host_ops.relayout_seconds`); returns the key it makes."""
        dur = int(round(relayout_seconds(self.estimator, shape, self._dtype[v], perm) * trips * PS))
        k = self.kid(("phase", self.canon(v), len(slot.tasks), op))
        slot.tasks.append(Task(f"all-gather relayout ({what}) {self.graph.values[v].name}", "compute", 0, dur, deps,
                               (k,), op))
        slot.compute_ps += dur
        return (k,)

    def resume(self, c: int, steps: tuple, keys: Mapping[int, int], origin: int = HOME) -> int:
        """How many steps of a path from value `c`'s home layout are done: the furthest of its layouts some
        slot made already with keys of `origin` (0: none)."""
        if origin == EXIT:  # (one exit tie reads a carry: nothing to resume)
            return 0
        for n in range(len(steps) - 1, 0, -1):
            i = self.key_of.get(self.vkey((c, steps[n - 1][0], origin)))
            if i is not None and i in keys:
                return n
        return 0

    # -- slots ---------------------------------------------------------------------------------------
    def build_slot(self, plan: Plan, op_id: int, keys: dict[int, int],
                   needs: Mapping[tuple[int, int], Sharding]) -> Slot:
        """The slot of one op; registers the keys it makes in `keys` (key id -> owning slot).

        Memoised per op: a slot depends only on the layouts its operands are needed in and their home
        layouts, which of those keys earlier slots made already, the op's strategy and its results'
        layouts. A search goes back and forth between a few states, so most rebuilt slots are found here
        (the few last states of each op are kept; sealed slots are never modified)."""
        if op_id in self.dead:  # (removed by XLA's DCE in this plan: no tasks, no keys)
            return Slot(op_id, []).seal()
        canon_in = self._canon_in[op_id] if self._canon_in is not None else self._canon_inputs()[op_id]
        if canon_in is None:
            return self._build_slot(plan, op_id, keys, needs)
        op = self.graph.ops[op_id]
        sh = plan.shardings
        key_of = self.key_of
        state = []
        bc_start, empty = self.bc_start, frozenset()
        for i, (v, c) in enumerate(zip(op.inputs, canon_in)):
            need = needs.get((op_id, i), sh[v])
            origin = self.read_origin(op, c, need, sh[c])
            k = key_of.get(self.vkey((c, need, origin)))
            if k is not None and k in keys:
                state.append((need, sh[c]))  # (the home layout: whether the read is through a collective)
            elif self.info.constant[c] or self.info.constant[v]:
                state.append((need, None))
            else:
                h = key_of.get(self.vkey((c, sh[c], HOME)))
                b = bc_start.get((op_id, i), empty)
                done = self.resume(c, self.path(sh[c], need, v, (), b), keys, origin) if need != sh[c] else 0
                state.append((need, sh[c], h is not None and h in keys, done, b))
        made_b = tuple(self.bc_made.get((op_id, k), empty) for k in range(len(op.outputs)))
        mk = (tuple(state), plan.strategies[op_id], tuple([sh[v] for v in op.outputs]), made_b)
        if self.info.entered or self.info.named:  # (the layouts a loop-invariant operand was made from decide
            # where its reshards run: `entering_collectives`, `named_after_one_loop`)
            made_from = (e for c in canon_in for e in (self.info.entered.get(c), self.info.named.get(c)))
            mk += (tuple(sh[e] for e in made_from if e is not None),)
        dropped = self.drops.get(op_id, ())
        if dropped:
            mk += (dropped,)
        if op.primitive in OP_COLLECTIVES:
            mk += (self._shared_made(plan, op, needs, keys),)
        marks = self.gathered
        if marks:  # (operands whose buffer a collective writes: read from memory, `set_gathered`)
            mk += (tuple([c in marks for c in canon_in]),)
        memo = self._slot_memo.setdefault(op_id, {})
        slot = memo.get(mk)
        if slot is None:
            if len(memo) >= 6:
                memo.clear()
            slot = memo[mk] = self._build_slot(plan, op_id, keys, needs)
        else:
            for i in slot.made:
                keys[i] = op_id
        return slot

    def entering_collectives(self, plan: Plan, c: int) -> tuple[str, ...]:
        """The kinds of the collectives of the reshard taking loop-invariant value `c` into its loop from the
        enclosing forward loop's body (`ProgramInfo.entered`; () when none). XLA's loop-invariant code motion takes
        that reshard out of the enclosing loop. When it has no all-to-all, the reshards of `c` in the loop then leave
        that loop only (an all-gather or a collective-permute entering, seed 150007); when it has one, they leave
        every loop, like the entering reshard (seed 160010; measured with an all-to-all, a collective-permute and an
        all-gather inside, each leaving the outer loop too, `leaves_one_loop_only`'s slices included)."""
        src = self.info.entered.get(c)
        if src is None:
            return ()
        return tuple(k.kind for _, colls in self.path(plan.shardings[src], plan.shardings[c], c) for k in colls)

    def named_after_one_loop(self, plan: Plan, c: int) -> bool:
        """Whether loop-invariant value `c`, a hint's in a loop body (`ProgramInfo.named`), is made by a reshard that
        leaves the innermost loop only (`leaves_one_loop_only`): its own reshards cannot leave further."""
        src = self.info.named.get(c)
        if src is None:
            return False
        s = plan.shardings[src]
        return leaves_one_loop_only(self.path(s, plan.shardings[c], c), s, self.graph.values[c].shape,
                                    self._itemsize[c], self.mesh)

    def _made_layouts(self, op: Any, strat: Any) -> tuple[Sharding, ...]:
        """The layouts an op's strategy makes its results in (partial sums included), memoised over ops of
        one plan class (same rule and shapes) and strategy."""
        if self._plan_class is None:
            from shardc.plan import _plan_classes

            self._plan_class = _plan_classes(self.graph)
        mk = (self._plan_class[op.id], strat)
        hit = self._made_memo.get(mk)
        if hit is None:
            rule = op.rule
            partial = strat.partial_axes(rule)
            out = []
            for dims in rule.results:
                m = strat.tensor_sharding(rule, dims, self.mesh)
                out.append(Sharding(m.dims, partial) if partial else m)
            hit = self._made_memo[mk] = tuple(out)
        return hit

    def _canon_inputs(self) -> list:
        """Per op: its operands' canonical values, or None when the slot is not memoised (a dead op, an io
        tie, or two operands with one canonical value, whose keys interact within the slot). Mesh-independent:
        computed once per graph and ProgramInfo (the builders of a search's meshes share it)."""
        def compute() -> list:
            info, out = self.info, []
            for op in self.graph.ops:
                cs = tuple(info.canon[v] for v in op.inputs)
                ok = info.live[op.id] and not (op.primitive == "tie" and op.region == "io") \
                    and len(set(cs)) == len(cs) and not any((op.id, i) in info.unread for i in range(len(op.inputs)))
                out.append(cs if ok else None)
            return out

        self._canon_in = per_info(self.graph, "canon_inputs", self.info, compute)
        return self._canon_in

    def _build_slot(self, plan: Plan, op_id: int, keys: dict[int, int],
                    needs: Mapping[tuple[int, int], Sharding]) -> Slot:
        g, info = self.graph, self.info
        op = g.ops[op_id]
        slot = Slot(op_id, [])
        if op.primitive == "tie" and op.region == "io" \
                or not info.live[op_id] and not (info.duplicate[op_id] and planned_apart(plan, op, info.canon)):
            # (a duplicate CSE merges runs on its own where it is planned apart: bound again by the lowering)
            return slot.seal()
        trips = info.trips[op_id]
        trips_in, trips_out = info.reshard_trips[op_id]  # (reshards of values entering/leaving a loop: outside it)
        made_keys: list[int] = []
        kid = self.kid

        def made(key: Key) -> int:
            i = kid(key)
            keys[i] = op_id
            made_keys.append(i)
            return i

        def have(i: int, v: int, s: Sharding) -> int:
            """The key of value v (operand i) at sharding s, building a reshard chain from its home layout
            if needed."""
            c = self.canon(v)
            origin = self.read_origin(op, c, s, plan.shardings[c])
            want = (c, s, origin)
            k = kid(want)
            if k in keys:
                return k
            if info.constant[c] or info.constant[v]:  # folded by XLA: ready, in any layout, at the start
                slot.tasks.append(Task(f"constant {g.values[v].name}", "join", -1, 0, (), (k,), op_id))
                return made(want)
            home = (c, plan.shardings[c], HOME)
            if kid(home) not in keys:  # made by an op XLA drops: ready at the start
                slot.tasks.append(Task(g.values[v].name, "join", -1, 0, (), (kid(home),), op_id))
                made(home)
            steps = self.path(home[1], s, v, (), self.bc_start.get((op_id, i), frozenset()))
            n = self.resume(c, steps, keys, origin)
            src = (c, steps[n - 1][0], origin) if n else home
            runs = trips_in
            if (h := info.hoisted.get(c)) is not None:  # a loop-invariant value's: out of the loop(s)
                entering = self.entering_collectives(plan, c)
                one = "all-to-all" not in entering and (
                    bool(entering) or self.named_after_one_loop(plan, c)
                    or leaves_one_loop_only(steps[n:], src[1], g.values[v].shape, self._itemsize[v], self.mesh))
                runs = min(trips_in, h[2] if one else h[0])
            chained = self.chain(slot, src, steps[n:], v, op_id, runs, None if origin == HOME else origin)
            return [made(k) for k in chained][-1]

        deps = []
        need_shardings = []
        dropped = self.drops.get(op_id, ())  # (operands XLA's simplifier drops in this plan)
        for i, v in enumerate(op.inputs):
            need = needs.get((op_id, i), plan.shardings[v])
            need_shardings.append(need)
            if (op_id, i) not in info.unread and i not in dropped:
                deps.append(have(i, v, need))
        out_keys: list[Key] = []
        for v, m in zip(op.outputs, self._made_layouts(op, plan.strategies[op_id])):
            out_keys.append((self.canon(v), m, HOME if m == plan.shardings[v] else MADE))
        outs = tuple(kid(k) for k in out_keys)
        free = (op.primitive in FREE_PRIMITIVES or all(info.constant[self.canon(v)] for v in op.outputs)
                or op_id in info.bitcast and self._reads_dot_as_made(plan, op, need_shardings[0])
                or bool(dropped) or op_id in info.through)  # (XLA replaced the op by the operands it reads)
        own = NO_COLLECTIVES if free else self._own_collectives(plan, op, need_shardings)
        if own.before:  # the op's own collectives on its operands (shardc.cost.op_collectives)
            deps = self._before_tasks(slot, op, own, need_shardings, tuple(deps), keys, made, trips)
            free = free or own.instead
        after = own.after
        slot.at = len(slot.tasks)
        if free:
            slot.tasks.append(Task(op.primitive, "join", -1, 0, tuple(deps), outs, op_id))
        else:
            dur_s, count = self._op_cost(op, need_shardings, [k[1] for k in out_keys],
                                         self._gathered_reads(plan, op, need_shardings))
            if op_id in info.strided and not self._folded_into_dot(plan, op, need_shardings[0]):
                dur_s += info.strided[op_id] * self._strided_read(op, need_shardings[0])
            dur = int(round(dur_s * trips * PS))
            local = (self.kid(("local", self.canon(op.outputs[0]), len(slot.tasks), op_id)),) if after else outs
            slot.tasks.append(Task(op.primitive, "compute", 0, dur, tuple(deps), local, op_id))
            if after:  # the local results' collectives (an argmax's candidates), then the results
                done = self.collective_tasks(slot, after, local, self.canon(op.outputs[0]), op.outputs[0], op_id, trips)
                slot.tasks.append(Task(op.primitive, "join", -1, 0, tuple(done), outs, op_id))
            slot.compute_ps += dur
            slot.flops += int(round(count.flops)) * trips
            slot.transcendentals += int(round(count.transcendentals)) * trips
            slot.xla_flops += int(round(count.flops))
        for k in out_keys:
            made(k)
        groups = None  # (the strategy's partial groups: only a result resharded needs them)
        for n, (v, k) in enumerate(zip(op.outputs, out_keys)):
            want = plan.shardings[v]
            if k[1] != want and (info.constant[self.canon(v)] or enters_a_constant(op, info.constant)):
                # (folded by XLA: made in the layout wanted)
                made((k[0], want, HOME))
            elif k[1] != want and info.read[self.canon(v)]:  # (a result no one reads: its constraint is dead)
                if groups is None:
                    groups = plan.strategies[op_id].partial_groups(op.rule)
                path = self.path(k[1], want, v, groups, self.bc_made.get((op_id, n), frozenset()))
                for key in self.chain(slot, k, path, v, op_id, trips_out):
                    made(key)
        slot.made = tuple(made_keys)
        return slot.seal()

    def set_drops(self, plan: Plan, needs: Mapping[tuple[int, int], Sharding]) -> set[int]:
        """Take the operands XLA's simplifier drops in `plan` and the ops only they read (`drops`, `dead`);
        returns the ops whose drops or deadness differ from the previous plan's."""
        drops = plan_drops(self.graph, plan.shardings, plan.strategies, needs, self.mesh)
        dead = dead_ops(self.graph, drops)
        changed = {i for i in drops.keys() | self.drops.keys() if drops.get(i) != self.drops.get(i)}
        changed |= dead ^ self.dead
        self.drops, self.dead = drops, dead
        return changed

    def _before_tasks(self, slot: Slot, op: Any, own: OwnCollectives, needs: Sequence[Sharding],
                      deps: tuple[int, ...], keys: Mapping[int, int], made: Callable[[tuple], int], trips: int
                      ) -> list[int]:
        """Append the tasks of `own.before` (one after the other, from `deps`) to `slot`, but for the operand
        permutes an earlier slot made already (`shared_keys`), which the op reads instead; returns the keys the
        op's computation reads. `made` registers a key this slot makes."""
        chain, reused = deps, []
        unshared = (None,) * len(own.before)
        for coll, permute, key in zip(own.before, own.shared or unshared, self.shared_keys(op, own, needs) or unshared):
            if key is not None and self.kid(key) in keys:
                reused.append(self.kid(key))
                continue
            v = op.inputs[permute.operand if permute is not None else 0]
            chain = self.collective_tasks(slot, (coll,), chain, self.canon(v), v, op.id, trips)
            if key is not None:
                slot.tasks.append(Task(f"{coll.kind} (shared) {self.graph.values[v].name}", "join", -1, 0, chain,
                                       (self.kid(key),), op.id))
                chain = (made(key),)
        return list(chain) + reused

    def _shared_made(self, plan: Plan, op: Any, needs: Mapping[tuple[int, int], Sharding], keys: Mapping[int, int]
                     ) -> tuple[bool, ...]:
        """Which of the operand permutes `op` may share (`shared_keys`) earlier slots made already (part of its
        slot's memo key: the slot reads those instead of making them)."""
        need = [needs.get((op.id, i), plan.shardings[v]) for i, v in enumerate(op.inputs)]
        own = self._own_collectives(plan, op, need)
        return tuple(k is not None and self.kid(k) in keys for k in self.shared_keys(op, own, need))

    def shared_keys(self, op: Any, own: OwnCollectives, needs: Sequence[Sharding]) -> tuple[tuple | None, ...]:
        """Per collective of `own.before`, the key of the operand permute it is (`OperandPermute`: the operand's
        canonical value and layout as read, the device pairs, the computation it runs in), None for one no other
        op shares; empty when none is shared. A constant operand is no other op's: the lowering constrains it
        for each consumer apart (`shardc.lower.Lowering.constants_as_needed`), and XLA's partitioner reshards
        each such instruction on its own."""
        if not own.shared:
            return ()
        constant = self.info.constant
        return tuple(None if p is None or constant[v := op.inputs[p.operand]] or constant[self.canon(v)]
                     else ("permute", self.canon(v), self.layout(needs[p.operand]), p.pairs, op.region)
                     for p in own.shared)

    def _own_collectives(self, plan: Plan, op: Any, needs: Sequence[Sharding]) -> OwnCollectives:
        """The collectives `op` makes by itself (`shardc.cost.op_collectives`) with its operands as it reads
        them: as `needs` says, a constant in the layout its strategy needs (the lowering slices it so,
        `constants_as_needed`)."""
        if op.primitive not in OP_COLLECTIVES:
            return NO_COLLECTIVES
        canon, constant = self.info.canon, self.info.constant
        strat = plan.strategies[op.id]
        ins = [strat.tensor_sharding(op.rule, dims, self.mesh) if constant[canon[v]] and len(dims) == len(need.dims)
               else need for v, dims, need in zip(op.inputs, op.rule.operands, needs)]
        g = self.graph
        return op_collectives(op, ins, [g.values[v].shape for v in op.inputs], [self._itemsize[v] for v in op.inputs],
                              self.mesh, [self.bc_start.get((op.id, i), frozenset()) for i in range(len(op.inputs))])

    def _reads_dot_as_made(self, plan: Plan, op: Any, need: Sharding) -> bool:
        """Whether transpose `op` reads its dot's result in the layout the dot makes it (no reshard between
        them: in XLA the transpose's operand is the dot itself, which layout assignment can make it a
        bitcast of, `ProgramInfo.bitcast`)."""
        v = op.inputs[0]
        p = self.graph.values[self.canon(v)].producer
        made = self._made_layouts(self.graph.ops[p], plan.strategies[p])[0]
        return need == plan.shardings[v] == made

    def _folded_into_dot(self, plan: Plan, op: Any, need: Sharding) -> bool:
        """Whether XLA folds transpose `op` into the dot making its operand (the dot then writes its result in the
        transposed order): it reads the dot's result as the dot makes it, no collective between them."""
        p = self.graph.values[self.canon(op.inputs[0])].producer
        return (p is not None and self.graph.ops[p].primitive == "dot_general"
                and not rewritten_dot(self.graph.ops[p], self.graph)
                and self._reads_dot_as_made(plan, op, need))

    def _strided_read(self, op: Any, need: Sharding) -> float:
        """Seconds one loop fusion spends reading transpose `op`'s local operand across its memory order, beyond
        a read in order (the estimator's `strided_read_time`; estimators without one do not price it)."""
        timed = getattr(self.estimator, "strided_read_time", None)
        if timed is None:
            return 0.0
        v = op.inputs[0]
        return timed(self.local_shape(v, need), self._dtype[v], tuple(op.params["permutation"]))

    def set_gathered(self, plan: Plan, needs: Mapping[tuple[int, int], Sharding],
                     changed: "tuple[set[int], set[int]] | None" = None, ops: Collection[int] = ()) -> set[int]:
        """Take the values whose buffer in `plan` a collective writes (`gathered`); returns the ops reading a value
        whose mark changed. A collective's result is a buffer: an op reading it (or a local slice of it) reads it
        from memory, though XLA fuses the value's producer into the readers the value reaches without one.

        `changed` (as `set_broadcasts` takes it) and `ops` (whose broadcasts or drops changed): only the ops they
        touch are looked at again, and the aliases of a value whose mark changes (the same result as from
        scratch)."""
        marks = self.gathered
        if changed is None or marks is None:
            marks = set()
            for op in self.graph.ops:
                marks |= self._marked_results(plan, needs, op, marks)
            diff = marks ^ (self.gathered or set())
            self.gathered = marks
            return {u for c in diff for u in self._reading().get(c, ())}
        values, changed_ops = changed
        graph, canon = self.graph, self.canon
        heap = list(set(changed_ops) | set(ops))
        for v in values:
            if (p := graph.values[v].producer) is not None:
                heap.append(p)
            heap.extend(self._alias_readers().get(canon(v), ()))
        heapq.heapify(heap)
        out: set[int] = set()
        for i in _in_order(heap):
            op = graph.ops[i]
            new = self._marked_results(plan, needs, op, marks)
            for v in op.outputs:
                c = canon(v)
                if c != v or (c in new) == (c in marks):
                    continue
                (marks.add if c in new else marks.discard)(c)
                out.update(self._reading().get(c, ()))
                for u in self._alias_readers().get(c, ()):
                    heapq.heappush(heap, u)
        return out

    def _marked_results(self, plan: Plan, needs: Mapping[tuple[int, int], Sharding], op: Any,
                        marks: Collection[int]) -> set[int]:
        """The canonical results of `op` whose buffer a collective writes in `plan`: resharded by one where the op
        makes them, or (an alias: a hint, a tie) its operand read through one (`_read_gathered`)."""
        info, sh = self.info, plan.shardings
        if not info.live[op.id] or op.id in self.dead or not op.outputs:
            return set()
        through = op.id in self._alias_ops and self._read_gathered(
            plan, op.id, 0, op.inputs[0], needs.get((op.id, 0), sh[op.inputs[0]]), marks)
        made = self._made_layouts(op, plan.strategies[op.id])
        if not through and all(m == sh[v] for v, m in zip(op.outputs, made)):
            return set()  # (made where they live: no reshard of its own)
        out, groups = set(), None
        for n, (v, m) in enumerate(zip(op.outputs, made)):
            c = self.canon(v)
            if c != v or info.constant[c]:
                continue
            if not through:
                if m == sh[v]:
                    continue
                if groups is None:
                    groups = plan.strategies[op.id].partial_groups(op.rule)
                if not any(colls for _, colls in self.path(m, sh[v], v, groups,
                                                             self.bc_made.get((op.id, n), frozenset()))):
                    continue
            out.add(c)
        return out

    def _alias_readers(self) -> dict[int, tuple[int, ...]]:
        """Canonical value -> the alias ops (hints, ties) reading it: their results are its buffer."""
        def compute() -> dict[int, tuple[int, ...]]:
            aliases = self._alias_ops
            return {c: tuple(u for u in ops if u in aliases) for c, ops in self._reading().items()}

        return per_info(self.graph, "alias_readers", self.info, compute)

    @functools.cached_property
    def _alias_ops(self) -> frozenset[int]:
        """The alias ops (hints, ties) of the graph: their results are their operand's buffer."""
        return frozenset(op.id for op in self.graph.ops if (op.primitive in ALIASES or op.primitive == "tie")
                         and op.inputs)

    def _read_gathered(self, plan: Plan, op_id: int, i: int, v: int, need: Sharding, marks: Collection[int]) -> bool:
        """Whether operand `i` (value `v`) of op `op_id`, read in layout `need`, is read from a buffer a collective
        wrote: its value's (`marks`), or the one its own reshard to `need` makes."""
        c = self.canon(v)
        if self.info.constant[c] or self.info.constant[v]:
            return False
        if c in marks:
            return True
        home = plan.shardings[c]
        return need != home and any(
            colls for _, colls in self.path(home, need, v, (), self.bc_start.get((op_id, i), frozenset())))

    def _gathered_reads(self, plan: Plan, op: Any, needs: Sequence[Sharding]) -> tuple[bool, ...]:
        """Per operand of `op` in the layouts `needs`: read from a collective's buffer (`_read_gathered`)."""
        return tuple(self._read_gathered(plan, op.id, i, v, s, self.gathered)
                     for i, (v, s) in enumerate(zip(op.inputs, needs)))

    def _reading(self) -> dict[int, tuple[int, ...]]:
        """Canonical value -> the ops reading it (per graph and ProgramInfo)."""
        def compute() -> dict[int, tuple[int, ...]]:
            out: dict[int, list[int]] = {}
            for op in self.graph.ops:
                for v in op.inputs:
                    out.setdefault(self.info.canon[v], []).append(op.id)
            return {c: tuple(dict.fromkeys(ops)) for c, ops in out.items()}

        return per_info(self.graph, "reading", self.info, compute)

    def _op_cost(self, op: Any, ins: list[Sharding], outs: list[Sharding], gathered: tuple[bool, ...]
                 ) -> tuple[float, Any]:
        """Seconds and FLOP count of one op at these layouts, memoised over ops with the same primitive,
        params, shapes, dtypes and fusion (the layers of a model) and the same local shapes. `gathered`: per
        operand, whether it is read from a collective's result (from memory, `_read_gathered`)."""
        cls = self._cost_class.get(op.id)
        if cls is None:
            info = self.info
            fused, read, canon, vals = info.fused, info.read_fused, info.canon, self.graph.values
            ck = (op.primitive, info.pkeys[op.id], tuple(vals[v].shape for v in op.inputs + op.outputs),
                  tuple(self._dtype[v] for v in op.inputs + op.outputs),
                  tuple(read[canon[v]] for v in op.inputs), tuple(fused[canon[v]] for v in op.outputs))
            cls = self._cost_class[op.id] = self._cost_classes.setdefault(ck, len(self._cost_classes))
        mk = (cls, tuple([s.dims for s in ins]), tuple([s.dims for s in outs]), gathered)
        hit = self._cost_memo.get(mk)
        if hit is None:
            key = self._op_key(op, ins, outs, gathered)
            count = self._count_memo.get(key)
            if count is None:
                count = self._count_memo[key] = count_op(op.primitive, key.in_shapes, key.out_shapes, op.params,
                                                         self.topology.backend)
            bitcast = moves_no_data(op.primitive, op.params, key.in_shapes, key.out_shapes, key.in_dtypes,
                                    key.out_dtypes)
            hit = self._cost_memo[mk] = (0.0 if bitcast else self.estimator.op_time(key, op.params), count)
        return hit

    def _op_key(self, op: Any, ins: list[Sharding], outs: list[Sharding], gathered: tuple[bool, ...]) -> OpKey:
        info = self.info
        fused, read = info.fused, info.read_fused
        canon = info.canon
        return OpKey(op.primitive, info.pkeys[op.id],
                     tuple(self.local_shape(v, s) for v, s in zip(op.inputs, ins)),
                     tuple(self.local_shape(v, s) for v, s in zip(op.outputs, outs)),
                     tuple(self._dtype[v] for v in op.inputs), tuple(self._dtype[v] for v in op.outputs),
                     tuple(read[canon[v]] and not g for v, g in zip(op.inputs, gathered)),
                     tuple(fused[canon[v]] for v in op.outputs))


def _in_order(heap: list[int]) -> Iterator[int]:
    """Each index of min-heap `heap` once, smallest first, while the caller may push more (a pass in program
    order over the ops a change reaches)."""
    done = -1
    while heap:
        at = heapq.heappop(heap)
        if at != done:
            done = at
            yield at


def plan_needs(plan: Plan) -> dict[tuple[int, int], Sharding]:
    """(consumer op, operand index) -> the layout the consumer needs it in, from the plan's reshards (as
    lowered)."""
    return reshard_needs(plan.constrained)
