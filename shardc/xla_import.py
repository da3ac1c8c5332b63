"""Import XLA's own sharding propagation as a shardc Plan.

Plain `jax.jit` with the user's hints leaves the rest of the layout to XLA (Shardy/GSPMD propagation). XLA
dumps the HLO module after propagation and before SPMD partitioning, with a `sharding={...}` on every
instruction and the jaxpr primitive in `metadata={op_name="jit(f)/jvp()/dot_general"}`:

    compiled, hlo = compile_with_dump(jax.jit(f, in_shardings=...), *args)
    plan, report = plan_from_xla(problem, mesh, hlo)     # report.fraction: values matched
    shardc.simulate(plan, topology)

Instructions are matched to the values of shardc's graph by dataflow: parameters by index, then each op in
program order to the unclaimed instruction whose op_name names the op's primitive, whose shape is the
value's, and whose operands (walking back through instructions of the same eqn and XLA-inserted glue) are
exactly the op's already-matched inputs. Ambiguous candidates that agree on their sharding still seed the
value; otherwise the value is left to shardc's propagation. Each matched sharding becomes a Seed, and
`plan_from_seeds` builds the plan (shardc's per-op strategy choice, not XLA's partitioner's).
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import math
import os
import re
import tempfile
from typing import Any, Mapping, Sequence

import numpy as np

from shardc.cost.hlo import _balanced, _device_ids
from shardc.cost.hlo import parse_hlo as parse_hlo_text
from shardc.fresh_compile import uncached
from shardc.sharding import Sharding

__all__ = ["HloInstr", "MatchReport", "decode_sharding", "hlo_shardings", "parse_hlo", "match_values",
           "plan_from_xla", "compile_with_dump", "DUMP_PASS_RE"]

DUMP_PASS_RE = "spmd-partitioning|shardy.*"
_DUMP_SUFFIX = "before_spmd-partitioning.txt"
# Instruction kinds that carry data through unchanged or are inserted by XLA around an eqn.
_GLUE = {"reshape", "copy", "transpose", "bitcast", "convert", "broadcast", "constant", "iota"}


@dataclasses.dataclass(frozen=True)
class HloInstr:
    """One instruction of the entry computation before SPMD partitioning."""

    name: str
    opcode: str
    shape: tuple[int, ...] | None  # None for tuple shapes and tokens
    operands: tuple[str, ...]
    prims: tuple[str, ...]  # jaxpr primitives named by its op_name (several after XLA merged eqns)
    sharding_text: str | None
    sharding: Sharding | None  # decoded on the mesh; None when absent or unsupported
    parameter: int | None = None


# ---------------------------------------------------------------------------------------------------------
# Sharding strings


def _braced(text: str, start: int) -> str:
    """The balanced `{...}` group starting at text[start] (which must be '{'), braces included."""
    return text[start:_balanced(text, start, "{", "}")]


def _tile_assignment(body: str) -> tuple[list[int], np.ndarray, str] | None:
    """Tile dims, the device array (shaped as the tile dims) and the rest of a `devices=[..]...` sharding."""
    m = re.match(r"devices=\[([\d,]+)\]", body)
    if m is None:
        return None
    tile = [int(x) for x in m.group(1).split(",")]
    rest = body[m.end():]
    ids = re.match(r"<=(\[[\d,]+\](?:T\([\d,]+\))?)|([\d,]+)", rest)  # iota (reshaped, transposed) or a list
    if ids is None:
        return None
    arr = _device_ids(ids.group(1) or ids.group(2), math.prod(tile))
    if arr.size != math.prod(tile):
        return None
    return tile, arr.reshape(tile), rest[ids.end():]


def _axes_for(tile_index: np.ndarray, count: int, names: Sequence[str], coords: np.ndarray,
              sizes: Sequence[int], used: set[str]) -> tuple[str, ...] | None:
    """The mesh axes (major to minor) whose mixed-radix coordinate equals each device's tile index along
    one dim; None when no ordered set of whole unused axes does (a sub-axis split)."""
    if count == 1:
        return ()
    free = [i for i, n in enumerate(names) if sizes[i] > 1 and n not in used]
    for r in range(1, len(free) + 1):
        for perm in itertools.permutations(free, r):
            if math.prod(sizes[i] for i in perm) != count:
                continue
            idx = np.zeros_like(tile_index)
            for i in perm:
                idx = idx * sizes[i] + coords[:, i]
            if np.array_equal(idx, tile_index):
                return tuple(names[i] for i in perm)
    return None


def decode_sharding(text: str, rank: int, mesh_sizes: Mapping[str, int]) -> Sharding | None:
    """An HLO sharding (`{replicated}`, `{devices=[2,4]<=[8]}`, `{devices=[4,1,2]<=[2,4]T(1,0)
    last_tile_dim_replicate}`, explicit device lists) as per-dim mesh axes on a mesh whose devices are iota
    over its shape (axes in mesh order). None for maximal, manual, tuple and sub-axis shardings."""
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    body = re.sub(r"\s*metadata=\{.*\}", "", body).strip()
    if body == "replicated":
        return Sharding(((),) * rank)
    if body.startswith("{") or "maximal" in body or "manual" in body:
        return None
    parsed = _tile_assignment(body)
    if parsed is None:
        return None
    tile, arr, rest = parsed
    replicate = "last_tile_dim_replicate" in rest or "last_tile_dims={replicated}" in rest
    if len(tile) != rank + (1 if replicate else 0) or "last_tile_dims" in rest and not replicate:
        return None
    names, sizes = list(mesh_sizes), [int(mesh_sizes[a]) for a in mesh_sizes]
    n = math.prod(sizes)
    if arr.size != n or sorted(arr.ravel().tolist()) != list(range(n)):
        return None
    pos = np.empty((n, len(tile)), dtype=np.int64)
    for idx, dev in np.ndenumerate(arr):
        pos[dev] = idx
    coords = np.stack(np.unravel_index(np.arange(n), sizes), axis=1)
    dims: list[tuple[str, ...]] = []
    used: set[str] = set()
    for d in range(rank):
        axes = _axes_for(pos[:, d], tile[d], names, coords, sizes, used)
        if axes is None:
            return None
        used.update(axes)
        dims.append(axes)
    return Sharding(tuple(dims))


# ---------------------------------------------------------------------------------------------------------
# HLO text


def _shape(text: str) -> tuple[int, ...] | None:
    m = re.fullmatch(r"[a-z]\w*\[([\d,]*)\](?:\{[^}]*\})?", text.strip())
    if m is None:
        return None
    return tuple(int(x) for x in m.group(1).split(",") if x)


def _prims(line: str) -> tuple[str, ...]:
    """The jaxpr primitives named in the instruction's op_name (last path component of each `;` part)."""
    m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
    if m is None:
        return ()
    return tuple(p.rsplit("/", 1)[1] for p in m.group(1).split(";") if "/" in p)


def parse_hlo(hlo_text: str, mesh_sizes: Mapping[str, int]) -> list[HloInstr]:
    """Every instruction of the entry computation, in text order, with its decoded sharding."""
    module = parse_hlo_text(hlo_text)
    out = []
    for ins in module.computations.get(module.entry, ()):
        shape = _shape(ins.shape)
        s_at = ins.attrs.find("sharding={")
        s_text = _braced(ins.attrs, s_at + len("sharding=")) if s_at >= 0 else None
        sharding = None
        if shape is not None:  # no sharding: the SPMD partitioner replicates the instruction
            sharding = decode_sharding(s_text or "{replicated}", len(shape), mesh_sizes)
        parameter = int(ins.operands[0]) if ins.opcode == "parameter" and ins.operands else None
        out.append(HloInstr(ins.name, ins.opcode, shape, ins.operands, _prims(ins.attrs), s_text, sharding,
                            parameter))
    return out


def hlo_shardings(hlo_text: str, mesh_sizes: Mapping[str, int]) -> list[tuple[str, tuple[int, ...] | None,
                                                                              Sharding | None]]:
    """Per instruction of the entry computation: (name, shape, sharding as per-dim mesh axes or None)."""
    return [(i.name, i.shape, i.sharding) for i in parse_hlo(hlo_text, mesh_sizes)]


# ---------------------------------------------------------------------------------------------------------
# Matching instructions to graph values


@dataclasses.dataclass
class MatchReport:
    """What the import matched: value -> instruction(s), the seeds, and the fraction of values covered."""

    matched: dict[int, str]  # value -> instruction (unique dataflow match)
    ambiguous: dict[int, tuple[str, ...]]  # value -> candidates agreeing on the sharding (seeded, unmapped)
    unsupported: dict[int, str]  # value -> instruction whose sharding could not be decoded
    candidates: int  # non-constant values of the graph outside loop/branch bodies
    seeds: list[Any] = dataclasses.field(default_factory=list)

    @property
    def fraction(self) -> float:
        """Share of the candidate values given XLA's sharding."""
        return (len(self.matched) + len(self.ambiguous)) / self.candidates if self.candidates else 1.0


@dataclasses.dataclass
class _Walk:
    """What a walk back from one instruction reached."""

    found: set[int]  # values of matched instructions
    through: set[str]  # instructions of the same eqn or glue walked through
    foreign: int  # unmatched instructions of other eqns
    maybe: list[tuple[str, frozenset[int]]]  # instructions that are one of several values' candidates


def _walk(instr: HloInstr, by_name: Mapping[str, HloInstr], owner: Mapping[str, int],
          maybe: Mapping[str, frozenset[int]], prims: set[str], depth: int = 6) -> _Walk:
    """From `instr`'s operands back to already-matched instructions, through instructions of the same eqn
    (same primitive) and XLA glue."""
    w = _Walk(set(), set(), 0, [])
    stack = [(o, depth) for o in instr.operands]
    while stack:
        name, d = stack.pop()
        op = by_name.get(name)
        if op is None:
            continue
        if name in owner:
            w.found.add(owner[name])
        elif name in maybe:
            w.maybe.append((name, maybe[name]))
        elif op.opcode == "constant":
            continue
        elif d > 0 and (set(op.prims) & prims or (not op.prims and op.opcode in _GLUE)):
            w.through.add(name)
            stack += [(o, d - 1) for o in op.operands]
        else:
            w.foreign += 1
    return w


def _tier(w: _Walk, want: set[int], mapped_want: set[int]) -> int | None:
    """How well a walk explains the op's inputs (lower is better; None: not at all). 0: every input reached
    (matched ones exactly, others as an unmatched producer or one of their candidates); 1: matched inputs
    exactly, fewer producers than unmatched inputs (folded by XLA); 2: some matched inputs reached through
    another instruction (a wrong or missing match upstream), the rest accounted for."""
    eff = set(w.found)
    rest = w.foreign
    for _, vals in w.maybe:
        hit = vals & want
        eff |= hit
        rest += not hit
    if w.found == mapped_want and eff <= want and len(eff) + rest == len(want):
        return 0
    if w.found == mapped_want and rest <= len(want - eff):
        return 1
    if w.found and w.found < mapped_want and eff <= want and len(eff) + rest == len(want):
        return 2
    return None


def _params(instrs: Sequence[HloInstr], graph: Any, kept: Sequence[int] | None) -> dict[str, int]:
    """HLO parameter -> graph input: by index (`kept`: the flat inputs XLA kept, jax drops unused ones),
    or by shape in order when fewer parameters than inputs and no `kept` is given."""
    params = sorted((i for i in instrs if i.parameter is not None), key=lambda i: i.parameter)
    inputs = list(graph.inputs)
    if kept is not None:
        inputs = [inputs[k] for k in kept]
    out: dict[str, int] = {}
    if len(params) == len(inputs):
        for p, v in zip(params, inputs):
            if p.shape == graph.values[v].shape:
                out[p.name] = v
        return out
    j = 0
    for p in params:  # greedy subsequence by shape
        while j < len(inputs) and graph.values[inputs[j]].shape != p.shape:
            j += 1
        if j < len(inputs):
            out[p.name] = inputs[j]
            j += 1
    return out


def _candidates(op: Any, vid: int, graph: Any, pool: Mapping[str, list[HloInstr]], by_name: Mapping[str, HloInstr],
                owner: Mapping[str, int], matched: Mapping[int, str],
                maybe: Mapping[str, frozenset[int]]) -> list[tuple[HloInstr, _Walk]]:
    """Unclaimed instructions that could be `vid` (an output of `op`): primitive and shape agree, and the
    operands explain the op's inputs, best tier only (`_tier`). Then a candidate that walks through another
    candidate is dropped: the innermost wins, because a chain of the same primitive is more often two
    eqns (mul of mul) than one eqn lowered to several instructions (integer_pow); mistaking an eqn's
    internal instruction for its result costs little (same inputs)."""
    want = {v for v in op.inputs if not graph.values[v].is_const}
    mapped_want = {v for v in want if v in matched}
    best: dict[int, list[tuple[HloInstr, _Walk]]] = {}
    for c in pool.get(op.primitive, ()):
        if c.name in owner or c.shape != graph.values[vid].shape:
            continue
        w = _walk(c, by_name, owner, maybe, {op.primitive})
        t = _tier(w, want, mapped_want)
        if t is not None:
            best.setdefault(t, []).append((c, w))
    if not best:
        return []
    ok = best[min(best)]
    names = {c.name for c, _ in ok}
    return [(c, w) for c, w in ok if not w.through & names]


def _resolve(w: _Walk, want: set[int], owner: dict[str, int], matched: dict[int, str],
             maybe: dict[str, frozenset[int]]) -> None:
    """After a unique match, an input reached through exactly one of its candidates is that candidate."""
    hits: dict[int, set[str]] = {}
    for name, vals in w.maybe:
        for v in vals & want:
            hits.setdefault(v, set()).add(name)
    for v, names in hits.items():
        if len(names) == 1 and v not in matched:
            (name,) = names
            owner[name], matched[v] = v, name
            for k in list(maybe):
                maybe[k] = maybe[k] - {v}
                if k == name or not maybe[k]:
                    del maybe[k]


def match_values(graph: Any, instrs: Sequence[HloInstr], kept: Sequence[int] | None = None) -> MatchReport:
    """Match HLO instructions to graph values (see the module docstring)."""
    by_name = {i.name: i for i in instrs}
    pool: dict[str, list[HloInstr]] = {}
    for i in instrs:
        for p in dict.fromkeys(i.prims):
            pool.setdefault(p, []).append(i)
    owner: dict[str, int] = {}  # instruction -> value
    matched: dict[int, str] = {}
    for name, v in _params(instrs, graph, kept).items():
        owner[name], matched[v] = v, name
    pending: dict[int, tuple[str, ...]] = {}  # value -> its candidates, when several
    maybe: dict[str, frozenset[int]] = {}  # instruction -> the pending values it may be
    for op in graph.ops:
        if op.region or op.primitive == "tie":
            continue
        want = {v for v in op.inputs if not graph.values[v].is_const}
        for vid in op.outputs:
            if vid in matched:
                continue
            cands = _candidates(op, vid, graph, pool, by_name, owner, matched, maybe)
            if len(cands) == 1:
                owner[cands[0][0].name], matched[vid] = vid, cands[0][0].name
                maybe.pop(cands[0][0].name, None)
                _resolve(cands[0][1], want, owner, matched, maybe)
            elif cands:
                pending[vid] = tuple(c.name for c, _ in cands)
                for c, _ in cands:
                    maybe[c.name] = maybe.get(c.name, frozenset()) | {vid}
    ambiguous = {v: names for v, names in pending.items()
                 if v not in matched and len({by_name[n].sharding_text for n in names}) == 1}
    top = {v for op in graph.ops if not op.region and op.primitive != "tie" for v in op.outputs} | set(graph.inputs)
    candidates = sum(1 for v in top if not graph.values[v].is_const)
    unsupported = {v: n for v, n in matched.items() if by_name[n].sharding is None}  # manual, maximal, sub-axis
    return MatchReport(matched, ambiguous, unsupported, candidates)


# ---------------------------------------------------------------------------------------------------------
# Seeds and plan


def _seeds(graph: Any, report: MatchReport, by_name: Mapping[str, HloInstr]) -> list[Any]:
    """One seed per matched value with a decoded sharding; the output of a carried-state tie is left to
    the tie when XLA gave it another layout than its input (shardc returns state as it came in)."""
    from shardc.propagate import Cause, Seed

    chosen: dict[int, tuple[tuple[str, ...], ...]] = {}
    for v, name in list(report.matched.items()) + [(v, ns[0]) for v, ns in report.ambiguous.items()]:
        s = by_name[name].sharding
        if s is not None and len(s.dims) == graph.values[v].rank:
            chosen[v] = s.dims
    for a, b in graph.carried().items():
        if a in chosen and b in chosen and chosen[a] != chosen[b]:
            del chosen[b]
    cause = Cause("xla", "XLA sharding propagation")
    return [Seed(v, dims, cause, 0) for v, dims in sorted(chosen.items())]


def plan_from_xla(problem: Any, mesh: Any, hlo_text: str, *, kept: Sequence[int] | None = None) -> tuple[Any, MatchReport]:
    """The plan whose values carry XLA's propagated shardings (matched ones; shardc propagates the rest),
    and the match report. `hlo_text`: the module after sharding propagation, before SPMD partitioning."""
    from shardc.search.evaluate import plan_from_seeds
    from shardc.sharding import mesh_shape

    instrs = parse_hlo(hlo_text, mesh_shape(mesh))
    report = match_values(problem.graph, instrs, kept)
    report.seeds = _seeds(problem.graph, report, {i.name: i for i in instrs})
    return plan_from_seeds(problem, mesh, report.seeds), report


def compile_with_dump(jitted: Any, *args: Any, compiler_options: Mapping[str, Any] | None = None,
                      **kwargs: Any) -> tuple[Any, str, tuple[int, ...] | None]:
    """Lower and compile a `jax.jit` function with XLA dumping its module before SPMD partitioning into a
    fresh temporary directory. Returns (compiled, HLO text, indices of the flat inputs XLA kept or None)."""
    lowered = jitted.lower(*args, **kwargs)
    with tempfile.TemporaryDirectory(prefix="shardc-xla-") as d:
        opts = {"xla_dump_to": d, "xla_dump_hlo_pass_re": DUMP_PASS_RE, **(compiler_options or {})}
        with uncached():  # (a program loaded from jax's persistent cache is not dumped)
            compiled = lowered.compile(compiler_options=opts)
        files = glob.glob(os.path.join(d, f"*{_DUMP_SUFFIX}"))
        if not files:
            raise RuntimeError("XLA dumped no module before SPMD partitioning (a single-device program?)")
        with open(max(files, key=os.path.getmtime)) as f:
            text = f.read()
    kept = None
    try:
        kept = tuple(sorted(lowered._lowering.compile_args["kept_var_idx"]))
    except (AttributeError, KeyError, TypeError):
        pass
    return compiled, text, kept
