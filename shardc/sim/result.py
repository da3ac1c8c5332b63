"""The result of a simulation: step time, memory, communication, per-op breakdown, critical path."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from shardc.cost.memory import MemoryResult
from shardc.cost.topology import MeshMapping, Topology
from shardc.sim.tasks import PS, TASKS_PER_SLOT, Slot, is_static

__all__ = ["SimResult", "OpTime"]


@dataclasses.dataclass(frozen=True, slots=True)
class OpTime:
    """One op's share of the step."""

    op: int
    primitive: str
    source: str
    start: float  # seconds
    end: float
    compute: float  # seconds of compute
    comm: float  # seconds of its collectives
    flops: float


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_time(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


# The memory model's temporaries are within ~10% of XLA's and more often over than under (docs/simulator.md):
# an estimate that reaches the mmap threshold by less than that margin is too likely XLA's below it to charge
# the fresh-memory cost for (two plans of bench/sim_vs_measured.py: 33.1 and 32.4 MiB predicted, 31.1 and
# 29.6 MiB compiled, no page faults).
TEMPORARIES_MARGIN = 1.1


@dataclasses.dataclass(eq=False)
class SimResult:
    """What one device does in one step of a plan on a topology (see `shardc.simulate`)."""

    plan: Any
    topology: Topology
    mapping: MeshMapping
    streams: tuple[str, ...]
    makespan_ps: int
    slots: Sequence[Slot]
    recorded_starts: Sequence[Sequence[int]]  # per slot, per task, before the slot's offset
    recorded_ends: Sequence[Sequence[int]]
    offsets: Any  # per slot: the shift of its recorded times (delta simulation keeps old tails shifted)
    binds: Sequence[Sequence[int]]  # the task each task waited for last (slot * TASKS_PER_SLOT + index), -1
    payload: dict[str, int]  # collective kind -> payload bytes per device per step
    xla_payload: dict[str, int]  # the same, loop bodies counted once (as the compiled HLO lists them)
    wire: dict[tuple[str, str], float]  # (kind, level) -> bytes each device sends per step
    flops: float  # per device per step
    xla_flops: float  # as XLA's cost analysis counts them
    transcendentals: float
    memory: MemoryResult
    merged_ps: int = 0  # fixed costs of merged all-reduces the schedule counts once per member (`merged_time`)

    def __post_init__(self) -> None:
        # Snapshot: a later delta simulation replaces slots in the simulator's lists.
        self.slots = list(self.slots)
        self.recorded_starts = list(self.recorded_starts)
        self.recorded_ends = list(self.recorded_ends)
        self.binds = list(self.binds)
        self._times: tuple[list, list] | None = None

    def _shifted(self) -> tuple[list, list]:
        """Recorded times plus their slot's offset (static tasks, joins at time 0, stay at 0)."""
        if self._times is None:
            starts, ends = [], []
            for slot, st, en, off in zip(self.slots, self.recorded_starts, self.recorded_ends, self.offsets.tolist()):
                if not off:
                    starts.append(st)
                    ends.append(en)
                    continue
                keep = [is_static(a, b, *task[1:3]) for a, b, task in zip(st, en, slot.sched)]
                starts.append([a if k else a + off for a, k in zip(st, keep)])
                ends.append([b if k else b + off for b, k in zip(en, keep)])
            self._times = (starts, ends)
        return self._times

    @property
    def starts(self) -> list[list[int]]:
        """Per slot, per task: start time (ps)."""
        return self._shifted()[0]

    @property
    def ends(self) -> list[list[int]]:
        """Per slot, per task: end time (ps)."""
        return self._shifted()[1]

    # -- headline numbers ----------------------------------------------------------------------------
    @property
    def step_time(self) -> float:
        """Seconds per step: the schedule's makespan, less the fixed costs merged all-reduces do not pay again,
        plus the time to map a fresh temporary buffer."""
        return (self.makespan_ps - self.merged_ps) / PS + self.fresh_memory_time

    @property
    def merged_time(self) -> float:
        """Seconds the schedule counts for merged all-reduces beyond one fixed cost per merged all-reduce (the
        timeline keeps a task per member; `step_time` subtracts this on topologies without overlap)."""
        return self.merged_ps / PS

    @property
    def fresh_memory_time(self) -> float:
        """Seconds per step spent faulting in the buffers the allocator maps afresh every step: the
        temporaries (one buffer; counted from `TEMPORARIES_MARGIN` times the threshold, as they are estimated)
        and each output buffer not donated (`Device.fresh_memory_time`; XLA:CPU on glibc, for buffers of
        32 MiB per device or more)."""
        dev, temp = self.topology.device, self.memory.temp_peak
        charged = temp if temp >= TEMPORARIES_MARGIN * dev.fresh_memory_threshold else 0
        return dev.fresh_memory_time(charged, *self.memory.fresh_outputs)

    @property
    def peak_memory(self) -> int:
        """Bytes per device at the peak."""
        return self.memory.peak

    @property
    def pipeline(self) -> Any:
        """The pipeline view of a pipelined plan's step (`shardc.sim.pipeline.PipelineCost`), else None."""
        from shardc.sim.pipeline import pipeline_cost

        return pipeline_cost(self)

    @property
    def comm_bytes(self) -> dict[str, int]:
        """Payload bytes per device per step, by collective kind."""
        return dict(self.payload)

    @property
    def comm_by_level(self) -> dict[str, dict[str, float]]:
        """Bytes each device sends per step: kind -> topology level -> bytes."""
        out: dict[str, dict[str, float]] = {}
        for (kind, level), b in sorted(self.wire.items()):
            out.setdefault(kind, {})[level] = b
        return out

    @property
    def compute_time(self) -> float:
        return sum(s.compute_ps for s in self.slots) / PS

    @property
    def comm_time(self) -> float:
        return sum(s.comm_ps for s in self.slots) / PS

    # -- breakdowns ----------------------------------------------------------------------------------
    def per_op(self) -> list[OpTime]:
        """Every op that does work: when it ran, its compute and communication time."""
        g = self.plan.graph
        out = []
        for s, st, en in zip(self.slots, self.starts, self.ends):
            if not s.tasks or (s.compute_ps == 0 and s.comm_ps == 0):
                continue
            op = g.ops[s.op]
            src = op.source
            out.append(OpTime(s.op, op.primitive, str(src) if src else "", min(st) / PS, max(en) / PS,
                              s.compute_ps / PS, s.comm_ps / PS, s.flops))
        return out

    def critical_path(self) -> list[tuple[str, str, float, float]]:
        """The chain of tasks that sets the step time: (task, stream, start s, end s), first to last."""
        best, at = -1, -1
        for si, en in enumerate(self.ends):
            for ti, e in enumerate(en):
                if e > best:
                    best, at = e, si * TASKS_PER_SLOT + ti
        path = []
        seen = set()
        while at >= 0 and at not in seen:
            seen.add(at)
            si, ti = divmod(at, TASKS_PER_SLOT)
            t = self.slots[si].tasks[ti]
            stream = self.streams[t.stream] if t.stream >= 0 else "-"
            if t.dur:
                path.append((t.name, stream, self.starts[si][ti] / PS, self.ends[si][ti] / PS))
            at = self.binds[si][ti]
        return path[::-1]

    def tasks(self):
        """(name, kind, stream, start s, end s, op id) of every task with a duration."""
        for s, st, en in zip(self.slots, self.starts, self.ends):
            for t, a, b in zip(s.tasks, st, en):
                if t.dur and t.stream >= 0:
                    yield t.name, t.kind, self.streams[t.stream], a / PS, b / PS, t.op

    # -- output --------------------------------------------------------------------------------------
    def to_chrome_trace(self, path: str) -> str:
        """Write the timeline as Chrome trace JSON (opens in Perfetto or chrome://tracing)."""
        from shardc.sim.timeline import chrome_trace

        return chrome_trace(self, path)

    def gantt(self, path: str, *, max_tasks: int = 4000) -> str:
        """Write a PNG Gantt chart of the streams (needs matplotlib)."""
        from shardc.sim.timeline import gantt

        return gantt(self, path, max_tasks=max_tasks)

    @property
    def fits(self) -> bool:
        """Whether the simulated per-device peak fits the topology's device memory."""
        return self.memory.peak <= self.topology.device.memory

    def summary(self, *, top: int = 8) -> str:
        m = self.memory
        lines = [
            f"simulated on {self.topology.name} ({self.topology.num_devices} x {self.topology.device.name}); "
            f"mesh axes: {self.mapping}",
            f"step time {_fmt_time(self.step_time)} (compute {_fmt_time(self.compute_time)}, "
            f"communication {_fmt_time(self.comm_time)}, {self.flops / 1e9:.3f} GFLOP per device)",
            f"peak memory {_fmt_bytes(m.peak)} per device (arguments {_fmt_bytes(m.arguments)}, outputs "
            f"{_fmt_bytes(m.outputs)}, donated {_fmt_bytes(m.aliased)}, temporaries {_fmt_bytes(m.temp_peak)}"
            f"; capacity {_fmt_bytes(self.topology.device.memory)})"
            + ("" if self.fits else " -- DOES NOT FIT in device memory"),
        ]
        if self.fresh_memory_time:
            threshold = self.topology.device.fresh_memory_threshold
            big = [b for b in m.fresh_outputs if b >= threshold]
            if m.temp_peak >= TEMPORARIES_MARGIN * threshold:
                big.append(m.temp_peak)
            lines.append(f"fresh memory: {len(big)} buffer{'s' if len(big) > 1 else ''} of "
                         f"{_fmt_bytes(sum(big))} (temporaries, outputs not donated) mapped and faulted in every step "
                         f"({_fmt_time(self.fresh_memory_time)}; under "
                         f"{_fmt_bytes(self.topology.device.fresh_memory_threshold)} the allocator reuses them)")
        if self.merged_ps:
            lines.append(f"merged all-reduces: {_fmt_time(self.merged_time)} of members' fixed costs not paid again "
                         f"(the timeline shows one task per member)")
        if self.payload:
            by_kind = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(self.payload.items()))
            lines.append(f"communication per device: {by_kind}")
            levels = {}
            for (kind, level), b in self.wire.items():
                levels[level] = levels.get(level, 0.0) + b
            lines.append("sent per device by level: " + ", ".join(f"{lv} {_fmt_bytes(b)}" for lv, b in levels.items()))
        pipe = self.pipeline
        if pipe is not None:
            lines.extend(pipe.describe().splitlines())
        ops = sorted(self.per_op(), key=lambda o: -(o.compute + o.comm))[:top]
        if ops:
            lines.append("most expensive ops:")
            for o in ops:
                lines.append(f"  {o.primitive:<20} compute {_fmt_time(o.compute):>10}  "
                             f"comm {_fmt_time(o.comm):>10}  {o.source}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
