"""Fidelity of the simulator against the compiled program.

    report = shardc.check(plan)          # a plan made by @shardc.auto / shardc.plan
    report = shardc.check(step, *args)   # or an @shardc.auto function and its arguments
    print(report); report.ok

The plan is lowered and compiled on the local backend, and per device:

* collective bytes by kind — read from `compiled.as_text()` (tuple-shaped, async and combined forms,
  loop bodies times their trip count; `shardc.cost.hlo`) — against the simulation's payloads;
* FLOPs — `compiled.cost_analysis()["flops"]` — against the simulation's count in XLA's convention
  (loop bodies once, all-reduce elements included);
* memory — arguments + outputs - aliased + temporaries of `compiled.memory_analysis()` — against the
  simulated peak.

Bounds: 5% for bytes and FLOPs, 10% for memory. A disagreement means the plan or the cost model is wrong.
XLA's own warnings while compiling (`[SPMD] Involuntary full rematerialization`: a reshard XLA does by
replicating the whole tensor, which the plan priced as something cheaper) are captured and listed too.
The program is compiled afresh, not loaded from jax's persistent compilation cache (`uncached`): a loaded
program logs no warning.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from typing import Any, Iterator, Sequence

import jax

from annotations.errors import ShardingError
from shardc.attribute import attribute
from shardc.cost.hlo import COLLECTIVE_KINDS, collectives
from shardc.cost.topology import Device, Level, Topology
from shardc.fresh_compile import uncached

__all__ = ["check", "compare", "CheckReport", "CheckRow", "compiled_stats", "BOUNDS", "xla_log", "uncached",
           "INVOLUNTARY_REMAT"]

BOUNDS = {"bytes": 0.05, "flops": 0.05, "memory": 0.10}
INVOLUNTARY_REMAT = "Involuntary full rematerialization"


@contextlib.contextmanager
def xla_log() -> Iterator[list[str]]:
    """What XLA's C++ code writes to the process's stderr inside the block (its SPMD warnings among it), as
    a list of lines filled in when the block ends; the text is also passed on to file descriptor 2 (so an
    enclosing `xla_log` — a test's — sees it too)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            lines.extend(text.splitlines())
            if text:
                os.write(2, text.encode())


@dataclasses.dataclass(frozen=True)
class CheckRow:
    quantity: str
    predicted: float
    compiled: float
    bound: float

    @property
    def error(self) -> float:
        if self.compiled == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return abs(self.predicted - self.compiled) / abs(self.compiled)

    @property
    def ok(self) -> bool:
        return self.error <= self.bound


@dataclasses.dataclass
class CheckReport:
    rows: list[CheckRow]
    compiled_collectives: list[Any]
    simulation: Any
    xla_warnings: list[str] = dataclasses.field(default_factory=list)  # XLA's SPMD warnings while compiling
    by_op: list[Any] = dataclasses.field(default_factory=list)  # shardc.attribute.OpCollectives per plan op

    def op_mismatches(self) -> list[Any]:
        """Plan ops whose compiled collectives differ from the ones the plan lists for them."""
        return [r for r in self.by_op if not r.agrees]

    @property
    def involuntary_remats(self) -> list[str]:
        return [w for w in self.xla_warnings if INVOLUNTARY_REMAT in w]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and not self.involuntary_remats

    def row(self, quantity: str) -> CheckRow:
        for r in self.rows:
            if r.quantity == quantity:
                return r
        raise KeyError(quantity)

    def failures(self) -> list[CheckRow]:
        return [r for r in self.rows if not r.ok]

    def summary(self) -> str:
        """One line for a table: "exact" / "within bounds", or each quantity out of bounds as
        predicted/compiled (e.g. "all-gather bytes 2.10/3.40 MiB; 1 involuntary remat")."""
        bad = [f"{r.quantity} {_short(r.predicted, r.quantity)}/{_short(r.compiled, r.quantity)}"
               for r in self.failures()]
        if self.involuntary_remats:
            bad.append(f"{len(self.involuntary_remats)} involuntary remat")
        if bad:
            return "; ".join(bad)
        return "exact" if all(r.error < 5e-4 for r in self.rows) else "within bounds"

    def assert_ok(self) -> None:
        if not self.ok:
            raise AssertionError("simulation disagrees with the compiled program:\n" + str(self))

    def __str__(self) -> str:
        head = ["quantity", "predicted", "compiled", "error", "bound", ""]
        body = []
        for r in self.rows:
            err = "inf" if r.error == float("inf") else f"{100 * r.error:.2f}%"
            body.append([r.quantity, f"{r.predicted:,.0f}", f"{r.compiled:,.0f}", err, f"{100 * r.bound:.0f}%",
                         "ok" if r.ok else "MISMATCH"])
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths)))
                  for b in body]
        lines += [f"XLA: {w.strip()[:300]}" for w in self.involuntary_remats]
        return "\n".join(lines)


def _short(x: float, quantity: str) -> str:
    return f"{x / 2**20:.2f} MiB" if "bytes" in quantity else f"{x / 1e9:.2f} GFLOP"


def _host_topology(platform: str) -> Topology:
    """A nominal topology of the local backend: the check compares bytes, FLOPs and memory, not time.
    XLA:CPU lowers a reduce-scatter to an all-reduce and a local slice."""
    dev = Device(f"{platform}-device", {"float32": 1e11}, mem_bandwidth=1e10, memory=2**40)
    n = len(jax.devices())
    return Topology(f"{platform}-nominal", dev, (Level("host", n, 1e10, 1e-6),), overlap=False,
                    reduce_scatter=platform not in ("cpu",),
                    combine_bytes=float("inf") if platform == "cpu" else 30 * 2**20, backend=platform)


def compiled_stats(compiled: Any, mesh_shape: list[tuple[str, int]]) -> dict[str, Any]:
    """Collectives, FLOPs and memory of a compiled program, per device."""
    colls = collectives(compiled.as_text(), mesh_shape)
    by_kind: dict[str, int] = {}
    for c in colls:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.total_bytes
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
    return {"collectives": colls, "bytes": by_kind, "flops": float(cost.get("flops", 0.0)) if cost else 0.0,
            "memory": peak, "memory_analysis": mem}


_COMBINERS = "cpu-all-reduce-combiner,all-reduce-combiner,all-gather-combiner,reduce-scatter-combiner,all-to-all-combiner," \
              "collective-permute-combiner"


def _lowered(plan: Any) -> Any:
    from shardc.lower import jit_plan

    if plan.program is None:
        raise ShardingError("shardc.check needs a plan made by @shardc.auto or shardc.plan (it records the traced "
                            "program); or call shardc.check(step, *args) with the @shardc.auto function")
    g = plan.graph
    avals = [jax.ShapeDtypeStruct(g.values[v].shape, g.values[v].dtype) for v in g.inputs]
    return jit_plan(plan, plan.program, plan.donated, tag_ops=True).lower(*avals)


def _compile(lowered: Any) -> tuple[Any, list[str]]:
    """The compiled program and XLA's SPMD warnings while compiling it (compiled afresh: `uncached`)."""
    with uncached(), xla_log() as log:
        compiled = lowered.compile()
    return compiled, [line for line in log if "[SPMD]" in line]


def _uncombined_collectives(lowered: Any, plan: Any) -> list[Any]:
    """The program's collectives compiled without XLA's combiners (each keeps its own op's metadata)."""
    from shardc.lower import compiler_options

    options = compiler_options(plan) or {}
    disabled = ",".join(p for p in (options.get("xla_disable_hlo_passes", ""), _COMBINERS) if p)
    with xla_log():
        compiled = lowered.compile(compiler_options={**options, "xla_disable_hlo_passes": disabled})
    return collectives(compiled.as_text(), list(plan.mesh_sizes.items()))


def check(plan_or_fn: Any, *args: Any, topology: Any = None, by_op: bool = False, **kwargs: Any) -> CheckReport:
    """Compile a plan and compare the simulator's collective bytes (by kind), FLOPs and memory with it.
    `by_op`: also attribute the compiled collectives to plan ops (`CheckReport.by_op`, per step: loop bodies
    times their trips; one more compile)."""
    from shardc.auto import AutoFunction

    plan = plan_or_fn.plan(*args, **kwargs) if isinstance(plan_or_fn, AutoFunction) else plan_or_fn
    lowered = _lowered(plan)
    compiled, warnings = _compile(lowered)
    report = compare(plan, compiled, warnings, topology=topology)
    if by_op:
        report.by_op = attribute(plan, _uncombined_collectives(lowered, plan), report.simulation)
    return report


def compare(plan: Any, compiled: Any, warnings: Sequence[str] = (), *, topology: Any = None) -> CheckReport:
    """The plan's simulation against a compiled program of it (`shardc.lower.jit_plan(...).lower(...)
    .compile()`) and XLA's SPMD warnings while compiling it (`xla_log`)."""
    from shardc.sim import as_topology, simulate

    platform = jax.default_backend()
    topo = _host_topology(platform) if topology is None else as_topology(topology)
    # What XLA does on this backend: XLA:CPU has no reduce-scatter and merges all-reduces without a size limit.
    topo = dataclasses.replace(topo, reduce_scatter=platform not in ("cpu",), backend=platform,
                               combine_bytes=float("inf") if platform == "cpu" else topo.combine_bytes)
    sim = simulate(plan, topo)
    stats = compiled_stats(compiled, list(plan.mesh_sizes.items()))
    rows = []
    for kind in COLLECTIVE_KINDS:
        p, c = sim.payload.get(kind, 0), stats["bytes"].get(kind, 0)
        if p or c:
            rows.append(CheckRow(f"{kind} bytes", p, c, BOUNDS["bytes"]))
    rows.append(CheckRow("FLOPs", sim.xla_flops, stats["flops"], BOUNDS["flops"]))
    if stats["memory"] is not None:
        rows.append(CheckRow("peak memory bytes", sim.peak_memory, stats["memory"], BOUNDS["memory"]))
    return CheckReport(rows, stats["collectives"], sim, [w for w in warnings if "[SPMD]" in w])
