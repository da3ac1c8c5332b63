"""Which part of each value XLA reads: slices moved towards the values they slice, and the operands of a
concatenate or pad left with no reader.

XLA's algebraic simplifier moves a slice (a dynamic slice at constant starts is one) through the ops below it
that only move data — another slice, a broadcast, a pad, a reverse, a concatenate; a hint, which is none
after partitioning — down to the values it reads from (a gather whose indices fold to a single index is such
a slice, `gather_window`): `slice(concat(a, b))` reading only `a`'s part is a
slice of `a`, and a slice of a pad reading only its padding is a broadcast of the padding value. A
concatenate's operand (or a pad's) that no slice reads is then read by nothing, so XLA's DCE removes it with
the ops and reshards only it needs (an einsum's all-reduce, an all-gather feeding the concatenate).
Measured on the compiled HLO of jaxlib 0.10: elementwise ops, converts, reshapes and transposes stop the
slice (what they read is read whole).

`read_windows` is the analysis: per value, the box (per dim, [start, limit)) its readers read of it, or None
when nothing reads it; `window_unread` is what it implies for one op: the operands of a concatenate or pad
(`WINDOW_RULES`) lying outside every read. `shardc.cost.program.unread_operands` adds them to the operands
XLA's simplifier drops (so the plan and the simulator skip their reshards and what only they need), and the
lowering hands such an operand to the op as zeros (`shardc.lower.Lowering.unread_as_zeros`) so that XLA
drops it whatever layouts the plan gives the values between the slice and the concatenate.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

from shardc.cost.aliases import ALIASES
from shardc.ir.folding import constant_array
from shardc.ir.graph import Graph

__all__ = ["Box", "OUT_OF_BOUNDS", "WINDOW_RULES", "slice_window", "gather_window", "read_windows", "window_unread"]

Box = tuple[tuple[int, int], ...]  # per dim, the [start, limit) read
OUT_OF_BOUNDS = "out of bounds"  # (`gather_window` of a fill-or-drop gather reading nothing: its fill value)


def slice_window(graph: Graph, op: Any) -> list[tuple[int, int]] | None:
    """Per dim, the [start, limit) of its operand a slice reads (a pad with no positive padding is a slice
    too: the transpose of a pad; so is a dynamic slice whose start indices are compile-time constants,
    clamped into the operand as XLA clamps them); None for other ops."""
    if op.primitive == "slice":
        return list(zip(op.params["start_indices"], op.params["limit_indices"]))
    if op.primitive == "dynamic_slice" and op.inputs:
        starts = [_scalar_constant(graph, v) for v in op.inputs[1:]]
        shape, sizes = graph.values[op.inputs[0]].shape, op.params.get("slice_sizes", ())
        if len(starts) != len(shape) or len(sizes) != len(shape) or any(s is None for s in starts):
            return None
        return _clamped(starts, sizes, shape)
    if op.primitive == "pad":
        config = [tuple(c) for c in op.params["padding_config"]]
        if all(lo <= 0 and hi <= 0 and interior == 0 for lo, hi, interior in config):
            shape = graph.values[op.inputs[0]].shape
            return [(-lo, n + hi) for (lo, hi, _), n in zip(config, shape)]
    return None


def _scalar_constant(graph: Graph, v: int) -> int | None:
    """Value `v` as a Python int when it is a scalar integer known at compile time (a literal, or folded:
    `lax.dynamic_slice` wraps a negative start with lt/add/select_n), else None."""
    array = constant_array(graph, v)
    return int(array) if array is not None and array.shape == () and array.dtype.kind in "iu" else None


def gather_window(graph: Graph, op: Any) -> list[tuple[int, int]] | None | str:
    """Per operand dim, the [start, limit) a gather reads when its indices fold to one index (XLA makes it a
    dynamic slice at constant starts, then a slice): clamped into the operand as XLA clamps them, or
    `OUT_OF_BOUNDS` when a fill-or-drop gather's index lies out of bounds (its result is the fill value; with
    several constant indices, when every one does); None for other gathers."""
    if op.primitive != "gather" or len(op.inputs) != 2:
        return None
    numbers, sizes = op.params["dimension_numbers"], op.params["slice_sizes"]
    if getattr(numbers, "operand_batching_dims", ()):
        return None
    indices = constant_array(graph, op.inputs[1])
    index_map = tuple(numbers.start_index_map)
    n = len(index_map)
    if indices is None or (indices.size % n if n else indices.size):
        return None
    shape = graph.values[op.inputs[0]].shape
    rows = indices.reshape(-1, n).tolist() if n else [[]]
    outside = lambda row: any(i < 0 or i + sizes[d] > shape[d] for d, i in zip(index_map, row))  # noqa: E731
    if "FILL_OR_DROP" in str(op.params.get("mode")) and all(map(outside, rows)):
        return OUT_OF_BOUNDS  # (XLA folds a gather whose every index is out of bounds to its fill)
    if len(rows) != 1:
        return None
    starts = [0] * len(sizes)
    for d, i in zip(index_map, rows[0]):
        starts[d] = int(i)
    return _clamped(starts, sizes, shape)


def _clamped(starts: Sequence[int], sizes: Sequence[int], shape: Sequence[int]) -> list[tuple[int, int]]:
    """Per dim, the [start, limit) of a window of `sizes` at `starts`, clamped into `shape` as XLA clamps a
    dynamic slice's (and a gather's) start indices."""
    lows = [min(max(s, 0), n - k) for s, k, n in zip(starts, sizes, shape)]
    return [(lo, lo + k) for lo, k in zip(lows, sizes)]


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def _union(a: Box | None, b: Box | None) -> Box | None:
    if a is None or b is None:
        return a if b is None else b
    return tuple((min(x0, y0), max(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))


# A rule: given the graph, the op and the boxes read of its results (None: not read), the box read of each
# operand (None: not read at all), or None when the op reads its operands whole.
WindowRule = Callable[[Graph, Any, Sequence["Box | None"]], "list[Box | None] | None"]


def _sliced(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A slice (dynamic at constant starts; a pad cutting its operand) reads its window of the part read of it
    (with strides: from the first element read to the last)."""
    window = slice_window(graph, op)
    if window is None:
        return None
    read = out[0]
    strides = (op.params.get("strides") if op.primitive == "slice" else None) or (1,) * len(window)
    box = None if read is None else tuple((s + lo * k, s + (hi - 1) * k + 1)
                                          for (s, _), (lo, hi), k in zip(window, read, strides))
    return [box] + [_full(graph.values[v].shape) for v in op.inputs[1:]]


def _gathered(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A gather at one constant index (`gather_window`) reads its window of the part read of it: the
    operand's uncollapsed dims are the result's offset dims, in order; the indices are read whole."""
    window = gather_window(graph, op)
    if window is None:
        return None
    indices = _full(graph.values[op.inputs[1]].shape)
    read = out[0]
    if read is None or window == OUT_OF_BOUNDS:
        return [None, indices]
    numbers = op.params["dimension_numbers"]
    offsets = iter(sorted(numbers.offset_dims))
    box = []
    for d, (start, limit) in enumerate(window):
        if d in numbers.collapsed_slice_dims:
            box.append((start, limit))
        else:
            lo, hi = read[next(offsets)]
            box.append((start + lo, start + hi))
    return [tuple(box), indices]


def _broadcast(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A broadcast reads, of each operand dim, the part read of the result dim it becomes (all of a dim of
    size 1 it broadcasts)."""
    read, src = out[0], graph.values[op.inputs[0]].shape
    if read is None:
        return [None]
    dst = graph.values[op.outputs[0]].shape
    mapped = op.params.get("broadcast_dimensions", ())
    return [tuple(read[d] if n == dst[d] else (0, n) for n, d in zip(src, mapped))]


def _reversed(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A reverse reads the mirror image of the part read of it."""
    read = out[0]
    if read is None:
        return [None]
    shape, dims = graph.values[op.inputs[0]].shape, set(op.params.get("dimensions", ()))
    return [tuple((n - hi, n - lo) if d in dims else (lo, hi) for d, ((lo, hi), n) in enumerate(zip(read, shape)))]


def _concatenated(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A concatenate reads, of each operand, the part of the read box lying in it along the concatenated dim
    (None: the operand lies outside it)."""
    read = out[0]
    if read is None:
        return [None] * len(op.inputs)
    dim, offset, boxes = op.params["dimension"], 0, []
    for v in op.inputs:
        n = graph.values[v].shape[dim]
        lo, hi = max(read[dim][0], offset) - offset, min(read[dim][1], offset + n) - offset
        boxes.append(read[:dim] + ((lo, hi),) + read[dim + 1:] if lo < hi else None)
        offset += n
    return boxes


def _padded(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A pad reads, of its operand, the elements lying in the part read of it; None when on some dim that
    part lies before the first or after the last of them (only padding: a broadcast of the padding value to
    XLA's simplifier; a part between two elements in interior padding is read, XLA does not fold it)."""
    read = out[0]
    shape = graph.values[op.inputs[0]].shape
    if read is None:
        return [None, _full(())]
    box = []
    for (start, limit), (lo, _, interior), n in zip(read, op.params["padding_config"], shape):
        step = interior + 1
        if n == 0 or limit <= lo or start > lo + (n - 1) * step:
            return [None, _full(())]
        first, last = -(-(start - lo) // step), (limit - 1 - lo) // step
        first, last = max(first, 0), min(last, n - 1)
        box.append((first, last + 1) if first <= last else (0, n))
    return [tuple(box), _full(())]


def _split(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A split (slices, to XLA) reads, of its operand, the parts read of each of its results."""
    axis, offset, box = op.params["axis"], 0, None
    for v, read in zip(op.outputs, out):
        n = graph.values[v].shape[axis]
        if read is not None:
            shifted = read[:axis] + ((read[axis][0] + offset, read[axis][1] + offset),) + read[axis + 1:]
            box = _union(box, shifted)
        offset += n
    return [box]


def _same(graph: Graph, op: Any, out: Sequence[Box | None]) -> list[Box | None] | None:
    """A hint (or a name, a stop_gradient) reads of its operand what is read of it: it is no instruction
    after partitioning, or a reshard between the slice and what it slices (which the lowering's zeros make
    harmless: `window_unread`)."""
    return [out[0]]


# Per primitive: how the part read of an op's results maps to the part read of its operands (ops XLA's
# simplifier moves a slice through; any other op reads its operands whole).
WINDOW_RULES: dict[str, WindowRule] = {
    "slice": _sliced, "dynamic_slice": _sliced, "pad": _padded, "broadcast_in_dim": _broadcast,
    "rev": _reversed, "concatenate": _concatenated, "split": _split, "gather": _gathered,
    **{p: _same for p in ALIASES}}
# Ops whose operands no reader of theirs may read at all (`window_unread`); the others' operands are read.
_DROPS_OPERANDS = frozenset({"concatenate", "pad"})


def read_windows(graph: Graph) -> tuple[Box | None, ...]:
    """Per value, the box its readers read of it (None: no op reads it), through `WINDOW_RULES`, over the
    values XLA's CSE keeps (a value and its duplicates are read together); program outputs, values a region
    reads and values several ops write are read whole (cached on the graph)."""
    return graph.analysis("read_windows", lambda: _read_windows(graph))


def _read_windows(graph: Graph) -> tuple[Box | None, ...]:
    from shardc.cost.program import cse  # (program asks this module which operands are unread)
    canon = cse(graph)[0]
    boxes: list[Box | None] = [None] * len(graph.values)
    writers = collections.Counter(v for op in graph.ops for v in op.outputs)
    whole = set(graph.outputs) | {v for vs in graph.region_reads.values() for v in vs}
    whole |= {v for v, n in writers.items() if n > 1}
    for v in whole:
        boxes[canon[v]] = _full(graph.values[v].shape)
    for op in reversed(graph.ops):
        rule = WINDOW_RULES.get(op.primitive)
        reads = rule(graph, op, [boxes[canon[v]] for v in op.outputs]) if rule is not None else None
        if reads is None:  # (read whole: the union with anything read before is the whole)
            for v in op.inputs:
                boxes[canon[v]] = _full(graph.values[v].shape)
            continue
        for v, box in zip(op.inputs, reads):
            boxes[canon[v]] = _union(boxes[canon[v]], box)
    return tuple(boxes[canon[v]] for v in range(len(boxes)))


def window_unread(graph: Graph, op: Any) -> tuple[int, ...]:
    """The operands of a concatenate or pad some of whose result is read but none of them (`read_windows`):
    XLA's simplifier moves every slice reading the op past them, and nothing reads them."""
    if op.primitive not in _DROPS_OPERANDS:
        return ()
    boxes = read_windows(graph)
    out = [boxes[v] for v in op.outputs]
    if all(b is None for b in out):
        return ()
    reads = WINDOW_RULES[op.primitive](graph, op, out)
    return tuple(i for i, b in enumerate(reads or ()) if b is None)
