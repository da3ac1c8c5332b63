"""The search space: mesh shapes x strategies of decision ops.

A *decision* is a choice of mesh axes for the factors of a decision op (`dot_general`, gather/scatter,
convolution) or for the dims of a graph input. Decisions of structurally identical ops (same primitive,
shapes, dtypes and params: the layers of a Transformer) form one *group* that shares a choice, so the
space does not grow with depth. A point of the space (`Assignment`) becomes extra seeds of lower
priority than the user's hints; propagation fills in every other op.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Mapping, Sequence

from shardc.ir.graph import Graph
from shardc.plan import OpStrategy
from shardc.propagate import Cause, Seed

__all__ = ["DECISION_PRIMITIVES", "DEFAULT_AXIS_NAMES", "Group", "Space", "Assignment", "mesh_candidates", "mesh_orders",
           "build_space", "seeds_for", "project_plan", "plan_choices", "mixing_domains", "op_signature"]

Axes = tuple[str, ...]
DECISION_PRIMITIVES = frozenset({"dot_general", "gather", "scatter", "scatter-add", "scatter_add", "scatter-mul",
                                 "scatter_mul", "conv_general_dilated"})
DEFAULT_AXIS_NAMES = ("data", "model", "expert")
SEARCH_CAUSE = Cause("search", "chosen by the strategy search")
Assignment = tuple[int, ...]  # group index -> strategy index


def _ordered_factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered tuples of `parts` integers >= 2 whose product is n."""
    if parts == 1:
        return [(n,)] if n >= 2 else []
    out = []
    for d in range(2, n + 1):
        if n % d == 0:
            out.extend((d,) + rest for rest in _ordered_factorisations(n // d, parts - 1))
    return out


def mesh_candidates(num_devices: int, required_axes: Sequence[str] = (), *, max_axes: int = 3,
                    fixed: Mapping[str, int] | None = None, topology: Any = None) -> list[dict[str, int]]:
    """Mesh shapes to try: factorisations of `num_devices` into 1..max_axes named axes (the user's mesh
    alone when given). Axis names start with `required_axes` (those the hints name), then the defaults;
    a required axis the factorisation has no room for gets size 1.

    The order of a mesh's axes is its mapping onto the topology's levels: the last axis is the innermost
    (inside a node). With a `topology` of more than one level (e.g. `h100-sxm-8x8`), each mesh with another
    of its axes innermost is a candidate too (`mesh_orders`), so which axis lies inside a node is a choice of the
    search (each variant follows its mesh)."""
    if fixed is not None:
        return [dict(fixed)]
    req = list(dict.fromkeys(required_axes))
    names = req + [a for a in DEFAULT_AXIS_NAMES + ("axis3", "axis4") if a not in req]
    out: list[dict[str, int]] = []
    seen: set[tuple] = set()
    if num_devices == 1:
        return [{a: 1 for a in (req or ["data"])}]
    for parts in range(1, max_axes + 1):
        for sizes in _ordered_factorisations(num_devices, parts):
            n_axes = max(parts, len(req))
            full = list(sizes) + [1] * (n_axes - parts)
            mesh = dict(zip(names[:n_axes], full))
            key = tuple(mesh.items())
            if key not in seen:
                seen.add(key)
                out.append(mesh)
    if len(_levels(topology)) > 1:
        out = list({tuple(m.items()): m for mesh in out for m in mesh_orders(mesh)}.values())
    fitting = [m for m in out if _maps_onto(m, topology)]
    if out and not fitting:
        from annotations.errors import ShardingError
        from shardc.sim import as_topology

        raise ShardingError(f"no mesh of {num_devices} devices lays onto topology {as_topology(topology)} (each "
                            f"mesh axis must divide the devices left on the levels it spans); plan for a device "
                            f"count that fills whole levels")
    return fitting


def _maps_onto(mesh: Mapping[str, int], topology: Any) -> bool:
    """Whether the mesh's axes lay onto the topology's levels (on 2 nodes of 3 GPUs an axis of 2 must
    span the nodes: `data=2, model=3` maps, `model=3, data=2` does not)."""
    if topology is None:
        return True
    from annotations.errors import ShardingError
    from shardc.sim import as_topology

    try:
        as_topology(topology).map_mesh(mesh)
    except ShardingError:
        return False
    return True


def mesh_orders(mesh: Mapping[str, int]) -> list[dict[str, int]]:
    """`mesh` as given, then with each other axis (of size > 1) moved innermost (last), the others keeping
    their order: the choices of which axis lies inside a node. Axes of size 1 stay where they are."""
    big = [a for a in mesh if mesh[a] > 1]
    out = [dict(mesh)]
    for a in reversed(big[:-1]):
        order = [b for b in big if b != a] + [a]
        out.append({**{b: mesh[b] for b in order}, **{b: n for b, n in mesh.items() if n == 1}})
    return out


def _levels(topology: Any) -> list[int]:
    if topology is None:
        return []
    from shardc.sim import as_topology

    return [lv.size for lv in as_topology(topology).levels]


@dataclasses.dataclass(frozen=True)
class Group:
    """Ops (or graph inputs) that share one decision, and the legal choices for it."""

    kind: str  # "op" or "input"
    members: tuple[int, ...]  # op ids, or graph-input value ids
    signature: str
    choices: tuple[tuple[Axes, ...], ...]  # per choice: axes per factor (op) or per dim (input)

    @property
    def size(self) -> int:
        return len(self.choices)


@dataclasses.dataclass(frozen=True)
class Space:
    """All groups of one graph on one mesh; assignment 0 (choice 0 everywhere) is "decide nothing"."""

    graph: Graph
    mesh: dict[str, int]
    groups: tuple[Group, ...]
    pinned: frozenset[tuple[int, int]]  # (value, dim) pinned by the user's hints

    def size(self) -> int:
        return math.prod(g.size for g in self.groups)

    def all_assignments(self):
        return itertools.product(*(range(g.size) for g in self.groups))

    def neutral(self) -> Assignment:
        return tuple(0 for _ in self.groups)


def _assignments(slots: Sequence[int], mesh: Mapping[str, int], axis_names: Sequence[str]) -> list[tuple[Axes, ...]]:
    """Every way to give each mesh axis (size > 1) to at most one slot whose size it divides (several
    axes on one slot in mesh order, product dividing the size). Choice 0 is all-empty."""
    axes = [a for a in axis_names if mesh[a] > 1]
    out: list[tuple[Axes, ...]] = []
    for pick in itertools.product(range(len(slots) + 1), repeat=len(axes)):
        per = [[] for _ in slots]
        for a, p in zip(axes, pick):
            if p:
                per[p - 1].append(a)
        if all(size % math.prod(mesh[a] for a in ax) == 0 for size, ax in zip(slots, per)):
            out.append(tuple(tuple(ax) for ax in per))
    out.sort(key=lambda c: (sum(len(a) for a in c), c))
    return out


def op_signature(graph: Graph, op) -> str:
    """What makes ops one decision group: primitive, operand/result shapes and dtypes, params."""
    shapes = [(graph.values[v].shape, str(graph.values[v].dtype)) for v in op.inputs + op.outputs]
    params = sorted((k, repr(v)) for k, v in op.params.items() if k not in ("jaxpr", "call_jaxpr"))
    return f"{op.primitive}|{shapes}|{params}"


def _input_signature(graph: Graph, vid: int) -> str:
    v = graph.values[vid]
    name = re.sub(r"\d+", "#", v.name or "")
    return f"input|{v.shape}|{v.dtype}|{name}"


def build_space(graph: Graph, mesh: Mapping[str, int], user_seeds: Sequence[Seed] = (), *,
                inputs: bool = True, max_choices: int = 64) -> Space:
    """Group the decision ops and inputs of `graph` and list each group's legal choices on `mesh`.

    Choices respect the user's pinned dims: an op whose operand/result dim the user pinned gets only
    choices that agree with the pin on that dim's factors (and do not reuse the pinned axes elsewhere);
    a fully pinned input is no decision at all."""
    mesh = dict(mesh)
    names = list(mesh)
    pinned: dict[tuple[int, int], Axes] = {}
    for s in user_seeds:
        for d, ax in enumerate(s.dims):
            if ax is not None:
                pinned[(s.value, d)] = tuple(ax)
    pins = _pins_by_value(pinned)
    by_sig: dict[str, list[int]] = {}
    for op in graph.ops:
        if op.primitive in DECISION_PRIMITIVES and op.rule.num_factors:
            by_sig.setdefault(op_signature(graph, op), []).append(op.id)
    groups: list[Group] = []
    for sig, members in by_sig.items():
        op = graph.ops[members[0]]
        choices = [c for c in _assignments(op.rule.sizes, mesh, names)
                   if _op_choice_ok(graph, [graph.ops[m] for m in members], c, pins, mesh)]
        if len(choices) > 1:
            groups.append(Group("op", tuple(members), sig, tuple(choices[:max_choices])))
    if inputs:
        by_isig: dict[str, list[int]] = {}
        for vid in graph.inputs:
            v = graph.values[vid]
            if v.rank == 0 or all((vid, d) in pinned for d in range(v.rank)):
                continue
            by_isig.setdefault(_input_signature(graph, vid), []).append(vid)
        for sig, members in by_isig.items():
            v = graph.values[members[0]]
            choices = [c for c in _assignments(v.shape, mesh, names)
                       if all(_dims_ok(m, c, pins) for m in members)]
            if len(choices) > 1:
                groups.append(Group("input", tuple(members), sig, tuple(choices[:max_choices])))
    return Space(graph, mesh, tuple(groups), frozenset(pinned))


Pins = Mapping[int, tuple[Mapping[int, Axes], frozenset[str]]]


def _pins_by_value(pinned: Mapping[tuple[int, int], Axes]) -> Pins:
    """The user's pinned dims grouped by value: value -> ({dim: axes}, every axis pinned on the value)."""
    dims: dict[int, dict[int, Axes]] = {}
    for (v, d), ax in pinned.items():
        dims.setdefault(v, {})[d] = ax
    return {v: (ds, frozenset(a for ax in ds.values() for a in ax)) for v, ds in dims.items()}


def _dims_ok(vid: int, dims: Sequence[Axes], pins: Pins) -> bool:
    """A choice of dims for a value: pinned dims must match; pinned axes are not reused on other dims."""
    pv = pins.get(vid)
    if pv is None:
        return True
    pinned, used = pv
    for d, ax in enumerate(dims):
        p = pinned.get(d)
        if p is not None:
            if ax != p:
                return False
        elif not used.isdisjoint(ax):
            return False
    return True


def _op_choice_ok(graph: Graph, ops, choice, pins: Pins, mesh) -> bool:
    for op in ops:
        st = OpStrategy(choice)
        for v, dims in zip(op.inputs + op.outputs, op.rule.operands + op.rule.results):
            pv = pins.get(v)
            if pv is not None and any(d < len(dims) for d in pv[0]):
                sh = st.tensor_sharding(op.rule, dims, mesh)
                if not _dims_ok(v, sh.dims, pins):
                    return False
    return True


def seeds_for(space: Space, assignment: Assignment, user_seeds: Sequence[Seed] = ()) -> list[Seed]:
    """Seeds that realise `assignment`: inputs first, then ops' operands and results; a dim the user pinned
    or an earlier decision set is left alone, and no axis is put twice on one value. An op's choice is a
    compute layout (priority 1); an input's has the priority of `baselines.input_priority` (the carried
    state's storage layout comes after the compute's), as the baselines seed them, so that a baseline's
    point of the space (`project_plan`) is the baseline."""
    from shardc.search.baselines import COMPUTE_PRIORITY, input_priority

    g = space.graph
    pinned_vals: dict[int, dict[int, Axes]] = {}
    for s in user_seeds:
        for d, ax in enumerate(s.dims):
            if ax is not None:
                pinned_vals.setdefault(s.value, {})[d] = tuple(ax)
    chosen: dict[int, dict[int, tuple[Axes, int]]] = {}  # value -> dim -> (axes, priority)

    def put(vid: int, dims: Sequence[Axes], priority: int) -> None:
        cur = chosen.setdefault(vid, {})
        pins = pinned_vals.get(vid, {})
        used = {a for ax, _ in cur.values() for a in ax} | {a for ax in pins.values() for a in ax}
        for d, ax in enumerate(dims):
            if d in cur or d in pins:
                continue
            if used & set(ax):
                ax = ()
            cur[d] = (ax, priority)
            used.update(ax)

    order = sorted(range(len(space.groups)), key=lambda i: space.groups[i].kind != "input")
    for gi in order:
        grp, c = space.groups[gi], assignment[gi]
        if c == 0:
            continue
        choice = grp.choices[c]
        for m in grp.members:
            if grp.kind == "input":
                put(m, choice, input_priority(g, m))
            else:
                op = g.ops[m]
                st = OpStrategy(choice)
                for v, dims in zip(op.inputs + op.outputs, op.rule.operands + op.rule.results):
                    put(v, st.tensor_sharding(op.rule, dims, space.mesh).dims, COMPUTE_PRIORITY)
    seeds = []
    for vid, dims in chosen.items():
        rank = g.values[vid].rank
        for prio in sorted({p for _, p in dims.values()}):
            seeds.append(Seed(vid, tuple(dims[d][0] if d in dims and dims[d][1] == prio else None for d in range(rank)),
                              SEARCH_CAUSE, prio))
    return seeds


def plan_choices(space: Space, plan) -> Assignment:
    """Per group, the choice equal to `plan`'s strategy of its first member (op) or sharding (input), else 0."""
    out = []
    for g in space.groups:
        m = g.members[0]
        want = tuple(plan.strategies[m].factor_axes if g.kind == "op" else plan.shardings[m].dims)
        out.append(g.choices.index(want) if want in g.choices else 0)
    return tuple(out)


def with_input_layouts(space: Space, point: Assignment, seeds: Sequence[Seed], values: Sequence[int]) -> Assignment:
    """`point` with each input group whose members are among `values` set to the layout `seeds` give its
    first member, when that layout is one of the group's choices (else the group keeps `point`'s choice)."""
    want = {s.value: tuple(() if d is None else tuple(d) for d in s.dims) for s in seeds}
    values = set(values)
    out = list(point)
    for i, grp in enumerate(space.groups):
        m = grp.members[0]
        if grp.kind == "input" and m in values and m in want and want[m] in grp.choices:
            out[i] = grp.choices.index(want[m])
    return tuple(out)


def project_plan(space: Space, plan) -> Assignment:
    """The point of the space that gives `plan` back when its decisions are made by seeding the graph inputs
    (every baseline is): the inputs' choices of `plan_choices`, op groups left to propagation (0)."""
    return tuple(c if g.kind == "input" else 0 for g, c in zip(space.groups, plan_choices(space, plan)))


def mixing_domains(space: Space, points: Sequence[Assignment], *, compose: bool = True) -> list[list[int]]:
    """Per group, "decide nothing", every choice one of `points` makes and (with `compose`) every legal union
    of two of them (one's axes, plus the other's on the dims/factors the first leaves unsharded, e.g.
    Megatron's column split of a weight plus FSDP's split of its other dim over the data axes: 2-D
    tensor parallel + ZeRO): the space in which a DP mixes several plans (e.g. the baselines) per kind of
    layer."""
    out = []
    for i, grp in enumerate(space.groups):
        dom = {0} | {p[i] for p in points}
        if compose:
            index = {c: k for k, c in enumerate(grp.choices)}
            picked = sorted(dom)
            for a in picked:
                for b in picked:
                    k = index.get(_union(grp.choices[a], grp.choices[b]))
                    if k is not None:
                        dom.add(k)
        out.append(sorted(dom))
    return out


def _union(first: tuple[Axes, ...], second: tuple[Axes, ...]) -> tuple[Axes, ...]:
    """`first`'s axes, plus `second`'s on the slots `first` leaves empty (axes `first` uses are skipped)."""
    used = {a for ax in first for a in ax}
    return tuple(ax if ax else tuple(a for a in bx if a not in used) for ax, bx in zip(first, second))
