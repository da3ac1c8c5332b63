"""Rematerialization chosen by shardc: a train step's repeated layers recompute their activations in the
backward pass instead of keeping them, by a policy per layer group.

The program is the traced train step (forward, backward and update in one jaxpr). Its layers are the
repeated modules of its name stack (`Block_0` ... `Block_11` under the model: `layer_groups`). A policy
says which of a layer's forward values the backward pass keeps (`POLICIES`, as `jax.checkpoint`
policies name them):

* "none": every one (what was traced);
* "dots": the outputs of its matmuls (`dots_saveable`); the rest is recomputed;
* "dots_no_batch": the outputs of matmuls without batch dims (`dots_with_no_batch_dims_saveable`);
* "names": the values the user tagged with `checkpoint_name` (`save_only_these_names`);
* "nothing": only the layer's input (`nothing_saveable`): the whole layer is recomputed.

`rematerialize(closed_jaxpr, policies)` rewrites the program the way `jax.checkpoint` would have made it:
just before the first backward op that reads a value the layer no longer keeps, the forward ops that
make those values run again from the kept ones, behind an `optimization_barrier` that also holds a value
of the backward pass (so XLA neither merges the recomputation with the forward one nor runs it early).
The rest of the layer's backward pass reads the kept values through that barrier too, so what the forward
pass derived from them (a weight all-gathered by an FSDP plan) is not kept alive for it: it is made again.
The rewritten program is what shardc plans, simulates (the recomputation is ops like any other; the
dropped values free their memory after the forward pass) and runs. Call-like eqns are inlined first, so
the rewrite sees every op. A program that already uses `jax.checkpoint` keeps its own remat (no layer
is offered a policy) unless the user lets shardc replace it (`without_own_remat`: `remat="replace"`), and
layers inside loop bodies (`nn.scan`) are not rewritten.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax
from jax._src import source_info_util
from jax.extend import core as jcore

from shardc.ir.build import call_jaxpr
from shardc.ir.jaxpr_env import JaxprEnv, open_jaxpr, retraced

__all__ = ["inlined_layer_groups", "POLICIES", "Layer", "layer_groups", "rematerialize", "inline_calls", "uses_own_remat",
           "without_own_remat"]

POLICIES = ("none", "dots", "dots_no_batch", "names", "nothing")
_REPEATED = re.compile(r"^(.*?)_(\d+)$")
_USER_REMAT = frozenset({"remat2", "checkpoint"})


@dataclasses.dataclass(frozen=True)
class Layer:
    """One instance of a repeated module: its path in the name stack (`Block_3`, `Encoder_0/Layer_2`) and its
    group (the path with the index starred: `Block_*`)."""

    path: str
    group: str


# ------------------------------------------------------------------------------------------ inlining


def inline_calls(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """The same program with call-like eqns (jit, remat, custom_jvp/vjp calls) inlined, each eqn keeping its
    source info (name stack), loop and branch bodies left as they are."""

    def run(*args: Any) -> list[Any]:
        return _eval(closed.jaxpr, closed.consts, args, source_info_util.NameStack())

    return retraced(closed, run)


def _bind(eqn: Any, invals: Sequence[Any], prefix: Any = None) -> list[Any]:
    """Bind `eqn`'s primitive on `invals` with its source info; `prefix`: the name stack of the call it was
    inlined from (an inner eqn's own name stack is relative to its call)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    names = eqn.source_info.name_stack if prefix is None else prefix + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=names), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], prefix: Any) -> list[Any]:
    env = JaxprEnv(jaxpr, consts, args)
    for eqn in jaxpr.eqns:
        invals = env.reads(eqn.invars)
        sub = call_jaxpr(eqn)
        if sub is not None:
            outs = _eval(*open_jaxpr(sub), invals, prefix + eqn.source_info.name_stack)
        else:
            outs = _bind(eqn, invals, prefix)
        env.write(eqn.outvars, outs)
    return env.reads(jaxpr.outvars)


# ------------------------------------------------------------------------------------------ layers


def _stack(eqn: Any) -> str:
    return str(eqn.source_info.name_stack)


def _is_forward(eqn: Any) -> bool:
    return _forward_stack(_stack(eqn))


def _forward_stack(s: str) -> bool:
    return s.startswith("jvp(") and "transpose(" not in s


def _path(eqn: Any) -> list[str]:
    """The module path of an eqn: its name stack without the transformation wrappers and the model root."""
    return _path_of(_stack(eqn))


def _path_of(stack: str) -> list[str]:
    parts = [p for p in stack.split("/") if p]
    return parts[1:] if parts else []


def uses_own_remat(closed: jcore.ClosedJaxpr) -> bool:
    """Whether the program already rematerializes (`jax.checkpoint` / `nn.remat` in the user's code)."""
    def walk(jaxpr: Any) -> bool:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _USER_REMAT:
                return True
            for p in eqn.params.values():
                inner = p.jaxpr if isinstance(p, jcore.ClosedJaxpr) else p
                if isinstance(inner, jcore.Jaxpr) and walk(inner):
                    return True
        return False

    return walk(closed.jaxpr)


def without_own_remat(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """The program as if written without its `jax.checkpoint` / `nn.remat` (outside loop bodies): the remat
    calls inlined, and each recomputation merged into the forward op it repeats (`merge_repeated`), so the
    backward pass reads the forward values, which the program keeps. The same math, no recomputation."""
    if not uses_own_remat(closed):
        return closed
    return merge_repeated(inline_calls(closed))


def merge_repeated(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """The program with every eqn that repeats an earlier one (same primitive, parameters and operands, no
    effects) removed and its outputs read from the earlier eqn's (common subexpressions, at the top level)."""
    jaxpr = closed.jaxpr
    renamed: dict[Any, Any] = {}
    first: dict[tuple, list[Any]] = {}
    eqns = []
    for eqn in jaxpr.eqns:
        invars = [renamed.get(v, v) if isinstance(v, jcore.Var) else v for v in eqn.invars]
        key = _eqn_key(eqn, invars)
        if key is not None and key in first:
            renamed.update(zip(eqn.outvars, first[key]))
            continue
        if key is not None:
            first[key] = list(eqn.outvars)
        eqns.append(eqn.replace(invars=invars))
    outvars = [renamed.get(v, v) if isinstance(v, jcore.Var) else v for v in jaxpr.outvars]
    return jcore.ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), closed.consts)


def _eqn_key(eqn: Any, invars: Sequence[Any]) -> tuple | None:
    """What identifies the value `eqn` computes; None when it must not be merged (effects, or parameters that
    cannot be compared)."""
    if eqn.effects:
        return None
    operands = tuple(("var", id(v)) if isinstance(v, jcore.Var) else ("lit", repr(v.val), str(v.aval)) for v in invars)
    try:
        params = tuple(sorted(eqn.params.items()))
        hash(params)
    except TypeError:
        return None
    return eqn.primitive, params, operands


def layer_groups(closed: jcore.ClosedJaxpr) -> dict[str, list[Layer]]:
    """The repeated modules of the forward pass, by group (`Block_*` -> [Block_0, Block_1, ...]): at the
    outermost level of the module path where a name appears with two or more indices."""
    return _groups_of(_stack(eqn) for eqn in closed.jaxpr.eqns)


def inlined_layer_groups(closed: jcore.ClosedJaxpr) -> dict[str, list[Layer]]:
    """`layer_groups(inline_calls(closed))` without tracing the program again: the name stack each eqn would
    have inlined (its calls' name stacks, then its own), walked where `inline_calls` binds it."""

    def stacks(jaxpr: Any, prefix: Any) -> Any:
        for eqn in jaxpr.eqns:
            sub = call_jaxpr(eqn)
            if sub is not None:
                yield from stacks(open_jaxpr(sub)[0], prefix + eqn.source_info.name_stack)
            else:
                yield str(prefix + eqn.source_info.name_stack)

    return _groups_of(stacks(closed.jaxpr, source_info_util.NameStack()))


def _groups_of(stacks: Any) -> dict[str, list[Layer]]:
    """`layer_groups` of the eqns with these name stacks (strings), in program order."""
    seen: dict[str, dict[str, Layer]] = {}
    for stack in stacks:
        if not _forward_stack(stack):
            continue
        path = _path_of(stack)
        for depth, part in enumerate(path):
            m = _REPEATED.match(part)
            if not m:
                continue
            prefix = "/".join(path[:depth])
            group = "/".join(filter(None, (prefix, m.group(1) + "_*")))
            layer = "/".join(path[:depth + 1])
            seen.setdefault(group, {})[layer] = Layer(layer, group)
            break
    groups = {g: sorted(ls.values(), key=lambda l: _index(l.path)) for g, ls in seen.items() if len(ls) >= 2}
    # a group nested in another (Block_*/Head_*) is the outer group's business
    return {g: ls for g, ls in groups.items() if not any(g != o and g.startswith(o[:-1]) for o in groups)}


def _index(path: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", path))


def _layer_of(eqn: Any, layers: Mapping[str, Layer]) -> Layer | None:
    """The layer (by path) an eqn belongs to, if any."""
    parts = _path(eqn)
    for depth in range(1, len(parts) + 1):
        layer = layers.get("/".join(parts[:depth]))
        if layer is not None:
            return layer
    return None


# ------------------------------------------------------------------------------------------ the rewrite


def _saved_by_policy(eqn: Any, policy: str) -> bool:
    """Whether `policy` keeps the results of forward eqn `eqn` for the backward pass."""
    name = eqn.primitive.name
    if policy == "dots":
        return name == "dot_general"
    if policy == "dots_no_batch":
        return name == "dot_general" and not eqn.params["dimension_numbers"][1][0]
    if policy == "names":
        return name == "name"
    return False


@dataclasses.dataclass
class _Recompute:
    """One layer's recomputation: its forward eqns to run again (indices, in order), the values they read
    that the layer keeps, and the eqn before which it runs."""

    chain: list[int]
    kept: list[Any]
    at: int


def _plan_recompute(eqns: Sequence[Any], members: Sequence[int], policy: str) -> _Recompute | None:
    """Which forward eqns of one layer (`members`) to run again under `policy`, and where."""
    member_set = set(members)
    made_by = {v: i for i in members for v in eqns[i].outvars}
    readers: dict[Any, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var) and v in made_by:
                readers.setdefault(v, []).append(i)
    # kept: what the policy saves, and the layer's outputs that other forward code reads (the next layer's input)
    kept = {v for i in members if _saved_by_policy(eqns[i], policy) for v in eqns[i].outvars}
    for v, rs in readers.items():
        if any(r not in member_set and _is_forward(eqns[r]) for r in rs):
            kept.add(v)
    dropped = {v for v, rs in readers.items() if v not in kept and any(not _is_forward(eqns[r]) for r in rs)}
    if not dropped:
        return None
    need: set[int] = set()
    todo = [made_by[v] for v in dropped]
    while todo:
        i = todo.pop()
        if i in need:
            continue
        need.add(i)
        for v in eqns[i].invars:
            if isinstance(v, jcore.Var) and v in made_by and v not in kept:
                todo.append(made_by[v])
    chain = sorted(need)
    made = {v for i in chain for v in eqns[i].outvars}
    inputs = list(dict.fromkeys(v for i in chain for v in eqns[i].invars
                                if isinstance(v, jcore.Var) and v not in made))
    at = min(r for v in dropped for r in readers[v] if not _is_forward(eqns[r]))
    return _Recompute(chain, inputs, at)


def _after(anchor: Any, values: list[Any]) -> list[Any]:
    """`values`, made to depend on `anchor` (a value of the backward pass) so that nothing computed from them
    can run before the backward pass reaches it, nor be merged with the forward pass's computation of the
    same: an `optimization_barrier` (what `jax.checkpoint` uses; XLA:CPU removes barriers before its last
    CSE and schedules by data dependence alone), and for floating values a data dependence XLA cannot
    simplify away: `v + 0 * s`, with s a finite scalar of the anchor (so exactly `v`)."""
    if anchor is None:
        return list(jax.lax.optimization_barrier(values))
    fenced = jax.lax.optimization_barrier(values + [anchor])
    values, anchor = fenced[:-1], fenced[-1]
    s = jax.lax.reshape(jax.lax.slice(anchor, (0,) * anchor.ndim, (1,) * anchor.ndim), ()) if anchor.ndim else anchor
    if not jax.numpy.issubdtype(s.dtype, jax.numpy.floating):
        return list(values)
    zero = jax.numpy.where(jax.numpy.isfinite(s), s, 0) * 0
    return [v + zero.astype(v.dtype) if jax.numpy.issubdtype(v.dtype, jax.numpy.floating) else v for v in values]


def rematerialize(closed: jcore.ClosedJaxpr, policies: Mapping[str, str]) -> jcore.ClosedJaxpr:
    """The program with each layer of group g recomputing in the backward pass what `policies[g]` does not
    keep (groups not named, or "none", keep everything). `closed` must have its calls inlined
    (`inline_calls`)."""
    eqns = closed.jaxpr.eqns
    groups = layer_groups(closed)
    by_path = {l.path: l for g, ls in groups.items() if policies.get(g, "none") != "none" for l in ls}
    members: dict[str, list[int]] = {}
    for i, eqn in enumerate(eqns):
        if _is_forward(eqn):
            layer = _layer_of(eqn, by_path)
            if layer is not None:
                members.setdefault(layer.path, []).append(i)
    plans: dict[int, list[_Recompute]] = {}
    for path, idx in members.items():
        rc = _plan_recompute(eqns, idx, policies[by_path[path].group])
        if rc is not None:
            plans.setdefault(rc.at, []).append(rc)
    if not plans:
        return closed
    made_backward = {v for e in eqns if "transpose(" in _stack(e) for v in e.outvars}
    layer_path = {rc.at: path for path, idx in members.items()
                  for rc in [r for rs in plans.values() for r in rs if r.chain[0] in idx]}
    backward_layer = [_layer_of(e, by_path).path if "transpose(" in _stack(e) and _layer_of(e, by_path) else None
                      for e in eqns]

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = {}
        later: dict[Any, Any] = {}  # a dropped value -> its recomputed version (for backward readers)
        fenced: dict[str, dict[Any, Any]] = {}  # layer -> its kept values as its own backward pass reads them

        def read(v: Any, backward: bool, layer: str | None) -> Any:
            if isinstance(v, jcore.Literal):
                return v.val
            if not backward:
                return env[v]
            own = fenced.get(layer, {}) if layer is not None else {}
            return own.get(v, later.get(v, env[v]))

        for var, c in zip(closed.jaxpr.constvars, closed.consts):
            env[var] = c
        for var, a in zip(closed.jaxpr.invars, args):
            env[var] = a
        for i, eqn in enumerate(eqns):
            backward = not _is_forward(eqn)
            for rc in plans.get(i, ()):
                # a value of the backward pass: the recomputation waits for the backward pass to reach it
                anchor = next((read(v, True, None) for v in eqn.invars if isinstance(v, jcore.Var)
                               and v in made_backward), None)
                local = dict(zip(rc.kept, _after(anchor, [env[v] for v in rc.kept])))
                # the layer's own backward pass reads the kept values anew too (its weights, its input): what
                # the forward pass made from them (an all-gathered weight) is not kept for it
                fenced[layer_path[i]] = dict(local)
                for j in rc.chain:
                    e = eqns[j]
                    outs = _bind(e, [v.val if isinstance(v, jcore.Literal) else local.get(v, env[v])
                                     for v in e.invars])
                    for var, val in zip(e.outvars, outs):
                        local[var] = val
                        later[var] = val
            outs = _bind(eqn, [read(v, backward, backward_layer[i]) for v in eqn.invars])
            for var, val in zip(eqn.outvars, outs):
                env[var] = val
        return [read(v, True, None) for v in closed.jaxpr.outvars]

    return retraced(closed, run)
