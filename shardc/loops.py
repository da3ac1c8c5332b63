"""Loop restructuring: a top-level scan's matmuls that need not run trip by trip run once, for all trips.

A recurrent layer's scan body mixes work that needs the carry (the recurrent matmul `h @ W_h` and its
backward) with work that does not: the input projection `x_t @ W_x` of every trip, and in the backward pass
the input gradient `dg_t @ W_x.T` and the weight gradients `x_t.T @ dg_t` summed into carries. Run per trip,
each is a small matmul that re-reads the whole weight (memory-bound on an accelerator) and, sharded, pays its
collectives once per trip on the recurrence's critical path. `restructure_loops(program)` rewrites each
top-level scan into up to three parts:

* **hoisted**: the ops that read no carry (only the scan's constants, its scanned inputs and each other) and
  lead to a matmul of a weight (an operand the same every trip) run before the loop for all trips at once (each
  op vmapped over the trip axis; ops of the constants alone once), their per-trip results scanned in as new
  inputs;
* **the loop**: what the carries need, trip by trip;
* **sunk**: the matmuls of a weight whose results no carry needs, and the ops after them, run after the loop on the
  per-trip values the loop now stacks as outputs; a matmul or sum whose result is only added into a
  carry that starts the loop and is read by nothing else (an accumulated weight gradient, through splits,
  transposes and reshapes) is summed over the trips inside the matmul (the trip axis contracted with the
  others) and added to the carry's start once.

Each part computes, per element, the same sums of the same products as the loop did; what changes is the
order of the additions of accumulated sums (one matmul over all trips instead of a running sum), so the
results equal the program's up to float rounding. The steps rest on rules of the PCG library, proved by Z3 like
the others (`shardc.pcg.library.LOOP_RULES`: a trip's value is chunk t of all trips' values, and a product or
elementwise op commutes with that chunk; per-trip products or sums added up are one over the trips laid side
by side); the rewrite runs only while all of them are in the library and proved. Beyond what those rules
state, it relies on JAX's batching of the other per-trip primitives it moves (vmap) and on rearrangements
(transpose, split, reshape) moving the elements of a sum as they move the elements of each addend.

The program is the traced train step (after differentiation); its top-level loops are rewritten (calls
inlined first), loops nested in them are left as they are, and so is a loop that would keep no matmul (no
recurrence: microbatches of a gradient accumulation, looped by their author to bound memory), and a scan whose
matmuls read a different weight every trip (a layer scan: run at once they would read as many bytes). The search plans
the rewritten program next to the traced one and keeps the faster (`choose_loops`, under `pcg=True`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax._src import source_info_util
from jax.extend import core as jcore

from shardc.ir.build import call_jaxpr
from shardc.ir.jaxpr_env import JaxprEnv, open_jaxpr, retraced
from shardc.remat import _bind, inline_calls

__all__ = ["LoopRewrite", "restructure_loops", "loop_rewrites"]

# Ops an accumulated sum may pass between its matmul (or sum) and the carry it is added into: rearrangements,
# exact on a sum, applied once to the summed value instead of to each trip's (not a cast: rounding each trip's
# value is not rounding the sum).
_REARRANGING = frozenset({"transpose", "split", "reshape", "squeeze", "expand_dims", "copy"})
_ACCUMULATING = frozenset({"add", "add_any"})
_ROOTS = frozenset({"dot_general", "reduce_sum"})  # sums a trip axis can be added to


@dataclasses.dataclass(frozen=True)
class LoopRewrite:
    """What `restructure_loops` did to one scan (for `plan.explain()`)."""

    source: str  # the scan's source line
    hoisted: int  # matmuls run before the loop for all trips
    sunk: int  # matmuls run after the loop on the stacked per-trip values
    summed: int  # carries that accumulated a sum per trip, now one sum over all trips

    def describe(self) -> str:
        parts = [f"{n} {what}" for n, what in ((self.hoisted, "matmul(s) hoisted before the loop"),
                                               (self.sunk, "sunk after it"),
                                               (self.summed, "accumulated carries summed once")) if n]
        return f"scan {self.source}: " + ", ".join(parts)


@dataclasses.dataclass
class _Split:
    """One scan body divided into its three parts (indices into the body's eqns, in program order)."""

    hoisted: list[int]
    loop: list[int]
    sunk: list[int]
    roots: set[int]  # sunk eqns summed over the trips (the trip axis added to their reduced dims)
    accumulators: dict[int, int]  # carry index -> the (sunk) eqn adding into it
    report: LoopRewrite
    body: "_Body"


def _source(eqn: Any) -> str:
    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return f"{frame.file_name}:{frame.start_line}" if frame is not None else "?"


def _simple(eqn: Any) -> bool:
    """An eqn that can move out of the loop: no effects, no body of its own."""
    return not eqn.effects and not any(isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr)) for p in eqn.params.values())


def _names(vs: Sequence[Any]) -> list[Any]:
    return [v for v in vs if not isinstance(v, jcore.Literal)]


class _Body:
    """A scan body's eqns with who makes and who reads each value."""

    def __init__(self, eqn: Any) -> None:
        p = eqn.params
        self.jaxpr = p["jaxpr"].jaxpr
        nc, nk = p["num_consts"], p["num_carry"]
        self.nk = nk
        self.consts = set(self.jaxpr.constvars) | set(self.jaxpr.invars[:nc])
        self.carries_in = list(self.jaxpr.invars[nc:nc + nk])
        self.xs = set(self.jaxpr.invars[nc + nk:])
        self.eqns = self.jaxpr.eqns
        self.outs = self.jaxpr.outvars
        self.producer = {v: i for i, e in enumerate(self.eqns) for v in e.outvars}
        self.readers: dict[Any, list[int]] = {}
        for i, e in enumerate(self.eqns):
            for v in _names(e.invars):
                self.readers.setdefault(v, []).append(i)
        self.out_reads: dict[Any, list[int]] = {}
        for j, v in enumerate(self.outs):
            if not isinstance(v, jcore.Literal):
                self.out_reads.setdefault(v, []).append(j)

    def ancestors(self, start: Sequence[int], within: set[int] | None = None) -> set[int]:
        seen: set[int] = set()
        stack = list(start)
        while stack:
            i = stack.pop()
            if i in seen or (within is not None and i not in within):
                continue
            seen.add(i)
            stack.extend(self.producer[v] for v in _names(self.eqns[i].invars) if v in self.producer)
        return seen

    def descendants(self, start: Sequence[int]) -> set[int]:
        seen: set[int] = set()
        stack = list(start)
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            stack.extend(r for v in self.eqns[i].outvars for r in self.readers.get(v, []))
        return seen

    def through_casts(self, v: Any) -> tuple[Any, set[int]]:
        """`v` as read through casts that change no dtype (a weak-typed carry made strong), and those casts."""
        casts: set[int] = set()
        while len(self.readers.get(v, [])) == 1 and not self.out_reads.get(v):
            e = self.eqns[self.readers[v][0]]
            if e.primitive.name != "convert_element_type" or e.outvars[0].aval.dtype != v.aval.dtype:
                break
            casts.add(self.readers[v][0])
            v = e.outvars[0]
        return v, casts

    def sum_chain(self, v: Any) -> tuple[int, set[int]] | None:
        """(root eqn, the rearranging eqns between it and `v`) when `v` is a dot_general or reduce_sum of
        per-trip values through rearranging ops of one operand, each value read once, else None."""
        between: set[int] = set()
        while True:
            i = self.producer.get(v)
            if i is None or not _simple(self.eqns[i]) or self.out_reads.get(v):
                return None
            e = self.eqns[i]
            if e.primitive.name in _ROOTS:
                return (i, between) if all(len(self.readers.get(o, [])) == 1 for o in e.outvars) else None
            ins = _names(e.invars)
            if e.primitive.name not in _REARRANGING or len(ins) != 1:
                return None
            between.add(i)
            v = ins[0]


def _split_scan(eqn: Any) -> _Split | None:
    """The parts of scan `eqn`'s body, or None when nothing would move."""
    b = _Body(eqn)
    eqns = b.eqns
    # Carry-free eqns read only constants, scanned inputs and each other; per-trip values depend on a scanned one.
    free: set[int] = set()
    per_trip: set[Any] = set(b.xs)
    for i, e in enumerate(eqns):
        if _simple(e) and all(v in b.consts or v in b.xs or b.producer.get(v) in free for v in _names(e.invars)):
            free.add(i)
            if any(v in per_trip for v in _names(e.invars)):
                per_trip.update(e.outvars)
    def same_every_trip(v: Any) -> bool:
        return v in b.consts or (b.producer.get(v) in free and v not in per_trip)

    # Accumulators: carry k's output = add(carry k's input, a), its input read by that add alone, `a` a sum
    # over per-trip values through rearranging ops that nothing else reads.
    accumulators: dict[int, int] = {}
    roots: set[int] = set()
    chained: set[int] = set()
    for k in range(b.nk):
        out, cin = b.outs[k], b.carries_in[k]
        i = b.producer.get(out)
        if i is None or eqns[i].primitive.name not in _ACCUMULATING or not _simple(eqns[i]):
            continue
        read_as, casts = b.through_casts(cin)
        if b.readers.get(read_as, []) != [i] or b.out_reads.get(cin) or len(b.out_reads.get(out, [])) != 1 \
                or b.readers.get(out):
            continue
        addends = [v for v in eqns[i].invars if v is not read_as]
        if len(addends) != 1 or isinstance(addends[0], jcore.Literal):
            continue
        chain = b.sum_chain(addends[0])
        if chain is None:
            continue
        root, between = chain
        if any(same_every_trip(v) for v in _names(eqns[root].invars)):
            continue  # a sum of something the same every trip: left in the loop
        accumulators[k] = i
        roots.add(root)
        chained |= between | casts
    adds = set(accumulators.values())
    if any(r not in chained and r not in adds for j in chained for v in eqns[j].outvars for r in b.readers.get(v, [])):
        accumulators, roots, chained, adds = {}, set(), set(), set()  # a rearranged sum read elsewhere too
    kept = [k for k in range(b.nk) if k not in accumulators]
    needed = b.ancestors([b.producer[b.outs[k]] for k in kept if b.outs[k] in b.producer])
    def weight_matmul(i: int) -> bool:
        """A matmul with an operand the same every trip (a weight): run per trip, each re-reads it (a layer scan's
        matmuls read a different weight each trip, and gain nothing from running them all at once)."""
        return eqns[i].primitive.name == "dot_general" and any(same_every_trip(v) for v in _names(eqns[i].invars))

    # Hoisted: the per-trip matmuls of a weight that read no carry, and what they read.
    hoisted = b.ancestors([i for i in free if weight_matmul(i) and i not in roots
                           and any(v in per_trip for v in _names(eqns[i].invars))], within=free)
    # Sunk: what no kept carry needs, from its matmuls of a weight and the accumulated sums on.
    start = [i for i, e in enumerate(eqns) if i not in needed and i not in free and _simple(e)
             and weight_matmul(i)] + sorted(roots | chained | adds)
    sunk = b.descendants(start)
    if sunk & needed or not all(_simple(eqns[i]) for i in sunk):
        return None  # (a value no kept carry needs is upstream of none that one does: cannot happen)
    n_hoisted = sum(eqns[i].primitive.name == "dot_general" for i in hoisted)
    n_sunk = sum(eqns[i].primitive.name == "dot_general" for i in sunk - roots)
    if not (n_hoisted or n_sunk or accumulators):
        return None
    loop = [i for i in range(len(eqns)) if i not in hoisted and i not in sunk]
    if not any(eqns[i].primitive.name == "dot_general" for i in loop):
        # no recurrent matmul: the loop is not a recurrence (microbatches of a gradient accumulation, whose
        # author loops to bound memory), left as written
        return None
    return _Split(sorted(hoisted), loop, sorted(sunk), roots, accumulators,
                  LoopRewrite(_source(eqn), n_hoisted, n_sunk, len(accumulators)), b)


def _summed_bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """`eqn` (a dot_general or reduce_sum) on operands stacked over the trips, the trip axis summed too."""
    p = dict(eqn.params)
    if eqn.primitive.name == "reduce_sum":
        p["axes"] = (0,) + tuple(a + 1 for a in p["axes"])
    else:
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        p["dimension_numbers"] = (((0,) + tuple(d + 1 for d in lc), (0,) + tuple(d + 1 for d in rc)),
                                  (tuple(d + 1 for d in lb), tuple(d + 1 for d in rb)))
    return _bind(eqn.replace(params=p), invals)


def _per_trip(eqn: Any, invals: Sequence[Any], stacked: Sequence[bool]) -> list[Any]:
    """`eqn` on each trip's slice of its stacked inputs (the others the same for every trip); bound once when
    none is stacked."""
    if not any(stacked):
        return _bind(eqn, invals)
    at = [j for j, s in enumerate(stacked) if s]

    def one(*trip: Any) -> list[Any]:
        vals = list(invals)
        for j, t in zip(at, trip):
            vals[j] = t
        return _bind(eqn, vals)

    return list(jax.vmap(one)(*[invals[j] for j in at]))


def _run_scan(eqn: Any, split: _Split, invals: Sequence[Any]) -> list[Any]:
    """Scan `eqn` as its three parts, on its operands' values; its results in its order."""
    p = eqn.params
    closed = p["jaxpr"]
    b = split.body
    eqns = b.eqns
    nc, nk = p["num_consts"], p["num_carry"]
    xs_vars = closed.jaxpr.invars[nc + nk:]
    env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars[:nc], invals[:nc]))
    env.update(zip(xs_vars, invals[nc + nk:]))
    stacked: set[Any] = set(xs_vars)  # values held stacked over the trips (trip axis first)

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def run(i: int) -> None:
        e = eqns[i]
        flags = [not isinstance(v, jcore.Literal) and v in stacked for v in e.invars]
        vals = [read(v) for v in e.invars]
        outs = _summed_bind(e, vals) if i in split.roots else _per_trip(e, vals, flags)
        env.update((v, x) for v, x in zip(e.outvars, outs) if not isinstance(v, jcore.DropVar))
        if any(flags) and i not in split.roots:
            stacked.update(e.outvars)

    for i in split.hoisted:
        run(i)
    kept = [k for k in range(nk) if k not in split.accumulators]
    loop_made = {v for i in split.loop for v in eqns[i].outvars} | {b.carries_in[k] for k in kept}
    sunk_made = {v for i in split.sunk for v in eqns[i].outvars}
    scanned = [v for v in dict.fromkeys(v for i in split.loop for v in _names(eqns[i].invars)) if v in stacked]
    ys = b.outs[nk:]
    # (an output that is a scanned input or a hoisted per-trip value is that stacked value: not through the loop)
    ys_loop = [j for j, v in enumerate(ys) if isinstance(v, jcore.Literal) or (v not in stacked and v not in sunk_made)]
    to_stack = [v for v in dict.fromkeys(v for i in split.sunk for v in _names(eqns[i].invars)) if v in loop_made]
    outer = {v: x for v, x in env.items() if v not in stacked}

    def step(carry: tuple, xs: tuple) -> tuple:
        local = dict(outer)
        local.update(zip([b.carries_in[k] for k in kept], carry))
        local.update(zip(scanned, xs))
        rd = lambda v: v.val if isinstance(v, jcore.Literal) else local[v]  # noqa: E731
        for i in split.loop:
            e = eqns[i]
            local.update((v, x) for v, x in zip(e.outvars, _bind(e, [rd(u) for u in e.invars]))
                         if not isinstance(v, jcore.DropVar))
        return tuple(rd(b.outs[k]) for k in kept), (tuple(rd(ys[j]) for j in ys_loop), tuple(rd(v) for v in to_stack))

    init = tuple(invals[nc + k] for k in kept)
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
        carry_out, (ys_vals, stacked_vals) = jax.lax.scan(
            step, init, tuple(env[v] for v in scanned), length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    env.update(zip(to_stack, stacked_vals))
    stacked.update(to_stack)
    for k in split.accumulators:  # the accumulated carries start from what the loop was given
        env[b.carries_in[k]] = invals[nc + k]
    for i in split.sunk:
        run(i)
    by_loop = dict(zip(ys_loop, ys_vals))
    kept_out = dict(zip(kept, carry_out))
    return [kept_out[k] if k in kept_out else env[b.outs[k]] for k in range(nk)] + \
        [by_loop[j] if j in by_loop else env[v] for j, v in enumerate(ys)]


def _splits(closed: jcore.ClosedJaxpr) -> tuple[jcore.ClosedJaxpr, dict[int, _Split]]:
    """`closed` with its calls inlined (when a scan is inside one), and the split of each top-level scan that has
    something to move (by the scan eqn's id)."""
    flat = inline_calls(closed) if _has_calls(closed) else closed
    return flat, {id(e): s for e in flat.jaxpr.eqns if e.primitive.name == "scan" and (s := _split_scan(e)) is not None}


def loop_rewrites(closed: jcore.ClosedJaxpr) -> list[LoopRewrite]:
    """What `restructure_loops` would do to each top-level scan of `closed` (empty: nothing)."""
    if not _has_scan(closed.jaxpr):
        return []
    return [s.report for s in _splits(closed)[1].values()]


def restructure_loops(closed: jcore.ClosedJaxpr) -> tuple[jcore.ClosedJaxpr, list[LoopRewrite]] | None:
    """`closed` with its top-level scans split into hoisted, loop and sunk parts (module docstring), and what
    was done; None when no scan has a matmul to move. Call-like eqns are inlined first."""
    if not _has_scan(closed.jaxpr):
        return None
    from shardc.pcg.library import loop_rules_proved

    if not loop_rules_proved():
        return None  # (a rule it rests on is missing from the library or not proved: the loops stay as traced)
    flat, splits = _splits(closed)
    if not splits:
        return None

    def run(*args: Any) -> list[Any]:
        env = JaxprEnv(flat.jaxpr, flat.consts, args)
        for e in flat.jaxpr.eqns:
            invals = env.reads(e.invars)
            env.write(e.outvars, _run_scan(e, splits[id(e)], invals) if id(e) in splits else _bind(e, invals))
        return env.reads(flat.jaxpr.outvars)

    return retraced(flat, run), [s.report for s in splits.values()]


def _has_calls(closed: jcore.ClosedJaxpr) -> bool:
    return any(call_jaxpr(e) is not None for e in closed.jaxpr.eqns)


def _has_scan(jaxpr: Any) -> bool:
    """Whether a scan is at the top level of `jaxpr` once its calls are inlined."""
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            return True
        sub = call_jaxpr(e)
        if sub is not None and _has_scan(open_jaxpr(sub)[0]):
            return True
    return False
