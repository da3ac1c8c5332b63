"""Timeline export: Chrome trace JSON (Perfetto, chrome://tracing) and a PNG Gantt chart."""
from __future__ import annotations

import json
from typing import Any

__all__ = ["chrome_trace", "gantt"]


def chrome_trace(result: Any, path: str) -> str:
    """One track per stream; each task is a complete event ("X") with its op and source line."""
    g = result.plan.graph
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0,
                                     "args": {"name": "device 0 (representative)"}}]
    for i, s in enumerate(result.streams):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": s}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": i, "args": {"sort_index": i}})
    tid = {s: i for i, s in enumerate(result.streams)}
    for name, kind, stream, start, end, op in result.tasks():
        src = g.ops[op].source
        events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": tid[stream],
                       "ts": start * 1e6, "dur": (end - start) * 1e6,
                       "args": {"op": op, "primitive": g.ops[op].primitive, "source": str(src) if src else ""}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"topology": result.topology.name, "step_time_s": result.step_time}}, f)
    return path


_COLORS = {"compute": "#4c72b0", "all-reduce": "#dd8452", "all-gather": "#55a868", "reduce-scatter": "#c44e52",
           "all-to-all": "#8172b3", "collective-permute": "#937860"}


def gantt(result: Any, path: str, *, max_tasks: int = 4000) -> str:
    """A PNG Gantt chart: one row per stream, tasks coloured by kind (the longest `max_tasks` drawn)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover
        raise ImportError("result.gantt needs matplotlib (pip install matplotlib)") from e
    tasks = sorted(result.tasks(), key=lambda t: -(t[4] - t[3]))[:max_tasks]
    rows = {s: i for i, s in enumerate(result.streams)}
    scale, unit = (1e3, "ms") if result.step_time >= 1e-3 else (1e6, "us")
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(rows)))
    for name, kind, stream, start, end, _ in tasks:
        ax.broken_barh([(start * scale, max((end - start) * scale, 1e-9))], (rows[stream] - 0.4, 0.8),
                       facecolors=_COLORS.get(kind, "#999999"), linewidth=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(list(rows))
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, max(result.step_time * scale, 1e-9))
    ax.set_title(f"{result.topology.name}: step {result.step_time * scale:.3f} {unit}, "
                 f"peak memory {result.peak_memory / 2**20:.1f} MiB/device")
    kinds = sorted({t[1] for t in tasks})
    ax.legend(handles=[Patch(color=_COLORS.get(k, "#999999"), label=k) for k in kinds], loc="upper right",
              fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
