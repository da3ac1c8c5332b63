"""Screening a rewrite of a large PCG by simulating only the part of the program around it.

A full simulation of a 12-layer GPT's PCG (~6,000 nodes) takes about a second, and the rewriting tries a few
dozen candidates per searched mesh. Most rewrites change a handful of nodes: the neighbourhood of the match
(nodes within `RADIUS` producer/reader links of it, loop and branch regions left out) is cut out as a PCG of its
own, before and after the rewrite, whose boundary tensors become its inputs and outputs; the difference of the two
simulated step times is the rewrite's *local gain*. It only orders and filters candidates: a rewrite is kept only
after a full simulation says the step gets faster (`shardc.pcg.optimize`), so what the screening gets wrong costs
a simulation or a missed rewrite, never a slower plan. What it cannot see: effects that reach beyond the
neighbourhood (an all-reduce XLA would combine with a distant one, overlap with another layer's compute).
"""
from __future__ import annotations

from typing import Callable, Collection

from shardc.pcg.graph import PCG, Node

__all__ = ["RADIUS", "neighbourhood", "sub_pcg", "local_gain", "rewired"]

RADIUS = 3  # producer/reader links around a match (on the 12-layer GPT, 3 orders its rewrites as full simulation)

NodeKey = tuple[int, ...]  # a node by the tensors it makes: the same in the PCGs before and after a rewrite


def neighbourhood(pcg: PCG, nodes: Collection[int], radius: int = RADIUS) -> set[NodeKey]:
    """The nodes (by output tensors) within `radius` links of the nodes with ids `nodes`, regions excepted."""
    by_outputs = {n.outputs: n for n in pcg.nodes}
    frontier = {n.outputs for n in pcg.nodes if n.id in nodes}
    found = set(frontier)
    for _ in range(radius):
        reached: set[NodeKey] = set()
        for key in frontier:
            n = by_outputs[key]
            for t in n.inputs:
                made = pcg.producer(t)
                if made is not None and not made[0].is_region:
                    reached.add(made[0].outputs)
            reached.update(u.outputs for t in n.outputs for u in pcg.users(t) if not u.is_region)
        frontier = reached - found
        found |= frontier
    return found


def sub_pcg(pcg: PCG, keep: Collection[NodeKey]) -> PCG:
    """The nodes of `pcg` in `keep` as a PCG of their own: its inputs are the tensors they read and do not make
    (constants stay constants), its outputs those they make that another node reads or `pcg` returns."""
    keep = set(keep)
    nodes = tuple(n for n in pcg.nodes if n.outputs in keep)
    made = {t for n in nodes for t in n.outputs}
    inputs: dict[int, None] = {}
    for n in nodes:
        inputs.update((t, None) for t in n.inputs if t not in made and t not in pcg.consts)
    returned = set(pcg.outputs)
    outputs = tuple(t for n in nodes for t in n.outputs
                    if t in returned or any(u.outputs not in keep for u in pcg.users(t)))
    read = {t for n in nodes for t in n.inputs}
    consts = {t: v for t, v in pcg.consts.items() if t in read}
    return PCG(pcg.mesh, pcg.tensors, nodes, tuple(inputs), outputs, consts)


def local_gain(before: PCG, after: PCG, match_nodes: Collection[int], step_time: Callable[[PCG], float],
               radius: int = RADIUS) -> float | None:
    """How much faster (seconds) `step_time` finds the neighbourhood of a rewrite (of the nodes with ids
    `match_nodes` of `before`) in `after` than in `before`; None when the match has a region node (a loop's
    body is no neighbourhood). `after`'s part is the same nodes where they are left, and the nodes the rewrite
    built or rewired."""
    ids = set(match_nodes)
    if any(n.is_region for n in before.nodes if n.id in ids):
        return None
    changed = {n.outputs for n in rewired(before, after)}
    if any(n.is_region for n in after.nodes if n.outputs in changed):
        return None
    hood = neighbourhood(before, ids, radius)
    return step_time(sub_pcg(before, hood)) - step_time(sub_pcg(after, hood | changed))


def rewired(before: PCG, after: PCG) -> list[Node]:
    """The nodes of `after` that `before` has not: those rewrites since built, and those reading a replaced result
    (a rule whose right side is one of its variables rewires its readers to a tensor `before` has already). By
    object: a rewrite (`apply_match`) keeps the node objects it leaves as they are and makes new ones for the rest."""
    was = {id(n) for n in before.nodes}
    return [n for n in after.nodes if id(n) not in was]
