"""The substitution engine under the fuzzer: a generated program's plan becomes a PCG, random proved rewrites
are applied to it, and its `shard_map` lowering must compute what the unsharded program computes with the
collectives the PCG names (issue 18: "the fuzzer runs with the engine on").

The rewrites are drawn at random (seeded), not chosen by the simulator: the engine's correctness — matching,
applying, the proofs, the lowering — must not depend on which rewrites happen to pay. `shardc.auto(pcg=True)`
runs the same lowering for the PCG it chooses (`shardc.pcg.choice.jit_pcg`).
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import jax

import fuzzlib
import shardc
from annotations.errors import ShardingError
from shardc.pcg import hlo_collectives
from shardc.pcg.carries import partial_carries
from shardc.pcg.choice import jit_pcg
from shardc.pcg.library import all_rules
from shardc.pcg.match import RewriteError, apply_match, find_matches
from shardc.pcg.optimize import usable_rules
from shardc.pcg.refine import refined_pcg
from shardc.pcg.verify import verify_rule

__all__ = ["PCGOutcome", "check_pcg"]


@dataclasses.dataclass(frozen=True)
class PCGOutcome:
    """What one engine check did: the rewrites applied (rule names, in order), the PCG's size, and why the
    program has no PCG (`unsupported`: the builder's ShardingError, as `shardc.auto(pcg=True)` then runs the
    plan as it is)."""

    rewrites: tuple[str, ...] = ()
    nodes: int = 0
    collectives: int = 0
    unsupported: str | None = None
    rounding: bool = False
    merged: int = 0  # collectives the rewritten PCG names that XLA merged away (see `check_pcg`)


def _reverse(name: str) -> str:
    return name[:-len("~rev")] if name.endswith("~rev") else name + "~rev"


def _random_rewrite(pcg: Any, rng: random.Random, rules: list[Any], last: str | None = None
                    ) -> tuple[Any, str] | None:
    """One proved rewrite of `pcg` chosen at random among every rule's first few matches (not the reverse of
    the `last` one applied, which would undo it), or None."""
    order = [r for r in rules if last is None or r.name != _reverse(last)]
    rng.shuffle(order)
    for rule in order:
        matches = list(itertools.islice(find_matches(pcg, rule), 4))
        if not matches or not verify_rule(rule).proved:  # (proved when it first matches, as `optimize` does)
            continue
        rng.shuffle(matches)
        for m in matches:
            try:
                return apply_match(pcg, m), rule.name
            except RewriteError:
                continue
    return None


def _check_results(reference: Any, args: Any, got: Any, what: str, hlo: str) -> bool:
    """Assert `got` equals the unsharded reference (within float32 tolerance, or no less accurate than it
    against a float64 run, or differing only where XLA's simplifier is not IEEE-exact on NaN/inf in the
    unsharded program, or where XLA:CPU's max/min all-reduce, in `hlo`, drops a NaN); returns whether they
    differed at all."""
    ref = jax.jit(reference)(*args)
    try:
        fuzzlib._results_close(got, ref, what)
        return False
    except fuzzlib.FuzzFailure:
        if fuzzlib._as_accurate_as_unsharded(reference, args, got, ref) \
                or fuzzlib.xla_semantics_difference(reference, args, got, ref, lambda: hlo) is not None:
            return True
        raise


def check_pcg(prog: fuzzlib.Program, seed: int = 0, rewrites: int = 3, search: bool = False) -> PCGOutcome:
    """Plan `prog` (its hints, no search; with `search`, the strategy search's plan on its mesh, as
    `fuzzlib.check_program(search=True)`), build its PCG (`fuse` drawn at random), apply up to `rewrites`
    random proved rewrites, and assert that the PCG's lowering (as `shardc.auto(pcg=True)` runs a chosen
    PCG) equals the unsharded program and compiles to the collectives the PCG names, kind by kind (after
    rewrites: to no more than it names)."""
    rng = random.Random(seed)
    fun = fuzzlib.program_function(prog)
    reference = fuzzlib.program_function(prog, reference=True)
    args = fuzzlib.make_args(prog, seed)
    mesh = shardc.make_mesh(dict(prog.mesh))
    info = fuzzlib.planned(fun, mesh, seed, search).compiled_info(*args)
    try:
        # (as `choose_pcg` builds it: on the plan's mesh with axes split where XLA's collectives act on part of one)
        pcg = refined_pcg(info.plan, info.closed_jaxpr, fuse=rng.random() < 0.5)
    except ShardingError as e:
        return PCGOutcome(unsupported=str(e).splitlines()[0])
    applied: list[str] = []
    if rng.random() < 0.5:  # (as `choose_pcg` tries first: accumulating scan carries as partial sums)
        pcg, loops = partial_carries(pcg, reduce_scatter=rng.random() < 0.5)
        applied += ["partial_sum_carry"] * len(loops)
    rules = usable_rules(all_rules())
    for _ in range(rewrites):
        step = _random_rewrite(pcg, rng, rules, applied[-1] if applied else None)
        if step is None:
            break
        pcg, name = step
        applied.append(name)
    flat = jax.tree.leaves(args)
    jitted = jit_pcg(info.plan, pcg)
    compiled = jitted.lower(*flat).compile()
    got = compiled(*flat)
    # (the PCG's outputs are the plan's flat outputs; the reference's leaves in the same order)
    hlo = compiled.as_text()
    rounding = _check_results(reference, args, got, f"PCG after {applied or 'no rewrite'}", hlo)
    want = {k: v for k, v in pcg.collectives().items() if v}
    have = {k: v for k, v in hlo_collectives(hlo).items() if v}
    # Unrewritten, the PCG is the plan: its collectives exactly. Rewritten, a rewrite may compute one value
    # twice in two algebraically equal ways (a sum of a broadcast beside a dot), which XLA's simplifier then
    # merges with their collectives: the PCG over-counts (prices more than runs), but the compiled program
    # has no collective the PCG does not name.
    if have != want and (not applied or any(have.get(k, 0) > want.get(k, 0) for k in have)):
        raise fuzzlib.FuzzFailure(f"PCG after {applied}: compiled collectives {have}, the PCG names {want}")
    merged = sum(want.values()) - sum(have.values())
    return PCGOutcome(tuple(applied), len(pcg.nodes), sum(want.values()), None, rounding, merged)
