"""Human-readable plan reports (`plan.explain()`). The first question first: on which mesh and hardware,
how fast, how much memory, and how each input group (batch, parameters, optimizer state) is laid out;
then, per decision group (repeated layers), what was chosen and what it beat; then the search, the
simulated cost and the detail tables (every input and output with its cause, hints, reshards). Lines
fit `width` columns: long cells are shortened, prose is wrapped."""
from __future__ import annotations

import math
import re
import textwrap
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from shardc.plan import Plan

__all__ = ["explain", "format_bytes"]

MAX_GROUPS = 8  # decision groups listed at the top


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _time(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


# -- layout helpers ---------------------------------------------------------------------------------------
def _shorten(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    if width <= 3:
        return text[:width]
    keep = width - 3
    return text[: (keep + 1) // 2] + "..." + text[len(text) - keep // 2:]


def _table(headers: list[str], rows: list[list[str]], width: int) -> str:
    """Columns as wide as their cells; when the table is wider than `width`, the widest columns are
    shortened (their cells keep both ends) until it fits."""
    cols = len(headers)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    while sum(widths) + 2 * (cols - 1) > width:
        i = max(range(cols), key=lambda k: widths[k])
        if widths[i] <= max(len(headers[i]), 12):
            break
        widths[i] -= 1
    line = "  ".join(_shorten(h, w).ljust(w) for h, w in zip(headers, widths))
    out = [line.rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(_shorten(c, w).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out)


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """Each line of `text` wrapped to `width` (continuations indented two more spaces)."""
    out = []
    for line in text.splitlines() or [""]:
        lead = indent + line[: len(line) - len(line.lstrip())]
        out += textwrap.wrap(line.strip(), width, initial_indent=lead, subsequent_indent=lead + "  ",
                             break_on_hyphens=False) or [lead]
    return out


def _cause(plan: "Plan", vid: int) -> str:
    causes = [str(c) for c in dict.fromkeys(c for c in plan.origins[vid] if c is not None)]
    if causes:
        return "; ".join(causes)
    return "replicated (undecided)" if plan.shardings[vid].is_replicated() else "propagated"


# -- the overview --------------------------------------------------------------------------------------------
def _cost(plan: "Plan") -> tuple[Any, str]:
    """The plan's simulated cost and what it was priced on; a plan made without a topology (search=False)
    is priced here on the devices at hand."""
    cost = getattr(plan, "cost", None)
    search = getattr(plan, "search", None)
    if cost is None:
        from shardc.cost.local import local_topology
        from shardc.plan import is_abstract
        from shardc.sim import simulate

        if is_abstract(plan.mesh):
            return None, ""
        topo = local_topology()
        cost = simulate(plan, topo)
        return cost, f"{topo.name} (the devices at hand, {topo.source}; for this report: the plan was not searched)"
    if search is not None and getattr(search, "topology", ""):
        return cost, search.topology
    topo = cost.topology
    return cost, f"{topo.name} ({topo.source})" if topo.source else topo.name


def _group_key(name: str) -> str:
    """The argument an input belongs to: the leading name of its path (`params`, `opt_state`, `[0]`)."""
    m = re.match(r"^(\[\d+\]|\['[^']*'\]|[^\[.(\s]+)", name)
    return m.group(1) if m else name


def _input_groups(plan: "Plan", names: Sequence[str]) -> list[tuple[str, list[int], bool]]:
    """(argument, its input value ids, carried state?) in argument order."""
    g = plan.graph
    carried = set(g.carried())
    groups: dict[str, list[int]] = {}
    for vid, name in zip(g.inputs, names):
        groups.setdefault(_group_key(name), []).append(vid)
    return [(k, vids, all(v in carried for v in vids)) for k, vids in groups.items()]


def _layout_summary(plan: "Plan", vids: list[int], names: dict[int, str], key: str) -> str:
    """How one argument's tensors are laid out, in a few words."""
    sh = plan.shardings
    if all(sh[v].is_replicated() for v in vids):
        return "replicated (every device holds all of it)"
    if len(vids) <= 3:
        return ", ".join(f"{names[v][len(key):].lstrip('.') or key} {sh[v]}" for v in vids)
    kinds: dict[str, int] = {}
    for v in vids:
        axes = sorted({a for d in sh[v].dims for a in d})
        kind = "replicated" if not axes else "split over " + "+".join(axes)
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))


def _inputs_overview(plan: "Plan", names: Sequence[str], width: int) -> list[str]:
    g = plan.graph
    by_vid = dict(zip(g.inputs, names))
    groups = _input_groups(plan, names)
    w = max((len(k) for k, _, _ in groups), default=0)
    lines = ["inputs (bytes per device of the whole; layout):"]
    for key, vids, state in groups:
        local = sum(plan.local_bytes(v) for v in vids)
        whole = sum(g.values[v].nbytes for v in vids)
        role = "state" if state else "data"
        count = f"{len(vids)} tensor{'s' if len(vids) != 1 else ''}"
        head = f"  {key.ljust(w)}  {role}, {count}, {format_bytes(local)} of {format_bytes(whole)}: "
        lines += _wrap(head + _layout_summary(plan, vids, by_vid, key), width)
    return lines


def _strategy_text(plan: "Plan", op_id: int) -> str:
    """The layouts an op's strategy computes in: operands -> results (partial sums marked)."""
    from shardc.sharding import Sharding

    op = plan.graph.ops[op_id]
    strat, rule, mesh = plan.strategies[op_id], op.rule, plan.mesh_sizes
    ins = [str(strat.tensor_sharding(rule, d, mesh)) for d in rule.operands]
    partial = strat.partial_axes(rule)
    outs = []
    for d in rule.results:
        s = strat.tensor_sharding(rule, d, mesh)
        outs.append(str(Sharding(s.dims, partial) if partial else s))
    return f"{', '.join(ins)} -> {', '.join(outs)}"


def _decisions(plan: "Plan", width: int, step_flops: float) -> list[str]:
    from shardc.layers import decision_groups, group_label
    from shardc.waste import duplication

    g = plan.graph
    groups = decision_groups(g)
    if not groups:
        return []
    search = getattr(plan, "search", None)
    notes = {n.members[0]: n for n in getattr(search, "groups", ())} if search is not None else {}
    lines = ["decisions (repeated ops share one; heaviest first): the layouts chosen, and what they beat"]
    for grp in groups[:MAX_GROUPS]:
        first = grp.members[0]
        op = g.ops[first]
        share = f", {100 * grp.flops / step_flops:.0f}% of the step's FLOPs" if step_flops else ""
        shapes = " x ".join("[" + ",".join(map(str, g.values[v].shape)) + "]" for v in op.inputs[:2])
        text = (f"  {group_label(g, grp.members)} ({len(grp.members)} {op.primitive} of {shapes}{share}): "
                f"{_strategy_text(plan, first)}")
        dup = duplication(plan, first)
        if dup > 1:
            text += f"; compute duplicated {dup} times"
        note = notes.get(first)
        if note is not None:
            if note.same_as:
                text += f"; as in {', '.join(note.same_as)}"
            if note.beats:  # the closest alternatives
                text += "; " + ", ".join(f"{_time(abs(dt))} {'faster' if dt >= 0 else 'slower'} than {who}'s choice"
                                        for who, dt in note.beats[:2]) + " here"
        lines += _wrap(text, width)
    if len(groups) > MAX_GROUPS:
        lines.append(f"  ... {len(groups) - MAX_GROUPS} more groups")
    return lines


def _overview(plan: "Plan", names: Sequence[str], width: int) -> tuple[list[str], Any]:
    from shardc.waste import describe_duplication, duplicated_flops

    g = plan.graph
    n = math.prod(plan.mesh_sizes.values())
    mesh = ", ".join(f"{a}={k}" for a, k in plan.mesh_sizes.items())
    cost, priced = _cost(plan)
    lines = _wrap(f"shardc plan: mesh ({mesh}) of {n} device{'s' if n != 1 else ''}"
                  + (f", priced on {priced}" if priced else ""), width)
    if cost is not None:
        m = cost.memory
        lines += _wrap(f"step {_time(cost.step_time)} simulated (compute {_time(cost.compute_time)}, communication "
                       f"{_time(cost.comm_time)}); memory {format_bytes(m.peak)} per device at the peak (of "
                       f"{format_bytes(cost.topology.device.memory)})" + ("" if cost.fits else ": DOES NOT FIT"), width)
    lines += _wrap(f"{describe_duplication(plan)}; {len(g.ops)} ops, {len(plan.reshards)} reshards moving "
                   f"{format_bytes(plan.total_reshard_bytes())} per device", width)
    for w in plan.warnings:
        lines += _wrap(f"note: {w}", width)
    lines += [""] + _inputs_overview(plan, names, width)
    dec = _decisions(plan, width, sum(duplicated_flops(plan).values()))
    if dec:
        lines += [""] + dec
    return lines, cost


# -- the details ---------------------------------------------------------------------------------------------
def _value_rows(plan: "Plan", vids: Sequence[int], names: Sequence[str]) -> list[list[str]]:
    g = plan.graph
    rows = []
    for vid, name in zip(vids, names):
        v = g.values[vid]
        rows.append([name, f"{v.dtype}{list(v.shape)}", str(plan.shardings[vid]), format_bytes(plan.local_bytes(vid)),
                     _cause(plan, vid)])
    return rows


def _inputs_table(plan: "Plan", names: Sequence[str], max_rows: int, width: int) -> list[str]:
    """Every data input (the batch) first and never cut; state inputs up to `max_rows`."""
    g = plan.graph
    carried = set(g.carried())
    data = [(v, n) for v, n in zip(g.inputs, names) if v not in carried]
    state = [(v, n) for v, n in zip(g.inputs, names) if v in carried]
    shown = data + state[:max(max_rows - len(data), 0)]
    rows = _value_rows(plan, [v for v, _ in shown], [n for _, n in shown])
    headers = ["value", "shape", "sharding", "bytes/device", "cause"]
    lines = ["inputs (data first):", _table(headers, rows, width)]
    if len(shown) < len(g.inputs):
        lines.append(f"... {len(g.inputs) - len(shown)} more state inputs (max_rows={max_rows})")
    return lines


def _details(plan: "Plan", names: Sequence[str], max_rows: int, width: int) -> list[str]:
    g = plan.graph
    headers = ["value", "shape", "sharding", "bytes/device", "cause"]
    lines = [""] + _inputs_table(plan, names, max_rows, width)
    out_names = list(plan.output_names) or [g.values[v].name for v in g.outputs]
    outs = _value_rows(plan, list(g.outputs), out_names)
    name_of_input = dict(zip(g.inputs, names))
    carried_from = {out: name_of_input[inp] for inp, out in g.carried().items() if inp in name_of_input}
    for row, vid in zip(outs, g.outputs):
        if vid in carried_from:  # tied: the next step's version of an input leaves in that input's layout
            row[-1] = f"next value of input {carried_from[vid]} (kept in its layout); {row[-1]}"
    lines += ["", "outputs:", _table(headers, outs[:max_rows], width)]
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
        lines += ["", "hints:", _table(["hint", "shape", "sharding", "bytes/device", "line"], rows, width)]
        if len(hints) > max_rows:
            lines.append(f"... {len(hints) - max_rows} more hints")
    if plan.reshards:
        by_kind: dict[str, list[int]] = {}
        for r in plan.reshards:
            for c in r.collectives:
                by_kind.setdefault(c.kind, []).append(c.bytes)
        summary = ", ".join(f"{k}: {len(v)} ({format_bytes(sum(v))})" for k, v in sorted(by_kind.items()))
        free = sum(1 for r in plan.reshards if not r.collectives)
        lines += [""] + _wrap(f"collectives of the planned reshards: {summary or 'none'}"
                              + (f"; {free} free local slices" if free else ""), width)
        lines += _wrap("(payload per device of each collective XLA emits for them, as shardc.check reads them from the "
                       "compiled program. The simulated cost counts loop bodies times their trips and leaves out "
                       "reshards of values made once and reused, or removed by XLA as duplicates or dead code)",
                       width)
        top = sorted(plan.reshards, key=lambda r: -r.bytes)[:max_rows]
        rows = [[r.kind, format_bytes(r.bytes), f"{r.src} -> {r.dst}", str(r.source) if r.source else "?", r.cause]
                for r in top]
        lines += ["", "largest reshards:", _table(["kind", "bytes/device", "change", "line", "cause"], rows, width)]
    return lines


def explain(plan: "Plan", *, max_rows: int = 60, width: int = 120) -> str:
    """The report: overview (mesh, topology, step time, memory, input groups, decision groups), the search
    against its baselines, the simulated cost, then the tables (at most `max_rows` rows each, except the
    data inputs, which are always listed), every line at most `width` columns."""
    g = plan.graph
    names = list(plan.input_names) or [g.values[v].name for v in g.inputs]
    lines, cost = _overview(plan, names, width)
    search = getattr(plan, "search", None)
    if search is not None:
        lines += [""] + [w for line in search.summary().splitlines() for w in _wrap(line, width)]
    for choice in (getattr(plan, "remat", None), getattr(plan, "loops", None)):
        if choice is not None:
            lines += [""] + [w for line in choice.summary().splitlines() for w in _wrap(line, width)]
    rewrites = getattr(plan, "pcg", None)
    if rewrites is not None:
        lines += [""] + [w for line in rewrites.summary().splitlines() for w in _wrap(line, width)]
    pipeline = getattr(plan, "pipeline", None)
    if pipeline is not None:
        text = f"pipeline: {pipeline.describe()}\n{pipeline.stage_map()}"
        lines += [""] + [w for line in text.splitlines() for w in _wrap(line, width)]
    choice = getattr(plan, "pipeline_choice", None)
    if choice is not None:
        lines += [""] + [w for line in choice.summary().splitlines() for w in _wrap(line, width)]
    if cost is not None:
        lines += ["", "simulated cost:"] + [w for line in cost.summary().splitlines() for w in _wrap(line, width)]
    lines += _details(plan, names, max_rows, width)
    return "\n".join(lines)
