"""Which compile-time constants XLA's simplifier can fold to a literal (the cond whose index it inlines).

A value the cost model knows at compile time (`shardc.cost.program.Merged.constant`) is not always one XLA
folds: its constant folding only evaluates instructions whose operands are literals, never a broadcast or
an iota (those would grow the constants), and its algebraic simplifier moves a broadcast of one scalar (a
*splat*) through elementwise ops and data movement, and reduces one to a scalar; a pad, a cumulative sum, a
dot or a concatenation of splats stays what it is. Measured on the 8 CPU devices (a `cond` whose index is
`sum(v) > 0`, `v` zeros from an argmax over a dim of one): through elementwise ops, transposes, reshapes,
slices, gathers, sorts, reversals and reductions the conditional is inlined; through a pad, a cumsum, a dot or a
dynamic_update_slice it is kept, and a sharding constraint that gathers a value XLA did not fold is an
all-gather in the compiled program.

Per value, one of three forms: `LITERAL` (a literal array: XLA's constant folding makes one), `SPLAT` (a
broadcast of a scalar literal), `OTHER` (known at compile time, not folded, or not constant at all).
"""
from __future__ import annotations

import enum
from typing import Any, Sequence

from shardc.cost.aliases import ALIASES
from shardc.cost.flops import ELEMENTWISE, TRANSCENDENTAL
from shardc.ir.graph import Graph

__all__ = ["Form", "form_of_result", "literal_form", "folded"]


class Form(enum.IntEnum):
    LITERAL = 0
    SPLAT = 1
    OTHER = 2


# Ops through which a splat stays one (elementwise over splats and scalar literals; data movement of a splat).
SPLAT_KEEPING = frozenset(ELEMENTWISE) | frozenset(TRANSCENDENTAL) | ALIASES | frozenset({
    "integer_pow", "select_n", "convert_element_type", "copy", "copy_p", "broadcast_in_dim", "transpose", "reshape",
    "squeeze", "expand_dims", "slice", "dynamic_slice", "rev", "split", "sort", "gather", "pcg_collective"})
# Ops whose result is a splat when their data operand is one, whatever their (constant) indices.
_DATA_OPERAND = {"gather": 0, "dynamic_slice": 0}
# Reductions the simplifier folds over a splat (to a splat of the reduced shape; a scalar one is a literal).
SPLAT_REDUCING = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
# Ops that make a broadcast, never a literal, from literal operands (constant folding skips them).
_BROADCASTING = frozenset({"broadcast_in_dim", "iota"})


def literal_form(graph: Graph, v: int) -> Form:
    """The form of a value no op makes: a literal (a scalar literal is also a splat of itself)."""
    return Form.LITERAL if graph.values[v].is_const else Form.OTHER


def folded(form: Form) -> bool:
    """Whether XLA's simplifier makes a value of this form a literal or a broadcast of one."""
    return form != Form.OTHER


def form_of_result(graph: Graph, op: Any, forms: Sequence[Form], read: Sequence[int], splat_source: bool) -> Form:
    """The form of `op`'s results given its read operands' (`read`: the operand indices XLA's simplifier still
    reads); `splat_source`: the op makes a splat whatever its operands (an argmax over dims of one, zeros, an
    iota along a dim of one, an out-of-bounds gather: `shardc.cost.program.folds_to_constant`)."""
    if splat_source:
        return Form.SPLAT
    if op.primitive in _DATA_OPERAND:
        read = [i for i in read if i == _DATA_OPERAND[op.primitive]]
    ins = [op.inputs[i] for i in read]
    kinds = [forms[v] for v in ins]
    if ins and all(k == Form.LITERAL for k in kinds) and op.primitive not in _BROADCASTING:
        return Form.LITERAL
    scalar_or_splat = all(k == Form.SPLAT or k == Form.LITERAL and not graph.values[v].rank
                          for v, k in zip(ins, kinds))
    if ins and scalar_or_splat and (op.primitive in SPLAT_KEEPING or op.primitive in SPLAT_REDUCING):
        return Form.SPLAT
    return Form.OTHER
