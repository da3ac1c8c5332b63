"""Human-readable plan reports: per-tensor shardings with their causes, and the reshards."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardc.plan import Plan

__all__ = ["explain", "format_bytes"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _cause(plan: "Plan", vid: int) -> str:
    causes = [str(c) for c in dict.fromkeys(c for c in plan.origins[vid] if c is not None)]
    if causes:
        return "; ".join(causes)
    return "replicated (undecided)" if plan.shardings[vid].is_replicated() else "propagated"


def _priced_on(plan: "Plan") -> str:
    """Which topology the plan's cost was simulated on, and why ("" when it was not simulated)."""
    search = getattr(plan, "search", None)
    if search is not None and getattr(search, "topology", ""):
        return search.topology
    cost = getattr(plan, "cost", None)
    if cost is None:
        return ""
    topo = cost.topology
    return f"{topo.name} ({topo.source})" if topo.source else topo.name


def explain(plan: "Plan", *, max_rows: int = 60) -> str:
    g = plan.graph
    mesh = ", ".join(f"{a}={n}" for a, n in plan.mesh_sizes.items())
    lines = [f"shardc plan on mesh ({mesh}): {len(g.ops)} ops, {len(g.values)} values, "
             f"{len(plan.reshards)} reshards moving {format_bytes(plan.total_reshard_bytes())} per device"]
    priced = _priced_on(plan)
    if priced:
        lines.append(f"priced on {priced}")
    for w in plan.warnings:
        lines.append(f"note: {w}")
    cost = getattr(plan, "cost", None)
    if cost is not None:
        lines += ["", "simulated cost:", cost.summary()]
    search = getattr(plan, "search", None)
    if search is not None:
        lines += ["", search.summary()]

    def rows_for(vids: list[int], names: list[str]) -> list[list[str]]:
        rows = []
        for vid, name in zip(vids, names):
            v = g.values[vid]
            rows.append([name, f"{v.dtype}{list(v.shape)}", str(plan.shardings[vid]),
                         format_bytes(plan.local_bytes(vid)), _cause(plan, vid)])
        return rows

    headers = ["value", "shape", "sharding", "bytes/device", "cause"]
    ins = rows_for(list(g.inputs), list(plan.input_names) or [g.values[v].name for v in g.inputs])
    lines += ["", "inputs:", _table(headers, ins[:max_rows])]
    if len(ins) > max_rows:
        lines.append(f"... {len(ins) - max_rows} more inputs")
    outs = rows_for(list(g.outputs), list(plan.output_names) or [g.values[v].name for v in g.outputs])
    in_names = list(plan.input_names) or [g.values[v].name for v in g.inputs]
    name_of_input = dict(zip(g.inputs, in_names))
    carried_from = {out: name_of_input[inp] for inp, out in g.carried().items() if inp in name_of_input}
    for row, vid in zip(outs, g.outputs):
        if vid in carried_from:  # tied: the next step's version of an input leaves in that input's layout
            row[-1] = f"next value of input {carried_from[vid]} (kept in its layout); {row[-1]}"
    lines += ["", "outputs:", _table(headers, outs[:max_rows])]
    if len(outs) > max_rows:
        lines.append(f"... {len(outs) - max_rows} more outputs")
    hints = [op for op in g.ops if op.is_hint]
    if hints:
        rows = []
        for op in hints[:max_rows]:
            vid = op.outputs[0]
            v = g.values[vid]
            spec = op.params.get("spec")
            what = spec.describe() if spec is not None else "with_sharding_constraint"
            src = (spec.source if spec is not None and spec.source else op.source)
            rows.append([what, f"{v.dtype}{list(v.shape)}", str(plan.shardings[vid]),
                         format_bytes(plan.local_bytes(vid)), str(src) if src else "?"])
        lines += ["", "hints:", _table(["hint", "shape", "sharding", "bytes/device", "line"], rows)]
        if len(hints) > max_rows:
            lines.append(f"... {len(hints) - max_rows} more hints")
    if plan.reshards:
        by_kind: dict[str, list[int]] = {}
        for r in plan.reshards:
            by_kind.setdefault(r.kind, []).append(r.bytes)
        summary = ", ".join(f"{k}: {len(v)} ({format_bytes(sum(v))})" for k, v in sorted(by_kind.items()))
        lines += ["", f"reshards by kind: {summary}",
                  "(bytes each device sends for the planned reshards. The simulated cost and the search table "
                  "differ either way: they count each collective's payload as XLA reports it (an all-gather's "
                  "gathered result, loop bodies times their trips), and they leave out reshards of values XLA "
                  "removes or recomputes (duplicates, dead code, broadcasts made again where they are needed))"]
        top = sorted(plan.reshards, key=lambda r: -r.bytes)[:max_rows]
        rows = [[r.kind, format_bytes(r.bytes), f"{r.src} -> {r.dst}", str(r.source) if r.source else "?", r.cause]
                for r in top]
        lines += ["", "largest reshards:", _table(["kind", "bytes/device", "change", "line", "cause"], rows)]
    return "\n".join(lines)
