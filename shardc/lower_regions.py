"""Loop and branch bodies lowered with their plan, as straight-line code is (`shardc.lower`).

A `scan`, `while` or `cond` is bound again with new bodies: each body is re-traced (`jax.make_jaxpr`) by the
same op-by-op walk that lowers the rest of the program, so every value inside it is constrained as the plan
says, and the region's boundary values take the layouts of the graph's `tie` / `scan_slice` / `scan_stack`
ops (shardc.ir.build): a carry keeps one layout in, out and across iterations; a scanned array is split
as its slice is, with the scanned dim whole. The walk meets the graph ops in the order the graph builder
made them: the boundary ops in, the body (for `while`: the condition, then the body), the boundary ops
out. A body's own constants become leading operands of the new region (a re-traced body closes over
nothing).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

__all__ = ["lower_region"]


def lower_region(w: Any, eqn: Any, invals: list[Any], region: str) -> list[Any]:
    """The region eqn `eqn` bound with planned bodies; `w` is the `shardc.lower.Lowering` walking it."""
    return _LOWER[eqn.primitive.name](w, eqn, invals, region)


def _trace(w: Any, fn: Callable[..., list[Any]], avals: Sequence[Any]) -> jcore.ClosedJaxpr:
    """`fn` traced on abstract values like `avals` into a closed jaxpr without constants."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals]
    with w.new_trace():
        closed = jax.make_jaxpr(fn)(*specs)
    if closed.consts:  # pragma: no cover - the walk binds primitives on traced values and literals only
        raise AssertionError(f"a re-traced region body captured {len(closed.consts)} constants")
    return closed


def _consts_avals(body: jcore.ClosedJaxpr) -> list[Any]:
    return [jax.core.get_aval(c) for c in body.consts]


def _tie(w: Any, x: Any, op: Any) -> Any:
    """`x` through tie `op`: its operand's reshard, then its result's (each through the reshard model's
    layouts); where this runs (before a loop, in its body, after it) is where the plan's reshards of `op`
    run (`shardc.cost.program.ProgramInfo.reshard_trips`)."""
    with w.scope(op.id):
        return w.result_side(w.operand_side(x, op), op)


def _carry(w: Any, x: Any, op: Any) -> Any:
    """`x` through tie `op` of a loop's boundary or carry (`_tie`), but a compile-time constant (the carry of a
    one-trip loop XLA folds once it inlines the loop) stays whole, as constants do outside loops
    (`Lowering.apply_op`): XLA partitions the loop before it folds it, so a constant carry split at the boundary
    would be all-gathered in the body for the ops that make its values whole. (A branch's ties keep their
    layouts: a constant-index cond's branch values are not constants to the plan.)"""
    if _constant(w, x, op.outputs[0]):
        with w.scope(op.id):
            return w.whole(x)
    return _tie(w, x, op)


def _constant(w: Any, x: Any, vid: int) -> bool:
    """Whether `x` (value `vid`) is a compile-time constant array (kept whole: `_carry`)."""
    return bool(w.info.constant[vid]) and bool(getattr(x, "shape", ()))


def _leave(w: Any, x: Any, op: Any) -> Any:
    """A loop's final carry `x` through its out tie `op`, constrained first to the carry's planned layout (the
    loop state's). A reshard right after the loop alone would not do: XLA's propagation gives the loop state
    the layout its results' users want when that is more split than its init and body (a constraint on the
    loop's result, [y] where the carry is [-], makes the loop state [y] and every iteration all-gathers it
    for the body; seed 93004)."""
    if _constant(w, x, op.inputs[0]):
        return _carry(w, x, op)
    with w.scope(op.id):
        x = w.as_planned(x, op.inputs[0])
    return _tie(w, x, op)


def _param(w: Any, x: Any, op: Any) -> Any:
    """A body parameter entering through tie `op` (already in its planned layout, or whole: `_carry` ran outside)."""
    with w.scope(op.id):
        return w.whole(x) if _constant(w, x, op.outputs[0]) else w.as_planned(x, op.outputs[0])


def _operand(w: Any, x: Any, op: Any) -> Any:
    with w.scope(op.id):
        return w.operand_side(x, op)


def _result(w: Any, x: Any, op: Any) -> Any:
    with w.scope(op.id):
        return w.result_side(x, op)


def _scan(w: Any, eqn: Any, invals: list[Any], region: str) -> list[Any]:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    body: jcore.ClosedJaxpr = p["jaxpr"]
    here = f"{region}/scan{w.next_op}"
    in_ops = [w.take("tie", "scan_slice") for _ in invals]
    # consts and the carry's initial value: in the body's layout; a scanned array: as its slice needs it
    # (scanned dim whole) — before the loop
    outer = [_carry(w, x, op) if i < nc + nk else _operand(w, x, op) for i, (x, op) in enumerate(zip(invals, in_ops))]
    start = w.next_op
    n_out = len(eqn.outvars)
    boundary: list[Any] = []

    def run_body(*args: Any) -> list[Any]:
        w.next_op = start
        consts, vals = args[:len(body.consts)], args[len(body.consts):]
        vals = [_param(w, a, op) if i < nc + nk else _result(w, a, op)  # a slice: to its planned layout
                for i, (a, op) in enumerate(zip(vals, in_ops))]
        outs = w.walk(body.jaxpr, consts, vals, here)
        boundary[:] = w.graph.ops[w.next_op:w.next_op + nk + n_out]  # per carry: across, out; per y: stack
        # a new carry: to the carry's layout (across the iteration); a y: as its stacked array needs it
        return [_carry(w, o, boundary[2 * i]) if i < nk else _operand(w, o, boundary[nk + i])
                for i, o in enumerate(outs)]

    new_body = _trace(w, run_body, _consts_avals(body) + list(body.in_avals))
    w.next_op = boundary[-1].id + 1  # past the body and its boundary ops
    outs = w.bind(eqn, list(body.consts) + outer, jaxpr=new_body, num_consts=nc + len(body.consts))
    # after the loop: the final carry through its out tie, the stacked ys to their planned layouts
    return [_leave(w, o, boundary[2 * i + 1]) if i < nk else _result(w, o, boundary[nk + i]) for i, o in enumerate(outs)]


def _while(w: Any, eqn: Any, invals: list[Any], region: str) -> list[Any]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond: jcore.ClosedJaxpr = p["cond_jaxpr"]
    body: jcore.ClosedJaxpr = p["body_jaxpr"]
    cond_consts, body_consts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    here = f"{region}/while{w.next_op}"
    const_ops = [w.take("tie") for _ in range(bn + cn)]  # the body's constants, then the condition's
    body_const_ops, cond_const_ops = const_ops[:bn], const_ops[bn:]
    carry_ops = [(w.take("tie"), w.take("tie"), w.take("tie")) for _ in init]  # init->body, body->cond, body->out
    cond_consts = [_carry(w, x, op) for x, op in zip(cond_consts, cond_const_ops)]
    body_consts = [_carry(w, x, op) for x, op in zip(body_consts, body_const_ops)]
    init = [_carry(w, x, ops[0]) for x, ops in zip(init, carry_ops)]

    cond_start = w.next_op
    ends: dict[str, int] = {}

    def run_cond(*args: Any) -> list[Any]:
        w.next_op = cond_start
        own, rest = args[:len(cond.consts)], args[len(cond.consts):]
        consts = [_param(w, a, op) for a, op in zip(rest[:cn], cond_const_ops)]
        carry = [_carry(w, a, ops[1]) for a, ops in zip(rest[cn:], carry_ops)]
        out = w.walk(cond.jaxpr, own, consts + carry, here)
        ends["cond"] = w.next_op
        return out

    new_cond = _trace(w, run_cond, _consts_avals(cond) + list(cond.in_avals))
    body_start = ends["cond"]

    def run_body(*args: Any) -> list[Any]:
        w.next_op = body_start
        own, rest = args[:len(body.consts)], args[len(body.consts):]
        consts = [_param(w, a, op) for a, op in zip(rest[:bn], body_const_ops)]
        carry = [_param(w, a, ops[0]) for a, ops in zip(rest[bn:], carry_ops)]
        outs = w.walk(body.jaxpr, own, consts + carry, here)
        ends["body"] = w.next_op
        back = w.graph.ops[w.next_op:w.next_op + len(outs)]  # the ties of each new carry to the body's
        return [_carry(w, o, op) for o, op in zip(outs, back)]

    new_body = _trace(w, run_body, _consts_avals(body) + list(body.in_avals))
    w.next_op = ends["body"]
    for _ in init:
        w.take("tie")
    operands = list(cond.consts) + cond_consts + list(body.consts) + body_consts + init
    outs = w.bind(eqn, operands, cond_jaxpr=new_cond, body_jaxpr=new_body,
                  cond_nconsts=cn + len(cond.consts), body_nconsts=bn + len(body.consts))
    return [_leave(w, o, ops[2]) for o, ops in zip(outs, carry_ops)]


def _cond(w: Any, eqn: Any, invals: list[Any], region: str) -> list[Any]:
    index, operands = invals[0], invals[1:]
    branches = eqn.params["branches"]
    if any(b.consts for b in branches):  # pragma: no cover - jax hoists branch constants into operands
        raise AssertionError("a cond branch with constants of its own")
    new_branches = []
    for b, branch in enumerate(branches):
        here = f"{region}/cond{w.next_op}.{b}"
        in_ops = [w.take("tie") for _ in operands]
        start = w.next_op
        ends: list[int] = []

        def run_branch(*args: Any, branch: Any = branch, in_ops: list = in_ops, start: int = start,
                       here: str = here, ends: list = ends) -> list[Any]:
            w.next_op = start
            outs = w.walk(branch.jaxpr, (), [_tie(w, a, op) for a, op in zip(args, in_ops)], here)
            out_ops = w.graph.ops[w.next_op:w.next_op + len(outs)]
            ends.append(w.next_op + len(outs))
            # every branch leaves its results in the layout of the cond's results (the out ties' targets)
            return [_tie(w, o, op) for o, op in zip(outs, out_ops)]

        new_branches.append(_trace(w, run_branch, branch.in_avals))
        w.next_op = ends[-1]
    outs = w.bind(eqn, [index] + list(operands), branches=tuple(new_branches))
    out_vids = [op.outputs[0] for op in w.graph.ops[w.next_op - len(outs):w.next_op]]  # the last branch's ties
    # a result XLA folds to a constant once it inlines the cond (a constant branch index, every branch computing
    # from constants: `shardc.cost.program`) is made whole as other constants, and its readers slice it; read
    # in its planned layout, XLA would partition the readers before the fold and move it as data
    return [w.whole(o) if w.info.constant[v] and o.shape else w.as_planned(o, v) for o, v in zip(outs, out_vids)]


_LOWER: dict[str, Callable[..., list[Any]]] = {"scan": _scan, "while": _while, "cond": _cond}
