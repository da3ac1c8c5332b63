"""Loops and branches of a plan as PCG `Region` nodes (used by `shardc.pcg.build`).

Each body becomes a PCG of its own, built from the plan's layouts of the body values. The region's
operands and results cross the boundary in fixed layouts — the plan's layout of the body value they
bind to (a scan's stacked arrays: that layout with the scanned dim 0 unsharded) — so the outer PCG
reshards into and out of the region once per step, and the body reshards inside only where the plan
does. A loop carry leaves the body in the layout it entered with, as a loop requires.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from shardc.ir.graph import source_line_of
from shardc.pcg.build import Scope, Walker
from shardc.pcg.graph import PCG, Region
from shardc.sharding import Sharding

__all__ = ["REGION_BUILDERS", "stacked"]

Arg = tuple[int | None, Any]  # (graph value or None for a literal, constant value or None)


def stacked(s: Sharding) -> Sharding:
    """The layout of a scan's stacked array whose slices are laid out as `s` (dim 0 unsharded)."""
    return Sharding(((),) + s.dims)


def _layout(w: Walker, v: int) -> Sharding:
    return w.plan.shardings[v].without_partial()


def _enter(w: Walker, scope: Scope, v: int, boundary: Sharding) -> int:
    """A body input for graph value v arriving in `boundary`; inside, v is resharded to its planned layout."""
    t = scope.input(v, boundary)
    scope.vmap[v] = scope.reshard(t, _layout(w, v), f"{w.graph.values[v].name} enters the body")
    return t


def _leave(scope: Scope, out: Arg, boundary: Sharding, what: str) -> int:
    """A body result in its boundary layout."""
    return scope.reshard(scope.outer(*out), boundary, f"{what} leaves the body as {boundary}")


def _operands(scope: Scope, ins: Sequence[Arg], layouts: Sequence[Sharding], name: str) -> list[int]:
    return [scope.reshard(scope.outer(*a), lay, f"{name} operand {i} as {lay}")
            for i, (a, lay) in enumerate(zip(ins, layouts))]


def _results(w: Walker, scope: Scope, region: Region, args: list[int], values: Sequence[int],
             layouts: Sequence[Sharding], name: str) -> list[Arg]:
    b = scope.b
    outs = [b.add_tensor(w.graph.values[v].shape, w.graph.values[v].dtype, lay, w.graph.values[v].name)
            for v, lay in zip(values, layouts)]
    b.add_node(region, args, outs)
    for v, t in zip(values, outs):
        scope.vmap[v] = scope.reshard(t, w.plan.shardings[v], f"{name} result {w.graph.values[v].name}")
    return [(v, None) for v in values]


def _params(eqn: Any, *drop: str) -> dict[str, Any]:
    return {k: v for k, v in eqn.params.items() if k not in drop}


def build_scan(w: Walker, scope: Scope, eqn: Any, ins: Sequence[Arg]) -> list[Arg]:
    p = eqn.params
    nc, nk, length = p["num_consts"], p["num_carry"], int(p["length"])
    heads = w.take(len(eqn.invars), "tie", "scan_slice")
    body_in = [h.outputs[0] for h in heads]
    lay = [_layout(w, v) for v in body_in]
    body = Scope(w)
    inputs = [_enter(w, body, v, s) for v, s in zip(body_in, lay)]
    closed = p["jaxpr"]
    outs = w.walk(body, closed.jaxpr, closed.consts, [(v, None) for v in body_in])
    ny = len(eqn.outvars) - nk
    tails = w.take(2 * nk + ny, "tie", "scan_stack")
    results = [tails[2 * i + 1].outputs[0] for i in range(nk)] + [t.outputs[0] for t in tails[2 * nk:]]
    out_lay = lay[nc:nc + nk] + [_layout(w, o[0]) if o[0] is not None else Sharding(((),) * len(
        w.graph.values[r].shape[1:])) for o, r in zip(outs[nk:], results[nk:])]
    body_out = [_leave(body, o, s, f"scan result {i}") for i, (o, s) in enumerate(zip(outs, out_lay))]
    pcg = body.b.finish(inputs, body_out)
    region = Region.of("scan", _params(eqn, "jaxpr"), [pcg], length, source_line_of(eqn.source_info))
    in_lay = lay[:nc + nk] + [stacked(s) for s in lay[nc + nk:]]
    args = _operands(scope, ins, in_lay, "scan")
    return _results(w, scope, region, args, results, out_lay[:nk] + [stacked(s) for s in out_lay[nk:]], "scan")


def build_while(w: Walker, scope: Scope, eqn: Any, ins: Sequence[Arg]) -> list[Arg]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    k = len(eqn.outvars)
    consts = [h.outputs[0] for h in w.take(bn + cn, "tie")]
    body_consts, cond_consts = consts[:bn], consts[bn:]
    triples = w.take(3 * k, "tie")
    bc = [triples[3 * i].outputs[0] for i in range(k)]
    cc = [triples[3 * i + 1].outputs[0] for i in range(k)]
    results = [triples[3 * i + 2].outputs[0] for i in range(k)]
    carry = [_layout(w, v) for v in bc]

    cond = Scope(w)
    c_in = [_enter(w, cond, v, _layout(w, v)) for v in cond_consts]
    c_in += [_enter(w, cond, v, s) for v, s in zip(cc, carry)]
    cj = p["cond_jaxpr"]
    (pred,) = w.walk(cond, cj.jaxpr, cj.consts, [(v, None) for v in cond_consts + cc])
    cond_pcg = cond.b.finish(c_in, [_leave(cond, pred, Sharding(()), "the loop condition")])

    body = Scope(w)
    b_in = [_enter(w, body, v, _layout(w, v)) for v in body_consts]
    b_in += [_enter(w, body, v, s) for v, s in zip(bc, carry)]
    bj = p["body_jaxpr"]
    outs = w.walk(body, bj.jaxpr, bj.consts, [(v, None) for v in body_consts + bc])
    w.take(k, "tie")
    body_pcg = body.b.finish(b_in, [_leave(body, o, s, f"carry {i}") for i, (o, s) in enumerate(zip(outs, carry))])

    region = Region.of("while", _params(eqn, "cond_jaxpr", "body_jaxpr"), [cond_pcg, body_pcg], 1,
                       source_line_of(eqn.source_info))
    in_lay = [_layout(w, v) for v in cond_consts] + [_layout(w, v) for v in body_consts] + carry
    args = _operands(scope, ins, in_lay, "while")
    return _results(w, scope, region, args, results, carry, "while")


def build_cond(w: Walker, scope: Scope, eqn: Any, ins: Sequence[Arg]) -> list[Arg]:
    branches = eqn.params["branches"]
    n_ops, k = len(eqn.invars) - 1, len(eqn.outvars)
    bodies: list[PCG] = []
    in_lay: list[Sharding] | None = None
    results: list[int] = []
    for branch in branches:
        args = [h.outputs[0] for h in w.take(n_ops, "tie")]
        if in_lay is None:
            in_lay = [_layout(w, v) for v in args]
        body = Scope(w)
        inputs = [_enter(w, body, v, s) for v, s in zip(args, in_lay)]
        outs = w.walk(body, branch.jaxpr, branch.consts, [(v, None) for v in args])
        results = [t.outputs[0] for t in w.take(k, "tie")]
        out_lay = [_layout(w, v) for v in results]
        bodies.append(body.b.finish(inputs, [_leave(body, o, s, f"branch result {i}")
                                             for i, (o, s) in enumerate(zip(outs, out_lay))]))
    region = Region.of("cond", _params(eqn, "branches"), bodies, 1, source_line_of(eqn.source_info))
    index = scope.reshard(scope.outer(*ins[0]), Sharding(()), "branch index")
    args = [index] + _operands(scope, ins[1:], in_lay or [], "cond")
    return _results(w, scope, region, args, results, [_layout(w, v) for v in results], "cond")


REGION_BUILDERS: dict[str, Callable[[Walker, Scope, Any, Sequence[Arg]], list[Arg]]] = {
    "scan": build_scan, "while": build_while, "cond": build_cond,
}
