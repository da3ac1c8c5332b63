"""Debug helper: the buffers live at the peak of temporaries, as XLA assigned them and as the memory model
counts them, side by side per plan op.

    from shardc.cost.memdebug import peak_buffers
    print(peak_buffers(plan))          # a plan made by @shardc.auto / shardc.plan (it records its program)

XLA's side is read from its own dumps of the compiled program (`--xla_dump_to`, per compile): the
buffer assignment (which allocation holds each logical buffer: a parameter, the output, or the
preallocated temporaries `memory_analysis().temp_size_in_bytes` reports), the live ranges over the
flattened schedule (`*-live-range.txt`) and the optimized HLO (each instruction's opcode, shape and the
`shardc.op<id>` tag of its metadata, `shardc.lower` with `tag_ops`). The temporaries' peak is the largest
sum of live temp buffers at one schedule position (XLA's heap packing may add fragmentation on top; on the
programs examined it added almost none: `docs/simulator.md`). A loop's or conditional's values (listed as
"(phi)": its carry, body parameter and result) are temporaries too. The model's side is `MemoryModel`'s
buffers and workspaces at the position where its temporaries peak.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile
from typing import Any

from shardc.fresh_compile import uncached

__all__ = ["Buffer", "PeakBuffers", "xla_peak", "model_peak", "peak_buffers"]


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer live at a peak: its size, the plan op it belongs to (None: unknown), and what it is."""

    nbytes: int
    op: int | None
    what: str
    start: int = -1  # live range in the side's own schedule positions
    end: int = -1


@dataclasses.dataclass(frozen=True)
class PeakBuffers:
    """XLA's and the model's temporaries at their peaks."""

    xla: list[Buffer]
    xla_temp_size: int  # memory_analysis().temp_size_in_bytes (the packed heap)
    model: list[Buffer]
    model_peak_op: int  # the op the model side is read at
    primitives: dict[int, str]

    def __str__(self) -> str:
        xs, ms = sum(b.nbytes for b in self.xla), sum(b.nbytes for b in self.model)
        lines = [f"XLA temporaries: {xs:,} B live at the peak ({len(self.xla)} buffers; allocation "
                 f"{self.xla_temp_size:,} B); model: {ms:,} B ({len(self.model)} buffers, at op "
                 f"{self.model_peak_op} {self.primitives.get(self.model_peak_op, '')})"]
        by_op: dict[int | None, tuple[list[Buffer], list[Buffer]]] = {}
        for side, bufs in ((0, self.xla), (1, self.model)):
            for b in bufs:
                by_op.setdefault(b.op, ([], []))[side].append(b)
        rows = sorted(by_op.items(), key=lambda kv: -abs(sum(b.nbytes for b in kv[1][0])
                                                         - sum(b.nbytes for b in kv[1][1])))
        lines.append(f"{'op':>6} {'primitive':<22} {'XLA B':>11} {'model B':>11}  buffers (XLA | model)")
        for op, (xb, mb) in rows:
            prim = self.primitives.get(op, "?") if op is not None else "-"
            lines.append(f"{op if op is not None else '-':>6} {prim[:22]:<22} {sum(b.nbytes for b in xb):>11,} "
                         f"{sum(b.nbytes for b in mb):>11,}  "
                         + "; ".join(f"{b.what} {b.nbytes:,}" for b in xb) + " | "
                         + "; ".join(f"{b.what} {b.nbytes:,}" for b in mb))
        return "\n".join(lines)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
# a value line; "(phi)" marks a while loop's or conditional's merged value (its carry, body parameter, result)
_VALUE = re.compile(r"^\s*value: <\d+ ([^ >]+)(?: \(phi\))?(?: @\d+)?> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"^\s*([\w.\-]+\{[\d,]*\}):(\d+)-(\d+)\s*$")
_OPNAME = re.compile(r'op_name="([^"]*)"')


def _instructions(hlo: str) -> dict[str, tuple[str, str, str]]:
    """Instruction name -> (shape, opcode, metadata op_name) of an HLO module's text."""
    out: dict[str, tuple[str, str, str]] = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        rest = line[m.end():]
        if rest.startswith("("):  # a tuple shape
            depth = 0
            for i, ch in enumerate(rest):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    break
            shape, rest = rest[: i + 1], rest[i + 1:].lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        opcode = rest.split("(", 1)[0]
        name = _OPNAME.search(rest)
        out[m.group(1)] = (shape, opcode, name.group(1) if name else "")
    return out


def _read(d: str, suffix: str) -> str:
    files = glob.glob(os.path.join(d, f"*{suffix}"))
    if not files:
        raise RuntimeError(f"XLA dumped no *{suffix} in {d}")
    with open(max(files, key=os.path.getsize)) as f:
        return f.read()


@dataclasses.dataclass
class XlaLive:
    """XLA's temp buffers over its flattened schedule."""

    sizes: dict[str, int]  # temp buffer -> bytes
    live: dict[str, tuple[int, int]]  # temp buffer -> (first, last) schedule position
    sequence: list[str]  # schedule position -> instruction name
    instrs: dict[str, tuple[str, str, str]]  # instruction -> (shape, opcode, op_name)
    temp_size: int  # memory_analysis().temp_size_in_bytes

    def op_at(self, pos: int) -> int | None:
        """The plan op of the instruction at a schedule position (the nearest tagged one before it)."""
        from shardc.lower import tagged_op

        for p in range(min(pos, len(self.sequence) - 1), -1, -1):
            op = tagged_op(self.instrs.get(self.sequence[p], ("", "", ""))[2])
            if op is not None:
                return op
        return None

    def peak(self) -> int:
        """The schedule position where the live temp bytes are largest."""
        end = max((e for _, e in self.live.values()), default=0) + 2
        diff = [0] * (end + 1)
        for name, (s, e) in self.live.items():
            diff[s] += self.sizes[name]
            diff[e + 1] -= self.sizes[name]
        best, at, acc = -1, 0, 0
        for i in range(end):
            acc += diff[i]
            if acc > best:
                best, at = acc, i
        return at

    def at(self, pos: int) -> list[Buffer]:
        """The temp buffers live at a schedule position, largest first."""
        from shardc.lower import tagged_op

        out = []
        for name, (s, e) in self.live.items():
            if s <= pos <= e:
                base = name.split("{", 1)[0]
                shape, opcode, op_name = self.instrs.get(base, ("?", "?", ""))
                out.append(Buffer(self.sizes[name], tagged_op(op_name), f"{opcode} {shape} ({base})", s, e))
        return sorted(out, key=lambda b: -b.nbytes)

    def position_of(self, op: int) -> int:
        """The last schedule position of an instruction tagged with plan op `op` (-1: none)."""
        from shardc.lower import tagged_op

        found = -1
        for p, name in enumerate(self.sequence):
            if tagged_op(self.instrs.get(name, ("", "", ""))[2]) == op:
                found = p
        return found


_SEQ = re.compile(r"^\s*(\d+):([\w.\-]+)\s*$")


def xla_live(lowered: Any, compiler_options: dict[str, Any] | None = None, keep: str | None = None) -> XlaLive:
    """XLA's temporaries of a lowered program (compiled once more, with dumps; kept in directory `keep` if
    given, else in a temporary one)."""
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="shardc-mem-")) as d:
        with uncached():  # (a program loaded from jax's persistent cache is not dumped)
            compiled = lowered.compile(compiler_options={**(compiler_options or {}), "xla_dump_to": d,
                                                         "xla_dump_hlo_as_text": True})
        assignment = _read(d, "after_optimizations-buffer-assignment.txt")
        ranges = _read(d, "after_optimizations-live-range.txt")
        hlo = _read(d, "after_optimizations.txt")
    sizes: dict[str, int] = {}
    offsets: dict[str, int] = {}
    temp = False
    for line in assignment.splitlines():
        m = _ALLOC.match(line)
        if m:
            temp = "preallocated-temp" in m.group(3)
            continue
        v = _VALUE.match(line)
        if v and temp:
            name = v.group(1) if "{" in v.group(1) else v.group(1) + "{}"
            sizes[name], offsets[name] = int(v.group(2)), int(v.group(3))
    live: dict[str, tuple[int, int]] = {}
    sequence: list[str] = []
    for line in ranges.splitlines():
        r = _RANGE.match(line)
        if r and r.group(1) in sizes:
            live[r.group(1)] = (int(r.group(2)), int(r.group(3)))
            continue
        q = _SEQ.match(line)
        if q and int(q.group(1)) == len(sequence):
            sequence.append(q.group(2))
    return XlaLive(sizes, _unshared(live, sizes, offsets), sequence, _instructions(hlo),
                   compiled.memory_analysis().temp_size_in_bytes)


def _unshared(live: dict[str, tuple[int, int]], sizes: dict[str, int],
              offsets: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Live ranges with a buffer written in place over another (same offset and size in the temp allocation,
    its range beginning where the other's ends: an elementwise fusion's result sharing a dying operand's
    buffer) starting one position later, so that the two count once."""
    out = dict(live)
    by_slot: dict[tuple[int, int], list[str]] = {}
    for name in live:
        by_slot.setdefault((offsets[name], sizes[name]), []).append(name)
    for names in by_slot.values():
        names.sort(key=lambda n: live[n])
        for a, b in zip(names, names[1:]):
            if out[a][1] == out[b][0] < out[b][1]:
                out[b] = (out[b][0] + 1, out[b][1])
    return out


def xla_peak(lowered: Any, compiler_options: dict[str, Any] | None = None) -> tuple[list[Buffer], int]:
    """The temporaries live at XLA's temp peak of a lowered program, and the temp allocation's size."""
    x = xla_live(lowered, compiler_options)
    return x.at(x.peak()), x.temp_size


class ModelLive:
    """The memory model's buffers of one full simulation of a plan."""

    def __init__(self, plan: Any, topology: Any = None) -> None:
        import jax

        from shardc.check import _host_topology
        from shardc.sim import simulator_for

        topo = _host_topology(jax.default_backend()) if topology is None else topology
        self.sim = simulator_for(plan, topo)
        self.result = self.sim.full(plan, tuple(getattr(plan, "donated", ()) or ()))
        self.mem = self.sim.memory
        self.plan = plan
        self.live = self.mem.live()
        self.copies = self.mem.param_copies(named=True)
        self.in_outputs = self.mem.in_outputs(self.copies)[1]  # buffers XLA would place in output buffers

    def peak(self) -> int:
        return int(self.live.argmax())

    def position_of(self, op: int) -> int:
        """The model's position while op `op` runs."""
        return 2 * self.mem.order[op]

    def op_at(self, pos: int) -> int:
        return self.mem._op_at[pos // 2]

    def at(self, pos: int) -> list[Buffer]:
        """The temporary buffers, workspaces and collectives' extra buffers live at a position, largest first (not
        those placed in output buffers: `MemoryModel.in_outputs`)."""
        mem, g = self.mem, self.plan.graph
        out = []
        for kid, (s, e, b) in mem.buffers.items():
            if s <= pos <= e and kid not in self.in_outputs:
                c, sh, origin = mem.keys.key_list[kid]
                v = g.values[c]
                what = f"v{c} {v.dtype}{list(v.shape)} {sh}" + (" (op layout)" if origin == 1 else "")
                out.append(Buffer(b, v.producer, what, s, e))
        for sl in self.sim._last.slots:
            for a, e, n in mem._positions(sl).workspace:
                if a <= pos <= e:
                    out.append(Buffer(n, sl.op, "workspace", a, e))
        for extra, what in ((mem.fulls, "all-reduced buffer of"), (mem.relayouts, "all-gathered layout of")):
            for kid, (a, e, n) in extra.items():
                if a <= pos <= e:
                    c = mem.keys.key_list[kid][0]
                    out.append(Buffer(n, g.values[c].producer, f"{what} v{c}", a, e))
        for a, e, n, v in self.copies:
            if a <= pos <= e and -1 - v not in self.in_outputs:
                out.append(Buffer(n, None, f"copy of donated input v{v}", a, e))
        return sorted(out, key=lambda b: -b.nbytes)


def model_peak(plan: Any, topology: Any = None) -> tuple[list[Buffer], int]:
    """The buffers (and workspaces) live where the memory model's temporaries peak, and the op there."""
    m = ModelLive(plan, topology)
    at = m.peak()
    return m.at(at), m.op_at(at)


def peak_buffers(plan: Any, at: str = "xla", keep: str | None = None) -> PeakBuffers:
    """XLA's temporaries next to the memory model's, for a plan that records its program: at XLA's peak (`at`
    "xla": the model's live set while the plan op XLA runs there runs) or at the model's ("model")."""
    from shardc.check import _lowered
    from shardc.lower import compiler_options

    x = xla_live(_lowered(plan), compiler_options(plan), keep)
    m = ModelLive(plan)
    if at == "xla":
        xp = x.peak()
        op = x.op_at(xp)
        mp = m.position_of(op) if op is not None else m.peak()
    else:
        mp = m.peak()
        op = m.op_at(mp)
        xp = x.position_of(op)
    prims = {o.id: o.primitive for o in plan.graph.ops}
    return PeakBuffers(x.at(xp), x.temp_size, m.at(mp), m.op_at(mp), prims)
