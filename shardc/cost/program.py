"""What XLA keeps of a program: the plan-independent facts the cost model needs about a Graph.

* duplicate ops (same primitive, params and inputs as an earlier op) are merged by CSE — so are their
  reshards (`canon` maps every value to the one XLA keeps);
* dead ops (nothing they make reaches an output) are removed by XLA's DCE, loops and branches whole; an
  operand XLA's simplifier stops reading (`unread_operands`) keeps nothing alive;
* constant ops (all inputs are compile-time constants) are folded, through loops of one trip too;
* fused values: XLA fuses an elementwise-like op into its consumers when they are all elementwise-like
  or reductions in a loop fusion — duplicating it into each when it is cheap, not when it is expensive
  (transcendentals, divides: those are fused only into a single consumer) — so its result is never written
  to memory. A fused value is recomputed where it is materialised: the operands it is computed from are
  read until then (`until`; an optimization barrier's result i is its operand i, not the others).
* backend rules (`backend="cpu"`, XLA:CPU): floating-point reductions are library (YNNPACK) fusions that
  absorb only producers read by them alone (`library`); the ops run in breadth-first order (`order`,
  `eager`: what depends only on the arguments runs at the start). Elsewhere: program order.
* strided reads (`backend="cpu"`): a transpose that moves the minor dimension and is fused into loop
  fusions is read element by element across its operand's memory order in each of them (`strided`: how many);
  one that reads a dot's result as the dot makes it is folded into the dot instead (the plan decides that:
  `shardc.sim.tasks`).
* regions: each op's outermost loop/branch region (`span`) and the values a loop carries (`carried`);
  on XLA:CPU, buffers made at the program's start and written in place later (`preset`: loop state
  initialised from constants, scatters into a constant operand).
* loop regions run `trips` times (scan length; 1 when XLA cannot know it); the reshards of values entering
  or leaving a loop run outside it (`reshard_trips`).

Computed once per Graph and backend (`program_info(graph, backend)`, cached on the graph object) and shared
by every plan of it.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, Collection, Iterator, Mapping, NamedTuple, Sequence

from shardc.cost import splats
from shardc.cost.aliases import ALIASES, HINTS  # (ALIASES' results have no buffer of their own, `fused`, yet what
# reads one reads its operand's buffer, unless the operand itself is fused)
from shardc.cost.estimator import params_key
from shardc.cost.flops import ELEMENTWISE, TRANSCENDENTAL, dot_rewrite
from shardc.cost.unfusible import globally_unfusible
from shardc.cost.wide_results import wide_results
from shardc.cost.windows import OUT_OF_BOUNDS, gather_window, slice_window, window_unread
from shardc.ir.graph import Graph

__all__ = ["ProgramInfo", "program_info", "per_info", "descendants", "Merged", "merged", "liveness", "unread_operands",
           "unread_if_same", "unread_repeats", "read_values",
           "SAME_OPERAND_RULES", "PASS_THROUGH_RULES", "BOUND_THROUGH", "passes_through", "splat_literal", "ALIASES",
           "reads_only_padding", "pad_of", "scatter_into_constant", "loop_entry", "enters_a_constant", "loop_exit",
           "is_loop_region",
           "broadcast_dims", "broadcast_transfer", "derived", "fusing_readers",
           "FUSIBLE", "FREE_PRIMITIVES", "PCG_COLLECTIVE"]

# Ops XLA fuses into their consumers (loop fusion): elementwise math and cheap data movement.
FUSIBLE = frozenset(ELEMENTWISE) | frozenset(TRANSCENDENTAL) | frozenset({
    "integer_pow", "broadcast_in_dim", "reshape", "convert_element_type", "iota", "squeeze", "expand_dims",
    "select_n", "stop_gradient", "slice", "transpose", "rev", "pad", "concatenate", "split"})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "argmax", "argmin"})
# Elementwise computation (not data movement): what a fusion recomputes into each consumer when it is cheap.
_ARITHMETIC = frozenset(ELEMENTWISE) | frozenset(TRANSCENDENTAL) | frozenset({"integer_pow", "select_n"})
# Reductions XLA:CPU hands to a library (YNNPACK) as a fusion of their own (floating point only).
LIBRARY_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
# A PCG's parallel op in the plan `shardc.pcg.simcost` makes of a PCG: no computation of its own, but (as
# the collective it stands for) a result in a buffer of its own that its readers read from memory.
PCG_COLLECTIVE = "pcg_collective"
# Ops that are not computation at all: hints, constraints, region ties.
FREE_PRIMITIVES = frozenset({"shardc_hint", "sharding_constraint", "tie", "scan_slice", "scan_stack",
                             "optimization_barrier", PCG_COLLECTIVE}) | ALIASES
_NOT_MERGED = frozenset({"tie", "scan_slice", "scan_stack"})
# Ops XLA computes at run time even from constant operands: jax lowers the threefry hash to a loop (XLA:CPU) or
# to elementwise work on an iota, and XLA's constant folding evaluates neither (measured: `jax.random.uniform`,
# `split`, `fold_in` of `jax.random.key(0)` compile to a while loop), so a dropout mask drawn with a literal seed
# is a buffer of the step like any other.
_RUN_TIME = frozenset({"random_bits", "random_split", "random_fold_in", "threefry2x32"})
# XLA duplicates cheap producers into each consumer, but not expensive ones (InstructionFusion::IsExpensive):
# transcendentals and floating divides, except sin and cos (and, on XLA:CPU, tan) of real numbers, and abs and
# sign, which are cheap unless complex. XLA:GPU also counts f32/f16 divides, sqrt, rsqrt and exp as cheap.
EXPENSIVE = frozenset(TRANSCENDENTAL) | {"div", "rem"}
_CHEAP_REAL = {"": frozenset({"sin", "cos"}), "cpu": frozenset({"sin", "cos", "tan"}),
               "gpu": frozenset({"sin", "cos"})}
_CHEAP_F32_GPU = frozenset({"div", "sqrt", "rsqrt", "exp"})


def rewritten_dot(op: Any, graph: Graph) -> str | None:
    """For a dot_general XLA's simplifier rewrites (`dot_rewrite`): "multiply" (elementwise, fused like one) or
    "reduce" (a reduction of a fused multiply); None for any other op. None of the dot rules (operand copies, GEMM
    layouts, transposed results) apply to such a dot."""
    if op.primitive != "dot_general":
        return None
    return dot_rewrite(op.params, [len(graph.values[v].shape) for v in op.inputs])


def fusible(op: Any, graph: Graph) -> bool:
    """Whether XLA's loop fusion may take `op` into its readers (`FUSIBLE`), a dot contracting nothing (a multiply
    to XLA: `rewritten_dot`), a dynamic_slice at compile-time constant starts (the simplifier makes it a slice:
    measured, an elementwise producer is fused into it and no longer materialised; at a start known only at run
    time it is), or a bitcast_convert_type between types of one width (XLA's elementwise, cheap bitcast-convert;
    across widths it adds or drops a dim)."""
    if op.primitive in FUSIBLE or rewritten_dot(op, graph) == "multiply":
        return True
    if op.primitive == "dynamic_slice":
        return slice_window(graph, op) is not None
    return (op.primitive == "bitcast_convert_type" and len(op.inputs) == 1 and len(op.outputs) == 1
            and tuple(graph.values[op.inputs[0]].shape) == tuple(graph.values[op.outputs[0]].shape))


# XLA:CPU keeps a concatenate out of every fusion (neither fused into its readers nor its operands into it) when
# it has more than this many operands, or joins along the minor dim (row-major: the last) at least
# `_MINOR_CONCAT_DIM_BYTES` along it and `_MINOR_CONCAT_BYTES` in all: a memcpy loop beats a fused one there
# (CpuInstructionFusion::ShouldFuse).
_MAX_FUSED_CONCAT_OPERANDS = 8
_MINOR_CONCAT_DIM_BYTES = 64
_MINOR_CONCAT_BYTES = 2048


def unfused_concatenate(op: Any, graph: Graph, backend: str) -> bool:
    """Whether `op` is a concatenate XLA's fusion on `backend` leaves unfused (XLA:CPU; from its global shape)."""
    if op.primitive != "concatenate" or backend != "cpu" or not op.outputs:
        return False
    if len(op.inputs) > _MAX_FUSED_CONCAT_OPERANDS:
        return True
    out = graph.values[op.outputs[0]]
    shape, item = tuple(out.shape), int(out.dtype.itemsize) if out.dtype is not None else 4
    return (len(shape) >= 2 and int(op.params["dimension"]) == len(shape) - 1
            and shape[-1] * item >= _MINOR_CONCAT_DIM_BYTES and math.prod(shape) * item >= _MINOR_CONCAT_BYTES)


def fusible_on(op: Any, graph: Graph, backend: str) -> bool:
    """`fusible`, on `backend`: XLA:CPU leaves some concatenates out of every fusion (`unfused_concatenate`)."""
    return fusible(op, graph) and not unfused_concatenate(op, graph, backend)


def _fused_into_readers(op: Any, backend: str, invariant: Collection[int] = frozenset()) -> bool:
    """Whether XLA:CPU's loop fusion takes `op`'s result into its readers though it fuses nothing into `op`: a
    dynamic_slice at a start known only at run time (a loop body's `x[i]`; CanBeLoopFused, measured: the slice
    is read inside its reader's fusion, no buffer) — unless it is invariant in its loop (`invariant`: value ids;
    loop-invariant code motion takes it out, a loop operand: an outer loop's `x[i]` read in an inner loop)."""
    return backend == "cpu" and op.primitive == "dynamic_slice" and not any(v in invariant for v in op.outputs)


def is_loop_region(name: str) -> bool:
    """Whether a region path component names a loop's body (a scan or while loop; not a cond branch)."""
    return name.startswith(("scan", "while"))


def _in_loop_body(op: Any) -> bool:
    """Whether `op`'s innermost region is a loop's body (not a branch)."""
    return is_loop_region(op.region.rsplit("/", 1)[-1])


def loop_entry(op: Any) -> bool:
    """Whether `op` is a loop's entry tie: it takes a value into the loop (its initial state or a constant)."""
    return op.primitive == "tie" and op.params.get("at") == "in"


def enters_a_constant(op: Any, constant: Sequence[bool]) -> bool:
    """Whether `op` is a loop's entry tie taking a compile-time constant in (`constant`: per value): XLA's
    partitioner makes the constant in the layout of the loop's state, so the tie's result needs no reshard
    (a zero-initialised carry hinted in another layout)."""
    return loop_entry(op) and bool(op.inputs) and constant[op.inputs[0]]


def loop_exit(op: Any) -> bool:
    """Whether `op` is a loop's exit tie: it reads the loop's carry as the loop leaves it (the loop's result)."""
    return op.primitive == "tie" and op.params.get("at") == "out"


def _loop_invariant(graph: Graph, canon: Sequence[int], constant: Sequence[bool], entering: Collection[int]
                    ) -> frozenset[int]:
    """Canonical values computed inside a loop body from values invariant in it only (`entering`: what enters a
    loop unchanged by its iterations, `_invariant_trips`'s keys; compile-time constants)."""
    out = set(entering)
    for op in graph.ops:  # (program order: operands first; a branch is no loop)
        if _in_loop_body(op) and op.primitive != "tie" and op.inputs and op.outputs \
                and all(canon[v] in out or constant[canon[v]] for v in op.inputs):
            out.update(canon[v] for v in op.outputs)
    return frozenset(out)


# Ops XLA's loop-invariant code motion does not take out of a loop for their own sake (NotWorthHoistingIndividually):
# moving data or making it, they are cheaper recomputed than carried; they leave with work that reads them.
_NOT_WORTH_HOISTING = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
                                 "rev", "iota", "convert_element_type", "copy", "copy_p"}) | FREE_PRIMITIVES


def hoisted_work(graph: Graph, live: Sequence[bool], canon: Sequence[int], consumers: Sequence[Sequence[int]],
                 invariant: Collection[int], entering: Collection[int]) -> frozenset[int]:
    """Canonical values a loop body computes from loop-invariant values only (`invariant`, `_loop_invariant`; not
    those entering the loop, `entering`) that work of the body reads: XLA's loop-invariant code motion computes
    them before the loop, and the loop carries them as operands — materialised, alive through the loop. Moving
    data (`_NOT_WORTH_HOISTING`) is not hoisted for its own sake: it is the work it moves that is materialised."""
    def read_by_varying(c: int, depth: int = 0) -> bool:
        """Whether work that is not invariant reads `c`, directly or through data movement."""
        for u in consumers[c]:
            op = graph.ops[u]
            outs = [canon[w] for w in op.outputs]
            if any(w not in invariant for w in outs):
                return True
            if op.primitive in _NOT_WORTH_HOISTING and depth < 8 and any(read_by_varying(w, depth + 1) for w in outs):
                return True
        return False

    out = set()
    for op in graph.ops:
        if live[op.id] and _in_loop_body(op) and op.outputs and op.primitive not in _NOT_WORTH_HOISTING:
            c = canon[op.outputs[0]]
            if c in invariant and c not in entering and read_by_varying(c):
                out.add(c)
    return frozenset(out)


# Ops that, when they only add, drop or move unit dims of their local operand (or reduce over unit dims),
# keep its bytes in order: XLA makes them bitcasts (`ShapeUtil::ReshapeIsBitcast`/`TransposeIsBitcast`, the
# algebraic simplifier's degenerate-dim rewrites), whatever the layouts.
_UNIT_DIM_OPS = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose"}) | REDUCTIONS - {
    "argmax", "argmin"}


def moves_no_data(primitive: str, params: Any, in_shapes: Sequence[Sequence[int]],
                  out_shapes: Sequence[Sequence[int]], in_dtypes: Sequence[str], out_dtypes: Sequence[str]) -> bool:
    """Whether an op on these local shapes is a bitcast: it only adds, drops or moves dims of size 1 (a
    reduce over dims of size 1 included), keeping the other dims in their order and the dtype."""
    if primitive not in _UNIT_DIM_OPS or len(in_shapes) != 1 or len(out_shapes) != 1 or in_dtypes != out_dtypes:
        return False
    src, dst = in_shapes[0], out_shapes[0]
    if math.prod(src) != math.prod(dst):
        return False
    if primitive == "transpose":
        perm = params["permutation"]
        moved = [p for p in perm if src[p] != 1]
        return moved == sorted(moved)
    return [d for d in src if d != 1] == [d for d in dst if d != 1]


def expensive(op: Any, graph: Graph, backend: str = "", constant: Sequence[bool] = ()) -> bool:
    """Whether XLA's fusion on `backend` would not duplicate `op` into several consumers (its IsExpensive).
    `constant`: per value, known at compile time: a division by a constant is cheap (an integer one is; XLA's
    algebraic simplifier makes a floating one a multiply by the reciprocal)."""
    if op.primitive not in EXPENSIVE:
        return False
    dtype = graph.values[op.outputs[0]].dtype if op.outputs else None
    kind = dtype.kind if dtype is not None else "f"
    if op.primitive in _CHEAP_REAL.get(backend, _CHEAP_REAL[""]) and kind != "c":
        return False
    if op.primitive in ("div", "rem") and len(op.inputs) > 1:
        d = op.inputs[1]
        by_constant = graph.values[d].is_const or (d < len(constant) and constant[d])
        if kind in "iub" or by_constant and op.primitive == "div":
            return not by_constant
    return not (backend == "gpu" and op.primitive in _CHEAP_F32_GPU and str(dtype) in ("float32", "float16"))


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    live: tuple[bool, ...]  # per op: reaches an output
    constant: tuple[bool, ...]  # per value: known at compile time
    canon: tuple[int, ...]  # per value: the value XLA's CSE keeps for it
    duplicate: tuple[bool, ...]  # per op: merged into an earlier identical op
    fused: tuple[bool, ...]  # per canonical value: never materialised (fused into its consumers)
    trips: tuple[int, ...]  # per op: how many times it runs per step
    order: tuple[int, ...]  # per op: its position in the order the compiled program runs the ops
    pkeys: tuple[Any, ...]  # per op: its params as a hashable key
    until: tuple[tuple[tuple[int, int], ...], ...]  # per op with fused results: (canonical input, last op by
    # `order` that materialises what is computed from that input) pairs: the op's reads of it last until then
    span: tuple[tuple[int, int], ...] = ()  # per op: first and last op (by `order`) of its outermost region
    carried: frozenset[int] = frozenset()  # canonical values a loop carries (or a region returns): loop state
    preset: frozenset[int] = frozenset()  # loop state whose buffer exists from the program's start (`_preset_state`)
    read_fused: tuple[bool, ...] = ()  # per canonical value: its readers read it from registers (`reads_fused`)
    loop: tuple[bool, ...] = ()  # per op: emitted in a loop fusion (reads its operands element by element; a
    # local slice it reads is fused into it)
    library: frozenset[int] = frozenset()  # ops inside a library fusion (XLA:CPU's YNNPACK fusions of reductions)
    transposed: Mapping[int, int] = dataclasses.field(default_factory=dict)  # (XLA:CPU) canonical dot result -> the
    # transpose that may have the dot write its result (`transposed_dots`)
    broadcasts: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # (XLA:CPU) op -> canonical
    # operands whose broadcast to its result's shape it holds until it runs (`library_broadcasts`)
    backend: str = ""  # the backend whose rules apply ("cpu", "gpu", "tpu"; "": none)
    post: tuple[int, ...] = ()  # per op: its position in XLA's post order of the program (the combiners' walk)
    eager: bool = False  # reshards run as soon as their operand exists (XLA:CPU's breadth-first schedule)
    reshard_trips: tuple[tuple[int, int], ...] = ()  # per op: runs of its operands' and its results' reshards
    hoisted: Mapping[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict)  # loop-invariant body
    # values: (runs of their reshards, the value outside the loops they come from, runs out of the innermost
    # loop only); XLA's loop-invariant code motion moves those reshards out of the loop (`_invariant_trips`)
    entered: Mapping[int, int] = dataclasses.field(default_factory=dict)  # loop-invariant value entering a loop
    # nested in a forward loop -> the enclosing body's value it enters from (`_entered_in_forward_loops`)
    named: Mapping[int, int] = dataclasses.field(default_factory=dict)  # loop-invariant value a hint makes in a
    # loop body -> the value it names (`_naming_invariants`)
    unread: frozenset[tuple[int, int]] = frozenset()  # (op, operand index) XLA does not read (`unread_operands`)
    through: frozenset[int] = frozenset()  # ops XLA replaces by their operands (`passes_through`): no work, no buffer
    copies: tuple[tuple[int, ...], ...] = ()  # per op (XLA:CPU): operands its dot decomposition copies (`dot_copies`)
    bitcast: frozenset[int] = frozenset()  # transposes layout assignment makes bitcasts (XLA:GPU: `dot_bitcasts`)
    copy_owner: frozenset[tuple[int, int]] = frozenset()  # (op, operand) whose copy is counted (`last_copies`)
    cheap: frozenset[int] = frozenset()  # (XLA:CPU) canonical values of cheap elementwise work fusion recomputes
    inplace: tuple[tuple[int, ...], ...] = ()  # per op (XLA:CPU): canonical values it may write its result over
    # (op, value) of those where the value is a dot result computed in another shape (`_reshaped_dot`)
    reshaped_dots: frozenset[tuple[int, int]] = frozenset()
    loop_buffer: Mapping[int, int] = dataclasses.field(default_factory=dict)  # loop state/result -> its buffer's value
    nested_buffers: frozenset[int] = frozenset()  # inner loops' body values in their enclosing loop's buffer
    hoisted_work: frozenset[int] = frozenset()  # (XLA:CPU) invariant body values computed before their loop
    out_alias: tuple[tuple[int, int], ...] = ()  # (value, output) pairs: a hint makes the output of the value
    recompute: frozenset[tuple[int, int]] = frozenset()  # (op, canonical cheap value it recomputes, not reads)
    fusing: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # fused canonical value (or
    # cheap materialised one) -> the ops whose fusions recompute it (`fusing_readers`; `until` walks them)
    strided: Mapping[int, int] = dataclasses.field(default_factory=dict)  # (XLA:CPU) transpose op moving the minor
    # dim, fused -> the loop fusions that read it across its operand's memory order (`strided_readers`)
    batch: tuple[int, ...] = ()  # per op (XLA:CPU): the last position of what its running made ready (`_breadth_first`)
    first_reader: tuple[int, ...] = ()  # per op (XLA:CPU): the first position of an instruction reading its results
    # through ops that are none (hints, fused values); its own when nothing does (`_first_readers`)
    wide: Mapping[int, int] = dataclasses.field(default_factory=dict)  # canonical value -> bytes per element of
    # the wider buffer its producer writes (`shardc.cost.wide_results`: XLA:CPU's threefry words)
    read: tuple[bool, ...] = ()  # per canonical value: the compiled program reads it (`read_values`); a result
    # no one reads is not resharded to its planned layout
    copied_at: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (XLA:CPU) a dot's copy of an
    # operand (dot, canonical operand: `copies`) -> the position of the op run before it (`_breadth_first`)
    queued_at: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (XLA:CPU) a plan's queued
    # reshard (op, canonical operand: `queued_reshards`) -> the position of the op run before its collective

    def counts(self, op_id: int) -> bool:
        """Whether an op does work in the compiled program."""
        return self.live[op_id] and not self.duplicate[op_id]


# Ops whose result XLA's layout assignment gives the layout of their (same-shaped) operand.
_SAME_LAYOUT = frozenset(ELEMENTWISE) | frozenset(TRANSCENDENTAL) | frozenset({
    "integer_pow", "convert_element_type", "select_n", "stop_gradient", "copy", "copy_p", "name", "shardc_hint",
    "sharding_constraint", "optimization_barrier"})


def gathered_order(src_dims: Sequence[tuple], dst_dims: Sequence[tuple],
                   local: Sequence[int]) -> tuple[int, ...] | None:
    """The memory order (major to minor) in which XLA:CPU's all-gather writes a reshard from dims `src_dims` to
    `dst_dims` (per dim, its mesh axes; `local`: the result's local shape): the gathered dims (those that lose
    axes) most major, the others after them in order — or None when that is row-major already (no dim before the
    first gathered one has more than one element). Otherwise the operand is first written in that order (the
    producer's fusion writes it transposed) and the gathered buffer then copied into the row-major one."""
    gathered = [d for d, (a, b) in enumerate(zip(src_dims, dst_dims)) if len(a) > len(b)]
    if not gathered or not any(n > 1 for n in local[:min(gathered)]):
        return None
    return tuple(gathered) + tuple(d for d in range(len(local)) if d not in gathered)


def gather_relayouts(src_dims: Sequence[tuple], dst_dims: Sequence[tuple], operand: Sequence[int],
                     result: Sequence[int]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The copies XLA:CPU makes around an all-gather from dims `src_dims` to `dst_dims` (`operand`, `result`: the
    local shapes), each (buffer shape in its memory order, permutation): none when it writes row-major
    (`gathered_order`), else the row-major operand into the gathered order, then the gathered buffer back."""
    order = gathered_order(src_dims, dst_dims, result)
    if order is None:
        return ()
    stored = tuple(result[d] for d in order)
    return (tuple(operand), order), (stored, tuple(order.index(d) for d in range(len(order))))


def physical_orders(graph: Graph, canon: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Per canonical value whose buffer is not laid out row-major on XLA:CPU, its dims from major to minor:
    layout assignment makes a transpose a bitcast (its result keeps its operand's memory order, permuted), and
    elementwise-like ops give their result the layout of their operand of the same shape."""
    out: dict[int, tuple[int, ...]] = {}
    for op in graph.ops:
        if not op.inputs or not op.outputs:
            continue
        if op.primitive == "transpose":
            src = canon[op.inputs[0]]
            order = out.get(src, tuple(range(graph.values[src].rank)))
            inverse = {p: i for i, p in enumerate(op.params["permutation"])}
            found: list[tuple[int, ...] | None] = [tuple(inverse[d] for d in order)]
        elif op.primitive == "optimization_barrier":
            found = [out.get(canon[u]) for u in op.inputs]
        elif op.primitive in _SAME_LAYOUT:
            shape = graph.values[op.outputs[0]].shape
            found = [next((out[canon[u]] for u in op.inputs
                           if graph.values[u].shape == shape and canon[u] in out), None)] * len(op.outputs)
        else:
            continue
        for v, order in zip(op.outputs, found):
            c = canon[v]
            if c == v and order is not None and order != tuple(range(len(order))):
                out[c] = order
    return out


def _dot_orders(op: Any, graph: Graph) -> list[tuple[tuple[int, ...], ...]]:
    """Per operand of dot_general `op`, the memory orders (major to minor, size-1 dims left out) XLA:CPU's dot
    decomposition reads without a copy: [batch, free, contracting] for the left operand, [batch, contracting,
    free] for the right one; with at most one free and one contracting dim, also those two swapped (the
    matmul library reads a matrix transposed) — but not where a free or contracting dim has one element: the
    decomposition collapses those dims into the canonical order, a copy (measured: a data-parallel weight
    gradient at one sequence per device, [1, s, d] contracting (0, 1), is copied transposed, then a library
    dot). Another order is transposed into a copy first."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    out = []
    for i, (contract, batch) in enumerate(((lc, lb), (rc, rb))):
        shape = graph.values[op.inputs[i]].shape
        keep = lambda dims: [d for d in dims if shape[d] != 1]
        b, c = keep(batch), keep(contract)
        free = [d for d in range(len(shape)) if d not in contract and d not in batch]
        f = keep(free)
        first, second = (f, c) if i == 0 else (c, f)
        orders = [tuple(b + first + second)]
        unit = any(shape[d] == 1 for d in (*contract, *free))
        if len(f) <= 1 and len(c) <= 1 and not (unit and UNIT_DIMS_CANONICAL):
            orders.append(tuple(b + second + first))
        out.append(tuple(orders))
    return out


def _conv_orders(op: Any, graph: Graph) -> list[tuple[tuple[int, ...], ...]]:
    """Per operand of convolution `op`, the memory order (major to minor, size-1 dims left out) XLA:CPU's
    convolution reads (ConvCanonicalization): the input as [batch, spatial..., feature], the kernel as [spatial...,
    input feature, output feature]. A backward convolution names other dims so (the filter gradient reads the
    activation's channels as its batch): its operands are transposed into copies first."""
    lhs, rhs, _ = op.params["dimension_numbers"]
    out = []
    for i, order in enumerate(((lhs[0], *lhs[2:], lhs[1]), (*rhs[2:], rhs[1], rhs[0]))):
        shape = graph.values[op.inputs[i]].shape
        out.append((tuple(d for d in order if shape[d] != 1),))
    return out


def conv_output_copied(op: Any, graph: Graph) -> bool:
    """Whether XLA:CPU writes convolution `op`'s result in the canonical order [batch, spatial..., feature] of its
    output dims and transposes it into the result's own order after (a filter gradient [kh, kw, in, out] is
    computed as [in, kh, kw, out])."""
    out = op.params["dimension_numbers"][2]
    shape = graph.values[op.outputs[0]].shape
    order = tuple(d for d in (out[0], *out[2:], out[1]) if shape[d] != 1)
    return order != tuple(d for d in range(len(shape)) if shape[d] != 1)


def _read_orders(op: Any, graph: Graph) -> list[tuple[tuple[int, ...], ...]]:
    """The memory orders a dot or a convolution reads its operands in without a copy (its first: the copy's)."""
    return _conv_orders(op, graph) if op.primitive == "conv_general_dilated" else _dot_orders(op, graph)


_COPYING = frozenset({"dot_general", "conv_general_dilated"})


def dot_copies(graph: Graph, live: Sequence[bool], canon: Sequence[int], physical: Mapping[int, tuple[int, ...]],
               cheap: frozenset[int] = frozenset(), library: frozenset[int] = frozenset()
               ) -> tuple[tuple[int, ...], ...]:
    """XLA:CPU's dot decomposition transposes a dot's operand into an order it reads (`_dot_orders`), and its
    convolution canonicalization a convolution's (`_conv_orders`): a copy of the operand unless its buffer
    already has that memory order (`physical_orders`). The dot decomposition also reshapes an
    operand with several free or contracting dims into one of each (`_collapses`); that reshape is a bitcast unless
    the operand is computed by a cheap elementwise op (`cheap`: canonical values), which fusion duplicates
    into the reshape: a buffer of its own for that dot — but for a dot inside a library fusion (`library`: op
    ids), which takes the reshape in and reads the operand's buffer. Per op: the indices of the operands it
    copies."""
    out: list[tuple[int, ...]] = [()] * len(graph.ops)
    for op in graph.ops:
        if op.primitive not in _COPYING or not live[op.id] or len(op.inputs) < 2 or rewritten_dot(op, graph):
            continue
        copied = []
        for i, wanted in enumerate(_read_orders(op, graph)):
            c = canon[op.inputs[i]]
            shape = graph.values[c].shape
            if tuple(d for d in physical.get(c, range(len(shape))) if shape[d] != 1) not in wanted:
                copied.append(i)
            elif c in cheap and op.primitive == "dot_general" and op.id not in library and _collapses(graph, op, i):
                copied.append(i)
        out[op.id] = tuple(copied)
    return tuple(out)


def _collapses(graph: Graph, dot: Any, i: int) -> bool:
    """Whether the dot decomposition reshapes operand `i` of dot_general `dot`: its contracting or its free dims
    hold more than one dim of more than one element (XLA:CPU's matmuls take several batch dims as they are:
    measured on attention's [b, h, q, k] operands, b of 2 and 16), or it has a dim of one element (the simplifier
    removes those from a dot: a data-parallel batch of one per device; measured on LayerNorm + Dense and
    attention steps at one sequence, 17% and 20% under before)."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    contract, batch = (lc, lb) if i == 0 else (rc, rb)
    shape = graph.values[dot.inputs[i]].shape
    free = [d for d in range(len(shape)) if d not in contract and d not in batch]
    return 1 in shape or any(sum(shape[d] != 1 for d in dims) > 1 for dims in (contract, free))


def _gemm_layout(perm: Sequence[int], batch: int, rows: int) -> bool:
    """Whether a GEMM can write a dot result [batch..., rows..., cols...] in the memory order `perm` (major to
    minor): each group's dims adjacent and in order, the groups as (B,R,C), (B,C,R), (R,B,C) or (C,B,R) — the
    batch never most minor (XLA:GPU's `MatrixLayout::For`, xla/service/gpu/matmul_utils.cc)."""
    rank = len(perm)
    groups = [g for g in (tuple(range(batch)), tuple(range(batch, batch + rows)), tuple(range(batch + rows, rank)))]
    order: list[int] = []
    at = 0
    while at < rank:
        g = next(i for i, dims in enumerate(groups) if perm[at] in dims)
        if tuple(perm[at:at + len(groups[g])]) != groups[g]:
            return False
        order.append(g)
        at += len(groups[g])
    present = [g for g in (0, 1, 2) if groups[g]]
    return not (0 in present and len(present) > 1 and order[-1] == 0)


def _dot_transposes(graph: Graph, live: Sequence[bool], canon: Sequence[int],
                    consumers: Sequence[Sequence[int]]) -> Iterator[tuple[Any, Any]]:
    """(transpose, dot) pairs: each live transpose whose operand is the result of a dot XLA keeps a dot (not
    `rewritten_dot`) that no other op reads and the program does not return."""
    outputs = {canon[v] for v in graph.outputs}  # (the program's result tuple reads them too)
    for op in graph.ops:
        if op.primitive != "transpose" or not live[op.id]:
            continue
        src = canon[op.inputs[0]]
        p = graph.values[src].producer
        if (p is not None and graph.ops[p].primitive == "dot_general" and not rewritten_dot(graph.ops[p], graph)
                and consumers[src] == [op.id] and src not in outputs):
            yield op, graph.ops[p]


def dot_bitcasts(graph: Graph, live: Sequence[bool], canon: Sequence[int],
                 consumers: Sequence[Sequence[int]]) -> frozenset[int]:
    """XLA:GPU: transposes that layout assignment makes bitcasts. `GpuLayoutAssignment::AddBackendConstraints`
    (xla/service/gpu/transforms/layout_assignment.cc) gives a dot read only by a transpose the layout that makes
    the transpose a bitcast when a GEMM can write that layout (`_gemm_layout`): the dot's result is written in
    the transposed order and the transpose moves nothing."""
    out = set()
    for op, dot in _dot_transposes(graph, live, canon, consumers):
        (lc, _), (lb, _) = dot.params["dimension_numbers"]
        rows = graph.values[dot.inputs[0]].rank - len(lc) - len(lb)
        if _gemm_layout(tuple(op.params["permutation"]), len(lb), rows):
            out.add(op.id)
    return frozenset(out)


def folded_transposes(graph: Graph, live: Sequence[bool], canon: Sequence[int],
                      consumers: Sequence[Sequence[int]]) -> frozenset[int]:
    """Transposes XLA's TransposeFolding removes: every reader is a dot that reads it as a row-column transpose
    (`TransposeFolding::IsRowColumnTransposeDotOperand`: one contracting dim, every other dim but two a batch dim
    the transpose leaves in place), which then reads the transpose's operand with swapped dimension numbers
    (measured on XLA:CPU: `a @ a.T` makes no transposed copy of `a`)."""
    out = set()
    outputs = {canon[v] for v in graph.outputs}
    for op in graph.ops:
        if op.primitive != "transpose" or not live[op.id]:
            continue
        v = canon[op.outputs[0]]
        if v in outputs or not consumers[v]:
            continue
        perm = tuple(op.params["permutation"])
        if all(_row_column_operand(graph.ops[u], [i for i, w in enumerate(graph.ops[u].inputs) if canon[w] == v], perm)
               for u in consumers[v]):
            out.add(op.id)
    return frozenset(out)


CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_WINDOW = 16  # XLA:CPU's ReduceWindowRewriter base length


def window_levels(length: int) -> int | None:
    """Elements per row of the levels XLA:CPU's ReduceWindowRewriter makes of a cumulative op over `length`
    elements: a prefix within blocks of 16 (the result's size), then the blocks' totals the same way, up to a last
    level of at most 16 (and one more); none up to 16. Measured for lengths that are multiples of 16 (64, 256,
    1024, 4096: 1.067-1.078x the result); None for others (XLA pads them first; not modelled)."""
    if length <= _WINDOW or length % _WINDOW:
        return 0 if length <= _WINDOW else None
    total, m = length, length // _WINDOW
    while m > _WINDOW:
        total += -(-m // _WINDOW) * _WINDOW
        m = -(-m // _WINDOW)
    return total + m + 1


def transposed_dots(graph: Graph, live: Sequence[bool], canon: Sequence[int],
                    consumers: Sequence[Sequence[int]]) -> dict[int, int]:
    """Results of dots XLA's algebraic simplifier may compute transposed (`transpose(dot(a, b)) -> dot(b, a)`), each
    with its transpose: a dot with one free dim per operand, read only by one transpose that swaps those two and
    keeps the batch dims in place, and not read by a transpose or a dot (which cancel or fold it). Where the plan
    reads the product in no other layout (no all-reduce between: the transpose must read the dot itself) and the
    transposed result has a buffer (materialised, or fused into its readers but resharded first), the dot writes
    it (`MemoryModel`; measured on XLA:CPU: a weight gradient `x.T @ g` returned as `(g.T @ x).T` makes no buffer
    of the untransposed product, nor does one resharded for Adam: the zoo MLP's Megatron plan kept 512 KiB more)."""
    out = {}
    for op, dot in _dot_transposes(graph, live, canon, consumers):
        if any(graph.ops[u].primitive in ("transpose", "dot_general") for u in consumers[canon[op.outputs[0]]]):
            continue
        (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
        lhs, rhs = (graph.values[v].rank for v in dot.inputs[:2])
        rank = len(lb) + 2
        swap = tuple(range(len(lb))) + (rank - 1, rank - 2)
        if lhs - len(lc) - len(lb) == 1 and rhs - len(rc) - len(rb) == 1 and tuple(op.params["permutation"]) == swap:
            out[canon[op.inputs[0]]] = op.id
    return out


def _row_column_operand(dot: Any, positions: Sequence[int], perm: Sequence[int]) -> bool:
    """Whether `dot` reads a transpose by `perm` at operand `positions` (0: lhs, 1: rhs) as a row-column transpose."""
    if dot.primitive != "dot_general" or not positions or any(i > 1 for i in positions):
        return False
    contracting, batch = dot.params["dimension_numbers"]
    for i in positions:
        if len(contracting[i]) != 1 or len(batch[i]) != len(perm) - 2 or any(perm[d] != d for d in batch[i]):
            return False
    return True


def _true_rank(shape: Sequence[int]) -> int:
    """The number of dims with more than one element."""
    return sum(d != 1 for d in shape)


def duplicable(graph: Graph, op: Any, canon: Sequence[int], constant: Sequence[bool]) -> bool:
    """Whether XLA's fusion may duplicate elementwise `op` into some of its readers while others read it from
    memory (InstructionFusion::ComputeGloballyUnfusible): when it is effectively at most unary — at most one
    operand that is not a broadcast, an iota or a constant and whose true rank (dims of size > 1) reaches the
    result's — or its operands hold no more elements than its result. Otherwise (`x + y` of two activations)
    it is computed once, unless every reader fuses it."""
    out = graph.values[op.outputs[0]].shape
    rank = _true_rank(out)

    def large(v: int) -> bool:
        c = canon[v]
        p = graph.values[c].producer
        while p is not None and loop_entry(graph.ops[p]):  # (a broadcast made outside the loop is one inside)
            c = canon[graph.ops[p].inputs[0]]
            p = graph.values[c].producer
        if constant[c] or p is not None and graph.ops[p].primitive in ("broadcast_in_dim", "iota"):
            return False
        return _true_rank(graph.values[c].shape) >= rank

    if sum(large(v) for v in op.inputs) <= 1:
        return True
    return sum(math.prod(graph.values[c].shape) for c in {canon[v] for v in op.inputs}) <= math.prod(out)


# Ops elementwise on every operand (XLA's IsElementwiseOnOperand): a fusion made of them can write its result
# over an operand of the result's shape (`inplace_operands`).
_ELEMENTWISE_OPS = frozenset(ELEMENTWISE) | frozenset(TRANSCENDENTAL) | {"integer_pow"}


def loop_buffers(graph: Graph, live: Sequence[bool], canon: Sequence[int], fused: Sequence[bool]) -> dict[int, int]:
    """Canonical value of a loop's state or result -> the canonical body value whose buffer holds it: XLA keeps a
    while loop's state in one buffer, which the body's new state (a carry `tie`'s operand) is written into and the
    loop's result (an `at="out"` tie of the state) is — an inner loop's buffer where that new state is the inner
    loop's result. Only where the body value is materialised with the state's shape and dtype."""
    carries = [(canon[op.inputs[0]], canon[op.outputs[0]]) for op in graph.ops
               if op.primitive == "tie" and op.region.startswith("/") and "at" not in op.params and live[op.id]
               and graph.values[op.inputs[0]].shape == graph.values[op.outputs[0]].shape
               and graph.values[op.inputs[0]].dtype == graph.values[op.outputs[0]].dtype]
    results = [(canon[op.inputs[0]], canon[op.outputs[0]]) for op in graph.ops if loop_exit(op)]
    out = {s: body for body, s in carries if not fused[body]}
    while True:  # (a state whose new value is an inner loop's result is that loop's buffer)
        size = len(out)
        out.update({r: out[s] for s, r in results if s in out and r not in out})
        out.update({s: out[body] for body, s in carries if body in out and s not in out})
        if len(out) == size:
            return out


def nested_loop_buffers(graph: Graph, canon: Sequence[int], consumers: Sequence[Sequence[int]],
                        loops: Mapping[int, int], inplace: Sequence[tuple[int, ...]]) -> frozenset[int]:
    """Canonical body values of inner loops whose buffer is the enclosing loop's: the inner loop starts from the
    outer loop's state, which nothing else in the body reads, and the outer body's new state is written over the
    inner loop's result — XLA colocates the two loops' operands, states and results (a `fori_loop` in a `scan`)."""
    out = set()
    for op in graph.ops:
        if not loop_entry(op):
            continue
        init, inner = canon[op.inputs[0]], loops.get(canon[op.outputs[0]])
        outer = loops.get(init)
        if inner is None or outer is None or outer == inner:
            continue
        readers = [u for u in consumers[init] if not loop_exit(graph.ops[u])]
        p = graph.values[outer].producer
        if readers == [op.id] and p is not None and inner in inplace[p]:
            out.add(inner)
    return frozenset(out)


def _with_loop_inits(graph: Graph, canon: Sequence[int], fused: Sequence[bool], loops: Mapping[int, int],
                     inplace: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """`inplace` with each loop's initial state added to what the op making its body's new state may write over:
    the loop's buffer is the initial value's when that value dies entering the loop (XLA colocates a while loop's
    operand, body and result)."""
    out = list(inplace)
    for op in graph.ops:
        if loop_entry(op):
            init, body = canon[op.inputs[0]], loops.get(canon[op.outputs[0]])
            p = graph.values[body].producer if body is not None else None
            if p is not None and not fused[init] and init not in out[p]:
                out[p] = out[p] + (init,)
    return tuple(out)


def inplace_operands(graph: Graph, live: Sequence[bool], canon: Sequence[int], fused: Sequence[bool],
                     loop: Sequence[bool], recompute: frozenset[tuple[int, int]] = frozenset(),
                     transposed: Mapping[int, int] | None = None, limit: int = 64,
                     consumers: Sequence[Sequence[int]] | None = None, loops: Mapping[int, int] | None = None,
                     absorbed: Collection[int] = frozenset()) -> tuple[tuple[int, ...], ...]:
    """Per op, the materialised values whose buffer XLA may give the op's result: XLA's buffer assignment lets an
    instruction's result take the buffer of an operand that dies there when they have one shape
    (HloDataflowAnalysis::CanShareOperandBufferWithUser); for a loop fusion, when everything the fusion computes
    from that operand is elementwise (`AreTransitiveUsesElementwiseOrTuple`). So: an elementwise op emitted in a
    loop fusion, and the values of its result's shape and dtype it reads directly or through fused elementwise
    producers of that shape only (a value also read through a fused broadcast, reshape or reduction is not one);
    cheap work the fusion recomputes (`recompute`) is not one (the fusion does not read its buffer), and the walk
    stops at a value computed inside a library fusion (`absorbed`): what recomputes from it reads that fusion's
    result, not the values the fusion read (a shift `x - max` recomputed from the max a `reduce_max` library
    fusion made reads x elementwise; the reduction reading x is not the fusion's). A fused value it reads so is one:
    where the plan reads it in another layout than it is computed in, the fusion reads a reshard's result, a buffer
    of the result's shape (XLA writes an elementwise result over an all-gather's output); where it does not, the
    value has no buffer to take. Whether the value dies there, and in one layout, is the plan's (`MemoryModel`); so
    is whether a dot's result XLA computes in another shape (`_reshaped_dot`, listed in `ProgramInfo.reshaped_dots`)
    is read through a reshard, whose buffer has the result's shape (the all-reduce of a vocabulary head's partial
    logits), or is its own. A fused transpose a dot may write (`transposed`: dot result -> transpose) is read as
    that dot's buffer, the transposed product. A result only dots read, each with some group of its dims collapsed
    (`_read_collapsed`), is written in the collapsed shape (the dot decomposition's bitcast is the fusion's root):
    it takes no operand's buffer. A dynamic_update_slice writes its result over its operand (a reshard's result the
    update reads, say: the program's output then holds it), and a sort its sorted keys over the keys. A loop's
    result or state it reads is the buffer the loop keeps it in (`loops`: `loop_buffers`)."""
    out: list[tuple[int, ...]] = [()] * len(graph.ops)
    for op in graph.ops:
        if op.primitive == "dynamic_update_slice" and live[op.id] and not fused[canon[op.outputs[0]]]:
            out[op.id] = (canon[op.inputs[0]],)  # (XLA updates the operand's buffer in place when it dies there)
            continue
        if op.primitive == "sort" and live[op.id] and op.inputs and not fused[canon[op.outputs[0]]]:
            out[op.id] = (canon[op.inputs[0]],)  # (XLA sorts in place: the keys' buffer when it dies there)
            continue
        if (not live[op.id] or not loop[op.id] or op.primitive not in _ELEMENTWISE_OPS or len(op.outputs) != 1
                or fused[canon[op.outputs[0]]]):
            continue
        if consumers is not None and _read_collapsed(graph, canon, consumers, canon[op.outputs[0]]):
            continue
        res = graph.values[op.outputs[0]]
        ok: set[int] = set()
        bad: set[int] = set()
        recomputed: set[int] = set()  # materialised values the fusion computes again instead of reading
        stack, seen = [(op, True)], 0
        while stack and seen < limit:
            o, elementwise = stack.pop()
            seen += 1
            for u in o.inputs:
                c = canon[u]
                v = graph.values[c]
                # (a hint or constraint is no instruction: what it names is its operand, whose shape a device's
                # view may give per device where the alias's is global)
                good = elementwise and (o.primitive in ALIASES or v.shape == res.shape and v.dtype == res.dtype)
                (ok if good else bad).add(c)
                p = v.producer
                if (fused[c] and p is not None and transposed and graph.ops[p].primitive == "transpose"
                        and transposed.get(canon[graph.ops[p].inputs[0]]) == p):
                    (ok if good else bad).add(canon[graph.ops[p].inputs[0]])  # (the dot's buffer, transposed)
                    continue
                if loops and fused[c] and c in loops:
                    (ok if good else bad).add(loops[c])  # (the loop's buffer)
                    continue
                if (fused[c] or (o.id, c) in recompute) and p is not None and c not in absorbed:
                    q = graph.ops[p].primitive
                    stack.append((graph.ops[p], good and (q in _ELEMENTWISE_OPS or q in ALIASES)))
                    if not fused[c]:
                        recomputed.add(c)
        if stack:
            continue  # too large a fusion to tell
        out[op.id] = tuple(sorted(ok - bad - recomputed))
    return tuple(out)


def _read_collapsed(graph: Graph, canon: Sequence[int], consumers: Sequence[Sequence[int]], c: int) -> bool:
    """Whether value `c` is read by dots only, each reading it with its contracting or free dims several of more
    than one element (`_collapses`): the dot decomposition reshapes it ([batch..., rows, contracting] /
    [batch..., contracting, columns]) by a bitcast XLA fuses into what computes it."""
    users = [graph.ops[u] for u in consumers[c]]
    return bool(users) and all(
        op.primitive == "dot_general" and not rewritten_dot(op, graph)
        and all(_collapses(graph, op, i) for i in range(2) if canon[op.inputs[i]] == c) for op in users)


def _reshaped_dot(graph: Graph, c: int) -> bool:
    """Whether value `c` is the result of a dot that XLA computes in another shape and bitcasts (the dot
    decomposition's [batch..., rows, columns] when its free dims are several of more than one element): an
    instruction of `c`'s shape cannot take that buffer in place (the shapes differ), only a reshard's of it."""
    p = graph.values[c].producer
    if p is None or graph.ops[p].primitive != "dot_general" or rewritten_dot(graph.ops[p], graph):
        return False
    op = graph.ops[p]
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = (graph.values[v].shape for v in op.inputs[:2])
    groups = [(shape, [d for d in range(len(shape)) if d not in contract and d not in batch])
              for shape, contract, batch in ((lhs, lc, lb), (rhs, rc, rb))]
    return any(sum(shape[d] != 1 for d in dims) > 1 for shape, dims in groups)


# Switches for measuring a rule's effect (docs/simulator.md quotes the errors without them).
LOOK_THROUGH_HINTS = True
HINTED_IN_PROGRAM_ORDER = True
USERS_AFTER_CONSTRAINT = True  # (switch: `_breadth_first` queues a matmul's readers last first)
RECOMPUTE_IN_LOOPS = True
LIBRARY_FUSION_UNITS = True  # (switch: `_breadth_first` queues a library fusion as one instruction)
_COPY_DEPTH = 8  # (how far along a chain of cheap values a copy's recomputation is followed)
RECOMPUTED_READS = True  # (switch: `_breadth_first` has a fusion recomputing a cheap value wait for its sources)
UNIT_DIMS_CANONICAL = True  # (switch: `_dot_orders` takes no swapped order for an operand with a dim of one)
COPY_UNITS = True  # (switch: `_breadth_first` queues a dot's copy of an operand as an instruction of its own)
COPIED_READERS_REVERSED = True  # (switch: `_breadth_first` queues a copied cheap value's readers in reverse)
GLOBALLY_UNFUSIBLE = True  # (switch: `_unfusible`: values fusion cannot take in along every path)


def output_aliases(graph: Graph, live: Sequence[bool], canon: Sequence[int],
                   constant: Sequence[bool]) -> tuple[tuple[int, int], ...]:
    """(canonical value, canonical output) pairs where a chain of hints (`split`, `with_sharding_constraint`) or
    other aliases (a copy, a name) makes a step output of the value: after partitioning a constraint is no
    instruction, so what computes the value writes the output's buffer when the value is in the output's layout
    (else the collective the constraint became does)."""
    outputs = {canon[v] for v in graph.outputs}
    made_by = {canon[op.outputs[0]]: op for op in graph.ops
               if live[op.id] and op.primitive in ALIASES and len(op.outputs) == 1 and op.inputs}
    out: dict[int, int] = {}
    for o in sorted(outputs):
        c, seen = o, 0
        while c in made_by and seen < 64:
            c, seen = canon[made_by[c].inputs[0]], seen + 1
            if c in outputs or constant[c] or graph.values[c].producer is None:
                break
            out.setdefault(c, o)
    return tuple(sorted(out.items()))


def _moved_scatter(graph: Graph, canon: Sequence[int], fused: Sequence[bool], v: int) -> bool:
    """Whether `v` is a scatter the simplifier moves into the sum reading it (the sum is the scatter's
    result, written in place: no cheap elementwise work)."""
    p = graph.values[canon[v]].producer
    return p is not None and graph.ops[p].primitive in SCATTERS and fused[canon[v]]


def last_copies(graph: Graph, canon: Sequence[int], copies: Sequence[tuple[int, ...]],
                order: Sequence[int]) -> frozenset[tuple[int, int]]:
    """(op, operand index) of the dot scheduled last among those copying one value into one memory order
    (XLA's CSE makes that copy once; it lives until its last reader)."""
    last: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
    for op in graph.ops:
        for i in copies[op.id] if copies else ():
            key = (canon[op.inputs[i]], _read_orders(op, graph)[i][0])
            if key not in last or order[op.id] > order[last[key][0]]:
                last[key] = (op.id, i)
    return frozenset(last.values())


# XLA:CPU's library (YNNPACK) fusions (`LibraryRewriter` with its YNN matcher; xla/backends/cpu/ynn_support.cc, and
# measured on jaxlib 0.10's XLA:CPU): a float reduction starts one when it or its operand has at least
# `_YNN_MIN_ELEMENTS` elements (a smaller one is a loop fusion), and the fusion takes in a producer every reader of
# which it holds: the elementwise ops YNNPACK has (at that size too), broadcasts, bitcast reshapes, f32 iotas, and
# dots whose left operand is read row by row (not a transposed read) with more than one row and column.
_YNN_MIN_ELEMENTS = 4096
_YNN_ELEMENTWISE = frozenset({
    "abs", "ceil", "convert_element_type", "cos", "erf", "exp", "expm1", "floor", "log", "log1p", "logistic", "neg",
    "round", "rsqrt", "sign", "sin", "sqrt", "tanh", "tan",  # (unary)
    "add", "add_any", "div", "max", "min", "mul", "pow", "sub", "square", "integer_pow"})  # (binary: x**n is a mul)
_YNN_MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})
_YNN_DTYPES = frozenset({"float32", "bfloat16", "float64", "int8", "uint8"})


# XLA's TreeReductionRewriter (run by XLA:CPU): a reduction with a reduced dim of more than this many elements
# becomes a reduce-window over windows of this size and a reduction of its result.
TREE_REDUCTION_WINDOW = 32


def tree_reduced(graph: Graph, op: Any) -> bool:
    """Whether XLA:CPU rewrites reduction `op` (outside a library fusion) into a reduce-window and a reduce: it has
    one operand and a reduced dim longer than `TREE_REDUCTION_WINDOW`. The reduce-window takes no producer into
    its fusion: it reads its operand from memory (measured: a data-parallel MLP's bias gradient of 64 x 32
    elements per device reads the output gradient's buffer, the fusion making which is not duplicated into it)."""
    if op.primitive not in REDUCTIONS or op.primitive in ("argmax", "argmin") or len(op.inputs) != 1:
        return False
    shape = graph.values[op.inputs[0]].shape
    return any(shape[d] > TREE_REDUCTION_WINDOW for d in op.params.get("axes", ()))


def _ynn_sized(graph: Graph, op: Any) -> bool:
    """YNNPACK's preference: some result or operand of `op` has at least `_YNN_MIN_ELEMENTS` elements (global shapes:
    a bound on the local ones)."""
    return any(math.prod(graph.values[v].shape) >= _YNN_MIN_ELEMENTS for v in (*op.outputs, *op.inputs))


def _ynn_dot(graph: Graph, op: Any, folded: frozenset[int]) -> bool:
    """Whether YNNPACK takes dot `op` into a fusion: a float matmul (not one XLA rewrites as a multiply or a reduce)
    of more than one row and column whose left operand is read row-major: its free dims before its contracting ones,
    and not a transpose XLA folds into the dot (measured: `x.T @ w` stays a dot of its own, `x @ w.T` is taken in)."""
    if op.primitive != "dot_general" or rewritten_dot(op, graph) or len(op.inputs) != 2:
        return False
    if any(str(graph.values[v].dtype) not in ("float32", "bfloat16", "float64") for v in (*op.inputs, *op.outputs)):
        return False
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = (graph.values[v].shape for v in op.inputs)
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    m, n = math.prod(lhs[d] for d in lfree), math.prod(rhs[d] for d in rfree)
    k = math.prod(lhs[d] for d in lc)
    if m == 1 or n == 1 or max(m, k, n) < 8:
        return False
    p = graph.values[op.inputs[0]].producer
    return not (p is not None and p in folded) and all(f < c for f in lfree for c in lc)


def _no_op_to_xla(graph: Graph, op: Any) -> bool:
    """Whether XLA's simplifier leaves nothing of `op`: a stop_gradient or copy, a max with -inf or a min with inf
    (jax's `max(..., initial=-inf)`)."""
    if op.primitive in ALIASES:
        return True
    if op.primitive not in ("max", "min") or len(op.inputs) != 2:
        return False
    bound = -math.inf if op.primitive == "max" else math.inf
    return any(graph.values[v].literal == bound for v in op.inputs)


def _select_to_xla(graph: Graph, op: Any) -> bool:
    """Whether XLA's simplifier makes `op` a select: a multiply by a boolean converted to a number (through ops it
    drops, `passes_through`), `x * convert(p)` being `select(p, x, 0)` — a one-hot target times log-probabilities."""
    if op.primitive != "mul" or len(op.inputs) != 2:
        return False
    for v in op.inputs:  # (through identities: `onehot * 1 + 0` when a label smoothing of zero is static)
        p = graph.values[passed_to(graph, v)].producer
        if p is not None and graph.ops[p].primitive == "convert_element_type" \
                and graph.values[graph.ops[p].inputs[0]].dtype.kind == "b":
            return True
    return False


def _ynn_op(graph: Graph, op: Any, folded: frozenset[int]) -> bool:
    """Whether a library fusion may take `op` in (see `_YNN_MIN_ELEMENTS`; a multiply XLA makes a select is none)."""
    if _no_op_to_xla(graph, op):
        return True
    if _select_to_xla(graph, op):
        return False
    if op.primitive == "dot_general":
        return _ynn_dot(graph, op, folded)
    dtypes = {str(graph.values[v].dtype) for v in (*op.inputs, *op.outputs)}
    if op.primitive in _YNN_MOVES:
        return dtypes <= _YNN_DTYPES
    if op.primitive == "iota":
        return dtypes <= {"float32", "int32"}
    return op.primitive in _YNN_ELEMENTWISE and dtypes <= _YNN_DTYPES and _ynn_sized(graph, op)


def _library_fusions(graph: Graph, live: list[bool], canon: list[int], constant: list[bool],
                     consumers: list[list[int]], folded: frozenset[int]) -> tuple[set[int], dict[int, int]]:
    """XLA:CPU's library (YNNPACK) fusions of reductions, made before loop fusion (XLA's LibraryRewriter): from each
    floating-point reduction of at least `_YNN_MIN_ELEMENTS` elements, the last first, a fusion grows over the ops
    YNNPACK has (`_ynn_op`): up into an operand when all of the operand's readers are in it, down into the one reader
    of its result when it has one (not a dot: those made fusions of their own before), again until neither grows it.
    Returns the values absorbed (computed inside a fusion, no buffer) and, per op inside a fusion, the fusion's
    reduction. `folded`: the transposes XLA folds into the dots reading them (`folded_transposes`)."""
    absorbed: set[int] = set()
    members: dict[int, int] = {}
    outputs = {canon[v] for v in graph.outputs}  # (the program's result reads them too)
    for op in reversed(graph.ops):  # from the last reduction up, as XLA starts from the root
        if (not live[op.id] or op.primitive not in LIBRARY_REDUCTIONS or op.id in members
                or graph.values[op.outputs[0]].dtype.kind != "f" or not _ynn_sized(graph, op)
                or _with_index_sibling(graph, op, canon, consumers)):
            continue
        group = _library_fusion(graph, op, canon, constant, consumers, members, absorbed, outputs, folded)
        members.update((u, op.id) for u in group)
    return absorbed, members


# The index reduction XLA computes a max or min reduction with (its variadic reduce's first result is the extreme).
_INDEX_SIBLING = {"reduce_max": "argmax", "reduce_min": "argmin"}


def _with_index_sibling(graph: Graph, op: Any, canon: Sequence[int], consumers: Sequence[Sequence[int]]) -> bool:
    """Whether `op` is a max (min) reduction whose operand an argmax (argmin) over the same dims reads too: XLA
    computes the two in one variadic reduce, a loop fusion of both results (measured: flax lm1b's `log_softmax`
    max and accuracy argmax over the logits), so the reduction is no library fusion."""
    sibling = _INDEX_SIBLING.get(op.primitive)
    if sibling is None or len(op.inputs) != 1:
        return False
    c = canon[op.inputs[0]]
    return any(graph.ops[u].primitive == sibling and tuple(graph.ops[u].params.get("axes", ()))
               == tuple(op.params.get("axes", ())) for u in consumers[c])


def _library_fusion(graph: Graph, start: Any, canon: Sequence[int], constant: Sequence[bool],
                    consumers: Sequence[Sequence[int]], members: Mapping[int, int], absorbed: set[int],
                    outputs: set[int], folded: frozenset[int]) -> set[int]:
    """The ops of the library fusion XLA grows from reduction `start` (see `_library_fusions`); adds the values it
    computes inside to `absorbed`."""
    group = {start.id}
    root = start
    stack = [canon[v] for v in start.inputs]
    while True:
        while stack:  # up: operands read only inside the fusion
            v = stack.pop()
            p = graph.values[v].producer
            if (p is None or constant[v] or v in absorbed or v in outputs or p in members or p in group
                    or not all(u in group for u in consumers[v])):
                continue
            o = graph.ops[p]
            if not (_ynn_op(graph, o, folded) or o.primitive in LIBRARY_REDUCTIONS and _ynn_sized(graph, o)
                    and not _with_index_sibling(graph, o, canon, consumers)):
                continue
            if o.primitive == "dot_general" and o.id > start.id:  # (a dot after the reduction: its own fusion)
                continue
            group.add(p)
            absorbed.add(v)
            stack.extend(canon[u] for u in o.inputs)
        # down: the one reader of the fusion's result
        out = canon[root.outputs[0]] if len(root.outputs) == 1 else None
        readers = set(consumers[out]) if out is not None and out not in outputs else set()
        if len(readers) != 1:
            return group
        u = graph.ops[readers.pop()]
        if u.id in members or u.id in group or u.primitive == "dot_general" or not _ynn_op(graph, u, folded):
            return group
        group.add(u.id)
        absorbed.add(out)
        root = u
        stack = [canon[v] for v in u.inputs] + [canon[v] for m in group for v in graph.ops[m].inputs]


RECIPROCAL_INSTRUCTIONS = True  # (switch: `_reciprocal_of_broadcast`)


def _reciprocal_of_broadcast(graph: Graph, op: Any, canon: Sequence[int], constant: Sequence[bool]) -> bool:
    """Whether `op` is `x / broadcast(s)` (a float `s` of fewer elements, not a constant): XLA's simplifier makes it
    `x * broadcast(1 / s)`, and the reciprocal, an expensive op whose reader reuses its elements, stays an instruction
    of its own on `s`'s shape (measured: `e / sum(e, -1, keepdims=True)` is a `broadcast_divide_fusion` of the sums'
    shape run when they exist, its readers' fusion multiplying): in the breadth-first schedule the division's readers
    wait for it as for any instruction, so a softmax's normalised product queues behind work made ready before it."""
    if op.primitive != "div" or len(op.inputs) != 2:
        return False
    d = canon[op.inputs[1]]
    p = graph.values[d].producer
    if p is None or constant[d] or graph.ops[p].primitive != "broadcast_in_dim" or not graph.ops[p].inputs:
        return False
    s = canon[graph.ops[p].inputs[0]]
    out = graph.values[op.outputs[0]]
    return (out.dtype is not None and out.dtype.kind == "f" and not constant[s]
            and math.prod(graph.values[s].shape) < math.prod(out.shape))


def _divides_by(op: Any, v: int) -> bool:
    """Whether `op` divides by value `v` (and reads it only there): XLA:CPU gives such a divisor a broadcast of its
    own, shared with no other reader (measured: `x / s` and `sum(g / s * x)` with `s` of shape (..., 1), in either
    role, make no buffer of the broadcast; `x * s` beside the same reduction does)."""
    return op.primitive == "div" and len(op.inputs) == 2 and op.inputs[1] == v and op.inputs[0] != v


def library_broadcasts(graph: Graph, live: Sequence[bool], canon: Sequence[int], groups: Mapping[int, int],
                       order: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """XLA:CPU: the broadcasts a library fusion reads from memory. An op broadcasting an operand (a dim of one
    against its result's, or a scalar) reads a broadcast instruction, one per (operand, shape) after CSE (a scalar
    literal's by its value); the library rewriter takes it into a fusion only when all its readers are there, so
    one a reader outside that fusion (an elementwise op, another reduction's fusion) shares is materialised in
    the result's shape, as soon as the operand exists, until the last fusion reading it (measured: `sum(x * v[:,
    None], 1)` makes none, with `x + v[:, None]` beside it one; LayerNorm's scale and statistics in its backward
    pass; attention's 1/sqrt(d) read by the scores' fusion and the gradient's). A reader dividing by a non-scalar
    operand has a broadcast of its own (`_divides_by`: softmax's sums). Returns, per op holding such a buffer (the
    last library op reading it, by `order`), the canonical operands."""
    readers: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
    first: dict[Any, int] = {}  # (a broadcast's key -> the operand named for it)
    for op in graph.ops:
        if not live[op.id] or not op.outputs or op.primitive in FREE_PRIMITIVES:
            continue
        shape = tuple(graph.values[op.outputs[0]].shape)
        for v in set(op.inputs):
            operand = graph.values[v]
            if not operand.shape:  # (a scalar: literals of one value are one constant to XLA)
                if not shape:
                    continue
                key: Any = canon[v] if operand.literal is None else ("literal", operand.literal, str(operand.dtype))
            elif operand.shape != shape and len(operand.shape) == len(shape) and math.prod(operand.shape) > 1 \
                    and not _divides_by(op, v):
                key = canon[v]
            else:
                continue
            first.setdefault(key, canon[v])
            readers.setdefault((key, shape), []).append(op.id)
    out: dict[int, list[int]] = {}
    for (key, _), ops in readers.items():
        fusions = {groups.get(u) for u in ops}
        library = [u for u in ops if u in groups]
        if library and len(fusions) > 1:
            out.setdefault(max(library, key=lambda u: order[u]), []).append(first[key])
    return {u: tuple(cs) for u, cs in out.items()}


def liveness(graph: Graph, extra: frozenset[tuple[int, int]] = frozenset()) -> tuple[bool, ...]:
    """Per op: whether XLA's DCE keeps it, with the operands `extra` ((op, operand index): those a plan's
    simplification drops, `shardc.cost.dropped`) unread besides those XLA's simplifier drops whatever the plan
    (cached without `extra`)."""
    cse = merged(graph)
    if not extra:
        return graph.analysis("liveness", lambda: tuple(_liveness(graph, cse.canon, cse.duplicate, cse.unread,
                                                                 cse.through)))
    return tuple(_liveness(graph, cse.canon, cse.duplicate, cse.unread | extra, cse.through))


def read_values(graph: Graph) -> tuple[bool, ...]:
    """Per canonical value: whether the compiled program reads it (an output, or an operand of an op XLA's DCE
    keeps that its simplifier does not drop; a region's branch index when the region runs). A live op's result
    nobody reads (the permutation of a sort whose gradient is not taken) is a dead instruction to XLA, and so is
    the reshard constraining it to its planned layout (cached on the graph)."""
    def compute() -> tuple[bool, ...]:
        cse, live = merged(graph), liveness(graph)
        read = [False] * len(graph.values)
        for v in graph.outputs:
            read[cse.canon[v]] = True
        for op in graph.ops:
            if not live[op.id]:
                continue
            for i, v in enumerate(op.inputs):
                if (op.id, i) not in cse.unread:
                    read[cse.canon[v]] = True
            for v in graph.region_reads.get(op.region, ()):
                read[cse.canon[v]] = True
        return tuple(read)
    return graph.analysis("read_values", compute)


def _liveness(graph: Graph, canon: Sequence[int], duplicate: Sequence[bool],
              unread: frozenset[tuple[int, int]], through: frozenset[int] = frozenset()) -> list[bool]:
    """Per op: whether XLA's DCE keeps it (over the CSE-merged program, backwards from the outputs). A loop
    or branch (the ops of one outermost region) is kept whole when a value it makes is read after it —
    with its branch index (`Graph.region_reads`) — and removed whole otherwise. An op XLA's simplifier replaces
    by its operands (`through`: result k is operand k) needs operand k only where result k is needed."""
    ops = graph.ops
    needed = [False] * len(graph.values)
    for v in graph.outputs:
        needed[canon[v]] = True
    live = [False] * len(ops)

    def keep(op: Any) -> None:
        live[op.id] = True
        passed = op.id in through
        for i, v in enumerate(op.inputs):
            if passed and not (i < len(op.outputs) and needed[canon[op.outputs[i]]]):
                continue
            if (op.id, i) not in unread:
                needed[canon[v]] = True
        for v in graph.region_reads.get(op.region, ()):
            needed[canon[v]] = True

    i = len(ops) - 1
    while i >= 0:
        region = outer_region(ops[i])
        j = i
        while region and j > 0 and outer_region(ops[j - 1]) == region:
            j -= 1
        run = ops[j:i + 1]  # one op, or a region's ops (contiguous: the graph builder makes them in a row)
        if any(needed[canon[v]] for op in run for v in op.outputs) or not run[-1].outputs:
            if _prunable_loop(run):
                _keep_needed(run, canon, duplicate, needed, live, keep)
            else:
                for op in reversed(run):
                    if not duplicate[op.id]:
                        keep(op)
        i = j - 1
    return live


def _prunable_loop(run: Sequence[Any]) -> bool:
    """Whether a region's ops are a scan (with scans and branches inside, no while loop) whose unneeded parts
    XLA removes: its while-loop simplifier drops loop state that nothing needed reads (a carry whose final value
    and stack are unread and that no needed value depends on, a stacked result nobody reads, a scanned operand
    no needed op slices), so the ops and reshards computing only those do not run."""
    return len(run) > 1 and outer_region(run[0]).startswith("scan") and not any("/while" in op.region for op in run)


def _keep_needed(run: Sequence[Any], canon: Sequence[int], duplicate: Sequence[bool], needed: list[bool],
                 live: list[bool], keep: Callable[[Any], None]) -> None:
    """Keep the ops of a loop whose results are needed (the values needed after it, then what they need
    inside it: a fixpoint, as the carries feed the body's earlier ops)."""
    changed = True
    while changed:
        changed = False
        for op in reversed(run):
            if live[op.id] or duplicate[op.id]:
                continue
            if not op.outputs or any(needed[canon[v]] for v in op.outputs):
                keep(op)
                changed = True


def outer_region(op: Any) -> str:
    """The outermost loop or branch region an op is in ("" for none)."""
    return op.region.split("/")[1] if op.region.startswith("/") else ""


def _spans(graph: Graph, live: list[bool], order: list[int]) -> tuple[tuple[int, int], ...]:
    """Per op: the first and last live op of its outermost region in `order` (the op itself outside regions)."""
    ends: dict[str, tuple[int, int]] = {}
    for op in graph.ops:
        r = outer_region(op)
        if r and live[op.id]:
            a, b = ends.get(r, (op.id, op.id))
            ends[r] = (min(a, op.id, key=order.__getitem__), max(b, op.id, key=order.__getitem__))
    return tuple(ends.get(outer_region(op), (op.id, op.id)) for op in graph.ops)


def _region_at(region: str, depth: int) -> str:
    """The loop or branch region at nesting `depth` (1: outermost) that `region` is in ("" above it)."""
    parts = region.split("/") if region.startswith("/") else [""]
    return "/".join(parts[:depth + 1]) if len(parts) > depth else ""


def _is_matmul(graph: Graph, i: int) -> bool:
    """Whether op `i` is a dot XLA computes as a matmul (not one it rewrites as a multiply or a reduce)."""
    return graph.ops[i].primitive == "dot_general" and not rewritten_dot(graph.ops[i], graph)


def _queued_units(graph: Graph, ops: Sequence[int], depth: int, canon: list[int], constant: list[bool],
                  fused: list[bool], copied: Collection[int], post: Sequence[int],
                  library: Mapping[int, int] | None = None,
                  recomputed: Recomputations | None = None, chains: Mapping[int, tuple[int, int]] | None = None,
                  copy_units: dict[int, tuple[int, int]] | None = None
                  ) -> tuple[dict[int, list[int]], list[tuple[list[int], list[int]]]]:
    """The breadth-first schedule of `ops` (live op ids in program order: the whole program at `depth` 1, else
    the body of a region nested at `depth` - 1; see `_breadth_first`): per unit — a region nested at `depth`,
    named by its first op's id, or any other op — its ops in the order they run (a region's body scheduled
    likewise), and per queued unit, in schedule order, the units that ran with it (inlined) and those it queued.
    A library fusion (`library`: op -> its fusion's reduction) is one unit too, its ops in program order. An op
    recomputing a materialised cheap value waits for what it is computed from (`recomputed.reads`), and a dot's
    copy of an operand (`recomputed.copies`) is a unit of no ops that the dot waits for (`_add_copy_units`), and so
    are the instructions of a plan's reshard an op waits for (`chains`: unit id -> (op, value), filled here from
    `graph`'s `queued_reshards`; the whole program's level only: `_add_chain_units`; `copy_units` likewise gets the
    copies' units: `_add_copy_units`)."""
    # (a loop's results — its `at="out"` ties — exist once the loop has run: after the rest of its body)
    results = [i for i in ops if depth > 1 and loop_exit(graph.ops[i])]
    if results:
        leaving = set(results)
        ops = [i for i in ops if i not in leaving]
    unit: dict[int, int] = {}
    first: dict[str, int] = {}
    library = library or {}
    fusion_of: dict[int, int] = {}  # a library fusion's reduction -> its unit (its first op here)
    for i in ops:
        r = _region_at(graph.ops[i].region, depth)
        if r:
            unit[i] = first.setdefault(r, i)
        else:
            unit[i] = fusion_of.setdefault(library[i], i) if i in library else i
    members: dict[int, list[int]] = {}
    for i in ops:
        members.setdefault(unit[i], []).append(i)
    fusions = set(fusion_of.values())
    for u, body in members.items():  # (a region's body is scheduled breadth first too)
        if len(body) > 1 and u not in fusions:
            inner, _ = _queued_units(graph, body, depth + 1, canon, constant, fused, copied, post, library,
                                     recomputed)
            members[u] = [i for w in inner for i in inner[w]]
    preds: dict[int, set[int]] = {u: set() for u in members}
    succs: dict[int, list[int]] = {u: [] for u in members}
    reads = recomputed.reads if recomputed else {}
    for u, body in members.items():
        for i in body:
            instead = reads.get(i, {})
            for c in (w for v in graph.ops[i].inputs for w in instead.get(canon[v], (canon[v],))):
                p = graph.values[c].producer
                if p is None or constant[c] or p not in unit or unit[p] == u or unit[p] in preds[u]:
                    continue
                preds[u].add(unit[p])
                succs[unit[p]].append(u)
    inline = {u for u, body in members.items() if len(body) == 1 and graph.ops[u].outputs
              and all(fused[canon[v]] or constant[canon[v]] for v in graph.ops[u].outputs)
              and not (RECIPROCAL_INSTRUCTIONS and _reciprocal_of_broadcast(graph, graph.ops[u], canon, constant))}
    for u, body in members.items():
        if len(body) != 1 or len(graph.ops[u].outputs) != 1 or len(succs[u]) < 2:
            continue
        c = canon[graph.ops[u].outputs[0]]
        matmul = _is_matmul(graph, u)
        read_by_matmuls = all(len(members[w]) == 1 and _is_matmul(graph, w) for w in succs[u])
        if USERS_AFTER_CONSTRAINT and (matmul or read_by_matmuls) and u not in inline \
                and not any(w in inline for w in succs[u]):
            succs[u] = succs[u][-1:] + succs[u][:-1]  # (see `_breadth_first`: the readers' order XLA's users keep)
        elif COPIED_READERS_REVERSED and c in copied and not fused[c]:
            succs[u] = sorted(succs[u], key=lambda w: -post[w])  # (`_breadth_first`: fusions made consumers first)
    if recomputed and recomputed.copies:
        _add_copy_units(graph, canon, unit, members, preds, succs, recomputed.copies, post,
                        copy_units if depth == 1 else None)
    if chains is not None and depth == 1:
        _add_chain_units(graph, canon, unit, members, preds, succs, chains)
    waiting = {u: len(p) for u, p in preds.items()}
    queue = collections.deque(u for u in sorted(members) if not waiting[u])
    runs: dict[int, list[int]] = {}
    groups: list[tuple[list[int], list[int]]] = []
    while queue:
        stack = [queue.popleft()]
        queued: list[int] = []
        ran: list[int] = []
        hinted = False
        while stack:  # inlined units run at once, with what made them ready
            u = stack.pop()
            ran.append(u)
            runs[u] = members[u]
            hinted = hinted or u < len(graph.ops) and graph.ops[u].primitive in ALIASES
            for w in succs[u]:
                waiting[w] -= 1
                if not waiting[w]:
                    (stack if w in inline else queued).append(w)
        # A hint is no instruction: what it makes ready is what the hinted value's instruction makes ready, queued in
        # the order of that instruction's users (program order), not in the order the hints were walked.
        queue.extend(sorted(queued) if hinted and HINTED_IN_PROGRAM_ORDER else queued)
        groups.append((ran, queued))
    for i in results:
        runs[i] = [i]
        groups.append(([i], []))
    return runs, groups


class Recomputations(NamedTuple):
    """What fusions recompute instead of reading (XLA duplicates cheap producers into each fusion that can take
    them, even where the value is materialised for other readers), as the values they are computed from: the
    first values up the chain of cheap values that are not cheap (constants aside)."""

    reads: dict[int, dict[int, tuple[int, ...]]]  # op -> {cheap value it recomputes: the values it reads instead}
    # dot -> {materialised value it copies: what the copy reads (the value, or what a cheap one is computed from)}
    copies: dict[int, dict[int, tuple[int, ...]]]


def _recomputations(graph: Graph, canon: Sequence[int], constant: Sequence[bool], fused: Sequence[bool],
                    cheap: frozenset[int], copies: Sequence[Sequence[int]], dup: Mapping[int, Sequence[int]]
                    ) -> Recomputations:
    """The recomputations `_queued_units` schedules by: the readers that recompute a materialised cheap value
    (`dup`), each with the values it is computed from, and the dots' copies of materialised values (`copies`)."""
    memo: dict[int, tuple[int, ...]] = {}

    def sources(c: int) -> tuple[int, ...]:
        if c not in memo:
            found: set[int] = set()
            stack, seen = [(c, 0)], {c}
            while stack:
                w, depth = stack.pop()
                for x in graph.ops[graph.values[w].producer].inputs:
                    cx = canon[x]
                    if constant[cx] or cx in seen:
                        continue
                    seen.add(cx)
                    if cx in cheap and depth < _COPY_DEPTH:
                        stack.append((cx, depth + 1))
                    else:
                        found.add(cx)
            memo[c] = tuple(sorted(found))
        return memo[c]

    reads: dict[int, dict[int, tuple[int, ...]]] = {}
    for c, readers in dup.items():
        for u in readers:
            reads.setdefault(u, {})[c] = sources(c)
    copying: dict[int, dict[int, tuple[int, ...]]] = {}
    for op in graph.ops:
        for i in copies[op.id] if copies else ():
            c = canon[op.inputs[i]]
            if not fused[c]:
                copying.setdefault(op.id, {})[c] = sources(c) if c in cheap else (c,)
    return Recomputations(reads if RECOMPUTED_READS else {}, copying if COPY_UNITS else {})


def _add_copy_units(graph: Graph, canon: Sequence[int], unit: Mapping[int, int], members: dict[int, list[int]],
                    preds: dict[int, set[int]], succs: dict[int, list[int]],
                    copies: Mapping[int, Mapping[int, tuple[int, ...]]], post: Sequence[int],
                    copy_units: dict[int, tuple[int, int]] | None = None) -> None:
    """Give each dot of `members` that copies an operand (`copies`: dot -> {operand: what the copy reads}) a unit
    of its own for the copy (an id past the ops'), which the dot waits for: XLA's dot decomposition makes the
    copy an instruction, the dot's operand in place of the value. A copy of a value's buffer takes the dot's
    place among the value's users; a copy of a materialised cheap value recomputes it, so it waits for what it is
    computed from instead, and is queued after their other users (the copies' dots consumers first: reverse post
    order, as fusion makes them). `copy_units` gets each copy's unit id -> (dot, canonical operand)."""
    n = len(graph.ops)
    made = 0
    for dot in sorted((u for u in members if u in copies and members[u] == [u]), key=lambda u: -post[u]):
        for c, sources in copies[dot].items():
            own = graph.values[c].producer
            if own not in unit or unit[own] not in preds[dot]:
                continue
            if sum(canon[v] == c or graph.values[canon[v]].producer == own for v in graph.ops[dot].inputs) > 1:
                continue  # (it reads the value's instruction otherwise too)
            copy = n + made
            made += 1
            if copy_units is not None:
                copy_units[copy] = (dot, c)
            members[copy] = []
            succs[copy] = [dot]
            at = succs[unit[own]].index(dot)
            if sources == (c,):
                preds[copy] = {unit[own]}
                succs[unit[own]][at] = copy
            else:
                preds[copy] = {unit[p] for v in sources for p in (graph.values[v].producer,) if p in unit}
                for p in preds[copy]:
                    succs[p].append(copy)
                del succs[unit[own]][at]
            preds[dot].discard(unit[own])
            preds[dot].add(copy)


# The most instructions of a queued reshard (`queued_reshards`): the operand's copy into the all-gather's memory
# order, the all-gather, the copy back into row-major order (a local slice and its collective are two).
_QUEUED_CHAIN = 3


def _add_chain_units(graph: Graph, canon: Sequence[int], unit: Mapping[int, int], members: dict[int, list[int]],
                     preds: dict[int, set[int]], succs: dict[int, list[int]],
                     chains: dict[int, tuple[int, int]]) -> None:
    """Put the instructions of each queued reshard (`graph`'s `queued_reshards`: (op, canonical operand, number of
    instructions)) between the operand's producer and the op, as units of no ops in a chain (ids past the ops' and
    copies'): the first takes the op's place among the producer's users, the op waits for the last. `chains` gets
    the id of each chain's collective (its second instruction) -> (op, operand)."""
    base = 2 * len(graph.ops) + 1
    for op, c, n in sorted(graph.analysis("queued_reshards", frozenset)):
        own = graph.values[c].producer
        if own not in unit or op not in members or members[op] != [op] or unit[own] not in preds[op] \
                or op not in succs[unit[own]]:
            continue
        if sum(canon[v] == c or graph.values[canon[v]].producer == own for v in graph.ops[op].inputs) > 1:
            continue  # (it reads the producer's instruction otherwise too)
        ids = [base + len(chains) * _QUEUED_CHAIN + k for k in range(n)]
        chains[ids[1]] = (op, c)
        at = succs[unit[own]].index(op)
        succs[unit[own]][at] = ids[0]
        for k, u in enumerate(ids):
            members[u] = []
            preds[u] = {unit[own] if k == 0 else ids[k - 1]}
            succs[u] = [ids[k + 1] if k + 1 < len(ids) else op]
        preds[op].discard(unit[own])
        preds[op].add(ids[-1])


def _breadth_first(graph: Graph, live: list[bool], canon: list[int], constant: list[bool], fused: list[bool],
                   consumers: list[list[int]], copied: Collection[int] = frozenset(), post: Sequence[int] = (),
                   library: Mapping[int, int] | None = None,
                   recomputed: Recomputations | None = None
                   ) -> tuple[list[int], list[int], dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """Per op, its position in XLA:CPU's schedule: breadth first (BFSMemoryScheduler, XLA:CPU's default
    since `xla_cpu_enable_concurrency_optimized_scheduler`): an instruction runs as soon as its operands
    exist, in the order they became ready — so what depends only on the arguments (a parameter's
    all-gather, an iota) runs at the start. Ops whose results are fused into their readers, hints and ties
    are no instructions: they run as they become ready (what hints make ready is queued in program order). A
    loop or branch region is one instruction, its body scheduled the same way (`_queued_units`).

    An instruction's users are queued in the order XLA keeps them, which is not program order: the lowering
    reads every result through a sharding constraint, and when the partitioner removes the constraint its
    readers join the result's users after it and the constraint leaves by swapping in the last of them
    (`HloInstruction::RemoveUser`). So an op's readers become ready last reader first, then the others in
    program order (measured: `(sum(d), exp(d), tanh(d), log(d))` runs log, sum, exp, tanh; a plain `jax.jit`
    of it, without constraints, runs them in program order). Kept to matmuls read by instructions only, and to
    values only matmuls read (attention's transposed output gradient, read by the probabilities' and the
    values' gradient matmuls: the value gradient runs first and frees the probabilities; 1.07-1.08x over
    before, and 1.3x on the attention core at 2 sequences): a fused value has no users of its own, and where a
    fused reader sits among the users is not modelled; applied to every op, it put a searched ResNet's peak 10%
    under (convolutions' readers, not analysed).

    A cheap value a dot decomposition copies (`copied`: the output gradient a layer's input- and weight-gradient
    matmuls both read) is no instruction of its own in XLA: fusion duplicates it into a fusion per reader, made
    as the fusion pass meets the readers — consumers first, in reverse post order (`post`) — and so queued in
    that order: the input gradient's matmul runs before the weight gradient's (measured: a Flax GELU MLP's step,
    17% under before)."""
    no = len(graph.ops)
    chains: dict[int, tuple[int, int]] = {}
    copy_units: dict[int, tuple[int, int]] = {}
    runs, groups = _queued_units(graph, [op.id for op in graph.ops if live[op.id]], 1, canon, constant, fused,
                                 copied, post, library, recomputed, chains, copy_units)
    order = [-1] * no
    queued_at: dict[tuple[int, int], int] = {}  # (op, operand) of a queued reshard -> the op run before its collective
    copied_at: dict[tuple[int, int], int] = {}  # (dot, operand) of a dot's copy -> the op run before the copy
    pos = 0
    for ran, _ in groups:
        for u in ran:
            if u in chains:
                queued_at[chains[u]] = pos - 1
            if u in copy_units:
                copied_at[copy_units[u]] = pos - 1
            for i in runs[u]:
                order[i] = pos
                pos += 1
    for i in range(no):  # dead ops (no work) after the rest
        if order[i] < 0:
            order[i] = pos
            pos += 1
    batch = list(order)  # per op: the last position of what its unit's group queued (`ProgramInfo.batch`)
    for ran, queued in groups:
        end = max((min(order[i] for i in runs[w]) for w in queued if runs[w]), default=-1)
        for u in ran:
            for i in runs[u]:
                batch[i] = max(batch[i], end)
    return order, batch, queued_at, copied_at


def _first_readers(graph: Graph, live: Sequence[bool], order: Sequence[int], fused: Sequence[bool],
                   constant: Sequence[bool], canon: Sequence[int],
                   consumers: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Per op, the first position (`order`) of an op reading its results that is an instruction: through readers
    whose results are all fused or constant (hints, fused elementwise work: no instruction), to theirs."""
    out = list(order)
    for op in reversed(graph.ops):  # (readers come after producers)
        if not live[op.id] or not op.outputs:
            continue
        firsts = []
        for v in op.outputs:
            for u in consumers[canon[v]]:
                r = graph.ops[u]
                none = bool(r.outputs) and all(fused[canon[w]] or constant[canon[w]] for w in r.outputs)
                firsts.append(out[u] if none else order[u])
        if firsts:
            out[op.id] = max(order[op.id], min(firsts))
    return tuple(out)


def derived(op: Any, c: int, canon: Sequence[int]) -> list[int]:
    """The results of `op` computed from its canonical input `c` (an optimization barrier passes operand i
    through as result i; other ops compute every result from every operand)."""
    if op.primitive == "optimization_barrier":
        return [w for u, w in zip(op.inputs, op.outputs) if canon[u] == c]
    return list(op.outputs)


def fusing_readers(graph: Graph, live: Sequence[bool], canon: Sequence[int], fused: Sequence[bool],
                   consumers: Sequence[Sequence[int]], dup: Mapping[int, Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """Per canonical value XLA recomputes inside the fusions reading it, those readers: all of a fused value's,
    and the readers of a cheap materialised value that fuse it anyway (`dup`)."""
    out: dict[int, tuple[int, ...]] = {}
    for op in graph.ops:
        if not live[op.id]:
            continue
        for v in op.outputs:
            c = canon[v]
            if c == v and (fused[c] or c in dup):
                out[c] = tuple(consumers[c]) if fused[c] else tuple(dup[c])
    return out


def _fused_reads(graph: Graph, live: list[bool], canon: list[int], fused: list[bool],
                 fusing: Mapping[int, Sequence[int]], order: list[int],
                 dup: Mapping[int, list[int]] | None = None,
                 library: Collection[int] = frozenset()) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per op whose results are fused into their readers: for each canonical input, the last op (by `order`)
    that materialises a value computed from it — XLA recomputes a fused value inside each fusion reading it
    (`fusing`), so the operands it is computed from are read there. `dup`: materialised values also recomputed
    inside these readers of theirs (cheap ones); `library`: the ops in library fusions. Independent of the plan:
    where a plan's collective reads a fused value, it is materialised there instead (`MemoryModel._fused_end`)."""
    dup = dup or {}
    nv = len(graph.values)
    at = [-1] * nv  # per fused canonical value: the last op materialising something computed from it

    def later(a: int, b: int) -> int:
        return b if a < 0 or (b >= 0 and order[b] > order[a]) else a

    def end(op: Any, c: int, own: bool = False) -> int:
        """The last op materialising what `op` computes from `c`: a reader's materialised result ends the chain,
        but a `dup` value's recomputations in its fusing readers count too (`own`: `op` makes the `dup` value),
        and where a loop fusion makes it, they recompute the fused values it is computed from as well (measured:
        flax lm1b's `exp(logits + b - max)` fusion reads the logits' dot, though `logits + b - max` and
        `logits + b` are materialised for library reductions; what a library fusion makes is only read)."""
        last = -1
        for w in derived(op, c, canon):
            cw = canon[w]
            last = later(last, at[cw] if fused[cw] and at[cw] >= 0 else
                         later(op.id, at[cw]) if cw in dup and (own or op.id not in library) else op.id)
        return last

    out: list[tuple[tuple[int, int], ...]] = [()] * len(graph.ops)
    for op in reversed(graph.ops):  # readers come after producers
        if not live[op.id] or not op.outputs:
            continue
        for v in op.outputs:
            c = canon[v]
            if c == v and c in fusing:
                for u in fusing[c]:
                    at[c] = later(at[c], end(graph.ops[u], c))
        if any(fused[canon[w]] or canon[w] in dup for w in op.outputs):
            pairs = {}
            for u in op.inputs:
                c = canon[u]
                e = end(op, c, own=True)
                if e >= 0 and e != op.id:
                    pairs[c] = later(pairs.get(c, -1), e)
            out[op.id] = tuple(sorted(pairs.items()))
    return tuple(out)


SCATTERS = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
                      "scatter_min", "scatter-max", "scatter_max"})


def _preset_state(graph: Graph, live: Sequence[bool], canon: Sequence[int], constant: Sequence[bool],
                  carried: frozenset[int]) -> frozenset[int]:
    """Buffers XLA:CPU makes at the program's start, written in place later: the state of top-level loops
    initialised from constants — a scan's stacked outputs (JAX starts them as zeros), the carries whose
    initial value is a compile-time constant (copy insertion copies the constant into the loop's buffer) —
    and the results of top-level scatters into a constant operand (the scatter writes into a broadcast of
    it). What makes these buffers reads nothing computed, so the breadth-first schedule runs it first."""
    init = {op.outputs[0]: op.inputs[0] for op in graph.ops
            if loop_entry(op) and live[op.id]}
    consumers: list[list[int]] = [[] for _ in graph.values]
    for op in graph.ops:
        if live[op.id]:
            for v in op.inputs:
                consumers[canon[v]].append(op.id)
    out: set[int] = set()
    for op in graph.ops:
        if not live[op.id]:
            continue
        if scatter_into_constant(op, canon, constant) \
                and not constant[canon[op.outputs[0]]] and not _scatter_into_sum(graph, op, canon, consumers):
            out.add(canon[op.outputs[0]])
        if op.region.count("/") != 1:
            continue
        if op.primitive == "scan_stack":
            out.update(canon[v] for v in op.outputs)
        elif op.primitive == "tie" and not op.params.get("at") and canon[op.inputs[0]] in carried:
            start = init.get(op.outputs[0])
            if start is not None and constant[canon[start]]:
                out.add(canon[op.inputs[0]])
    return frozenset(out)


def scatter_into_constant(op: Any, canon: Sequence[int], constant: Sequence[bool]) -> bool:
    """Whether `op` is a top-level scatter into a compile-time constant operand: XLA makes a broadcast of the
    constant at the program's start and scatters into it in place."""
    return op.primitive in SCATTERS and not op.region and bool(op.inputs) and constant[canon[op.inputs[0]]]


def _scatter_into_sum(graph: Graph, op: Any, canon: Sequence[int], consumers: list[list[int]]) -> bool:
    """Whether XLA's algebraic simplifier turns add(scatter-add(zeros, i, u), x) into scatter-add(x, i, u): the
    scatter's only reader adds a value of its shape to it (a softmax cross-entropy's gradient). (`consumers`: the
    live ops reading each canonical value; a PCG's collectives are looked through, as a plan's reshards are.)"""
    c = canon[op.outputs[0]]
    readers = [graph.ops[u] for u in _readers(graph, consumers, canon, c)]
    return (op.primitive in ("scatter-add", "scatter_add") and len(readers) == 1
            and readers[0].primitive in ("add", "add_any")
            and all(graph.values[v].shape == graph.values[c].shape for v in readers[0].inputs))


def _post_order(graph: Graph, canon: list[int]) -> list[int]:
    """Per op, its position in the post order XLA walks a computation in (MakeInstructionPostOrder): depth
    first from the root — the tuple of the outputs, in order — each instruction's operands first to last,
    an instruction after its operands. Ops no output reaches come after, in program order."""
    no = len(graph.ops)
    pos = [-1] * no
    n = 0
    for root in graph.outputs:
        p = graph.values[canon[root]].producer
        if p is None or pos[p] >= 0:
            continue
        stack: list[tuple[int, bool]] = [(p, False)]
        while stack:
            op, done = stack.pop()
            if pos[op] >= 0:
                continue
            if done:
                pos[op] = n
                n += 1
                continue
            stack.append((op, True))
            for v in reversed(graph.ops[op].inputs):  # the first operand is visited first
                q = graph.values[canon[v]].producer
                if q is not None and pos[q] < 0:
                    stack.append((q, False))
    for i in range(no):
        if pos[i] < 0:
            pos[i] = n
            n += 1
    return pos


def descendants(graph: Graph, canon: Sequence[int]) -> list[int]:
    """Per canonical value, a bitmask of the canonical values computed from it (cached per graph and `canon`)."""
    cache: dict = graph.analysis("descendants", dict)  # id(canon) -> (canon, desc); canon: a ProgramInfo's
    cached = cache.get(id(canon))
    if cached is not None and cached[0] is canon:
        return cached[1]
    desc = [0] * len(graph.values)
    for op in reversed(graph.ops):
        below = 0
        for v in op.outputs:
            below |= desc[canon[v]] | (1 << canon[v])
        if below:
            for v in op.inputs:
                desc[canon[v]] |= below
    cache[id(canon)] = (canon, desc)  # (the entry keeps canon alive: its id is not reused)
    return desc


def per_info(graph: Graph, name: str, info: ProgramInfo, compute: Callable[[], Any]) -> Any:
    """A table that depends only on the graph and `info`, computed once per (graph, info) pair: the simulators
    of a search's meshes share it (cached on the graph, keyed by the ProgramInfo object it was computed from)."""
    cache = graph.analysis(name, dict)  # id(info) -> (info, table); the entry keeps info alive, so its id stays its own
    hit = cache.get(id(info))
    if hit is None or hit[0] is not info:
        hit = cache[id(info)] = (info, compute())
    return hit[1]


def program_info(graph: Graph, backend: str = "") -> ProgramInfo:
    """What XLA keeps of `graph` when compiled for `backend` ("cpu", "gpu", "tpu" or "": no backend rule)."""
    cache: dict[str, ProgramInfo] = graph.analysis("program_info", dict)
    info = cache.get(backend)
    if info is None:
        info = cache[backend] = _analyse(graph, backend)
    return info


@dataclasses.dataclass(frozen=True)
class Merged:
    """What XLA's CSE and constant folding make of a graph's values (plan-independent)."""

    constant: tuple[bool, ...]  # per value: known at compile time
    canon: tuple[int, ...]  # per value: the value CSE keeps for it
    duplicate: tuple[bool, ...]  # per op: merged into an earlier identical op
    pkeys: tuple[Any, ...]  # per op: its params as a hashable key
    unread: frozenset[tuple[int, int]] = frozenset()  # (op, operand index) XLA's simplifier stops reading
    through: frozenset[int] = frozenset()  # ops XLA's simplifier replaces by their operands (`passes_through`)


def folds_to_constant(graph: Graph, op: Any) -> bool:
    """Whether XLA's simplifier makes `op`'s results constants whatever its operands: argmax/argmin over
    dims of size 1 (the index is 0); `empty`/`empty2` are zeros (a broadcast of a constant, which XLA's
    partitioner makes in any layout without collectives), and so is an iota along a dim of size 1 (its
    simplifier's `HandleIota`: the sort permutation of a sort along such a dim); a fill-or-drop gather whose
    constant index lies out of bounds is its fill value (`shardc.cost.windows.gather_window`)."""
    if op.primitive in ("empty", "empty2") and not op.inputs:
        return True
    if op.primitive == "iota" and not op.inputs:
        shape = op.params.get("shape", ())
        return bool(shape) and shape[op.params.get("dimension", 0)] <= 1
    if op.primitive in ("argmax", "argmin") and op.inputs:
        shape = graph.values[op.inputs[0]].shape
        return all(shape[d] == 1 for d in op.params.get("axes", ()))
    return op.primitive == "gather" and gather_window(graph, op) == OUT_OF_BOUNDS


# Ops whose result is their (first) operand's value: what is zeros through them stays zeros (the free ones
# but those that slice or stack a loop's values, and converts and copies).
_SAME_VALUE = FREE_PRIMITIVES - _NOT_MERGED | {"tie", "convert_element_type", "copy", "copy_p"}


def _sorts_one(graph: Graph, op: Any) -> bool:
    """A sort along a dim of size 1 (or of no elements) is its operands (`AlgebraicSimplifier::HandleSort`)."""
    shape = graph.values[op.inputs[0]].shape
    return not shape or math.prod(shape) == 0 or shape[op.params.get("dimension", len(shape) - 1)] <= 1


# The identity element of a binary op: `x op e` is `x` (XLA's simplifier: A + 0, A - 0, A * 1, A / 1 => A).
_IDENTITY_ELEMENT = {"add": 0, "add_any": 0, "sub": 0, "mul": 1, "div": 1}


def _by_identity(graph: Graph, op: Any) -> bool:
    """`x op e` with `e` a splat of the op's identity element (`splat_literal`) and `x` of the result's shape and
    dtype: `x` (Flax's RMSNorm subtracts a mean of zeros). (`e op x` is `x` to XLA too; not modelled: the result
    would be operand 1.)"""
    if len(op.inputs) != 2 or len(op.outputs) != 1:
        return False
    x, out = graph.values[op.inputs[0]], graph.values[op.outputs[0]]
    e = splat_literal(graph, op.inputs[1])
    return (e is not None and e == _IDENTITY_ELEMENT[op.primitive] and tuple(x.shape) == tuple(out.shape)
            and x.dtype == out.dtype)


# Ops XLA's algebraic simplifier replaces by their operands whatever their shardings (result k is operand k's
# value; further operands are not read): per primitive, whether this op is one. Run after SPMD partitioning: the
# op's reshards run, but it computes nothing, makes no buffer, and what it makes of a constant is that constant.
PASS_THROUGH_RULES: dict[str, Callable[[Graph, Any], bool]] = {
    "sort": _sorts_one, **{p: _by_identity for p in _IDENTITY_ELEMENT}}
# Of those, the ones the lowering still binds: XLA drops them itself, and dropping them before it changes its
# fusions (measured: a layer norm's gradient with a scale of ones, 25% more temporaries when the lowering
# dropped the multiplies). The others (a sort) are their operands in the lowering too (`Lowering.passed_through`).
BOUND_THROUGH = frozenset(_IDENTITY_ELEMENT)


def passes_through(graph: Graph, op: Any) -> bool:
    """Whether XLA's simplifier replaces `op` by its operands (`PASS_THROUGH_RULES`)."""
    rule = PASS_THROUGH_RULES.get(op.primitive)
    return rule is not None and 0 < len(op.outputs) <= len(op.inputs) and rule(graph, op)


def passed_to(graph: Graph, v: int) -> int:
    """The value `v` is to XLA, through the ops its simplifier replaces by their operands (`passes_through`)."""
    for _ in range(64):  # (chains of such ops; bounded)
        p = graph.values[v].producer
        if p is None or not passes_through(graph, graph.ops[p]):
            return v
        v = graph.ops[p].inputs[graph.ops[p].outputs.index(v)]
    return v


def splat_literal(graph: Graph, v: int) -> Any | None:
    """The scalar literal value `v` holds in every element at compile time (a broadcast of a literal, through ops
    that keep their operand's value, not into a loop's carry: `joined_values`), or None."""
    joined = joined_values(graph)
    for _ in range(64):  # (chains of broadcasts, hints and converts; bounded)
        p = graph.values[v].producer
        if p is None:
            return graph.values[v].literal
        op = graph.ops[p]
        if v in joined or not op.inputs or not (op.primitive == "broadcast_in_dim" or op.primitive in _SAME_VALUE):
            return None
        v = op.inputs[0]
    return None


def joined_values(graph: Graph) -> frozenset[int]:
    """Values more than one op writes: a loop's carry (its initial value's tie and the body's new carry) and a
    branch's result (each branch's tie). No one writer's operand is their value."""
    def compute() -> frozenset[int]:
        count = collections.Counter(v for op in graph.ops for v in op.outputs)
        return frozenset(v for v, n in count.items() if n > 1)
    return graph.analysis("joined_values", compute)


def is_zeros(graph: Graph, v: int) -> bool:
    """Whether value `v` is all zeros at compile time as XLA's simplifier sees it: a broadcast of a literal 0
    (`zeros_like`, the cotangent of an unused result), through ops that keep their operand's value (not into a
    loop's carry, whose value the body changes: `joined_values`), and a dynamic_update_slice over its whole
    operand of such zeros."""
    joined = joined_values(graph)
    for _ in range(64):  # (chains of hints and converts; bounded)
        p = graph.values[v].producer
        if p is None:
            return graph.values[v].literal == 0
        if v in joined:
            return False
        op = graph.ops[p]
        if op.primitive == "broadcast_in_dim" and op.inputs:
            return splat_literal(graph, op.inputs[0]) == 0
        if op.primitive == "iota":
            return folds_to_constant(graph, op)  # (zeros along a dim of size 1)
        if op.primitive == "dynamic_update_slice" and len(op.inputs) > 1 \
                and graph.values[op.inputs[1]].shape == graph.values[op.inputs[0]].shape:
            v = op.inputs[1]
        elif op.primitive in _SAME_VALUE and op.inputs:
            v = op.inputs[0]
        elif passes_through(graph, op):
            v = op.inputs[op.outputs.index(v)]
        else:
            return False
    return False


def _cases_alike(n: int, same: Callable[[int, int], bool]) -> tuple[int, ...]:
    """select_n (predicate, case 0, case 1, ...) whose cases are one buffer is that case: the predicate and the
    other cases are not read."""
    return (0, *range(2, n)) if n > 2 and all(same(1, i) for i in range(2, n)) else ()


def _pair_alike(n: int, same: Callable[[int, int], bool]) -> tuple[int, ...]:
    """max(x, x) and min(x, x) are x."""
    return (1,) if n == 2 and same(0, 1) else ()


# Ops XLA's algebraic simplifier replaces by one of their operands when some operands are one buffer (on the
# compiled HLO of jaxlib 0.10: select, max and min of one operand are dropped, `and`/`or` kept): per primitive,
# given `same(i, j)` (operands i and j are one buffer), the operands it drops; the op is then the first
# operand left. Statically one buffer means one value (`unread_operands`); per plan, also one value read
# through hints in the layout they make it (`shardc.sim.tasks`: `where(p, hint(x), x)` with the select in
# the hint's layout reads the hint's reshard of x twice, so its predicate's reshards do not run).
SAME_OPERAND_RULES: dict[str, Callable[[int, Callable[[int, int], bool]], tuple[int, ...]]] = {
    "select_n": _cases_alike, "max": _pair_alike, "min": _pair_alike}


def unread_if_same(op: Any, same: Callable[[int, int], bool]) -> tuple[int, ...]:
    """The operands of `op` XLA's simplifier drops given which of its operands are one buffer
    (`SAME_OPERAND_RULES`; () for other ops)."""
    rule = SAME_OPERAND_RULES.get(op.primitive)
    return rule(len(op.inputs), same) if rule is not None else ()


def unread_repeats(op: Any) -> tuple[int, ...]:
    """The operands of `op` XLA's simplifier drops because they repeat another as one value (`where(p, x, x)`:
    the predicate and the second case; `max(x, x)`: the second x). The op is then the first operand left."""
    return unread_if_same(op, lambda i, j: op.inputs[i] == op.inputs[j])


def unread_operands(graph: Graph, op: Any) -> tuple[int, ...]:
    """Operands of `op` XLA's algebraic simplifier drops: a dynamic_update_slice whose update covers its
    whole operand is the update; a select whose cases are one value (or all zeros, `is_zeros`: one broadcast
    once XLA's CSE merges them) is that value (`where(p, x, x)`: the predicate is not read), and so are max and
    min of one value (`SAME_OPERAND_RULES`); an op folded to a constant whatever its operands reads none of
    them; a slice of nothing but a pad's padding reads nothing (`reads_only_padding`); a concatenate's or pad's
    operand no slice of its result reads is not read (`shardc.cost.windows.window_unread`)."""
    if folds_to_constant(graph, op):
        return tuple(range(len(op.inputs)))
    if op.primitive == "dynamic_update_slice" and len(op.inputs) > 1 \
            and graph.values[op.inputs[1]].shape == graph.values[op.inputs[0]].shape:
        return (0,)
    same = unread_if_same(op, lambda i, j: op.inputs[i] == op.inputs[j]
                          or is_zeros(graph, op.inputs[i]) and is_zeros(graph, op.inputs[j]))
    if same:
        return same
    if reads_only_padding(graph, op):
        return tuple(range(len(op.inputs)))
    return window_unread(graph, op)


def pad_of(graph: Graph, v: int) -> Any | None:
    """The pad op whose result value `v` is, itself or through ops XLA's simplifier replaces by their operands
    (`passes_through`: a sort along a dim of size 1), which it folds before it folds a slice of the pad; None
    when `v` is no pad's result."""
    p = graph.values[passed_to(graph, v)].producer
    return graph.ops[p] if p is not None and graph.ops[p].primitive == "pad" else None


def reads_only_padding(graph: Graph, op: Any) -> bool:
    """Whether `op` slices nothing but the padding of the pad making its operand (`pad_of`; on some dim, its
    window lies before the padded value's first element or after its last, interior padding included): XLA's
    simplifier makes it a broadcast of the padding value, and the padded value is not read (the transpose of
    a slice of a pad is such a pad of a pad; a dynamic slice at literal starts is a slice)."""
    window = slice_window(graph, op)
    if window is None or not op.inputs:
        return False
    pad = pad_of(graph, op.inputs[0])
    if pad is None:
        return False
    inner = graph.values[pad.inputs[0]].shape
    for (start, limit), (lo, _, interior), n in zip(window, pad.params["padding_config"], inner):
        # (the padded value's elements sit at lo + i * (interior + 1): before the first or after the last;
        # XLA does not fold a window between two of them, in interior padding)
        if n == 0 or limit <= lo or start > lo + (n - 1) * (interior + 1):
            return True
    return False


# Ops XLA's SPMD partitioner sees as elementwise (a result is a broadcast along the dims all operands are).
_ELEMENTWISE_HLO = frozenset(ELEMENTWISE) | frozenset(TRANSCENDENTAL) | {"integer_pow", "stop_gradient", "copy",
                                                                      "copy_p", "shardc_hint", "sharding_constraint",
                                                                      PCG_COLLECTIVE}


def broadcast_transfer(graph: Graph, op: Any, operands: Sequence[frozenset[int]]) -> list[frozenset[int]]:
    """The dims along which each result of `op` is a broadcast, given its operands' (XLA's SpmdBuilder
    tracks them through broadcasts, elementwise ops, transposes, reshapes, slices (`split`'s too) and pads: a
    reshard that only moves data along them is a local copy). Ties and scan slices/stacks: none (loop and
    branch parameters and results are not tracked)."""
    prim = op.primitive
    shape = graph.values[op.outputs[0]].shape if op.outputs else ()
    none = [frozenset()] * len(op.outputs)
    if prim == "broadcast_in_dim":
        mapped = op.params.get("broadcast_dimensions", ())
        src = graph.values[op.inputs[0]].shape
        new = {d for d in range(len(shape)) if d not in mapped}
        new |= {d for i, d in enumerate(mapped) if src[i] == 1 and shape[d] != 1}
        return [frozenset(new)]
    if prim == "iota":  # (XLA makes it a broadcast of a 1-D iota along its dimension)
        return [frozenset(d for d in range(len(shape)) if d != op.params.get("dimension", 0))]
    if not operands or not operands[0] and prim not in _ELEMENTWISE_HLO:
        return none
    b = operands[0]
    if prim in _ELEMENTWISE_HLO:
        dims = set(range(len(shape)))
        for u, ub in zip(op.inputs, operands):
            if graph.values[u].rank:  # (a scalar operand is broadcast to every dim)
                dims &= ub | _implicitly_broadcast(graph.values[u].shape, shape)
        return [frozenset(dims)] * len(op.outputs)
    if prim == "transpose":
        perm = op.params["permutation"]
        return [frozenset(i for i, p in enumerate(perm) if p in b)]
    if prim in ("reshape", "squeeze", "expand_dims"):
        return [_reshape_broadcast(graph.values[op.inputs[0]].shape, shape, b)]
    if prim in ("slice", "dynamic_slice"):
        return [b]
    if prim == "split":  # (slices, to XLA)
        return [b] * len(op.outputs)
    if prim == "pad":
        config = op.params["padding_config"]
        return [frozenset(d for d in b if tuple(config[d]) == (0, 0, 0))]
    return none


def _implicitly_broadcast(operand: Sequence[int], result: Sequence[int]) -> frozenset[int]:
    """The dims along which an elementwise op's operand is broadcast to its result's shape: those of size 1
    where the result's is not (lax's `eq(x: f32[4], m: f32[1])` in reduce_min's gradient lowers to a
    broadcast_in_dim of m, which XLA's SpmdBuilder tracks as one)."""
    if len(operand) != len(result):
        return frozenset()
    return frozenset(d for d, (n, m) in enumerate(zip(operand, result)) if n == 1 and m != 1)


def _reshape_broadcast(src: Sequence[int], dst: Sequence[int], b: frozenset[int]) -> frozenset[int]:
    """SpmdBuilder::SetBroadcastDimsForReshape: dims of `dst` made only of broadcast dims of `src`, when
    the reshape only splits and merges dims."""
    if not dst or math.prod(dst) == 0:
        return frozenset()
    out = set(range(len(dst)))
    before, after = list(reversed(src)), list(reversed(dst))
    while before and after:
        cb, ca = len(src) - len(before), len(dst) - len(after)
        bs, a_s = before.pop(), after.pop()
        if cb not in b:
            out.discard(ca)
        if bs == a_s:
            continue
        if bs % a_s == 0:
            before.append(bs // a_s)
        elif a_s % bs == 0:
            after.append(a_s // bs)
        else:
            out -= set(range(ca, len(dst)))
            break
    return frozenset(out) if out and not before and not after else frozenset()


def broadcast_dims(graph: Graph) -> tuple[frozenset[int], ...]:
    """Per value: the dims along which it is a broadcast when every reshard on the way keeps it one (an
    upper bound; a plan's collectives can make a new value: `shardc.sim.tasks.TaskBuilder.broadcasts`)."""
    return graph.analysis("broadcast_dims", lambda: _broadcast_dims(graph))


def _broadcast_dims(graph: Graph) -> tuple[frozenset[int], ...]:
    canon = merged(graph).canon
    out = [frozenset()] * len(graph.values)
    for op in graph.ops:
        if op.primitive in ("tie", "scan_slice", "scan_stack") or not op.outputs:
            continue
        for v, b in zip(op.outputs, broadcast_transfer(graph, op, [out[canon[u]] for u in op.inputs])):
            if canon[v] == v:
                out[v] = b
    return tuple(out[canon[v]] for v in range(len(out)))


def merged(graph: Graph) -> Merged:
    """CSE and constant folding over `graph`, forwards (cached on the graph)."""
    return graph.analysis("merged", lambda: _merge(graph))


def cse(graph: Graph) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[Any, ...]]:
    """XLA's CSE over `graph` (cached on the graph): per value the one XLA keeps (`canon`), per op whether it
    is merged into an earlier identical one (`duplicate`), per op its params as a hashable key (`pkeys`)."""
    return graph.analysis("cse", lambda: _cse(graph))


def _cse(graph: Graph) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[Any, ...]]:
    pkeys = tuple(params_key(op.params) for op in graph.ops)
    canon = list(range(len(graph.values)))
    duplicate = [False] * len(graph.ops)
    seen: dict[Any, int] = {}
    for op in graph.ops:
        if op.primitive in _NOT_MERGED or op.primitive in ("shardc_hint", "sharding_constraint"):
            continue
        ins = tuple(_operand_key(graph, canon, v) for v in op.inputs)
        lits = tuple((graph.values[v].shape, str(graph.values[v].dtype), graph.values[v].name)
                     if graph.values[v].is_const else None for v in op.inputs)
        key = (op.primitive, op.region, pkeys[op.id], ins, lits)
        first = seen.get(key)
        if first is None:
            seen[key] = op.id
            continue
        duplicate[op.id] = True
        for a, b in zip(op.outputs, graph.ops[first].outputs):
            canon[a] = canon[b]
    return tuple(canon), tuple(duplicate), pkeys


def _operand_key(graph: Graph, canon: Sequence[int], v: int) -> Any:
    """What identifies operand `v` to XLA's CSE: a scalar literal by its value (two `1024.0`s of a mean and of a
    variance are one constant to XLA), any other value by the one CSE keeps of it."""
    value = graph.values[v]
    if value.is_const and value.literal is not None and not value.shape:
        return "literal", str(value.dtype), type(value.literal).__name__, value.literal
    return canon[v]


def _merge(graph: Graph) -> Merged:
    canon, duplicate, pkeys = cse(graph)
    through = frozenset(op.id for op in graph.ops if passes_through(graph, op))
    # A one-trip loop's carry is a constant only when every value written into it is: one its body makes
    # anew from other values is no constant for the body's readers either (XLA partitions the loop state,
    # one buffer in one layout, before its while-loop simplifier inlines the loop: fuzz seed 128002). Carries
    # found so are taken as such from the start and the propagation runs again (each run demotes some; it ends).
    demoted: set[int] = set()
    while True:
        constant, unread_pairs, mixed = _propagate_constants(graph, through, demoted)
        if mixed <= demoted:
            return Merged(tuple(constant), canon, duplicate, pkeys, frozenset(unread_pairs), through)
        demoted |= mixed


def _propagate_constants(graph: Graph, through: frozenset[int], demoted: set[int]
                         ) -> tuple[list[bool], set[tuple[int, int]], set[int]]:
    """Per value, whether it is a compile-time constant (one pass in program order), the (op, operand) pairs
    XLA's simplifier drops, and the one-trip loops' carries first written a constant and then not (`demoted`:
    carries taken for non-constants from the start). A cond's branch index is a constant to XLA only when its
    simplifier folds it to a literal (`shardc.cost.splats`: not through a pad, a cumsum, a dot)."""
    constant = [graph.values[v].is_const for v in range(len(graph.values))]
    forms = [splats.literal_form(graph, v) for v in range(len(graph.values))]
    unread_pairs: set[tuple[int, int]] = set()
    once = {r for r, n in graph.region_trips.items() if n == 1}  # (loops of one trip: XLA inlines them)
    carried: set[int] = set()  # values a one-trip loop's tie or slice, or a constant-index cond's result tie, wrote
    mixed: set[int] = set()
    folds: set[int] = set()  # values of a constant-index cond's branch that XLA folds once it inlines it
    for op in graph.ops:
        # (an operand the simplifier drops does not count: a dynamic_update_slice of a constant over its whole
        # operand is that constant; in a loop or branch body too: XLA folds them there)
        unread = unread_operands(graph, op)
        unread_pairs.update((op.id, i) for i in unread)
        read = [i for i in range(len(op.inputs)) if i not in unread]
        source = folds_to_constant(graph, op)
        if (op.inputs and all(constant[op.inputs[i]] for i in read) or source) and op.primitive not in _NOT_MERGED \
                and op.primitive not in _RUN_TIME:
            for v in op.outputs:
                constant[v] = True
                forms[v] = splats.form_of_result(graph, op, forms, read, source)
        elif op.id in through:  # (result k is operand k: a constant where that operand is one)
            for v, u in zip(op.outputs, op.inputs):
                constant[v], forms[v] = constant[u], forms[u]
        elif _constant_branch(graph, op, constant, forms):
            # XLA inlines a cond whose branch index it folds to a literal and folds the branch taken when that
            # computes from constants only; the branch's own values stay what they are to the plan (their layouts
            # run in the branch before the fold), the cond's result is a constant when every branch's is one XLA
            # folds (a sharding constraint gathering any other is a collective: the cond inlines after partitioning)
            folded = [constant[v] or v in folds for v in op.inputs]
            if op.primitive != "tie":
                if all(folded) and op.primitive not in _NOT_MERGED | _RUN_TIME:
                    folds.update(op.outputs)
                    for v in op.outputs:
                        forms[v] = splats.form_of_result(graph, op, forms, read, source)
            elif op.params.get("at") == "arg":
                if folded[0]:
                    folds.update(op.outputs)
                    forms[op.outputs[0]] = forms[op.inputs[0]]
            else:
                for v in op.outputs:
                    taken = folded[0] and splats.folded(forms[op.inputs[0]])
                    constant[v] = taken and (v not in carried or constant[v])
                    forms[v] = max(forms[op.inputs[0]], forms[v]) if v in carried else forms[op.inputs[0]]
                    carried.add(v)
        elif op.region in once and op.primitive in _NOT_MERGED and len(op.inputs) == 1:
            # XLA's while-loop simplifier inlines a loop of one trip, and constants fold through it: a carry is
            # a constant when each value written into it is (its initial value, the body's result), a slice or
            # stack of the one trip when its operand is
            for v in op.outputs:
                was = constant[v] if v in carried else None
                constant[v] = constant[op.inputs[0]] and v not in demoted and (v not in carried or constant[v])
                written = max(forms[op.inputs[0]], forms[v]) if v in carried else forms[op.inputs[0]]
                forms[v] = written if constant[v] else splats.Form.OTHER
                if was and not constant[v]:
                    mixed.add(v)
                carried.add(v)
    return constant, unread_pairs, mixed


def _constant_branch(graph: Graph, op: Any, constant: Sequence[bool], forms: Sequence[splats.Form]) -> bool:
    """Whether `op` is in a branch of a cond whose branch index XLA folds to a literal (`Graph.region_reads`)."""
    index = graph.region_reads.get(op.region, ())
    return len(index) == 1 and constant[index[0]] and splats.folded(forms[index[0]])


def _readers(graph: Graph, consumers: list[list[int]], canon: Sequence[int], v: int) -> list[int]:
    """The ops reading v, looking through PCG collectives to the ops reading their results (a plan prices a
    value by the ops reading it, its reshards aside; a PCG must price it the same). (A module function: a
    recursive closure would be a reference cycle keeping the graph alive until a cyclic collection.)"""
    out = []
    for u in consumers[v]:
        if graph.ops[u].primitive == PCG_COLLECTIVE or graph.ops[u].primitive in HINTS and LOOK_THROUGH_HINTS:
            out += [w for r in graph.ops[u].outputs for w in _readers(graph, consumers, canon, canon[r])]
        else:
            out.append(u)
    return out


def _fusion_takes(graph: Graph, backend: str, constant: Sequence[bool], library: Collection[int],
                  invariant: Collection[int], readers: Callable[[int], Sequence[int]], w: int, u: int) -> bool:
    """Whether XLA's loop fusion takes value w into op u reading it (its ShouldFuse, as the fusion rules here see
    it): w's producer and u are fusible outside library fusions, and w is not expensive work u would duplicate."""
    p = graph.ops[graph.values[w].producer]
    if p.id in library or not _takes_fusion(graph, u, backend, library):
        return False
    if not (fusible_on(p, graph, backend) or _fused_into_readers(p, backend, invariant)):
        return False
    return not (expensive(p, graph, backend, constant) and len(readers(w)) > 1)


def _takes_fusion(graph: Graph, u: int, backend: str, library: Collection[int]) -> bool:
    """Whether op `u` takes what it reads into its loop fusion: an elementwise-like op, or a reduction (also a
    dot XLA makes one) outside a library fusion."""
    reader = graph.ops[u]
    return (fusible_on(reader, graph, backend) or reader.primitive in REDUCTIONS
            or rewritten_dot(reader, graph) == "reduce" or backend == "cpu" and reader.primitive == "gather") \
        and u not in library


def _unfusible(graph: Graph, live: Sequence[bool], canon: Sequence[int], constant: Sequence[bool],
               consumers: list[list[int]], library: Collection[int], outputs: Collection[int], backend: str,
               invariant: Collection[int]) -> frozenset[int]:
    """XLA:CPU: the elementwise values fusion never takes in though every reader could (`shardc.cost.unfusible`:
    more than unary, and some reader also reads a value computed from it through an op no fusion takes in)."""
    if backend != "cpu" or not GLOBALLY_UNFUSIBLE:
        return frozenset()

    def readers(v: int) -> list[int]:
        return _readers(graph, consumers, canon, v)

    candidates = [c for c in set(canon) for p in (graph.values[c].producer,)
                  if p is not None and live[p] and c not in outputs and not constant[c]
                  and graph.ops[p].primitive in _ARITHMETIC and len(graph.ops[p].outputs) == 1
                  and len(readers(c)) > 1 and not duplicable(graph, graph.ops[p], canon, constant)]
    return globally_unfusible(graph, live, canon, candidates, readers,
                              functools.partial(_fusion_takes, graph, backend, constant, library, invariant, readers),
                              HINTS if LOOK_THROUGH_HINTS else ())


def _analyse(graph: Graph, backend: str) -> ProgramInfo:
    nv, no = len(graph.values), len(graph.ops)
    cse = merged(graph)
    constant, canon, duplicate, pkeys = list(cse.constant), cse.canon, cse.duplicate, cse.pkeys
    live = liveness(graph)

    consumers: list[list[int]] = [[] for _ in range(nv)]
    for op in graph.ops:
        if not live[op.id]:
            continue
        for v in op.inputs:
            consumers[canon[v]].append(op.id)
    fused = [False] * nv
    outputs = {canon[v] for v in graph.outputs}
    for op in graph.ops:
        # Hints, constraints, ties and scan slices have no buffer of their own (a constraint that moves data
        # is a collective, which makes one); a scan's stacked outputs do.
        if op.primitive in FREE_PRIMITIVES and op.primitive not in ("scan_stack", PCG_COLLECTIVE) and live[op.id]:
            for v in op.outputs:
                if canon[v] not in outputs and not constant[canon[v]]:
                    fused[canon[v]] = True
    folded = folded_transposes(graph, live, canon, consumers) if backend == "cpu" else frozenset()
    absorbed, groups = (_library_fusions(graph, live, canon, constant, consumers, folded) if backend == "cpu"
                        else (set(), {}))
    library = set(groups)
    for v in absorbed:  # (computed inside a library fusion: no buffer, whatever op makes it)
        fused[v] = True
    results = {canon[v] for u in groups for v in graph.ops[u].outputs} - absorbed  # (a library fusion's result)
    # XLA:CPU removes optimization barriers before fusion: a local slice a barrier reads is fused into the
    # fusions that read the barrier's result (what it slices is read there: `until`)
    loop = _loop_ops(graph, live, library, backend)
    # op -> the op whose fusion computes it, where all of its results are fused into one (XLA's loop fusion
    # walks consumers before producers: an op whose readers are all in one fusion by then has one user)
    root: dict[int, int] = {}
    lengths = _loop_lengths(graph)
    hoisted = _invariant_trips(graph, canon, lengths)
    invariant = _loop_invariant(graph, canon, constant, hoisted) if backend == "cpu" and hoisted else frozenset()
    unfusible = _unfusible(graph, live, canon, constant, consumers, library, outputs, backend, invariant)
    for op in reversed(graph.ops):
        if not (fusible_on(op, graph, backend) or _fused_into_readers(op, backend, invariant)) or not live[op.id]:
            continue
        roots: set[int] = set()
        for v in op.outputs:
            users = _readers(graph, consumers, canon, v)
            into = {root.get(u, u) for u in users}
            roots |= into
            if v in outputs or not users or v in results:
                continue
            # Loop fusion takes a value into its readers when every one of them is an elementwise-like op or a
            # reduction outside a library fusion (which reads its operands from memory); an expensive value
            # only into one fusion (XLA duplicates cheap producers, not expensive ones).
            one = len(into) == 1 and all(graph.ops[u].region == op.region for u in users)
            fused[v] = v in absorbed or (
                all(_takes_fusion(graph, u, backend, library) for u in users)
                and (not expensive(op, graph, backend, constant) or len(users) == 1 or one) and v not in unfusible)
        if len(roots) == 1 and op.outputs and all(fused[canon[v]] for v in op.outputs):
            root[op.id] = roots.pop()
    for op in graph.ops:  # a scatter-add the simplifier moves into the sum reading it writes that sum's buffer
        if live[op.id] and op.primitive in SCATTERS and op.outputs and canon[op.outputs[0]] not in outputs \
                and _scatter_into_sum(graph, op, canon, consumers):
            fused[canon[op.outputs[0]]] = True
    # A bitcast transpose fused into its readers already costs what they read of the dot's buffer. One read
    # only by dots (GEMMs reading the dot's buffer in its order) is free: no buffer of its own. Any other
    # reader copies it anyway — a scan's stacked output is a dynamic-update-slice fusion copying it into the
    # stack (XLA:GPU's dynamic-slice fusion, which would let the GEMM write in place, is off by default), which
    # the transpose's price stands for — so there it keeps its price.
    bitcast = frozenset(t for t in (dot_bitcasts(graph, live, canon, consumers) if backend == "gpu" else ())
                        if not fused[c := canon[graph.ops[t].outputs[0]]] and c not in outputs
                        and consumers[c] and all(graph.ops[u].primitive == "dot_general" for u in consumers[c]))
    for t in bitcast:
        fused[canon[graph.ops[t].outputs[0]]] = True
    for t in folded:  # (XLA:CPU: transposes folded into the dots reading them)
        fused[canon[graph.ops[t].outputs[0]]] = True
    hoisted_values = hoisted_work(graph, live, canon, consumers, invariant, hoisted) if invariant else frozenset()
    for c in hoisted_values:
        fused[c] = False
    wide = wide_results(graph, live, canon, backend)
    # A dot decomposition's copy of cheap work is a fusion recomputing it, and the cheap values it is computed
    # from even where they are also materialised (XLA duplicates cheap producers into each consumer fusing
    # them): those values' operands are read until the copy is made.
    copies: tuple[tuple[int, ...], ...] = ()
    cheap: frozenset[int] = frozenset()
    copied: set[int] = set()
    dup: dict[int, list[int]] = {}
    if backend == "cpu":
        cheap = frozenset(c for c in set(canon) for p in (graph.values[c].producer,)
                          if p is not None and live[p] and graph.ops[p].primitive in _ARITHMETIC
                          and not expensive(graph.ops[p], graph, backend, constant) and not constant[c]
                          and duplicable(graph, graph.ops[p], canon, constant)
                          and not any(_moved_scatter(graph, canon, fused, u) for u in graph.ops[p].inputs))
        copies = dot_copies(graph, live, canon, physical_orders(graph, canon), cheap, frozenset(library))
        copied = {canon[op.inputs[i]] for op in graph.ops for i in copies[op.id]} & cheap
    post = _post_order(graph, canon)
    if backend == "cpu":
        def into_copy(u: int, depth: int = 0) -> bool:
            """Whether op u's result is copied cheap work, or fused cheap work leading to one."""
            out = canon[graph.ops[u].outputs[0]] if graph.ops[u].outputs else -1
            return out in copied or (out in cheap and fused[out] and depth < _COPY_DEPTH
                                     and any(into_copy(w, depth + 1) for w in consumers[out]))

        for c in cheap:
            if fused[c] or c in outputs:
                continue
            fusing = [u for u in consumers[c]
                      if loop[u] and RECOMPUTE_IN_LOOPS and not tree_reduced(graph, graph.ops[u]) or into_copy(u)]
            if fusing:
                dup[c] = fusing
    order, batch, queued_at, copied_at = (_breadth_first(graph, live, canon, constant, fused, consumers, copied, post,
                                                         groups if LIBRARY_FUSION_UNITS else None,
                                                         _recomputations(graph, canon, constant, fused, cheap, copies,
                                                                         dup))
                                          if backend == "cpu" else (list(range(no)), [], {}, {}))
    fusing = fusing_readers(graph, live, canon, fused, consumers, dup)
    until = _fused_reads(graph, live, canon, fused, fusing, order, dup, library)
    loops = loop_buffers(graph, live, canon, fused) if backend == "cpu" else {}
    if loops:  # (a loop's initial state is read entering it: the loop's buffer holds what is computed from it)
        until = tuple(() if loop_entry(op) and canon[op.outputs[0]] in loops else until[op.id] for op in graph.ops)
    recompute = frozenset((u, c) for c, us in dup.items() for u in us)

    strided = strided_readers(graph, live, canon, fused, consumers, loop) if backend == "cpu" else {}
    trips, reshard_trips = _trips(graph, lengths)
    reshard_trips = _hoisted_reshards(graph, canon, hoisted, reshard_trips)
    naming = _naming_invariants(graph, canon, hoisted)
    # Loop state: values a region's ties carry to the next iteration or out of it.
    carried = frozenset(c for op in graph.ops if op.primitive == "tie" and outer_region(op) and live[op.id]
                        for c in (canon[op.inputs[0]],)
                        if graph.values[c].producer is not None
                        and outer_region(graph.ops[graph.values[c].producer]) == outer_region(op))
    preset = _preset_state(graph, live, canon, constant, carried) if backend == "cpu" else frozenset()
    transposed = transposed_dots(graph, live, canon, consumers) if backend == "cpu" else {}
    inplace = (inplace_operands(graph, live, canon, fused, loop, recompute, transposed, consumers=consumers,
                                loops=loops, absorbed=absorbed) if backend == "cpu" else ())
    reshaped = frozenset((o, c) for o, cands in enumerate(inplace) for c in cands if _reshaped_dot(graph, c))
    if loops:
        inplace = _with_loop_inits(graph, canon, fused, loops, inplace)
    nested = nested_loop_buffers(graph, canon, consumers, loops, inplace) if loops else frozenset()
    return ProgramInfo(tuple(live), tuple(constant), tuple(canon), tuple(duplicate), tuple(fused),
                       tuple(trips), tuple(order), pkeys, until, span=_spans(graph, live, order),
                       carried=carried, loop=loop, library=frozenset(library), backend=backend, preset=preset,
                       broadcasts=library_broadcasts(graph, live, canon, groups, order) if groups else {},
                       transposed=transposed,
                       eager=backend == "cpu", reshard_trips=reshard_trips, hoisted=hoisted,
                       entered=_entered_in_forward_loops(graph, canon, hoisted, lengths, naming),
                       named={c: canon[op.inputs[0]] for c, op in naming.items()}, unread=cse.unread,
                       through=cse.through,
                       post=tuple(post),
                       copies=copies, copy_owner=last_copies(graph, canon, copies, order), cheap=cheap,
                       bitcast=bitcast, inplace=inplace, reshaped_dots=reshaped, loop_buffer=loops,
                       nested_buffers=nested,
                       hoisted_work=hoisted_values, out_alias=output_aliases(graph, live, canon, constant),
                       recompute=recompute if backend == "cpu" else frozenset(), fusing=fusing, strided=strided,
                       read_fused=reads_fused(graph, canon, fused), batch=tuple(batch),
                       first_reader=_first_readers(graph, live, order, fused, constant, canon, consumers)
                       if batch else (), wide=wide, read=read_values(graph), queued_at=queued_at,
                       copied_at=copied_at)


def reads_fused(graph: Graph, canon: Sequence[int], fused: Sequence[bool]) -> tuple[bool, ...]:
    """Per canonical value: whether an op reading it reads it from registers (its producer fused into the
    reader), for op costs. As `fused`, except that a value an alias op (`ALIASES`) makes is read as its
    operand is: from that operand's buffer when it has one. (`fused` says the alias has no buffer; taken for
    the read, a hinted value cost its readers nothing to read: the expert matmuls of a hinted MoE layer
    were priced 25% cheaper than the same matmuls unhinted, on a TPU v5e.) A loop's tie is read so too: what
    enters a loop and its carry are buffers of the loop's state, read from memory in the body (an LSTM's
    in-loop matmuls were priced 3.8x cheaper per trip than outside a loop, on an H100)."""
    out = list(fused)
    for op in graph.ops:  # (in program order: an alias of an alias reads what the first one reads)
        if (op.primitive in ALIASES or op.primitive == "tie") and op.inputs:
            src = canon[op.inputs[0]]
            for v in op.outputs:
                c = canon[v]
                if c != src:
                    out[c] = out[src]
    return tuple(out)


def strided_readers(graph: Graph, live: Sequence[bool], canon: Sequence[int], fused: Sequence[bool],
                    consumers: Sequence[Sequence[int]], loop: Sequence[bool]) -> dict[int, int]:
    """Per live transpose that moves the minor dimension and is fused into its readers: how many loop fusions
    read it (the loop ops its result reaches through fused values and that write a result of their own). Each
    reads the transpose's operand element by element across its memory order: XLA:CPU does not tile a transpose
    fused into a loop. (A transpose of its own, materialised, is a library transpose, which tiles: not here.)"""
    out: dict[int, int] = {}
    for op in graph.ops:
        perm = op.params.get("permutation") if op.primitive == "transpose" else None
        if not live[op.id] or not perm or perm[-1] == len(perm) - 1 or not fused[canon[op.outputs[0]]]:
            continue
        kernels: set[int] = set()
        seen: set[int] = set()
        todo = [canon[op.outputs[0]]]
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            for u in consumers[c]:
                outs = [canon[w] for w in graph.ops[u].outputs]
                if outs and all(fused[w] for w in outs):
                    todo.extend(outs)
                elif loop[u]:
                    kernels.add(u)
        if kernels:
            out[op.id] = len(kernels)
    return out


def _loop_ops(graph: Graph, live: Sequence[bool], library: set[int], backend: str) -> tuple[bool, ...]:
    """Per op: emitted in a loop fusion (elementwise-like ops and reductions outside library fusions; on XLA:CPU
    optimization barriers too, removed before fusion: a local slice a barrier reads is fused into the fusions
    reading the barrier's result)."""
    return tuple(live[op.id] and ((fusible_on(op, graph, backend) or op.primitive in REDUCTIONS)
                                  and op.id not in library
                                  or backend == "cpu" and op.primitive == "optimization_barrier")
                 for op in graph.ops)


def _loop_lengths(graph: Graph) -> dict[str, int]:
    """Per loop region: its trip count (scans' lengths; whiles' when known)."""
    lengths: dict[str, int] = dict(graph.region_trips)
    for op in graph.ops:
        if op.primitive in ("scan_slice", "scan_stack") and op.rule.sizes:
            lengths.setdefault(op.region, int(op.rule.sizes[0]))
    return lengths


def _runs(lengths: Mapping[str, int], region: str) -> int:
    """How many times per step region `region`'s ops run (its loops' lengths and its enclosing loops')."""
    n = 1
    parts = region.split("/")
    for i in range(1, len(parts)):
        n *= lengths.get("/".join(parts[: i + 1]), 1)
    return n


def _invariant_trips(graph: Graph, canon: Sequence[int], lengths: Mapping[str, int]
                     ) -> dict[int, tuple[int, int, int]]:
    """Per canonical loop-invariant value of a loop body (a value entering the loop that no iteration
    replaces: a scan's or while's constant operand, not its carry): how often its reshards run, the
    canonical value outside every loop it is invariant in that it comes from, and how often they run when
    taken out of the innermost of those loops only. XLA's loop-invariant code motion moves a collective
    whose operand is invariant out of the loop (the FSDP all-gather of a weight an LSTM cell reads every step
    runs once, not once per step; out of every enclosing loop in which the value is invariant too, but for
    the reshards `sim.tasks.leaves_one_loop_only` names, which leave the innermost loop only, and the next one
    out too when that is a one-trip loop or a reversed scan). A PCG collective's result of such a value is
    invariant too."""
    replaced = {v for op in graph.ops if op.primitive == "tie" and not op.params.get("at") for v in op.outputs}
    out: dict[int, tuple[int, int, int]] = {}
    for op in graph.ops:  # (an outer loop's ties come before its body's: nested invariants see theirs)
        if (op.primitive == PCG_COLLECTIVE or op.primitive in ALIASES) and op.inputs and canon[op.inputs[0]] in out:
            out.setdefault(canon[op.outputs[0]], out[canon[op.inputs[0]]])  # (a hint of it names it)
        if not loop_entry(op):
            continue
        inner = op.outputs[0]
        if inner in replaced:
            continue
        outer = op.region.rsplit("/", 1)[0]
        source, here = canon[op.inputs[0]], _runs(lengths, outer)
        if source in out and (lengths.get(op.region) == 1 or outer in graph.region_reversed):
            # (XLA inlines a one-trip loop: its body is the outer's; a reversed outer scan's index arithmetic
            # gives its loop-invariant code motion more to hoist, and the loop state it rebuilds for that passes
            # the slice's offsets on unchanged: the slice leaves that loop too)
            here = out[source][2]
        runs, origin = out[source][:2] if source in out else (here, source)
        out[canon[inner]] = (runs, origin, here)
    return out


def _entered_in_forward_loops(graph: Graph, canon: Sequence[int], hoisted: Mapping[int, tuple[int, int, int]],
                              lengths: Mapping[str, int], naming: Mapping[int, Any]) -> dict[int, int]:
    """Per canonical loop-invariant value entering a loop of several trips nested in a forward loop of several
    trips in which the value it enters from is invariant too: that value (looked through the hints of the outer
    body, `naming`). XLA's loop-invariant code motion takes a collective making the entering value out of the outer
    loop, and in the same run moves a collective of it from the inner body into the outer one; the outer loop's
    state, rebuilt for the first, leaves the second reading a copy of that state which the later runs do not take
    for invariant, so the second runs once per outer trip (`shardc.sim.tasks.TaskBuilder.entering_collectives`;
    measured with an all-gather and a collective-permute entering, an all-to-all inside. A reversed outer scan,
    whose index arithmetic has the motion rebuild its state again, takes both out; a slice entering, no
    collective, leaves nothing behind; nor does an all-to-all entering, seed 160010)."""
    out: dict[int, int] = {}
    for op in graph.ops:
        if not loop_entry(op) or lengths.get(op.region, 1) < 2:
            continue
        outer = op.region.rsplit("/", 1)[0]
        inner, source = canon[op.outputs[0]], canon[op.inputs[0]]
        if lengths.get(outer, 1) > 1 and outer not in graph.region_reversed and inner in hoisted and source in hoisted:
            while (hint := naming.get(source)) is not None and hint.region == outer:
                source = canon[hint.inputs[0]]  # (a hint in the outer body reshards it on the way: the same)
            out[inner] = source
    return out


def _naming_invariants(graph: Graph, canon: Sequence[int], hoisted: Mapping[int, tuple[int, int, int]]
                       ) -> dict[int, Any]:
    """Per canonical loop-invariant value a hint (or another alias) makes in a loop body from another one: that op
    (`ProgramInfo.named`: the value it names). A reshard of it runs where the reshard to its layout runs
    (`shardc.sim.tasks.TaskBuilder.named_after_one_loop`: XLA's loop-invariant code motion cannot take it further
    out than what it reads)."""
    return {canon[op.outputs[0]]: op for op in graph.ops
            if op.primitive in ALIASES and op.inputs and op.region and canon[op.outputs[0]] in hoisted
            and canon[op.inputs[0]] in hoisted and canon[op.outputs[0]] != canon[op.inputs[0]]}


def _hoisted_reshards(graph: Graph, canon: Sequence[int], hoisted: Mapping[int, tuple[int, int, int]],
                      reshard_trips: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The reshards of ops that only pass a loop-invariant value on, which XLA's loop-invariant code motion takes
    out of the loops as it takes the readers' (`_invariant_trips`): a `tie` taking such a value into an inner loop
    (its reshard runs outside the inner loop, and outside every enclosing loop the value is invariant in) and a PCG
    collective of such a value. Each runs as often as the value's reshards."""
    out = list(reshard_trips)
    for op in graph.ops:
        passes_on = op.primitive == PCG_COLLECTIVE or loop_entry(op)
        if passes_on and (h := hoisted.get(canon[op.inputs[0]])) is not None:
            out[op.id] = (min(out[op.id][0], h[0]), min(out[op.id][1], h[0]))
    return tuple(out)


def _trips(graph: Graph, lengths: Mapping[str, int]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """Per op: how many times it runs per step (scan bodies `length` times, nested ones multiplied), and
    how many times its operands' and its results' reshards run. The lowering (`shardc.lower_regions`)
    reshards a value entering a loop before the loop (a `tie` at "in", a `scan_slice`'s stacked operand)
    and a loop's result after it (a `tie` at "out", a `scan_stack`'s stacked result): those run as often
    as the loop itself, not once per iteration (`lengths`: `_loop_lengths`)."""
    of = functools.partial(_runs, lengths)
    trips = [of(op.region) if op.region else 1 for op in graph.ops]
    reshard: list[tuple[int, int]] = []
    for op in graph.ops:
        inner = trips[op.id]
        outer = of(op.region.rsplit("/", 1)[0]) if op.region.startswith("/") else inner
        at = op.params.get("at") if op.primitive == "tie" else None
        if at in ("in", "out"):
            reshard.append((outer, outer))
        elif op.primitive == "scan_slice":
            reshard.append((outer, inner))
        elif op.primitive == "scan_stack":
            reshard.append((inner, outer))
        else:
            reshard.append((inner, inner))
    return trips, tuple(reshard)
