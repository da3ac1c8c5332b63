"""A rewrite's PCG spliced into its parent's node list (the fast path of `match.apply_matches`).

`GraphBuilder.finish` sorts every node, orders them all topologically and removes the dead ones: three passes
over the 6,000 nodes of a 12-layer GPT's PCG for each candidate rewrite. A rewrite of a PCG that `finish` made
(topologically ordered, no dead node) changes little: its new nodes go right after the last node it matched,
the readers of the tensors it replaces read their replacements, and only the matched nodes, the new ones and
the nodes feeding them can be dead. `splice` builds that PCG directly — the nodes, in the order, that `finish`
gives — and declines (None) where a rerouted reader would come before the node now making its operand, which
`finish` reorders.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Iterable, Mapping, Sequence

from shardc.pcg.graph import PCG, Node, Tensor, mark_clean

__all__ = ["splice"]


Place = tuple[float, int]  # where a node lands in the merged list: (old index or new anchor, creation order)


@dataclasses.dataclass(frozen=True)
class _Places:
    """Where the old nodes (index i at (i, -1)) and the added ones (anchor, creation order) land in the merged list,
    and which node makes each tensor there."""

    pcg: PCG
    pos: Mapping[int, int]  # old node id -> its index
    place: Mapping[int, Place]  # added node id -> its place
    made_by: Mapping[int, Node]  # tensor an added node makes -> that node

    def of(self, n: Node) -> Place:
        return self.place.get(n.id, (float(self.pos.get(n.id, -1)), -1))

    def maker(self, t: int) -> Node | None:
        """The node making tensor `t` (an added one first), None for an input or a constant."""
        n = self.made_by.get(t)
        if n is None and (p := self.pcg.producer(t)) is not None:
            n = p[0]
        return n

    def made_at(self, t: int) -> Place:
        n = self.maker(t)
        return (-1.0, 0) if n is None else self.of(n)


def splice(pcg: PCG, added: Sequence[tuple[float, Node]], tensors: Sequence[Tensor], consts: Mapping[int, Any],
           replace: Mapping[int, int], outputs: Sequence[int]) -> tuple[PCG, list[Node]] | None:
    """The PCG `GraphBuilder.finish` makes of clean `pcg`'s nodes (old node i at order i) and the `added` (order,
    node) pairs, with each reader of a tensor of `replace` reading its replacement, `outputs` returned and
    `tensors`/`consts` the builder's, with its new and rerouted nodes in order (the only ones reading or making new
    tensors); None where that list is not in topological order as it stands."""
    pos = {n.id: i for i, n in enumerate(pcg.nodes)}
    added = sorted(added, key=lambda p: p[0])  # (stable: a right-hand side's nodes in the order it made them)
    at = _Places(pcg, pos, {n.id: (o, k) for k, (o, n) in enumerate(added)},
                 {t: n for _, n in added for t in n.outputs})
    rerouted: dict[int, Node] = {}
    gained: dict[int, list[Node]] = {}  # a replacement -> the rerouted readers now reading it
    replacements = set(replace.values())
    for t in replace:
        for u in pcg.users(t):
            if u.id not in rerouted:
                rerouted[u.id] = dataclasses.replace(u, inputs=tuple(replace.get(i, i) for i in u.inputs))
    for u in rerouted.values():
        for i in dict.fromkeys(u.inputs):
            if at.made_at(i) >= at.of(u):
                return None  # (it would read a tensor made after it: `finish` reorders)
            if i in replacements:
                gained.setdefault(i, []).append(u)
    for _, n in added:
        if any(at.made_at(i) >= at.of(n) for i in n.inputs):
            return None
    new_readers: dict[int, list[Node]] = {}
    for _, n in added:
        for i in dict.fromkeys(n.inputs):
            new_readers.setdefault(i, []).append(n)
    out = set(outputs)

    def readers(t: int) -> Iterable[Node]:
        old = () if t in replace else pcg.users(t)  # (a replaced tensor's readers read its replacement)
        return (*old, *gained.get(t, ()), *new_readers.get(t, ()))

    losing = [p[0] for t in replace if (p := pcg.producer(t)) is not None]  # (the only old nodes losing readers)
    dead = _dead(at, [n for _, n in added] + losing, out, readers)
    nodes: list[Node] = []
    touched: list[Node] = []  # (the new and rerouted nodes, in order: the only ones reading or making new tensors)
    k = 0
    for i, n in enumerate(pcg.nodes):
        while k < len(added) and added[k][0] < i:
            if added[k][1].id not in dead:
                nodes.append(added[k][1])
                touched.append(added[k][1])
            k += 1
        if n.id not in dead:
            nodes.append(rerouted.get(n.id, n))
            if n.id in rerouted:
                touched.append(nodes[-1])
    for _, n in added[k:]:
        if n.id not in dead:
            nodes.append(n)
            touched.append(n)
    gone = [pcg.nodes[pos[i]] for i in dead if i in pos]  # (the old nodes removed)
    losing_consts = {t for n in gone for t in n.inputs} | (consts.keys() - pcg.consts.keys())
    kept_consts = {t: v for t, v in consts.items()
                   if t not in losing_consts or t in out or any(r.id not in dead for r in readers(t))}
    new = PCG(pcg.mesh, tuple(tensors), tuple(nodes), pcg.inputs, tuple(outputs), kept_consts)
    _seed_maps(at, new, gone, rerouted, [n for _, n in added if n.id not in dead], readers, dead)
    return mark_clean(new), touched


def _seed_maps(at: _Places, new: PCG, gone: list[Node], rerouted: Mapping[int, Node], fresh: list[Node],
               readers: Any, dead: set[int]) -> None:
    """Give `new` its readers and producers maps (`PCG.users`, `PCG.producer`): the parent's, where it has them, with
    the splice's changes (`gone`: the old nodes removed, `fresh`: the new nodes kept), instead of a pass over the
    nodes."""
    pcg, pos = at.pcg, at.pos
    if "_users" not in pcg.__dict__ or "_producers" not in pcg.__dict__:
        return
    producers = dict(pcg.__dict__["_producers"])
    for n in gone:
        for t in n.outputs:
            producers.pop(t, None)
    for n in (*(u for u in rerouted.values() if u.id not in dead), *fresh):
        for j, t in enumerate(n.outputs):
            producers[t] = (n, j)
    changed = {t for n in gone for t in n.inputs}
    changed.update(t for i, u in rerouted.items() for t in (*pcg.nodes[pos[i]].inputs, *u.inputs))
    changed.update(t for n in fresh for t in n.inputs)
    users = dict(pcg.__dict__["_users"])
    for t in changed:
        live = {r.id: rerouted.get(r.id, r) for r in readers(t) if r.id not in dead}
        if live:
            users[t] = sorted(live.values(), key=at.of)
        else:
            users.pop(t, None)
    new.__dict__["_users"] = users
    new.__dict__["_producers"] = producers


def _dead(at: _Places, start: Sequence[Node], out: set[int], readers: Any) -> set[int]:
    """The ids of the nodes no output needs any more, looked for from `start` (the new nodes and those making a
    replaced tensor) back through their producers, the latest first (so each node's readers are settled before
    it): a node is dead when no output is its and every reader of its results is dead."""
    def entry(n: Node) -> tuple[float, int, int, Node]:
        o, k = at.of(n)
        return -o, -k, n.id, n

    heap = [entry(n) for n in start]
    heapq.heapify(heap)
    dead: set[int] = set()
    done: set[int] = set()
    while heap:
        _, _, nid, n = heapq.heappop(heap)
        if nid in done:
            continue
        done.add(nid)
        if any(t in out or any(r.id not in dead for r in readers(t)) for t in n.outputs):
            continue
        dead.add(nid)
        for t in dict.fromkeys(n.inputs):
            p = at.maker(t)
            if p is not None and p.id not in done:
                heapq.heappush(heap, entry(p))
    return dead
