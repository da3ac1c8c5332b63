"""Collectives of a compiled XLA program, read from its HLO text (`compiled.as_text()`).

Robust to the forms XLA prints: tuple-shaped collectives (`(f32[4], f32[8,8]) all-reduce(...)`, one
combined op for several tensors), async pairs (`all-gather-start`/`-done`, `async-start` wrapping a
collective computation: counted once, at the start), operands printed with or without their shapes,
every replica-group syntax (explicit lists, iota `[2,4]<=[8]T(1,0)`, `mesh[...] {...}`), and collectives
inside loop bodies (counted once per iteration when XLA knows the trip count).

A collective's *payload* is the size of the logical buffer it works on, per device: the operands of an
all-reduce / reduce-scatter / all-to-all / collective-permute, and the gathered result of an all-gather.
The simulator reports the same quantity, so the two can be compared kind by kind.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable, Sequence

import numpy as np

__all__ = ["HloCollective", "HloModuleText", "parse_hlo", "collectives", "shape_bytes", "COLLECTIVE_KINDS",
           "even_spacing"]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OPCODE_KIND = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "all-gather": "all-gather", "all-gather-start": "all-gather",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-permute",
}
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "token": 0, "tuple": 0,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z0-9]*)?)\[([^\]]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple is the sum of its arrays; layouts are ignored)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(_strip_layouts(shape)):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        n = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            if d:
                n *= int(d)
        total += size * n
    return int(math.ceil(total))


def _strip_layouts(shape: str) -> str:
    out, depth = [], 0
    for ch in shape:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


@dataclasses.dataclass(frozen=True, slots=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    operand_shapes: tuple[str | None, ...]
    attrs: str


@dataclasses.dataclass
class HloModuleText:
    """Computations of an HLO module: instructions by computation, and which computation is the entry."""

    computations: dict[str, list[_Instr]]
    params: dict[str, dict[str, str]]
    entry: str
    num_partitions: int

    def shape_of(self, comp: str, name: str) -> str | None:
        for ins in self.computations.get(comp, ()):
            if ins.name == name:
                return ins.shape
        return self.params.get(comp, {}).get(name)


def _balanced(text: str, start: int, open_ch: str = "(", close_ch: str = ")") -> int:
    """Index just past the bracket group starting at text[start] (which is open_ch)."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_ch}{close_ch} in HLO: {text[start:start + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas not nested in (), [], {}."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))\s*->\s*(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    pos = m.end()
    if line[pos] == "(":
        end = _balanced(line, pos)
        shape = line[pos:end]
    else:
        end = pos
        depth = 0
        while end < len(line) and (line[end] != " " or depth):
            if line[end] in "[{(":
                depth += 1
            elif line[end] in "]})":
                depth -= 1
            end += 1
        shape = line[pos:end]
    rest = line[end:].lstrip()
    p = rest.find("(")
    if p < 0:
        return None
    opcode = rest[:p].strip()
    close = _balanced(rest, p)
    operands, shapes = [], []
    for tok in _split_top(rest[p + 1:close - 1]):
        tok = tok.strip()
        name_at = tok.rfind("%")
        if name_at >= 0:
            operands.append(tok[name_at + 1:].strip())
            shapes.append(tok[:name_at].strip() or None)
        else:
            pieces = tok.rsplit(" ", 1)
            operands.append(pieces[-1])
            shapes.append(pieces[0] if len(pieces) == 2 else None)
    return _Instr(m.group(2), shape, opcode, tuple(operands), tuple(shapes), rest[close:])


def parse_hlo(text: str) -> HloModuleText:
    """Split HLO text into computations of instructions."""
    comps: dict[str, list[_Instr]] = {}
    params: dict[str, dict[str, str]] = {}
    entry = ""
    current: str | None = None
    m = re.search(r"num_partitions=(\d+)", text)
    num_partitions = int(m.group(1)) if m else 1
    for line in text.splitlines():
        line = _COMMENT.sub("", line)
        if current is None:
            h = _HEADER.match(line.strip())
            if h:
                current = h.group(2)
                comps[current] = []
                params[current] = {}
                for p in _split_top(h.group(3)[1:-1]):
                    if ":" in p:
                        name, shape = p.split(":", 1)
                        params[current][name.strip().lstrip("%")] = shape.strip()
                if h.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            comps[current].append(ins)
    if not entry and comps:
        entry = list(comps)[-1]
    return HloModuleText(comps, params, entry, num_partitions)


@dataclasses.dataclass(frozen=True, slots=True)
class HloCollective:
    """One collective of the compiled program (a combined one counts once, with all its tensors)."""

    kind: str
    bytes: int  # payload per device, one execution
    group_size: int
    axes: tuple[str, ...] | None  # mesh axes its groups span (None when no mesh was given)
    count: int  # executions per step (loop trip counts multiplied in)
    name: str
    computation: str
    tensors: int  # how many tensors it moves (more than one when XLA combined several)
    op_name: str = ""  # the metadata's op_name: the jax name stack of the op XLA made it for
    stride: int = 1  # a group of part of one mesh axis: its devices' spacing along it (`Collective.stride`)

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"\b(calls|body|to_apply|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _multiplicities(mod: HloModuleText) -> dict[str, int]:
    """How many times each computation runs per execution of the entry (reducers excluded)."""
    edges: dict[str, list[tuple[str, int]]] = {c: [] for c in mod.computations}
    for comp, instrs in mod.computations.items():
        for ins in instrs:
            trip = 1
            if ins.opcode == "while":
                t = _TRIP.search(ins.attrs)
                trip = int(t.group(1)) if t else 1
            for key, callee in _CALLS.findall(ins.attrs):
                if key == "to_apply" and ins.opcode != "call":
                    continue  # scalar reducer of a reduce/all-reduce/sort
                edges[comp].append((callee, trip if key == "body" else (trip + 1 if key == "condition" else 1)))
            for b in _BRANCHES.findall(ins.attrs):
                for callee in _split_top(b):
                    edges[comp].append((callee.strip().lstrip("%"), 1))
    mult: dict[str, int] = {}
    order: list[str] = []
    seen: set[str] = set()

    def visit(c: str) -> None:  # post-order, so callers come after callees; reversed = topological
        if c in seen or c not in edges:
            return
        seen.add(c)
        for callee, _ in edges[c]:
            visit(callee)
        order.append(c)

    visit(mod.entry)
    mult[mod.entry] = 1
    for c in reversed(order):
        for callee, k in edges[c]:
            mult[callee] = mult.get(callee, 0) + mult.get(c, 0) * k
    return mult


def _replica_groups(attrs: str, n: int) -> list[list[int]] | None:
    m = re.search(r"replica_groups=", attrs)
    if not m:
        return None
    s = attrs[m.end():]
    if s.startswith("{"):
        body = s[:_balanced(s, 0, "{", "}")]
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
        return groups or [list(range(n))]
    iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", s)
    if iota:
        out_shape = [int(x) for x in iota.group(1).split(",")]
        src_shape = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(math.prod(src_shape)).reshape(src_shape)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    mesh = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", s)
    if mesh:
        axes = [(a.split("=")[0].strip().strip("'\""), int(a.split("=")[1])) for a in _split_top(mesh.group(1))]
        ids = _device_ids(mesh.group(2), math.prod(k for _, k in axes))
        return _mesh_groups(ids, axes, [a for a in mesh.group(3).split(",") if a.strip()])
    return None


def _mesh_groups(ids: np.ndarray, axes: Sequence[tuple[str, int]], chosen: Sequence[str]) -> list[list[int]]:
    """The replica groups of a `mesh[...] {...}` spec: devices `ids` (in mesh order) grouped over the `chosen` axes,
    each a name or a sub-axis `'name':(pre)size` (Shardy's: the part of size `size` of that axis after its major
    part of size `pre`). An axis is cut into the sub-axes its selections mark, major to minor."""
    names = [a for a, _ in axes]
    picked: list[tuple[int, int, int]] = []  # (axis index, from, to): cumulative sizes from the major side
    for token in chosen:
        m = re.match(r"\s*['\"]?([^'\":]+)['\"]?\s*(?::\s*\((\d+)\)\s*(\d+))?\s*$", token)
        if not m or m.group(1) not in names:
            continue
        i = names.index(m.group(1))
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (1, axes[i][1])
        picked.append((i, pre, pre * size))
    shape: list[int] = []
    keep: list[int] = []
    for i, (_, n) in enumerate(axes):
        cuts = sorted({1, n} | {c for j, a, b in picked if j == i for c in (a, b)})
        for lo, hi in zip(cuts, cuts[1:]):
            if any(j == i and a <= lo and hi <= b for j, a, b in picked):
                keep.append(len(shape))
            shape.append(hi // lo)
    rest = [d for d in range(len(shape)) if d not in keep]
    grid = ids.reshape(shape).transpose(rest + keep)
    return grid.reshape(-1, math.prod(shape[d] for d in keep) if keep else 1).tolist()


def _device_ids(spec: str | None, n: int) -> np.ndarray:
    """Device order of a `mesh[...]` replica-group spec: `[2,4]T(1,0)` (iota, reshaped, transposed) or a list."""
    if not spec:
        return np.arange(n)
    iota = re.match(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if iota:
        ids = np.arange(n).reshape([int(x) for x in iota.group(1).split(",")])
        if iota.group(2):
            ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in spec.replace("(", "").replace(")", "").split(",") if x.strip()])


def _pairs(attrs: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if not m:
        return []
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)", m.group(0))]


def _span_of_groups(groups: Sequence[Sequence[int]], mesh_shape: Sequence[tuple[str, int]], permute: bool
                    ) -> tuple[tuple[str, ...], int]:
    """The mesh axes along which the devices of some group differ, and for groups of part of one axis their
    devices' spacing along it (`even_spacing`, as `shardc.cost.reshard` gives it for the collectives it
    predicts; 1 otherwise, and for a collective-permute's pairs)."""
    names = [a for a, _ in mesh_shape]
    sizes = [k for _, k in mesh_shape]
    coords = [[np.unravel_index(i, sizes) for i in g] for g in groups]
    varying = sorted({d for cs in coords for d in range(len(sizes)) if len({c[d] for c in cs}) > 1})
    axes = tuple(names[d] for d in varying)
    if permute or len(varying) != 1 or len(groups[0]) >= sizes[varying[0]]:
        return axes, 1
    return axes, even_spacing([c[varying[0]] for c in cs] for cs in coords)


def even_spacing(positions: Iterable[Iterable[int]]) -> int:
    """`Collective.stride` of a collective among part of one axis: given each group's devices' positions along the
    axis, their spacing when every group's are evenly spaced with the same spacing; 1 otherwise."""
    steps = set()
    for group in positions:
        at = sorted(int(p) for p in group)
        steps.update(b - a for a, b in zip(at, at[1:]))
    return steps.pop() if len(steps) == 1 else 1


def collectives(hlo_text: str | HloModuleText,
                mesh_shape: Sequence[tuple[str, int]] | None = None) -> list[HloCollective]:
    """Every collective of the module with its payload, group size, mesh axes and execution count.

    `mesh_shape` is the mesh as (axis, size) pairs in mesh order; partition i of the program is the
    device at flat index i of that mesh (how jax assigns devices to a NamedSharding's mesh).
    """
    mod = hlo_text if isinstance(hlo_text, HloModuleText) else parse_hlo(hlo_text)
    mult = _multiplicities(mod)
    out: list[HloCollective] = []
    n = mod.num_partitions
    for comp, instrs in mod.computations.items():
        count = mult.get(comp, 0)
        if count == 0:
            continue
        for ins in instrs:
            kind = _OPCODE_KIND.get(ins.opcode)
            if kind is None:
                continue
            operand_shapes = [s if s else (mod.shape_of(comp, o) or "")
                              for o, s in zip(ins.operands, ins.operand_shapes)]
            if kind == "collective-permute":
                operand_shapes = operand_shapes[:1]
                pairs = _pairs(ins.attrs)
                groups = [list(p) for p in pairs] or [[0]]
                group_size = 2 if pairs else 1
            else:
                groups = _replica_groups(ins.attrs, n) or [list(range(n))]
                group_size = max(len(g) for g in groups)
            in_bytes = sum(shape_bytes(s) for s in operand_shapes)
            payload = in_bytes * group_size if kind == "all-gather" else in_bytes
            axes, stride = (_span_of_groups(groups, mesh_shape, kind == "collective-permute") if mesh_shape
                            else (None, 1))
            op_name = _OP_NAME.search(ins.attrs)
            out.append(HloCollective(kind, payload, group_size, axes, count, ins.name, comp, len(operand_shapes),
                                     op_name.group(1) if op_name else "", stride))
    return out
