"""Per-device memory: arguments, outputs, donated buffers, and the peak of temporaries by liveness over the
order the compiled program runs its ops in.

Peak = arguments + outputs - aliased (outputs written into donated inputs) + peak temporaries, which is
how XLA's `memory_analysis()` accounts a compiled program. A temporary is a buffer made by one slot of the
simulation and read by later ones: an op's result in the layout its strategy makes (partial sums are
full-size), the result in its planned layout, each layout a reshard makes for consumers, and values the
backward pass keeps (activations live until their last reader). It lives from the position that makes it
to the last position that reads it, positions following `ProgramInfo.order` (XLA:CPU: breadth first, an
operand's reshards right after its producer, a collective reading a local slice after what the value made ready:
`_late`). Values XLA fuses into their readers, local slices fused into
elementwise readers and compile-time constants take no memory; what a fused value is computed from is read
where the value is materialised: by its readers' fusions, or by a collective reading it (`_read_end`). Loop
bodies are counted once (their buffers are reused across iterations); a loop holds the values it reads from
outside until its end, and its stacked outputs and carried values from its start (XLA:CPU: from the program's
start when a constant initialises them, `ProgramInfo.preset`). Some ops need buffers beyond their operands and
results where the backend expands them (`_workspace_of`), some collectives beyond their results (`fulls`,
`relayouts`), and some ops write a buffer wider than their result (`ProgramInfo.wide`: XLA:CPU's threefry words).

`update` recomputes only the buffers of the slots a delta simulation rebuilt; the peak is a prefix sum
over positions (numpy), so an update costs O(changed buffers) plus one vectorised pass, and the placement of
temporaries into output allocations (`in_outputs`) replays the previous one (`shardc/cost/first_fit.py`).
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from shardc.cost.first_fit import FirstFit
from shardc.cost.program import (CUMULATIVE, SAME_OPERAND_RULES, ProgramInfo, conv_output_copied, derived,
                                 descendants, fusible_on, gathered_order, is_loop_region, loop_entry, outer_region,
                                 per_info, rewritten_dot, scatter_into_constant, window_levels)

__all__ = ["MemoryModel", "MemoryResult", "gather_copy", "local_slice"]

COPIES_EARLY = True
LATE_AFTER_SLICES = True  # (switch: `_late`)
# Ops that are no instruction: their readers read what they read.
_PASS_THROUGH = frozenset({"shardc_hint", "sharding_constraint", "tie", "name", "optimization_barrier"})
# Ops XLA fuses into the dynamic-slice fusions of their result's local slices (`_into_result_slice`).
_FUSED_INTO_RESULT_SLICES = frozenset({"dynamic_update_slice"})
# XLA:CPU's threefry loop (a `ProgramInfo.wide` result: two 32-bit words per element) copies each of its two
# state arrays every iteration (copy insertion: the body reads the old words while it writes the new ones), so
# two buffers of 4 bytes per element live while the op runs (`state_copies`; measured: jax.random.uniform of
# N elements is 12 bytes per element of temporaries and an output buffer XLA puts one copy in, a dropout mask 16).
_STATE_WORD = 4
_STATE_COPIES = 2
_COLOCATED = -math.inf  # (`FirstFit` order of a buffer colocated with an output: before the others of its size)
_MIN_REUSE = 1024  # outputs smaller than this (a loss) are not worth looking for values to put in


@dataclasses.dataclass(frozen=True, slots=True)
class SlotMemory:
    """What one slot contributes to memory, computed once per slot (a sealed slot never changes)."""

    makes: dict[int, tuple[int, bool, tuple[int, ...]]]  # key id -> (position made, fused local slice, keys it slices)
    reads: dict[int, int]  # key id -> the last position the slot reads it at (fused values: `ProgramInfo.until`)
    workspace: tuple[tuple[int, int, int], ...]  # (first, last position, bytes) beyond operands and results
    reduced: dict[int, int]  # key id -> bytes of the all-reduced buffer it is a local slice of
    recomputed: frozenset[int]  # key ids the op recomputes from their operands rather than reads
    fused_reads: dict[int, int]  # key id the op's fused result is computed from -> its own last read of it, before
    # `until` extends it to where that result is materialised (`MemoryModel._read_end` decides per plan)
    relayouts: dict[int, tuple[int, int]]  # all-gathered key id -> (position, bytes) of its gathered layout before
    # XLA:CPU's relayout copy (`MemoryModel._gathers_of`)
    late: tuple[bool, ...] = ()  # per task: a reshard of a collective after a local slice (`MemoryModel._late`)


@dataclasses.dataclass(frozen=True)
class MemoryResult:
    arguments: int
    outputs: int
    aliased: int
    temp_peak: int
    peak_slot: int  # op index at which temporaries peak
    fresh_outputs: tuple[int, ...] = ()  # bytes of each output buffer the step allocates (not donated, not an input)

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temp_peak


def _union(masks: Iterable[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


class MemoryModel:
    """Buffers of one device over the slots of a simulation. `keys` resolves interned key ids to
    (canonical value, sharding, origin) triples and gives local shapes (the simulation's TaskBuilder)."""

    def __init__(self, graph: Any, info: ProgramInfo, mesh: Mapping[str, int], keys: Any) -> None:
        self.graph = graph
        self.info = info
        self._first_fit = FirstFit()  # (in_outputs' placement, replayed from the previous call's)
        self._colocated_keys: set[int] = set()  # key ids colocated with an output (`_into_outputs`)
        self._region_spans: dict[str, tuple[int, int]] = {}  # (`_region_span`)
        self._loop_bodies = frozenset(info.loop_buffer.values())  # (the values holding loops' state: `_holds_loop`)
        self._placing: tuple | None = None  # (limit, biggest, in place, pairs) `_buffer_ranges` last sorted for
        self._range_of: dict[int, tuple] = {}  # key id -> its range there
        self._sorted_ranges: list[tuple] = []
        self._dirty: set[int] = set()  # key ids `_set` recomputed since
        self._vbytes: dict[int, int] = {}  # key id -> `_value_bytes`
        self.mesh = dict(mesh)
        self.keys = keys
        self.n = len(graph.ops)
        self._inputs = {info.canon[v] for v in graph.inputs}
        self._outputs = {info.canon[v] for v in graph.outputs}
        # Two positions per slot: 2s while its operands' reshards and the op run, 2s+1 while the op's
        # results are resharded (the op's inputs may be freed by then).
        self.diff = np.zeros(2 * self.n + 1, dtype=np.int64)
        self.buffers: dict[int, tuple[int, int, int]] = {}  # key id -> (first, last position, bytes)
        self.owner: dict[int, tuple[int, int, bool]] = {}  # key id -> (slot, position) that makes it, fused slice
        self.readers: dict[int, dict[int, int]] = {}  # key id -> {slot: last position it reads the key}
        self._local: dict[int, int] = {}  # input/output value -> local bytes
        self.bounds: dict[int, tuple[int, int]] = {}  # key id -> (starts no earlier, ends no earlier) slots
        self.args = self.outs = self.alias = 0
        self.fresh_outs: tuple[int, ...] = ()
        self._planned: Sequence[Any] = ()  # the plan's sharding per value
        self.out_keys: dict[int, int] = {}  # key id counted with the outputs -> its output value
        self._alias = dict(info.out_alias)  # value -> the output a hint makes of it
        self.slices: dict[int, set[int]] = {}  # key id -> fused local slices of it (key ids)
        self.slice_src: dict[int, tuple[int, ...]] = {}  # fused local slice -> the keys it slices
        self._free_outs: list[tuple[int, int]] = []  # (bytes, value) of outputs not written into donated inputs
        self.ends_at: dict[int, set[int]] = {}  # position -> key ids of buffers whose last position it is
        self.fulls: dict[int, tuple[int, int, int]] = {}  # key id -> the all-reduced buffer it slices (`_set_full`)
        self.state_copies: dict[int, tuple[int, int]] = {}  # key id -> (position, bytes of each copy) (`_set`)
        self.relayouts: dict[int, tuple[int, int, int]] = {}  # key id -> its gathered layout before the copy (`_set`)
        self._ends: dict[int, int] = {}  # fused value -> where this plan materialises it last (`_value_end`; per run)
        self._walks: dict[int, tuple[int, ...]] | None = None  # value -> fused ops whose `_fused_end` visits it
        self.shares: dict[int, tuple[tuple[int, frozenset[int]], ...]] = {}  # op -> its results' in-place pairs
        self._slots: Sequence[Any] = ()  # the simulation's slots (the last full or delta run's)
        self._donated_to: list[tuple[int, int]] = []  # (donated input, the output written into it), canonical
        self._donated_ids: list[tuple[int, int]] = []  # the same pairs, as value ids (`_set_donated`)
        self._donated_outputs: frozenset[int] = frozenset()  # canonical outputs written into donated inputs
        self._io_donated: tuple[int, ...] | None = None  # the donated inputs `io` last computed for
        self._io_ids: frozenset[int] | None = None  # (`_io_values`)
        self._unused: frozenset[int] | None = None  # (`_unused_inputs`)
        self._merged: list[tuple[int, int]] = []  # per merged all-reduce: (bitmask of members, of their descendants)
        self._merged_dsts: list[tuple[int, ...]] = []  # per merged all-reduce: the key ids of its members' results
        self._merged_results: frozenset[int] = frozenset()  # all of those
        self._merged_of: Sequence[Any] | None = None  # the groups `_merged` is of
        self.order = info.order  # op -> its position in the compiled program's schedule
        self._op_at = [0] * self.n  # position -> op
        for op, i in enumerate(self.order):
            self._op_at[i] = op
        # Where a value's reshards run when XLA schedules them as soon as the value exists: right after the
        # op making it (the arguments' at the start).
        self._ready = [0] * len(graph.values)
        if info.eager:
            for v in graph.values:
                p = v.producer
                self._ready[v.id] = 2 * self.order[p] + 1 if p is not None and info.live[p] else 0

    def _bytes(self, kid: int) -> int:
        c, s, _ = self.keys.key_list[kid]
        if self.info.constant[c] or (self.info.fused[c] and kid not in self.keys.chain_keys):
            return 0
        return self._value_bytes(kid)

    def _set(self, kid: int) -> None:
        self._dirty.add(kid)
        old = self.buffers.pop(kid, None)
        if old is not None:
            s, e, b = old
            self.diff[s] -= b
            self.diff[e + 1] += b
            self.ends_at[e].discard(kid)
        for extra in (self.fulls, self.relayouts):
            old = extra.pop(kid, None)
            if old is not None:
                s, e, b = old
                self.diff[s] -= b
                self.diff[e + 1] += b
        self.out_keys.pop(kid, None)
        self.state_copies.pop(kid, None)
        owner = self.owner.get(kid)
        if owner is None:
            return
        if self._dropped(owner[0], kid):
            return  # (the operand's buffer: its reads last as long as this key's, `_read_end`)
        self._set_relayout(kid, owner[0])
        c, sharding, origin = self.keys.key_list[kid]
        o = self._output_of(c, sharding, origin)
        if o is not None:
            self.out_keys[kid] = o
            return  # counted with the arguments / outputs (other layouts of them are temporaries)
        b = 0 if owner[2] or self._into_result_slice(kid, owner[0]) or self._written_transposed(kid, owner[0]) \
            or (c in self.info.nested_buffers and self._made_by_op(kid, owner[0])) else self._bytes(kid)
        if b == 0:
            self._set_operand(kid, owner[1])
            if kid not in self.buffers:
                self._set_library_slice(kid, owner)
            return
        if c in self.info.wide and self._made_by_op(kid, owner[0]):
            elements = b // self.graph.values[c].dtype.itemsize
            b = elements * self.info.wide[c]
            self.state_copies[kid] = (owner[1], elements * _STATE_WORD)
        ends: dict[int, int] = {}  # reader -> its read end of `kid` (`_last_read`, `_sliced_last`)
        end = self._last_read(kid, owner[1], ends)
        loop = self.info.loop
        for k in self.slices.get(kid, ()):  # a local slice of it fused into its readers (loop fusions) reads it
            for r, pos in (self.readers.get(k) or {}).items():
                if loop and loop[r]:
                    end = max(end, self._read_end(k, r, pos))
        lo, hi = self.bounds.get(kid, (-1, -1))
        order = self.order
        # merged all-reduces: a member's operand lives until the merged all-reduce, its result from there; XLA writes
        # the result over the operand (the two never live at once) unless it flows into a donated input's buffer
        in_place = hi >= 0 and self._reduced_in_place(c)
        lo, hi = 2 * order[lo] + 1 if lo >= 0 else -1, 2 * order[hi] + 1 - in_place if hi >= 0 else -1
        start = max(owner[1], lo)
        dot = self._transposed_product(kid, owner[0])
        if dot is not None:  # (the dot writes it)
            start = min(start, dot)
        if end > start and self._sliced_last(kid, end, ends):
            end -= 1
        end = max(end, hi, start)
        full = self._positions(self._slots[owner[0]]).reduced.get(kid) if self._slots else None
        if full is not None:  # a slice of an all-reduced buffer
            end = self._set_full(kid, full, start, end, hi)
            if end < 0:
                return
        self._add_buffer(kid, start, end, b)

    def _add_buffer(self, kid: int, start: int, end: int, b: int) -> None:
        """Record key `kid`'s temporary buffer of `b` bytes, live from position `start` to `end`."""
        self.buffers[kid] = (start, end, b)
        self.diff[start] += b
        self.diff[end + 1] -= b
        self.ends_at.setdefault(end, set()).add(kid)

    def _set_library_slice(self, kid: int, owner: tuple[int, int, bool]) -> None:
        """Give fused value key `kid` a buffer where it is a local slice that library ops read (XLA:CPU): a dynamic
        slice fuses into loop fusions only, so for each dot or library reduction reading it (through hints) XLA makes
        a dynamic-slice fusion of its own, right where the slice is made (breadth first: after the value it slices),
        living until that reader runs (measured: a gathered value's slice read by a dot and a `reduce_sum` is two
        slice-sized buffers beside the gathered one). A reader that copies the operand anyway (`ProgramInfo.copies`)
        slices it in that copy."""
        if self.info.backend != "cpu" or not self._slots or self.info.constant[self.keys.key_list[kid][0]]:
            return
        slot = self._slots[owner[0]]
        made = next((i for i, t in enumerate(slot.tasks) if kid in t.outs), None)
        if made is None or made == slot.at or not self._local_slice(slot, made):
            return
        ends = self._library_reads(kid, 0)
        if not ends:
            return
        start, b = owner[1], self._value_bytes(kid) * len(ends)
        self._add_buffer(kid, start, max(max(ends), start), b)

    def _library_reads(self, kid: int, depth: int) -> list[int]:
        """The positions at which library ops (a dot XLA does not rewrite, an op of a library fusion) read key `kid`
        as an operand of their own, directly or through hints (free ops passing it on), each reader once."""
        out: list[int] = []
        for r, pos in (self.readers.get(kid) or {}).items():
            op = self.graph.ops[r]
            own = self._own_task(r)
            if own is None or kid not in own.deps:
                continue
            if op.primitive in _PASS_THROUGH and depth < 4:
                for k in own.outs:
                    if self.keys.is_value_key[k] and self.keys.key_list[k][0] != self.keys.key_list[kid][0]:
                        out += self._library_reads(k, depth + 1)
                continue
            if r in self.info.library or (op.primitive == "dot_general" and rewritten_dot(op, self.graph) is None):
                copied = self.info.copies[r] if self.info.copies else ()
                if not any(self.info.canon[op.inputs[i]] == self.keys.key_list[kid][0] for i in copied):
                    out.append(pos)
        return out

    def _reduced_in_place(self, c: int) -> bool:
        """Whether XLA:CPU's all-reduce of value `c` (a merged all-reduce's member) writes its result into the
        operand's buffer: it does unless an output computed from it is written into a donated input's buffer
        (measured on SGD and Adam steps of an MLP, data-parallel and Megatron: with no input donated each
        gradient's all-reduce is in place, and each donated weight adds one gradient-sized temporary). Inside a loop
        body it is not (measured: the merged all-reduce of a data-parallel gradient accumulation, and of a scanned
        model's backward loop, has its operands and its results live at once)."""
        p = self.graph.values[c].producer
        if p is not None and any(is_loop_region(r) for r in self.graph.ops[p].region.split("/")):
            return False
        if not self._donated_outputs:
            return True
        desc = descendants(self.graph, self.info.canon)[c]
        return not any(desc >> o & 1 for o in self._donated_outputs)

    def _into_result_slice(self, kid: int, op_id: int) -> bool:
        """Whether key `kid`, what a dynamic_update_slice's own task makes, is computed only into local slices of it
        (its reshards to its planned layout, and nothing else reads it): XLA fuses the update into the
        dynamic-slice fusion making each slice (measured: an update computed replicated and split on its result
        writes no full-size buffer), so it has none of its own."""
        if self.graph.ops[op_id].primitive not in _FUSED_INTO_RESULT_SLICES or not self._made_by_op(kid, op_id):
            return False
        if set(self.readers.get(kid, ())) != {op_id}:
            return False
        slot = self._slots[op_id]
        readers = [i for i in range(slot.at + 1, len(slot.tasks)) if kid in slot.tasks[i].deps]
        return bool(readers) and all(self._result_slice(slot, i) for i in readers)

    def _written_transposed(self, kid: int, op_id: int) -> bool:
        """Whether key `kid`, what a dot's own task makes, is computed transposed into the result of the transpose
        reading it (`ProgramInfo.transposed`: the plan reads the product in no other layout, the transpose reads
        it itself, and its result has a buffer: materialised, or resharded): it has no buffer of its own."""
        t = self.info.transposed.get(self.keys.key_list[kid][0]) if self.info.transposed else None
        if t is None or not self._made_by_op(kid, op_id) or set(self.readers.get(kid, ())) != {t}:
            return False
        own = self._own_task(t)
        return own is not None and kid in own.deps and any(
            self._bytes(k) or self._collective_operand(k) >= 0 and self._computed(k) for k in own.outs)

    def _transposed_product(self, kid: int, op_id: int) -> int | None:
        """Where the dot is that writes key `kid`, a transpose's own result, in its place (`_written_transposed`):
        its position, or None."""
        if (not self.info.transposed or self.graph.ops[op_id].primitive != "transpose"
                or not self._made_by_op(kid, op_id)):
            return None
        for d in self._own_task(op_id).deps:
            if not self.keys.is_value_key[d]:
                continue
            c = self.keys.key_list[d][0]
            dot = self.graph.values[c].producer
            if self.info.transposed.get(c) == op_id and dot is not None and self._written_transposed(d, dot):
                return self.owner[d][1]
        return None

    def _result_slice(self, slot: Any, i: int) -> bool:
        """Whether task `i` of a slot is a reshard of the op's result without collectives (a local slice of it)."""
        t = slot.tasks[i]
        return i > slot.at and t.kind == "join" and bool(t.deps) and all(self.keys.is_value_key[d] for d in t.deps)

    def _own_task(self, op_id: int) -> Any | None:
        """The task of op `op_id`'s slot that is the op itself (None: it has none, or no simulation ran)."""
        if not self._slots:
            return None
        slot = self._slots[op_id]
        return slot.tasks[slot.at] if slot.at < len(slot.tasks) else None

    def _dropped(self, op_id: int, kid: int | None = None) -> bool:
        """Whether op `op_id` is one XLA's simplifier replaced by an operand in this plan
        (`shardc.cost.dropped.plan_drops`: its own task is a join; `kid`: and it makes that key there), or by its
        operands whatever the plan (`ProgramInfo.through`): its results are that operand's buffer."""
        if self.graph.ops[op_id].primitive not in SAME_OPERAND_RULES and op_id not in self.info.through:
            return False
        own = self._own_task(op_id)
        return own is not None and own.kind == "join" and bool(own.deps) and (kid is None or kid in own.outs)

    def _made_by_op(self, kid: int, op_id: int) -> bool:
        """Whether key `kid` is what op `op_id`'s own task makes (not a reshard of its result)."""
        own = self._own_task(op_id)
        return own is not None and kid in own.outs

    def _set_operand(self, kid: int, made: int) -> None:
        """Record the buffer a collective reads fused value key `kid` from (`_collective_operand`): XLA computes the
        value into it (a fusion of its own) just before the collective's result is made, and it lives until the
        collective has read it."""
        c = self.keys.key_list[kid][0]
        if not self.info.fused[c] or self.info.constant[c]:
            return
        at = self._collective_operand(kid)
        if at < 0 or not self._computed(kid):
            return
        # (a local slice fused into an op that runs after this collective, which owns the key in program order: the
        # collective reads a slice of its own, a dynamic-slice fusion made just before it)
        start, b = (max(made, at - 1) if made <= at else max(at - 1, 0)), self._collective_read_bytes(kid)
        if made <= at and self._read_late(kid):  # (a slice of its own, made where it is, read late: `_late`)
            start = made
        op = self.graph.ops[self.owner[kid][0]]
        if scatter_into_constant(op, self.info.canon, self.info.constant) and self._made_by_op(kid, op.id):
            start = 0  # (a scatter XLA would move into the sum reading it but for this collective between them: it
            # writes into a broadcast of its constant operand, made at the start, `ProgramInfo.preset`)
        dot = self._transposed_product(kid, self.owner[kid][0])
        if dot is not None:  # (the dot writes it)
            start = min(start, dot)
        self._add_buffer(kid, start, at, b)

    def _computed(self, kid: int, depth: int = 0) -> bool:
        """Whether fused value key `kid` is computed (an op's fused result, or a local slice) rather than another
        buffer under a free op (a hint of an argument or of a collective's result): looks through free ops."""
        owner = self.owner.get(kid)
        if owner is None or not self._slots or depth > 8:
            return False
        flags, keys = self.keys.is_value_key, self.keys.key_list
        for t in self._slots[owner[0]].tasks:
            if kid not in t.outs:
                continue
            if t.kind != "join":
                return True
            same = [d for d in t.deps if flags[d] and keys[d][1] == keys[kid][1]]
            if not same:
                return bool(t.deps) and all(flags[d] for d in t.deps)  # a local slice (not a collective's result)
            return all(self._bytes(d) == 0 and self._output_of(*keys[d]) is None and self._computed(d, depth + 1)
                       for d in same)
        return False

    def _collective_operand(self, kid: int) -> int:
        """The last position where a collective reads key `kid` itself (a phase of it, or the relayout copy before
        it, reads the key), -1: none does. A collective reads its operand from memory."""
        last = -1
        for r, pos in (self.readers.get(kid) or {}).items():
            slot = self._slots[r] if self._slots else None
            if slot is None:
                continue
            for i, t in enumerate(slot.tasks[:slot.at]):
                if kid in t.deps and (t.collective or t.kind == "compute" and self._feeds_collective(slot, i)):
                    last = max(last, self._position(slot, i, kid, read=True, late=self._late(slot)[i]))
        owner = self.owner.get(kid)
        slot = self._slots[owner[0]] if owner is not None and self._slots else None
        if slot is not None:  # (the reshard of the op's own result to its planned layout)
            for i in range(slot.at + 1, len(slot.tasks)):
                if kid in slot.tasks[i].deps and slot.tasks[i].collective:
                    last = max(last, self._position(slot, i, kid, read=True, late=self._late(slot)[i]))
        return last

    def _collective_read_bytes(self, kid: int) -> int:
        """The bytes of fused value key `kid` XLA computes for the collectives reading it: all of it, but for a
        collective-permute only the local slice it sends where a loop fusion computes it (the slice of its destination
        layout: XLA fuses the value's computation into that dynamic slice; measured on flax lm1b's log-softmax gradient
        moved from [data, -, -] to [fsdp, data, -]: a [8, 64, 2048] `multiply_dynamic-slice_fusion`, not the
        [16, 128, 2048] product). A library fusion computes it whole — but a library fusion the program analysis
        grew through the hint of this collective (`_in_loop_fusion_here`) ends at it."""
        full = self._value_bytes(kid)
        p = self.graph.values[self.keys.key_list[kid][0]].producer
        while p is not None and self.graph.ops[p].primitive in _PASS_THROUGH and self.graph.ops[p].inputs:
            p = self.graph.values[self.graph.ops[p].inputs[0]].producer  # (a hint's value is what it names)
        if p is None or not self._in_loop_fusion_here(p):
            return full  # (a library fusion computes it whole)
        out = 0
        owner = self.owner.get(kid)
        for r in set(self.readers.get(kid) or ()) | ({owner[0]} if owner is not None else set()):
            slot = self._slots[r] if self._slots else None
            tasks = slot.tasks if slot is not None else ()
            for i, t in enumerate(tasks):
                if kid not in t.deps or not t.collective:
                    continue
                if t.collective != "collective-permute":
                    return full
                sent = next((o for u in tasks[i + 1:] if set(t.outs) & set(u.deps) for o in u.outs
                             if self.keys.is_value_key[o]), None)
                out = max(out, min(full, self._value_bytes(sent)) if sent is not None else full)
        return out or full

    def _in_loop_fusion_here(self, p: int) -> bool:
        """Whether op `p`'s result, read by a collective, is made in a loop fusion: an op of a loop fusion, or an
        elementwise op the plan-independent analysis put in a library fusion of a reduction after the collective.
        XLA:CPU's library rewriter runs after SPMD partitioning, so such a fusion cannot reach across the collective
        (measured: `sum(reshard(a * b + 1))` makes the product in a loop fusion with the slice a permute sends)."""
        info = self.info
        if p not in info.library:
            return bool(info.loop) and info.loop[p]
        return fusible_on(self.graph.ops[p], self.graph, info.backend)

    def _read_late(self, kid: int) -> bool:
        """Whether a collective that runs late (`_late`: it reads a local slice) reads key `kid`."""
        for r in self.readers.get(kid) or ():
            slot = self._slots[r] if self._slots else None
            if slot is not None and any(kid in t.deps and t.collective and late
                                        for t, late in zip(slot.tasks, self._late(slot))):
                return True
        return False

    def _value_bytes(self, kid: int) -> int:
        """Local bytes of key `kid`'s value in its layout, fused or not (memoised: a key id names one value and
        layout for good)."""
        n = self._vbytes.get(kid)
        if n is None:
            c, s, _ = self.keys.key_list[kid]
            v = self.graph.values[c]
            item = int(v.dtype.itemsize) if v.dtype is not None else 4
            n = self._vbytes[kid] = item * math.prod(-(-d // math.prod(self.mesh[a] for a in axes))
                                                     for d, axes in zip(v.shape, s.dims))
        return n

    def _sliced_last(self, kid: int, end: int, ends: dict[int, int] | None = None,
                     asked: frozenset[int] = frozenset()) -> bool:
        """Whether every read of key `kid` at position `end` is a local slice of its own (a dynamic-slice fusion,
        not fused into the op reading it) that a collective reads next: the slice is made before the
        collective's result exists, so `kid`'s buffer is free by then (the model makes both at one position). A
        free op reading it (a hint) passes the question on to its result's readers. `ends`: reader -> `_read_end`
        of `kid` known already (`_last_read`'s). `asked`: the keys whose question this one is part of (the ties of
        nested loops' carries pass a buffer around a cycle: a key asked again adds no reader of its own)."""
        if kid in asked:
            return True
        rs = self.readers.get(kid)
        if not rs or not self._slots:
            return False
        ends = {} if ends is None else ends
        at_end = [r for r, pos in rs.items() if self._read_end_of(ends, kid, r, pos) >= end]
        if not at_end:
            return False
        for r in at_end:
            slot = self._slots[r]
            for i, t in enumerate(slot.tasks):
                if kid not in t.deps:
                    continue
                if self._passes_on(slot, i):
                    if not all(self._sliced_last(o, end, asked=asked | {kid}) for o in t.outs):
                        return False
                elif self._fused_slice(slot, i) or not self._local_slice(slot, i) or not self._feeds_collective(slot, i):
                    return False
        return True

    def _last_read(self, kid: int, made: int, ends: dict[int, int] | None = None) -> int:
        """The last position a slot reads key `kid` at (`made` when none), not counting the slots that recompute
        it from its operands (`_recomputed_of`) unless a collective made it. `ends`: reader -> `_read_end` of `kid`,
        filled in for the readers counted (for `_sliced_last`)."""
        rs = self.readers.get(kid)
        if not rs:
            return made
        if not self._slots:
            return max(rs.values())
        skip = bool(self.info.recompute) and kid not in self.keys.chain_keys
        ends = {} if ends is None else ends
        return max((self._read_end_of(ends, kid, r, p) for r, p in rs.items()
                    if not (skip and kid in self._positions(self._slots[r]).recomputed)), default=made)

    def _read_end_of(self, ends: dict[int, int], kid: int, r: int, pos: int) -> int:
        """`_read_end(kid, r, pos)`, kept in `ends` (reader -> its read end of `kid`) for the next question about
        the same key (a plan's read ends do not change while its buffers are set)."""
        e = ends.get(r)
        if e is None:
            e = ends[r] = self._read_end(kid, r, pos)
        return e

    def _read_end(self, kid: int, r: int, pos: int) -> int:
        """Where slot `r`'s reads of key `kid` end, `pos` as `_reads_of` found them: for an op whose fused result is
        computed from `kid`, at the last place this plan materialises that result (`_fused_end`), not at
        `ProgramInfo.until`'s, which does not know the plan's collectives."""
        if self._dropped(r) and kid in self._own_task(r).deps:
            return self._dropped_read_end(r, pos)
        base = self._positions(self._slots[r]).fused_reads.get(kid) if self._slots else None
        if base is None:
            return pos
        return max(base, self._fused_end(r, self.keys.key_list[kid][0]))

    def _dropped_read_end(self, op_id: int, default: int) -> int:
        """Where the reads of an operand of op `op_id`, which XLA replaced by that operand (`_dropped`), end: where
        its results' reads end, as the op is gone and its readers read the operand's buffer (nothing is fused
        into it); `default` for a result nothing reads (an output) and when it has no result key."""
        outs = [o for o in self._own_task(op_id).outs if self.keys.is_value_key[o]]
        return max(self._last_read(o, default) for o in outs) if outs else default

    def _fused_end(self, op_id: int, c: int, own: bool = True) -> int:
        """The last position where what op `op_id` computes from canonical value `c` is materialised: where the
        op is when it materialises it itself, else where its fused results are (`_value_end`); a cheap result it
        materialises that readers recompute too (`ProgramInfo.fusing`) is materialised in both places — for the
        op's own reads (`own`), and for what it recomputes where a loop fusion makes it — as in `ProgramInfo.until`."""
        info = self.info
        at = 2 * self.order[op_id]
        last = -1
        for w in derived(self.graph.ops[op_id], c, info.canon):
            cw = info.canon[w]
            e = self._value_end(cw) if self._walks_into(cw, op_id, own) else -1
            last = max(last, (e if e >= 0 else at) if info.fused[cw] else max(at, e))
        return last

    def _walks_into(self, cw: int, op_id: int, own: bool) -> bool:
        """Whether the walk of `_fused_end` (and `_fused_tree`, which must visit what it visits) goes on from op
        `op_id` into the fusing readers of value `cw` it computes: a fused value's; a cheap materialised one's for the
        op's own reads (`own`), and also where a loop fusion makes it, its readers recomputing what it is computed
        from (not a library fusion's result, which they read)."""
        info = self.info
        return cw in info.fusing and (info.fused[cw] or own or op_id not in info.library)

    def _value_end(self, c: int) -> int:
        """The last position where something computed from value `c` is materialised, `c` being recomputed in the
        fusions of its readers (`ProgramInfo.fusing`): in each reader, where it materialises what it computes from
        `c` — unless it reads `c` only in layouts a collective made. A collective reads its operand from memory:
        XLA computes `c` into the collective's operand, and the reader reads the collective's result; so `c` is
        materialised into the collective's operand, just before the collective's result is made
        (`_collective_read`; the model makes both at one position, so one before). (-1: nowhere.)"""
        hit = self._ends.get(c)
        if hit is not None:
            return hit
        self._ends[c] = -1
        last = -1
        for w in self.info.fusing.get(c, ()):
            if self._dropped(w):  # (no fusion computes `c` there: the op's readers read the buffer it passes on)
                last = max(last, self._dropped_read_end(w, -1))
                continue
            cut = self._collective_read(w, c)
            last = max(last, max(cut - 1, 0) if cut >= 0 else self._fused_end(w, c, own=False))
        self._ends[c] = last
        return last

    def _collective_read(self, op_id: int, c: int) -> int:
        """Where the layouts of value `c` op `op_id` reads are made, when each is made by a collective or is a
        local slice of one a collective made (-1: the op reads a layout its fusion computes `c` into)."""
        slot = self._slots[op_id]
        if slot.at >= len(slot.tasks):
            return -1
        flags, keys = self.keys.is_value_key, self.keys.key_list
        made = [self._collective_made(d) for d in slot.tasks[slot.at].deps if flags[d] and keys[d][0] == c]
        return max(made) if made and min(made) >= 0 else -1

    def _collective_made(self, kid: int, depth: int = 0) -> int:
        """The position where key `kid` is made when a collective makes it, or a local slice makes it of a layout of
        the same value a collective made (-1: otherwise; a hint's result is another value, the buffer it aliases
        is read where the hint's readers read)."""
        owner = self.owner.get(kid)
        if owner is None:
            return -1
        if kid in self.keys.chain_keys:
            return self._sliced_from(kid, owner)
        flags, keys = self.keys.is_value_key, self.keys.key_list
        for t in self._slots[owner[0]].tasks if depth < 4 else ():
            if kid in t.outs:
                if t.kind != "join" or not t.deps or not all(flags[d] and keys[d][0] == keys[kid][0] for d in t.deps):
                    return -1
                made = [self._collective_made(d, depth + 1) for d in t.deps]
                return max(made) if min(made) >= 0 else -1
        return -1

    def _sliced_from(self, kid: int, owner: tuple[int, int, bool]) -> int:
        """Where a collective makes key `kid` (`owner`'s position), for what it is computed from: one after the local
        slice its chain starts with when the collective runs late (`_late`: the slice reads the value there)."""
        slot = self._slots[owner[0]]
        late = self._late(slot)
        for i, t in enumerate(slot.tasks[:slot.at]):
            if kid in t.outs and late[i]:
                return min(owner[1], self._ready[self.keys.key_list[kid][0]] + 1)
        return owner[1]

    def _walked(self) -> dict[int, tuple[int, ...]]:
        """Value -> the ops whose reads `_read_end` decides by walking through it (`_fused_end`): a change in the
        layouts of the value, or in who reads them, moves where those reads end. Plan- and mesh-independent: computed
        once per graph and ProgramInfo (the simulators of a search's meshes share it)."""
        if self._walks is None:
            self._walks = per_info(self.graph, "memory_walks", self.info, self._walks_of)
        return self._walks

    def _walks_of(self) -> dict[int, tuple[int, ...]]:
        """`_walked`'s table, computed."""
        info, out = self.info, {}
        for op in self.graph.ops:
            for c, _ in info.until[op.id] if info.until else ():
                for v in self._fused_tree(op.id, c):
                    out.setdefault(v, set()).add(op.id)
        return {v: tuple(sorted(ops)) for v, ops in out.items()}

    def _fused_tree(self, op_id: int, c: int) -> set[int]:
        """The values `_fused_end(op_id, c)` may visit."""
        info, seen = self.info, set()
        stack = [(op_id, c, True)]
        while stack:
            o, v, own = stack.pop()
            for w in derived(self.graph.ops[o], v, info.canon):
                cw = info.canon[w]
                if self._walks_into(cw, o, own) and cw not in seen:
                    seen.add(cw)
                    stack.extend((r, cw, False) for r in info.fusing[cw])
        return seen

    def _set_relayout(self, kid: int, owner: int) -> None:
        """Record the all-gathered layout XLA:CPU copies key `kid` from (`_gathers_of`), unless every reader fuses
        that copy: the copy is an elementwise instruction, which loop fusion fuses into readers emitted in loop
        fusions (reading `kid` directly or through a local slice fused into them), so they read the gathered
        buffer itself and no copy is made."""
        rel = self._positions(self._slots[owner]).relayouts.get(kid) if self._slots else None
        if rel is None or self._fused_everywhere(kid):
            return
        pos, n = rel
        self.relayouts[kid] = (pos, pos, n)
        self.diff[pos] += n
        self.diff[pos + 1] -= n

    def _fused_everywhere(self, kid: int) -> bool:
        """Whether every slot reading key `kid` reads it in a loop fusion: its op's (the op itself, or a local slice
        fused into it), or a local slice of its own (a dynamic-slice fusion, which reads any layout), or a dot or
        convolution that reads it only through its copy into another order (`_copied`: the relayout copy fuses into
        that transposing copy, one loop fusion reading the gathered buffer); a free op reading it (a hint) passes the
        question on to its result's readers."""
        rs = self.readers.get(kid)
        if not rs or not self.info.loop:
            return False
        c = self.keys.key_list[kid][0]
        for r in rs:
            slot = self._slots[r]
            for i, t in enumerate(slot.tasks):
                if kid not in t.deps or i == slot.at and (self.info.loop[r] or c in self._copied(r)) \
                        or self._local_slice(slot, i):
                    continue
                if not (self._passes_on(slot, i) and all(self._fused_everywhere(o) for o in t.outs)):
                    return False
        return True

    def _set_full(self, kid: int, full: int, start: int, end: int, hi: int) -> int:
        """Record the all-reduced buffer (`full` bytes) that key `kid` is a local slice of (`_reduced_of`): it lives
        until the slice is made, or, when readers emitted in loop fusions fuse the slice, until the last of
        them. Returns the last position of the slice's own buffer: the last read by a reader that does not fuse
        it (-1: none, the slice is never materialised)."""
        fused, other = start, -1
        for r, pos in (self.readers.get(kid) or {}).items():
            pos = self._read_end(kid, r, pos)
            slot = self._slots[r]
            if (self.info.loop[r] and slot.at < len(slot.tasks) and kid in slot.tasks[slot.at].deps
                    and not any(kid in t.deps for t in slot.tasks[:slot.at])):
                fused = max(fused, pos)
            else:
                other = max(other, pos)
        self.fulls[kid] = (start, fused, full)
        self.diff[start] += full
        self.diff[fused + 1] -= full
        return max(other, hi, start) if other >= 0 else -1

    def _recomputed_of(self, slot: Any) -> frozenset[int]:
        """Key ids the slot's op reads as cheap work it recomputes from that work's operands (`ProgramInfo.recompute`:
        XLA duplicates cheap producers into the loop fusions reading them): it reads them only where they are
        made, unless a collective made them."""
        rec = self.info.recompute
        if not rec or slot.at >= len(slot.tasks):
            return frozenset()
        flags, keys = self.keys.is_value_key, self.keys.key_list
        return frozenset(d for d in slot.tasks[slot.at].deps if flags[d] and (slot.op, keys[d][0]) in rec
                         and not any(d in t.deps for t in slot.tasks[:slot.at]))

    def _reduced_of(self, slot: Any) -> dict[int, int]:
        """Key id -> bytes of the all-reduced buffer it slices, for each all-reduce of the slot followed by a
        local slice (a backend without reduce-scatter, XLA:CPU: the partitioner all-reduces the whole value, then
        each device takes its part)."""
        out = {}
        for e in slot.ars:
            if self.keys.is_value_key[e.dst] and e.bytes > self._bytes(e.dst) > 0:
                out[e.dst] = e.bytes
        return out

    def _output_of(self, c: int, sharding: Any, origin: int) -> int | None:
        """The input or output whose buffer holds value `c` in layout `sharding` (None: a temporary): an input's or
        output's planned layout, or the output a hint makes of `c` in that output's layout
        (`ProgramInfo.out_alias`: what computes `c` writes the output)."""
        if origin != 0:
            return None
        if (c in self._inputs or c in self._outputs) and sharding == self._planned[c]:
            return c
        o = self._alias.get(c)
        return o if o is not None and sharding == self._planned[o] else None

    def _work(self, slot: Any, sign: int) -> None:
        for a, b, n in self._positions(slot).workspace:
            self.diff[a] += sign * n
            self.diff[b + 1] -= sign * n

    def _reads(self, slot: Any) -> dict[int, int]:
        """Key id -> the last position at which the slot reads it."""
        return self._positions(slot).reads

    def _makes(self, slot: Any) -> dict[int, tuple[int, bool, tuple[int, ...]]]:
        """Key id -> (the position at which the slot makes it, whether it is a slice fused into the op, what it
        slices)."""
        return self._positions(slot).makes

    def _positions(self, slot: Any) -> SlotMemory:
        """What a slot contributes to memory, computed once per slot (slots are not modified once sealed)."""
        cached = getattr(slot, "memory", None)
        if cached is None:
            late = tuple(self._late(slot))  # (once: the positions of the slot's reads and makes depend on it)
            reads, fused_reads = self._reads_of(slot, late)
            cached = SlotMemory(self._makes_of(slot, late), reads, self._workspace_of(slot), self._reduced_of(slot),
                                self._recomputed_of(slot), fused_reads, self._gathers_of(slot, late), late)
            try:
                slot.memory = cached
            except AttributeError:  # a slot type without the cache field
                pass
        return cached

    def _workspace_of(self, slot: Any) -> tuple[tuple[int, int, int], ...]:
        """Buffers (first, last position, bytes) an op needs beyond its operands and results where XLA's
        backend makes more of it (XLA:CPU only):

        * the last op of a library fusion reading a broadcast other readers share holds it, a buffer of its
          result's shape made as soon as the operand exists (`ProgramInfo.broadcasts`);
        * a select-and-scatter (a max pool's gradient) is expanded (SelectAndScatterExpander) into an s32
          iota of the operand's shape per dim (no operands: made at the start), a reduce-window over (operand,
          iotas) giving the value and index per dim of each window (as soon as the operand exists), the
          indices concatenated, and a scatter (the op) into zeros of the operand's shape (a broadcast, made
          at the start; the scatter writes its result in place);
        * a dot whose operand is not in a memory order the dot decomposition reads makes a transposed copy of
          it while it runs (`ProgramInfo.copies`);
        * a cumulative op (a cumsum) over more than 16 elements is computed from reduce-window levels
          (`window_levels`), made while it runs;
        * a convolution whose operands are not in the order XLA:CPU's convolution reads ([batch, spatial...,
          feature] and [spatial..., in, out]: a backward convolution's) reads transposed copies of them
          (`ProgramInfo.copies`), and one whose result is not in that order writes it in that order first and
          transposes it (`conv_output_copied`).

        (An all-gather's layout before its relayout copy is the gathered key's: `_gathers_of`, `_set_relayout`.)"""
        if self.info.backend != "cpu" or slot.at >= len(slot.tasks):
            return ()
        op = self.graph.ops[slot.op]
        task = slot.tasks[slot.at]
        keys = [self.keys.key_list[k] for k in task.deps if self.keys.is_value_key[k]]
        at = 2 * self.order[slot.op]
        out: list[tuple[int, int, int]] = []
        held = self.info.broadcasts.get(op.id, ()) if self.info.broadcasts else ()
        if held and task.outs:  # (`ProgramInfo.broadcasts`: a broadcast a library fusion shares with other readers)
            n = math.prod(self.keys.local_shape(op.outputs[0], self.keys.key_list[task.outs[0]][1]))
            for c in held:
                out.append((min(self._ready[c], at), at, int(self.graph.values[c].dtype.itemsize) * n))
        shared = False  # (whether the result is written over one of the copies already)
        for i in self.info.copies[op.id] if self.info.copies else ():  # the dot decomposition's operand copies
            if COPIES_EARLY and (op.id, i) not in self.info.copy_owner:
                continue
            c = self.info.canon[op.inputs[i]]
            s = next((s for k, s, _ in keys if k == c), None)
            if s is not None:
                start = min(self._copy_start(op.id, c), at) if COPIES_EARLY else at
                n = int(self.graph.values[c].dtype.itemsize) * math.prod(self.keys.local_shape(c, s))
                end = at
                if not shared and self._result_over_copy(op, task, c, n):
                    shared, end = True, at - 1  # (the result's buffer is this copy's from the dot on)
                if start <= end:
                    out.append((start, end, n))
        if op.primitive in CUMULATIVE and task.outs:  # (the reduce-window levels it is computed from)
            axis = int(op.params.get("axis", 0))
            levels = window_levels(int(self.graph.values[op.outputs[0]].shape[axis]))
            if levels:
                b = self._value_bytes(task.outs[0])
                out.append((at, at, b * levels // self.graph.values[op.outputs[0]].shape[axis]))
        if op.primitive == "conv_general_dilated" and task.outs and conv_output_copied(op, self.graph):
            out.append((at, at, self._bytes(task.outs[0])))  # the result in canonical order, before its transpose
        if op.primitive == "select_and_scatter_add" and len(keys) >= 2:
            (cs, ss, _), (co, so, _) = keys[:2]  # (source, operand)
            rank = len(self.graph.values[co].shape)
            n_in = math.prod(self.keys.local_shape(co, so))
            n_out = math.prod(self.keys.local_shape(cs, ss))
            ready = self._ready[co]
            item = int(self.graph.values[co].dtype.itemsize)
            out += [(0, ready, 4 * rank * n_in), (ready, ready, (item + 4 * rank) * n_out),
                    (min(ready + 1, at), at, 4 * rank * n_out), (0, at - 1, item * n_in)]
        return tuple(out)

    def _result_over_copy(self, op: Any, task: Any, c: int, n: int) -> bool:
        """Whether XLA:CPU writes dot `op`'s result (what its own `task` makes) over its copy of operand `c` (`n`
        bytes): the copy dies at the dot and has the result's dtype and size, so buffer assignment gives the two one
        buffer (measured: `einsum("bhqk,bkhd->bqhd", s, k)` with k's transposed copy of the result's [b, h, d, q]
        size, 9-14% over before; not where the result is no buffer of its own; a convolution's copies not measured)."""
        outs = [k for k in task.outs if self.keys.is_value_key[k]]
        if (op.primitive != "dot_general" or len(outs) != 1
                or self.graph.values[c].dtype != self.graph.values[op.outputs[0]].dtype):
            return False
        r = self.keys.key_list[outs[0]][0]
        return self._value_bytes(outs[0]) == n and not self.info.fused[r] and not self.info.constant[r]

    def _gathers_of(self, slot: Any, late: Sequence[bool]) -> dict[int, tuple[int, int]]:
        """Key id -> (position, bytes) of each all-gather of a slot's reshards that XLA:CPU writes in a layout with
        the gathered dim most major and then copies into the row-major one (when a dim before the gathered one has
        more than one element): the gathered buffer before its copy, made next (whether the copy is a buffer of
        its own depends on the key's readers: `_set_relayout`). Not for a loop's carried state (a hint or tie
        making it): the loop state keeps the gathered layout, the copy is made where it is read. `late`: the slot's
        `_late`."""
        op = self.graph.ops[slot.op]
        if self.info.backend != "cpu" or (op.primitive in _PASS_THROUGH
                                          and any(self.info.canon[v] in self.info.carried for v in op.outputs)):
            return {}
        flags, keys = self.keys.is_value_key, self.keys.key_list
        out = {}
        for i, t in enumerate(slot.tasks):
            if t.kind != "join" or len(t.deps) != 1 or flags[t.deps[0]] or not t.outs or not flags[t.outs[0]]:
                continue
            j, dep, kinds = i - 1, t.deps[0], set()
            # back through this step's collective phases to its operand (a layout: the step before is another's)
            while j >= 0 and dep >= 0 and not flags[dep] and dep in slot.tasks[j].outs:
                kinds.add(slot.tasks[j].collective)
                dep = slot.tasks[j].deps[0] if slot.tasks[j].deps else -1
                j -= 1
            if "all-gather" not in kinds or dep < 0 or not flags[dep]:
                continue
            c, src, _ = keys[dep]
            dst = keys[t.outs[0]][1]
            if gathered_order(src.dims, dst.dims, self.keys.local_shape(c, dst)) is not None:
                out[t.outs[0]] = (self._position(slot, i, t.outs[0], late=late[i]), self._bytes(t.outs[0]))
        return out

    def _shares_of(self, slot: Any) -> tuple[tuple[int, frozenset[int]], ...]:
        """(result key, canonical values whose buffer it may take) of a slot's op (`ProgramInfo.inplace`): the
        key its computation writes."""
        cands = self.info.inplace[slot.op] if self.info.inplace else ()
        if not cands or slot.at >= len(slot.tasks):
            return ()
        c = self.info.canon[self.graph.ops[slot.op].outputs[0]]
        flags, keys = self.keys.is_value_key, self.keys.key_list
        return tuple((k, frozenset(cands)) for k in slot.tasks[slot.at].outs if flags[k] and keys[k][0] == c)

    def _share_pairs(self) -> dict[int, int]:
        """Result key id -> the operand key id whose buffer it is written over (`_shares_of`): the operand's buffer
        ends where the result's begins, with the same layout and size; each buffer taken once. A dot's result XLA
        computes in another shape (`ProgramInfo.reshaped_dots`) is taken only as a reshard's buffer, not the dot's."""
        out: dict[int, int] = {}
        taken: set[int] = set()
        keys, reshaped = self.keys.key_list, self.info.reshaped_dots
        for op, pairs in self.shares.items():
            for k, cands in pairs:
                bk = self.buffers.get(k)
                if bk is None:
                    continue
                for j in sorted(self.ends_at.get(bk[0], ())):
                    bj = self.buffers[j]
                    c = keys[j][0]
                    if (j != k and j not in taken and bj[2] == bk[2] and c in cands and keys[j][1] == keys[k][1]
                            and not ((op, c) in reshaped and self._made_by_op(j, self.graph.values[c].producer))):
                        taken.add(j)
                        out[k] = j
                        break
        return out

    def _shared(self, pairs: Mapping[int, int], skip: set[int]) -> dict[int, int]:
        """Position -> bytes of results written over an operand's temporary buffer there (`_share_pairs`; `skip`:
        key ids of buffers placed in other allocations, where the two are one buffer already)."""
        out: dict[int, int] = {}
        for k, j in pairs.items():
            if k not in skip and j not in skip:
                s, _, b = self.buffers[k]
                out[s] = out.get(s, 0) + b
        return out

    def _copied(self, op_id: int) -> frozenset[int]:
        """Canonical values dot `op_id` reads only through the dot decomposition's copies of them (its reads of
        the value itself end where the copy is made)."""
        if not COPIES_EARLY or not self.info.copies or not self.info.copies[op_id]:
            return frozenset()
        op, canon, idx = self.graph.ops[op_id], self.info.canon, self.info.copies[op_id]
        return frozenset(canon[op.inputs[i]] for i in idx) - {canon[v] for j, v in enumerate(op.inputs) if j not in idx}

    def _copy_start(self, dot: int, c: int) -> int:
        """Where the breadth-first schedule makes dot `dot`'s copy of value `c`: where the queue runs the copy's
        instruction (`ProgramInfo.copied_at`: after what was queued before it, not always as soon as `c` exists);
        else (inside a loop body) as soon as `c` exists, or, when `c` is cheap elementwise work, with `c` itself
        (the copy is a fusion recomputing it)."""
        before = self.info.copied_at.get((dot, c)) if self.info.copied_at else None
        if before is not None:
            return 2 * before + 1
        p = self.graph.values[c].producer
        if p is not None and self.info.eager and c in self.info.cheap:
            return 2 * self.order[p]
        return self._ready[c]

    def _passes_on(self, slot: Any, i: int) -> bool:
        """Whether task `i` of a slot is a free op's own join (a hint): its results are the buffer it reads."""
        t = slot.tasks[i]
        return i == slot.at and t.kind == "join" and bool(t.outs) and all(self.keys.is_value_key[o] for o in t.outs)

    @staticmethod
    def _feeds_collective(slot: Any, i: int) -> bool:
        """Whether the next task of a slot's operand reshards is a collective reading what task `i` makes."""
        nxt = slot.tasks[i + 1] if i + 1 < slot.at else None
        return nxt is not None and bool(nxt.collective) and bool(set(slot.tasks[i].outs) & set(nxt.deps))

    def _local_slice(self, slot: Any, i: int) -> bool:
        return local_slice(slot, i, self.keys.is_value_key)

    def _fused_slice(self, slot: Any, i: int) -> bool:
        """Whether task `i` of a slot is a reshard without collectives (a local slice of its operand) that XLA
        fuses into the op reading it (an elementwise-like op in a loop fusion): no buffer of its own."""
        return bool(self.info.loop[slot.op]) and self._local_slice(slot, i)

    def _late(self, slot: Any) -> Sequence[bool]:
        """Per task of a slot: whether it is one of the operands' reshards that belongs to a collective reading a
        local slice (one of this slot's reshard, or a layout another slot made, which this chain resumes from) or
        a copy the schedule queues (`ProgramInfo.queued_at`), or to what follows it (False for the op's own task
        and its results' reshards). XLA:CPU's breadth-first schedule queues such a collective when the slice (a
        dynamic-slice fusion) or the copy runs, so it runs after what became ready with the value, not with it
        (`_position`)."""
        cached = getattr(slot, "memory", None)
        if cached is not None:
            return cached.late
        flags, keys, planned = self.keys.is_value_key, self.keys.key_list, self._planned
        sliced: set[int] = set()
        out: list[bool] = []
        for i, t in enumerate(slot.tasks[:slot.at]):
            if self._local_slice(slot, i):
                sliced.update(t.outs)
                out.append(False)
                continue
            resumed = any(flags[d] and d not in sliced and planned and keys[d][2] == 0
                          and self.keys.layout(planned[keys[d][0]]) != keys[d][1] for d in t.deps)
            resumed = resumed or self._queued_copy(slot, i)
            late = bool(t.collective or t.kind == "compute") and resumed or any(d in sliced for d in t.deps)
            if late:
                sliced.update(t.outs)
            out.append(late)
        return out + [False] * (len(slot.tasks) - len(out))

    def _queued_copy(self, slot: Any, i: int) -> bool:
        """Whether task `i` of a slot is the copy of an operand into its all-gather's order that the schedule
        queues as an instruction of its own (`ProgramInfo.queued_at`, `shardc.sim.queued`)."""
        return bool(self.info.queued_at) and gather_copy(slot, i, self.keys.is_value_key) \
            and (slot.op, self.keys.key_list[slot.tasks[i].deps[0]][0]) in self.info.queued_at

    def _position(self, slot: Any, i: int, kid: int, read: bool = False, late: bool = False) -> int:
        """Where task `i` of a slot reads or makes value key `kid`: with its op (2 * position in the schedule),
        after it (+1: the results' reshards), or, for the operands' reshards under an eager schedule, where
        the resharded value is made — a collective reading a local slice (`late`, `_late`) after what the
        value's maker made ready (`ProgramInfo.batch`), but not after the instruction reading its result (the
        op, or a hint's first reader: `first_reader`). A loop reads a value made outside it until its last
        iteration, and writes its stacked outputs and the values it carries into buffers that exist from its first."""
        op = slot.op
        first, last = self.info.span[op]
        c = self.keys.key_list[kid][0]
        if first != last and read and self._enters_loop_buffer(op, c):
            return 2 * self.order[first]  # (read once, entering the loop: its state's buffer is made from it)
        if first != last and c in self.info.hoisted_work:
            # (computed before its loop by loop-invariant code motion, a loop operand: alive through the loop)
            lo, hi = self._region_span(self.graph.ops[self.graph.values[c].producer].region)
            return 2 * self.order[hi] + 1 if read else 2 * self.order[lo]
        hoisted = self.info.hoisted.get(c)
        if first != last and hoisted is not None and hoisted[0] < self.info.trips[op]:
            # a loop-invariant value: XLA moves its reshards out of the loop (made before it: as soon as the
            # value outside exists under an eager schedule), and their results live through it
            if read:
                return 2 * self.order[last] + 1
            if i < slot.at:
                return self._ready[hoisted[1]] if self.info.eager else 2 * self.order[first]
        if first != last:  # inside a loop or branch region
            if read:
                p = self.graph.values[self.keys.key_list[kid][0]].producer
                if p is None or self.info.span[p] != (first, last):
                    return 2 * self.order[last] + 1
            elif (self.graph.ops[op].primitive == "scan_stack"
                  or self.keys.key_list[kid][0] in self.info.carried):
                return 0 if self.keys.key_list[kid][0] in self.info.preset else 2 * self.order[first]
        if i < slot.at and self.info.eager and not self._fused_slice(slot, i):
            c = self.keys.key_list[kid][0]
            p = self.graph.values[c].producer
            if not late or not LATE_AFTER_SLICES or not self.info.batch or p is None or not self.info.live[p]:
                return self._ready[c]
            limit = self.info.first_reader[op] if self.graph.ops[op].primitive in _PASS_THROUGH else self.order[op]
            after = self.info.queued_at.get((op, c), self.info.batch[p])  # (what runs before the collective)
            return max(self._ready[c], min(2 * after + 1, 2 * limit))
        if not read and i == slot.at and self.keys.key_list[kid][0] in self.info.preset:
            return 0  # written in place into a buffer made at the start (`ProgramInfo.preset`)
        return 2 * self.order[op] + (i > slot.at)

    def _region_span(self, region: str) -> tuple[int, int]:
        """The first and last live op of loop or branch region `region` (nested ones in it included), in `order`."""
        span = self._region_spans.get(region)
        if span is None:
            ops = [op.id for op in self.graph.ops if self.info.live[op.id]
                   and (op.region == region or op.region.startswith(region + "/"))]
            span = self._region_spans[region] = (min(ops, key=self.order.__getitem__),
                                                  max(ops, key=self.order.__getitem__))
        return span

    def _enters_loop_buffer(self, op_id: int, c: int) -> bool:
        """Whether op `op_id` reads canonical value `c` only as the initial state of a loop it is in (through an
        `at="in"` tie), a state the loop keeps in a buffer of its own (`ProgramInfo.loop_buffer`): the body reads
        that buffer, so `c` is read once, entering the loop."""
        op = self.graph.ops[op_id]
        regions = self._loop_inits.get(c)
        if not regions or not any(op.region == r or op.region.startswith(r + "/") for r in regions):
            return False
        return op.primitive == "tie" or c not in {self.info.canon[v] for v in op.inputs}

    @functools.cached_property
    def _loop_inits(self) -> dict[int, tuple[str, ...]]:
        """Canonical initial value -> the regions of the loops whose buffered state it initialises."""
        out: dict[int, tuple[str, ...]] = {}
        for op in self.graph.ops:
            if loop_entry(op) and self.info.canon[op.outputs[0]] in self.info.loop_buffer:
                c = self.info.canon[op.inputs[0]]
                out[c] = out.get(c, ()) + (op.region,)
        return out

    def _reads_of(self, slot: Any, late: Sequence[bool]) -> tuple[dict[int, int], dict[int, int]]:
        """The last position a slot reads each key at, and, for the keys its reads of which `until` extends, its
        own last read of them. An op whose results are fused into their readers reads its operands (and the
        operands of local slices fused into it) wherever a value computed from them is materialised
        (`ProgramInfo.until`, independent of the plan: `_read_end` decides per plan). `late`: the slot's `_late`."""
        flags = self.keys.is_value_key
        until = dict(self.info.until[slot.op]) if self.info.until else {}
        copied = self._copied(slot.op)
        out: dict[int, int] = {}
        plain: dict[int, int] = {}  # the reads without `until`
        extended: set[int] = set()
        for i, t in enumerate(slot.tasks):
            fused_in = until and (i == slot.at or self._fused_slice(slot, i))
            for d in t.deps:
                if flags[d]:
                    pos = self._position(slot, i, d, read=True, late=late[i])
                    c = self.keys.key_list[d][0]
                    if i == slot.at and c in copied:  # the dot reads its copy
                        pos = min(pos, self._copy_start(slot.op, c))
                    plain[d] = max(plain.get(d, -1), pos)
                    if fused_in and until.get(c, -1) >= 0:
                        extended.add(d)
                        pos = max(pos, 2 * self.order[until[c]])
                    out[d] = max(out.get(d, -1), pos)
        return out, {d: plain[d] for d in extended}

    def _makes_of(self, slot: Any, late: Sequence[bool]) -> dict[int, tuple[int, bool, tuple[int, ...]]]:
        """Key id -> (the position a slot makes it at, whether it is a local slice fused into the op, the keys it
        slices); `late`: the slot's `_late`."""
        flags = self.keys.is_value_key
        out: dict[int, tuple[int, bool, tuple[int, ...]]] = {}
        for i, t in enumerate(slot.tasks):
            for k in t.outs:
                if flags[k] and k not in out:
                    fused = self._fused_slice(slot, i)
                    out[k] = (self._position(slot, i, k, late=late[i]), fused,
                              tuple(t.deps) if fused else ())
        return out

    def full(self, plan: Any, slots: Sequence[Any], donated: Sequence[int] = (),
             bounds: Mapping[int, tuple[int, int]] | None = None, groups: Sequence[Any] = ()) -> None:
        """`bounds`: buffers merged collectives hold longer (key id -> (start no earlier, end no earlier));
        `groups`: the merged all-reduces (`shardc.sim.combine.Group`)."""
        self.bounds = dict(bounds or {})
        self._slots = slots
        self._set_merged(groups)
        self._set_donated(plan, donated)
        self._planned = plan.shardings
        self._placing = None
        self.diff[:] = 0
        self.buffers.clear()
        self.owner.clear()
        self.out_keys.clear()
        self.readers.clear()
        self.slices.clear()
        self.slice_src.clear()
        self.ends_at.clear()
        self.fulls.clear()
        self.relayouts.clear()
        self.state_copies.clear()
        self.shares.clear()
        self._ends.clear()
        for s in slots:
            pairs = self._shares_of(s)
            if pairs:
                self.shares[s.op] = pairs
            for k, (pos, free, srcs) in self._makes(s).items():
                if k not in self.owner:
                    self.owner[k] = (s.op, pos, free)
                    if srcs:
                        self.slice_src[k] = srcs
                    for d in srcs:
                        self.slices.setdefault(d, set()).add(k)
            for k, pos in self._reads(s).items():
                self.readers.setdefault(k, {})[s.op] = pos
        for k in self.owner:
            self._set(k)
        for sl in slots:
            self._work(sl, 1)
        self._local.clear()
        self.io(plan, donated, None)

    def update(self, plan: Any, slots: Sequence[Any], affected: Sequence[int], old_slots: Mapping[int, Any],
               donated: Sequence[int] = (), values: Iterable[int] = (),
               bounds: tuple[Mapping[int, tuple[int, int]], Mapping[int, tuple[int, int]]] | None = None,
               groups: Sequence[Any] = ()) -> None:
        """Recompute the buffers of rebuilt slots (and of keys whose `bounds` changed: (before, after))."""
        touched: set[int] = set()
        self._planned = plan.shardings
        self._slots = slots
        self._set_merged(groups)
        if self._set_donated(plan, donated, values):  # (which all-reduces are in place changed: their operands' too)
            touched.update(k for k, (_, hi) in self.bounds.items() if hi >= 0)
        if bounds is not None:
            before, after = bounds
            touched.update(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            self.bounds = dict(after)
        for i in affected:
            old = old_slots[i]
            self._work(old, -1)
            self._work(slots[i], 1)
            for k, (_, _, srcs) in self._makes(old).items():
                if self.owner.get(k, (None,))[0] == i:
                    del self.owner[k]
                    touched.add(k)
                    for d in self.slice_src.pop(k, ()):
                        self.slices.get(d, set()).discard(k)
                        touched.add(d)
            for k in self._reads(old):
                rs = self.readers.get(k)
                if rs is not None:
                    rs.pop(i, None)
                touched.add(k)
        for i in affected:
            new = slots[i]
            pairs = self._shares_of(new)
            if pairs:
                self.shares[i] = pairs
            else:
                self.shares.pop(i, None)
            for k, (pos, free, srcs) in self._makes(new).items():
                if k not in self.owner:
                    self.owner[k] = (i, pos, free)
                    touched.add(k)
                    if srcs:
                        self.slice_src[k] = srcs
                    for d in srcs:
                        self.slices.setdefault(d, set()).add(k)
                        touched.add(d)
            for k, pos in self._reads(new).items():
                self.readers.setdefault(k, {})[i] = pos
                touched.add(k)
        touched |= self._walking(touched)
        for k in list(touched):  # a fused slice's readers read what it slices
            touched.update(self.slice_src.get(k, ()))
        touched |= self._passed_on(touched, slots)
        touched |= self._aliases(touched, slots)
        touched |= self._transposes_of(touched, slots)
        self._ends.clear()
        for k in touched:
            self._set(k)
        self.io(plan, donated, values)

    def _passed_on(self, touched: Iterable[int], slots: Sequence[Any]) -> set[int]:
        """The keys free ops (hints) read to make any of `touched`, transitively: their result's readers decide
        whether a relayout copy of them is made and where they are free (`_fused_everywhere`, `_sliced_last`)."""
        out: set[int] = set()
        todo = list(touched)
        while todo:
            k = todo.pop()
            owner = self.owner.get(k)
            if owner is None:
                continue
            slot = slots[owner[0]]
            if slot.at >= len(slot.tasks) or slot.tasks[slot.at].kind != "join" or k not in slot.tasks[slot.at].outs:
                continue
            for d in slot.tasks[slot.at].deps:
                if self.keys.is_value_key[d] and d not in out:
                    out.add(d)
                    todo.append(d)
        return out

    def _aliases(self, touched: Iterable[int], slots: Sequence[Any]) -> set[int]:
        """The keys free ops (hints) make of any of `touched` in the same layout, transitively: whether a collective
        reading them materialises a computation depends on what they alias (`_computed`)."""
        out: set[int] = set()
        flags, keys = self.keys.is_value_key, self.keys.key_list
        todo = list(touched)
        while todo:
            k = todo.pop()
            for r in self.readers.get(k) or ():
                slot = slots[r]
                if slot.at >= len(slot.tasks):
                    continue
                t = slot.tasks[slot.at]  # (only a free op's own join passes a layout on unchanged)
                if t.kind == "join" and k in t.deps:
                    for o in t.outs:
                        if flags[o] and keys[o][1] == keys[k][1] and o not in out:
                            out.add(o)
                            todo.append(o)
        return out

    def _transposes_of(self, touched: Iterable[int], slots: Sequence[Any]) -> set[int]:
        """The results of the transposes whose dot's results are among `touched`, and the dot results such a transpose
        reads where its result is among them (`_written_transposed`, `_transposed_product`: whether the dot writes the
        transpose's result depends on who reads either)."""
        out: set[int] = set()
        if not self.info.transposed:
            return out
        flags, transposes = self.keys.is_value_key, set(self.info.transposed.values())
        for k in touched:
            c = self.keys.key_list[k][0]
            t = self.info.transposed.get(c)
            if t is not None and slots[t].at < len(slots[t].tasks):
                out.update(o for o in slots[t].tasks[slots[t].at].outs if flags[o])
            p = self.graph.values[c].producer
            if p in transposes and slots[p].at < len(slots[p].tasks) and k in slots[p].tasks[slots[p].at].outs:
                out.update(d for d in slots[p].tasks[slots[p].at].deps if flags[d])
        return out

    def _walking(self, touched: Iterable[int]) -> set[int]:
        """Key ids whose reads by fused ops end where `_fused_end` walks through a value one of `touched` is a layout
        of (a change there moves them)."""
        walked, keys = self._walked(), self.keys.key_list
        ops: set[int] = set()  # (each op once: many of the values walk through the same ops)
        for c in {keys[k][0] for k in touched}:
            ops.update(walked.get(c, ()))
        out: set[int] = set()
        for op in ops:
            out.update(self._positions(self._slots[op]).fused_reads)
        return out

    def io(self, plan: Any, donated: Sequence[int], values: Iterable[int] | None) -> None:
        """Arguments, outputs and aliased bytes (recomputed for `values` only, all when None; the outputs written
        into donated inputs are those `_set_donated` paired for the same call)."""
        g = self.graph
        if values is None:
            self._local.clear()
        else:
            values = set(values)
            if tuple(donated) == self._io_donated and values.isdisjoint(self._io_values()):
                return  # (no argument's or output's layout changed: the same bytes and aliases)
            for v in values:
                self._local.pop(v, None)
        self._io_donated = tuple(donated)
        local = self._local

        def nbytes(v: int) -> int:
            n = local.get(v)
            if n is None:
                n = local[v] = plan.local_bytes(v)
            return n

        unused = self._unused_inputs()
        self.args = sum(nbytes(v) for v in g.inputs if v not in unused)
        # A tuple of outputs also holds its table of pointers (8 bytes each), as XLA counts it.
        self.outs = sum(nbytes(v) for v in g.outputs) + (8 * len(g.outputs) if len(g.outputs) > 1 else 0)
        aliased = {v for _, v in self._donated_ids}  # (paired by `_set_donated`, which runs first)
        alias = sum(nbytes(v) for v in aliased)
        inputs = set(g.inputs)
        fresh = [nbytes(v) for v in g.outputs if v not in aliased and v not in inputs]
        self.alias = alias
        self.fresh_outs = tuple(fresh)
        canon = self.info.canon
        self._free_outs = sorted((nbytes(v), canon[v]) for v in set(g.outputs) - aliased
                                 if canon[v] not in self._inputs and (nbytes(v) >= _MIN_REUSE or self._holds_loop(v)))

    def _holds_loop(self, v: int) -> bool:
        """Whether output `v` is a loop's result, or is computed in place from one: its allocation is the loop's
        buffer whatever its size (colocated, not reused: `_into_outputs`)."""
        c = self.info.canon[v]
        p = self.graph.values[c].producer
        return c in self.info.loop_buffer or (p is not None and bool(self.info.inplace)
                                              and any(b in self._loop_bodies for b in self.info.inplace[p]))

    def _unused_inputs(self) -> frozenset[int]:
        """The arguments nothing computing an output reads: `jax.jit` (keep_unused=False) prunes them from the
        compiled program, so they take no argument buffer. (A tie of an input to an output is no read.)"""
        if self._unused is None:
            g, live = self.graph, self.info.live
            used = set(g.outputs)
            for op in g.ops:
                if live[op.id] and not (op.primitive == "tie" and op.region == "io"):
                    used.update(op.inputs)
            for vs in getattr(g, "region_reads", {}).values():
                used.update(vs)
            self._unused = frozenset(v for v in g.inputs if v not in used)
        return self._unused

    def _io_values(self) -> frozenset[int]:
        """The arguments and outputs, as value ids and as their canonical values."""
        if self._io_ids is None:
            ids = list(self.graph.inputs) + list(self.graph.outputs)
            self._io_ids = frozenset(ids) | {self.info.canon[v] for v in ids}
        return self._io_ids

    def in_outputs(self, copies: Sequence[tuple[int, int, int, int]] = (),
                   pairs: Mapping[int, int] | None = None) -> tuple[np.ndarray | None, set[int]]:
        """Bytes of temporaries XLA places in the output buffers before the outputs are written, per position,
        and the key ids of those buffers (a copy of donated input `p` in `copies` as key id -1 - p).

        XLA's buffer assignment gives each output (not written into a donated input) an allocation of its own
        and reuses it for values that die before the output is made and fit in it, so those values are not
        temporaries (`memory_analysis()`'s temp heap); a pipelined step's loop state and gradient accumulators
        live there. So is the allocation of a donated input XLA copies at the start (`param_copies`: its value
        is dead once copied) until the output written into it is made: the next input's copy lives there.
        Modelled as XLA assigns: values largest first (then in XLA's post order of what makes them), each into
        the smallest allocation free over its whole live range that it fits in (a copy only into the allocation
        of an input copied before it) — up to the output's making when the output is written over it in place
        (`_shares_of`: the value dies where an elementwise fusion writes the output, with the output's shape; a dot
        writing into the output allocation that the fusion then updates), and a value may begin where one it is
        written over in place ends (`pairs`, `_share_pairs`). The placement replays the previous call's
        (`FirstFit`)."""
        pairs = self._share_pairs() if pairs is None else pairs
        made: dict[int, int] = {}
        for kid, o in self.out_keys.items():
            p = self.owner[kid][1]
            made[o] = min(made.get(o, p), p)
        for (_, desc), dsts in zip(self._merged, self._merged_dsts):
            # (an output computed from a merged all-reduce's result is made after it, whatever its op's order: an
            # optimizer update reading a gradient the combiner merged with the last one)
            at = max((self.buffers[d][0] for d in dsts if d in self.buffers), default=-1)
            for o in made:
                if desc >> self.info.canon[o] & 1:
                    made[o] = max(made[o], at)
        loops = self._loop_outputs()
        for j, o in loops.items():  # (the loop's result is made when the loop ends)
            made[o] = max(made[o], self.buffers[j][1])
        end = 2 * self.n
        into = dict(self._donated_to)
        allocs = [(b, made.get(v, end), v, -1) for b, v in self._free_outs]  # (size, made, output, own input)
        allocs += [(b, made.get(into[p], end), into[p], p) for _, _, b, p in copies]
        if not allocs:
            return None, set()
        allocs.sort(key=lambda x: x[0])
        self._colocated_keys = set()
        inplace = self._into_outputs(allocs, loops, pairs)
        biggest = max(a[0] for a in allocs)
        ranges = self._buffer_ranges(max(a[1] for a in allocs), biggest, inplace, pairs)
        if self._merged_results:  # (a merged all-reduce's results are elements of its tuple: XLA keeps them apart)
            ranges = [r for r in ranges if r[4] not in self._merged_results]
        extra = [(-b, self._copy_post(p), a, e, -1 - p, -1, pairs.get(-1 - p)) for a, e, b, p in copies
                 if b <= biggest]
        extra += [(-b, post, a, e, i, -1, None) for a, e, b, i, post in self._state_copy_ranges() if b <= biggest]
        if extra:
            ranges = sorted(ranges + extra)  # (largest first, then in XLA's post order of what makes them)
        if not ranges:
            return None, set()
        where = self._first_fit.place(allocs, ranges, _admitting(allocs))
        return self._first_fit.usage(end), set(where)

    def _buffer_ranges(self, limit: int, biggest: int, inplace: dict[int, int], pairs: Mapping[int, int]
                       ) -> list[tuple]:
        """The buffers' ranges `in_outputs` places, sorted (`FirstFit`'s order: largest first, then in XLA's post
        order of what makes them): those that end before `limit` (the last output's making) or die where an
        output is written over them (`inplace`), no larger than `biggest`. Kept from the last call and updated
        for the buffers `_set` recomputed since, while its arguments are the same."""
        placing = (limit, biggest, inplace, pairs)
        if placing != self._placing:
            self._placing = (limit, biggest, dict(inplace), dict(pairs))
            self._range_of = {k: r for k in self.buffers if (r := self._range(k, placing)) is not None}
            self._sorted_ranges = sorted(self._range_of.values())
        else:
            rs = self._sorted_ranges
            for k in self._dirty:
                old = self._range_of.pop(k, None)
                if old is not None:
                    del rs[bisect.bisect_left(rs, old)]
                new = self._range(k, placing)
                if new is not None:
                    bisect.insort(rs, new)
                    self._range_of[k] = new
        self._dirty.clear()
        return self._sorted_ranges

    def _range(self, k: int, placing: tuple) -> tuple | None:
        """Buffer k's range for `FirstFit` (see `_buffer_ranges`), or None when it is not placed."""
        limit, biggest, inplace, pairs = placing
        buf = self.buffers.get(k)
        if buf is None:
            return None
        s, e, b = buf
        if not ((e < limit or k in inplace) and b <= biggest):
            return None
        # (XLA assigns colocated buffers first, each to its output's allocation: `_admitting`)
        post = _COLOCATED if k in self._colocated_keys else self.info.post[self.owner[k][0]]
        return -b, post, s, e, k, inplace.get(k, -1), pairs.get(k)

    def _loop_outputs(self) -> dict[int, int]:
        """Key id of a loop's buffer -> the output that is the loop's result in that layout (`ProgramInfo.loop_buffer`:
        XLA colocates a while loop's buffer with its result, here an output's allocation)."""
        if not self.info.loop_buffer:
            return {}
        by_value = {(self.keys.key_list[k][0], self.keys.key_list[k][1]): k for k in self.buffers
                    if self._made_by_op(k, self.owner[k][0])}  # (the body's own buffer, not a reshard of it)
        out: dict[int, int] = {}
        for k, o in self.out_keys.items():
            body = self.info.loop_buffer.get(self.info.canon[o])
            j = by_value.get((body, self.keys.key_list[k][1])) if body is not None else None
            if j is not None and j not in out:
                out[j] = o
        return out

    def _into_outputs(self, allocs: Sequence[tuple[int, int, int, int]], loops: Mapping[int, int],
                      pairs: Mapping[int, int]) -> dict[int, int]:
        """Key id -> the allocation (index in `allocs`: (size, made, output, own input)) whose output is written
        over its buffer in place: the key dies where the output is made, by an op that may write its result
        over it (`_shares_of`), with the output's layout and size; or it is a loop's buffer that is the output
        (`loops`: key id -> output, `_loop_outputs`). XLA colocates a while loop's operand, buffer and result, and
        assigns such a set before other values: a loop's buffer in an output's allocation holds the loop's initial
        value too where the buffer is written over it (`pairs`); those keys are noted in `_colocated_keys`."""
        index = {o: i for i, (_, _, o, _) in enumerate(allocs)}
        keys = self.keys.key_list
        out: dict[int, int] = {}
        for j, o in loops.items():
            i = index.get(o)
            if i is not None and self.buffers[j][2] == allocs[i][0]:
                out[j] = i
        for shares in self.shares.values():
            for k, cands in shares:
                i = index.get(self.out_keys.get(k, -1))
                if i is None:
                    continue
                pos = self.owner[k][1]
                for j in sorted(self.ends_at.get(pos, ())):
                    if (j not in out and self.buffers[j][2] == allocs[i][0] and keys[j][0] in cands
                            and keys[j][1] == keys[k][1]):
                        out[j] = i
                        break
        bodies = set(self.info.loop_buffer.values())
        for j, i in list(out.items()):
            if keys[j][0] in bodies and self._made_by_op(j, self.graph.values[keys[j][0]].producer):
                self._colocated_keys.add(j)
                init = pairs.get(j)
                if init is not None and init not in out and self.buffers[init][2] == self.buffers[j][2]:
                    out[init] = i
                    self._colocated_keys.add(init)
        return out

    def live(self) -> np.ndarray:
        """Bytes of temporaries per position."""
        live = np.cumsum(self.diff[: 2 * self.n])
        copies = self.param_copies(named=True)
        pairs = self._share_pairs()
        reused, kids = self.in_outputs(copies, pairs)
        if reused is not None:
            live = live - reused
        for pos, b in self._shared(pairs, kids).items():
            live[pos] -= b
        for a, e, b, p in copies:  # a temporary; placed in an input's allocation, none ( `reused` took it off)
            live[a:e + 1] += b
        for a, e, b, _, _ in self._state_copy_ranges():  # (the same: `reused` took off those in output buffers)
            live[a:e + 1] += b
        return live

    def _state_copy_ranges(self) -> list[tuple[int, int, int, int, float]]:
        """(first, last position, bytes, range id, order) of the copies of threefry loops' states (`state_copies`),
        as `in_outputs` places them: after the entry computation's values of their size (they are values of the
        loop's body; measured: an output buffer a value of the step takes is not theirs)."""
        return [(pos, pos, n, (1 << 40) + _STATE_COPIES * kid + j, float("inf"))
                for kid, (pos, n) in sorted(self.state_copies.items()) for j in range(_STATE_COPIES)]

    def _alias_pairs(self, plan: Any, donated: Sequence[int]) -> list[tuple[int, int]]:
        """(donated input, output written into its buffer) value ids: each output takes the first donated input
        left of its shape, dtype and layout (an input the compiled program prunes takes none)."""
        g, unused = self.graph, self._unused_inputs()
        free = [g.inputs[i] for i in donated if i < len(g.inputs) and g.inputs[i] not in unused]
        pairs = []
        for v in g.outputs:
            val = g.values[v]
            for j, u in enumerate(free):
                w = g.values[u]
                if w.shape == val.shape and w.dtype == val.dtype and plan.shardings[u] == plan.shardings[v]:
                    pairs.append((u, v))
                    free.pop(j)
                    break
        return pairs

    def _set_donated(self, plan: Any, donated: Sequence[int], values: Iterable[int] | None = None) -> bool:
        """Pair the outputs with the donated inputs whose buffers they are written into (`_alias_pairs`; the
        value ids for `io`, the canonical values in `_donated_to` and `_donated_outputs`); whether the outputs
        written so changed (`values`: the values whose layouts changed since the last call, which `io` made;
        none of the arguments or outputs: the same pairs)."""
        if values is not None and tuple(donated) == self._io_donated and set(values).isdisjoint(self._io_values()):
            return False
        canon = self.info.canon
        self._donated_ids = self._alias_pairs(plan, donated)
        self._donated_to = [(canon[u], canon[v]) for u, v in self._donated_ids]
        new = frozenset(o for _, o in self._donated_to)
        changed = new != self._donated_outputs
        self._donated_outputs = new
        return changed

    def _set_merged(self, groups: Sequence[Any]) -> None:
        """Per merged all-reduce of `groups`, the bitmasks of its members and of their descendants (kept while
        the simulator passes the same groups object: it does when no rebuilt slot's all-reduces changed)."""
        if groups is self._merged_of:
            return
        self._merged_of = groups
        desc = descendants(self.graph, self.info.canon) if groups else ()
        self._merged, self._merged_dsts = [], []
        for g in groups:
            members = [self.keys.key_list[self._slots[s].ars[e].src][0] for s, e in g.members]
            self._merged.append((sum(1 << c for c in set(members)), _union(desc[c] for c in members)))
            self._merged_dsts.append(tuple(self._slots[s].ars[e].dst for s, e in g.members))
        self._merged_results = frozenset(d for dsts in self._merged_dsts for d in dsts)

    def _orders_before(self, op: int, o: int) -> bool:
        """Whether XLA's dependency order puts op `op` before the making of value `o`: `o` is computed from its
        results, directly or through an all-reduce merged with one computed from them. An op in a loop or
        branch is its region's instruction: what the region makes counts."""
        below = self._below(op)
        return bool(below >> o & 1) or any(below & m and d >> o & 1 for m, d in self._merged)

    def _below(self, op: int) -> int:
        """Bitmask of the canonical values computed from op `op`'s results (from its outermost region's)."""
        region = outer_region(self.graph.ops[op])
        cache = self.graph.analysis("region_below", dict)
        key = (id(self.info.canon), region or op)
        hit = cache.get(key)
        if hit is None:
            desc, canon = descendants(self.graph, self.info.canon), self.info.canon
            ops = [o for o in self.graph.ops if outer_region(o) == region] if region else [self.graph.ops[op]]
            hit = cache[key] = _union(desc[canon[v]] | 1 << canon[v] for o in ops for v in o.outputs)
        return hit

    def param_copies(self, named: bool = False) -> list[tuple[int, ...]]:
        """(first, last position, bytes) of the copies XLA makes of donated inputs (XLA:CPU; `named`: and the
        input's canonical value).

        An output written into a donated input's buffer may overwrite it only after every instruction reading
        the input; copy insertion (run on the dependency order, before scheduling) keeps a copy of the input
        unless each of them is an ancestor of the output — a backward dot reading a weight in its stored
        layout is not an ancestor of that weight's update unless an all-reduce merged with its gradient's
        makes it one (data parallelism), so Megatron and FSDP plans copy such weights. Every reader then reads
        the copy, made at the start by the breadth-first schedule and live until its last reader."""
        if self.info.backend != "cpu" or not self._donated_to:
            return []
        out = []
        for p, o in self._donated_to:
            kid = self._planned_key(p)
            rs = self.readers.get(kid) if kid is not None else None
            maker = self.graph.values[o].producer
            if not rs or p == o or maker is None:
                continue
            if all(r == maker or self._orders_before(r, o) for r in self._reading_ops(kid, rs)):
                continue
            end = max(self._read_end(kid, r, pos) for r, pos in rs.items())
            out.append((0, end, self._bytes(kid)) + ((p,) if named else ()))
        return out

    def _copy_post(self, p: int) -> float:
        """Where a copy of input `p` is in XLA's post order: just before the first op reading it."""
        kid = self._planned_key(p)
        return min((self.info.post[r] for r in self.readers.get(kid, ())), default=0) - 0.5

    def _planned_key(self, c: int) -> int | None:
        """The key id of value `c` in its planned layout (None: none made)."""
        for k in self.keys.value_keys.get(c, ()):
            if self.keys.key_list[k][2] == 0 and self._output_of(c, self.keys.key_list[k][1], 0) == c:
                return k
        return None

    def _reading_ops(self, kid: int, readers: Mapping[int, int], depth: int = 0) -> set[int]:
        """The ops whose instructions read key `kid`: a slot's op when it reads it itself, the readers of what a
        slot's reshard of it makes when the reshard does, and the readers of a hint's result (no instruction)."""
        flags = self.keys.is_value_key
        out: set[int] = set()
        for s in readers:
            slot = self._slots[s]
            for i, t in enumerate(slot.tasks):
                if kid not in t.deps:
                    continue
                free = i >= slot.at and self.graph.ops[s].primitive in _PASS_THROUGH
                if i >= slot.at and not free:
                    out.add(s)
                    continue
                out.add(s)
                for k in (k for u in slot.tasks[i:len(slot.tasks) if free else slot.at] for k in u.outs if flags[k]):
                    rs = self.readers.get(k)
                    if rs and depth < 8:
                        out |= set(rs) | self._reading_ops(k, rs, depth + 1)
        return out

    def result(self) -> MemoryResult:
        if not self.n:
            return MemoryResult(self.args, self.outs, self.alias, 0, 0, self.fresh_outs)
        live = self.live()
        i = int(np.argmax(live))
        return MemoryResult(self.args, self.outs, self.alias, int(live[i]), self._op_at[i // 2], self.fresh_outs)


def _admitting(allocs: Sequence[tuple[int, int, int, int]]) -> Callable[[tuple], int]:
    """`admits` for `FirstFit.place` over `allocs` (size, made, output, own input; sorted by size): the
    allocations a range may use whatever they hold (a bitmask; tried smallest first) — as large as it, made
    after its last position unless its output is written over it in place, and for a copy of donated input p
    (key id -1 - p) only that of an input copied before it."""
    sizes = [a[0] for a in allocs]
    by_made = sorted(range(len(allocs)), key=lambda j: allocs[j][1])
    made_at = [allocs[j][1] for j in by_made]
    after = [0] * (len(allocs) + 1)  # after[i]: the allocations made after made_at[i - 1]
    for i in range(len(allocs) - 1, -1, -1):
        after[i] = after[i + 1] | 1 << by_made[i]
    left, right = bisect.bisect_left, bisect.bisect_right

    def admits(r: tuple) -> int:
        neg_b, post, _, e, k, mine, _ = r
        if post == _COLOCATED:
            return 1 << mine
        ok = after[right(made_at, e)] | (1 << mine if mine >= 0 else 0)
        fits = left(sizes, -neg_b)
        ok = ok >> fits << fits
        if k < 0:
            ok &= sum(1 << j for j, a in enumerate(allocs) if 0 <= a[3] < -1 - k)
        return ok

    return admits


def local_slice(slot: Any, i: int, is_value_key: Sequence[bool]) -> bool:
    """Whether task `i` of a slot is an operand's reshard without collectives (a local slice of a value's key)."""
    t = slot.tasks[i]
    return i < slot.at and t.kind == "join" and bool(t.deps) and all(is_value_key[d] for d in t.deps)


def gather_copy(slot: Any, i: int, is_value_key: Sequence[bool]) -> bool:
    """Whether task `i` of a slot is one of its operands' reshards copying a value (a key of it) into the memory
    order of the all-gather that reads the copy next (XLA:CPU: `shardc.cost.program.gather_relayouts`)."""
    t = slot.tasks[i]
    return (i < slot.at and t.kind == "compute" and len(t.deps) == 1 and is_value_key[t.deps[0]]
            and MemoryModel._feeds_collective(slot, i) and slot.tasks[i + 1].collective == "all-gather")
