"""jaxpr -> Graph.

Call-like primitives (jit, closed_call, remat, custom_jvp_call, custom_vjp_call) are inlined. `scan`,
`while` and `cond` are regions: their bodies are inlined too, and `tie` ops join each body value to the
outer values it must be sharded like (loop carries in, out and across iterations; scanned slices to the
stacked arrays, whose scanned dim is kept unsharded).
"""
from __future__ import annotations

from typing import Any, Sequence

from jax.extend import core as jcore

from shardc.ir.folding import small_integer_array
from shardc.ir.graph import Graph, Op
from shardc.rules.core import rule_or_conservative
from shardc.rules.core import FactorKind, FactorRule

__all__ = ["build_graph", "CALL_PRIMITIVES", "REGION_PRIMITIVES", "call_jaxpr"]

CALL_PRIMITIVES = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "custom_lin": None,
}
REGION_PRIMITIVES = ("scan", "while", "cond")


def scalar_literal(val: Any) -> int | float | None:
    """A literal's value when it is a scalar number (else None)."""
    if isinstance(val, bool) or getattr(val, "shape", ()) != ():
        return None
    try:
        return val.item() if hasattr(val, "item") else (val if isinstance(val, (int, float)) else None)
    except (TypeError, ValueError):
        return None


def call_jaxpr(eqn: Any) -> Any:
    """The (closed) jaxpr a call-like eqn (`CALL_PRIMITIVES`) calls, or None."""
    key = CALL_PRIMITIVES.get(eqn.primitive.name)
    return eqn.params.get(key) if key else None


def _tie_rule(shape: Sequence[int]) -> FactorRule:
    """Identity: every dim of the input is the same factor as the matching dim of the output."""
    r = len(shape)
    dims = tuple((i,) for i in range(r))
    return FactorRule((dims,), (dims,), tuple(int(s) for s in shape), (FactorKind.PASS_THROUGH,) * r)


def _stack_rule(slice_shape: Sequence[int], length: int, *, stacked_is_operand: bool) -> FactorRule:
    """A scanned slice [..] and its stacked array [T, ..]: shared dims, T kept unsharded."""
    r = len(slice_shape)
    inner = tuple((i + 1,) for i in range(r))
    stacked = ((0,),) + inner
    sizes = (int(length),) + tuple(int(s) for s in slice_shape)
    kinds = (FactorKind.NEED_REPLICATION,) + (FactorKind.PASS_THROUGH,) * r
    if stacked_is_operand:
        return FactorRule((stacked,), (inner,), sizes, kinds)
    return FactorRule((inner,), (stacked,), sizes, kinds)


class _Builder:
    def __init__(self) -> None:
        self.g = Graph()
        self.rule_cache: dict[Any, tuple[FactorRule, bool]] = {}

    # -- values -----------------------------------------------------------------------------------
    def new_value(self, aval: Any, name: str = "", *, is_const: bool = False,
                  literal: int | float | None = None) -> int:
        shape = getattr(aval, "shape", ())
        dtype = getattr(aval, "dtype", None)
        return self.g.add_value(tuple(shape), dtype, name, is_const=is_const, literal=literal)

    def constant(self, var: Any, value: Any) -> int:
        """A jaxpr's constvar bound to `value` (kept when a small integer array: `shardc.ir.folding`)."""
        shape, dtype = getattr(var.aval, "shape", ()), getattr(var.aval, "dtype", None)
        return self.g.add_value(tuple(shape), dtype, "constant", is_const=True, array=small_integer_array(value))

    def read(self, env: dict, atom: Any) -> int:
        if isinstance(atom, jcore.Literal):
            value = scalar_literal(atom.val)  # (named by it: printing the numpy value itself costs ~90 us a literal)
            name = "literal" if value is None else f"literal {value!r}"[:40]
            return self.new_value(atom.aval, name, is_const=True, literal=value)
        return env[atom]

    def add(self, primitive: str, ins: Sequence[int], outs: Sequence[int], params: Any, rule: FactorRule,
            *, conservative: bool = False, source_info: Any = None, region: str = "") -> None:
        op = Op(len(self.g.ops), primitive, tuple(ins), tuple(outs), params, rule, conservative, source_info, region)
        self.g.add_op(op)

    def tie(self, a: int, b: int, region: str, source_info: Any = None, at: str = "") -> None:
        """`b` is sharded like `a`. `at`: "in" for an outer value entering a loop, "out" for a loop's result
        leaving it (their reshards run outside the loop: `shardc.cost.program.ProgramInfo.reshard_trips`),
        "arg" for a branch's or a loop condition's parameter (its reshards run inside, on the parameter)."""
        self.add("tie", [a], [b], {"at": at} if at else {}, _tie_rule(self.g.values[a].shape),
                 source_info=source_info, region=region)

    # -- jaxprs -----------------------------------------------------------------------------------
    def closed(self, jaxpr: Any) -> tuple[Any, list]:
        if isinstance(jaxpr, jcore.ClosedJaxpr):
            return jaxpr.jaxpr, list(jaxpr.consts)
        return jaxpr, []

    def inline(self, jaxpr: Any, args: Sequence[int], region: str) -> list[int]:
        """Walk a (closed or open) jaxpr with its invars bound to `args`; returns its outvars' values."""
        inner, consts = self.closed(jaxpr)
        env: dict = {}
        for i, var in enumerate(inner.constvars):
            env[var] = self.constant(var, consts[i] if i < len(consts) else None)
        if len(inner.invars) != len(args):
            raise AssertionError(f"jaxpr takes {len(inner.invars)} inputs, given {len(args)}")
        for var, vid in zip(inner.invars, args):
            env[var] = vid
        self.eqns(inner.eqns, env, region)
        return [self.read(env, v) for v in inner.outvars]

    def eqns(self, eqns: Sequence[Any], env: dict, region: str) -> None:
        for eqn in eqns:
            ins = [self.read(env, v) for v in eqn.invars]
            name = eqn.primitive.name
            if (called := call_jaxpr(eqn)) is not None:
                outs = self.inline(called, ins, region)
                for var, vid in zip(eqn.outvars, outs):
                    env[var] = vid
                continue
            if name == "scan":
                outs = self.scan(eqn, ins, region)
            elif name == "while":
                outs = self.while_loop(eqn, ins, region)
            elif name == "cond":
                outs = self.cond(eqn, ins, region)
            else:
                outs = [self.new_value(v.aval) for v in eqn.outvars]
                in_shapes = [self.g.values[v].shape for v in ins]
                out_shapes = [self.g.values[v].shape for v in outs]
                rule, conservative = self.rule(name, in_shapes, out_shapes, eqn.params)
                if conservative:
                    self.g.conservative_primitives.add(name)
                self.add(name, ins, outs, eqn.params, rule, conservative=conservative,
                         source_info=eqn.source_info, region=region)
            for var, vid in zip(eqn.outvars, outs):
                env[var] = vid

    def rule(self, name: str, ins: list, outs: list, params: Any) -> tuple[FactorRule, bool]:
        """The op's factor rule, memoised: a Transformer repeats the same op instances layer after layer."""
        try:
            key = (name, tuple(ins), tuple(outs), tuple(sorted(params.items())))
            hash(key)
        except TypeError:
            return rule_or_conservative(name, ins, outs, params)
        hit = self.rule_cache.get(key)
        if hit is None:
            hit = self.rule_cache[key] = rule_or_conservative(name, ins, outs, params)
        return hit

    # -- regions ----------------------------------------------------------------------------------
    def scan(self, eqn: Any, ins: list[int], region: str) -> list[int]:
        p = eqn.params
        body = p["jaxpr"]
        nc, nk = p["num_consts"], p["num_carry"]
        length = p["length"]
        here = f"{region}/scan{len(self.g.ops)}"
        self.g.region_trips[here] = int(length)
        if p.get("reverse"):
            self.g.region_reversed.add(here)
        inner_jaxpr, _ = self.closed(body)
        body_in = [self.new_value(v.aval) for v in inner_jaxpr.invars]
        for i, vid in enumerate(body_in):
            outer = ins[i]
            if i < nc + nk:
                self.tie(outer, vid, here, eqn.source_info, at="in")
            else:
                self.add("scan_slice", [outer], [vid], {}, _stack_rule(self.g.values[vid].shape, length, stacked_is_operand=True),
                         source_info=eqn.source_info, region=here)
        body_out = self.inline(body, body_in, here)
        outs = [self.new_value(v.aval) for v in eqn.outvars]
        for i, (bo, oo) in enumerate(zip(body_out, outs)):
            if i < nk:
                self.tie(bo, body_in[nc + i], here, eqn.source_info)  # carry across iterations
                # the final carry leaves in the carry's layout (the loop state's, as XLA's while holds it)
                self.tie(body_in[nc + i], oo, here, eqn.source_info, at="out")
            else:
                self.add("scan_stack", [bo], [oo], {}, _stack_rule(self.g.values[bo].shape, length, stacked_is_operand=False),
                         source_info=eqn.source_info, region=here)
        return outs

    def while_loop(self, eqn: Any, ins: list[int], region: str) -> list[int]:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
        here = f"{region}/while{len(self.g.ops)}"
        carry_avals = [v.aval for v in eqn.outvars]
        body_carry = [self.new_value(a) for a in carry_avals]
        cond_carry = [self.new_value(a) for a in carry_avals]
        body_const_vals = [self.new_value(_Aval(self.g.values[c])) for c in body_consts]
        cond_const_vals = [self.new_value(_Aval(self.g.values[c])) for c in cond_consts]
        for outer, inner in zip(body_consts + cond_consts, body_const_vals + cond_const_vals):
            self.tie(outer, inner, here, eqn.source_info, at="in")
        outs = [self.new_value(a) for a in carry_avals]
        for x, bc, cc, o in zip(init, body_carry, cond_carry, outs):
            self.tie(x, bc, here, eqn.source_info, at="in")
            self.tie(bc, cc, here, eqn.source_info, at="arg")
            self.tie(bc, o, here, eqn.source_info, at="out")
        self.inline(p["cond_jaxpr"], cond_const_vals + cond_carry, here)
        body_out = self.inline(p["body_jaxpr"], body_const_vals + body_carry, here)
        for bo, bc in zip(body_out, body_carry):
            self.tie(bo, bc, here, eqn.source_info)
        return outs

    def cond(self, eqn: Any, ins: list[int], region: str) -> list[int]:
        branches = eqn.params["branches"]
        operands = ins[1:]
        outs = [self.new_value(v.aval) for v in eqn.outvars]
        for b, branch in enumerate(branches):
            here = f"{region}/cond{len(self.g.ops)}.{b}"
            self.g.region_reads[here] = (ins[0],)
            inner_jaxpr, _ = self.closed(branch)
            args = [self.new_value(v.aval) for v in inner_jaxpr.invars]
            for outer, inner in zip(operands, args):
                self.tie(outer, inner, here, eqn.source_info, at="arg")
            for bo, o in zip(self.inline(branch, args, here), outs):
                self.tie(bo, o, here, eqn.source_info)
        return outs


class _Aval:
    """Shape/dtype of an existing value, to make a fresh value like it."""

    def __init__(self, value: Any) -> None:
        self.shape = value.shape
        self.dtype = value.dtype


def build_graph(closed_jaxpr: Any, input_names: Sequence[str] | None = None,
                output_names: Sequence[str] | None = None) -> Graph:
    """Build the Graph of a ClosedJaxpr (from jax.make_jaxpr) with optional names for its inputs/outputs."""
    b = _Builder()
    jaxpr, consts = b.closed(closed_jaxpr)
    env: dict = {}
    for i, var in enumerate(jaxpr.constvars):
        env[var] = b.constant(var, consts[i] if i < len(consts) else None)
    for i, var in enumerate(jaxpr.invars):
        name = input_names[i] if input_names and i < len(input_names) else f"arg{i}"
        env[var] = b.new_value(var.aval, name)
        b.g.inputs.append(env[var])
    b.eqns(jaxpr.eqns, env, "")
    b.g.outputs = [b.read(env, v) for v in jaxpr.outvars]
    b.g.top_level = {v: vid for v, vid in env.items()}
    if output_names:
        for vid, name in zip(b.g.outputs, output_names):
            val = b.g.values[vid]
            if val.name.startswith("%"):
                val.name = name
    return b.g
