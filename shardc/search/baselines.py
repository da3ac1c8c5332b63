"""Baseline strategies as seeds (priority 1, under the user's hints): data parallel, FSDP/ZeRO-3, Megatron
tensor parallel + data parallel, expert parallel, and the user's hints alone.

Inputs are told apart by the graph: an input tied to an output (carried train-step state: params,
optimizer state) is *state*; any other input is *data* (its dim 0 is the batch).

In a pipelined program (`shardc.pipeline`) the stage axis is the pipeline's: every baseline runs inside a
stage, on the mesh without the stage axis, and the stacked per-layer state (dim 0 = the stack's layers:
parameters and their optimizer moments) has its layer dim over the stage axis, so each stage keeps its own
layers where the pipeline loop reads them. Megatron there is Megatron-LM's 3-D parallelism — stages over
the stage axis (the slowest level), tensor parallel on the innermost axis, data parallel on the rest —
reported as `megatron-3d`.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

from shardc.ir.graph import Graph
from shardc.propagate import Cause, Seed

__all__ = ["BASELINES", "baseline_seeds", "stacked_state", "baseline_plan", "state_inputs", "data_inputs",
           "parameter_inputs", "role_mixes", "storage_mixes", "consistent_carry", "COMPUTE_OF", "expert_weights",
           "scanned_state", "embed_size", "input_priority", "COMPUTE_PRIORITY", "STORAGE_PRIORITY"]

# Seed priorities of the search's own seeds (the user's are 0). The layouts that decide where the compute runs
# -- the batch, the experts, the ops the search decides -- are propagated first; the carried state's storage
# layout after them, so that where the two disagree the state is resharded (an FSDP weight gathered where it
# is used), not the activations (a batch-split activation re-split along the weight's sharded dim).
COMPUTE_PRIORITY = 1
STORAGE_PRIORITY = 2

Axes = tuple[str, ...]
# the argument a flattened input's path starts with: its parameter name (params[...]) or index ([0][...])
_ARG = re.compile(r"^(\[\d+\]|[A-Za-z_]\w*)")
# ... and the attributes that follow it (`state.params['w']`: a TrainState's parameters), leaving the path
# inside the parameter tree that the optimizer state repeats (`state.opt_state[0].mu['w']`)
_PREFIX = re.compile(r"^(\[\d+\]|[A-Za-z_]\w*)(\.[A-Za-z_]\w*)*")
_ROW = re.compile(r"(out|o_proj|\bo\b|'o'|down|wo\b|fc2|c_proj|proj_out|dense_?1)", re.I)


def state_inputs(graph: Graph) -> list[int]:
    """Graph inputs carried to the next step (tied to an output)."""
    carried = graph.carried()
    return [v for v in graph.inputs if v in carried]


def consistent_carry(graph: Graph, plan) -> bool:
    """Every carried input and its next value have the same sharding (the next step needs no reshard)."""
    return all(plan.shardings[a] == plan.shardings[b] for a, b in graph.carried().items())


def parameter_inputs(graph: Graph) -> list[int]:
    """Carried inputs on which the step's other outputs (the loss, metrics) depend: the parameters (and
    statistics such as BatchNorm's). The other carried inputs (optimizer moments, step counters) only feed
    their own updates."""
    tied = set(graph.carried().values())
    writers = _writers(graph)
    needed: set[int] = set()
    stack = [v for v in graph.outputs if v not in tied]
    while stack:
        v = stack.pop()
        if v not in needed:
            needed.add(v)
            for op in writers.get(v, ()):
                stack.extend(graph.ops[op].inputs)
    return [v for v in state_inputs(graph) if v in needed]


def _writers(graph: Graph) -> dict[int, list[int]]:
    """The ops that write each value: its producer and, for a loop's carry, the tie that feeds it the
    previous iteration's result (`Value.producer` records only the first, the tie from outside the loop)."""
    def compute() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for op in graph.ops:
            if op.region == "io":
                continue  # (a carried input's next value is not what made it)
            for v in op.outputs:
                out.setdefault(v, []).append(op.id)
        return out
    return graph.analysis("baseline_writers", compute)


def role_mixes(graph: Graph, seed_sets: Mapping[str, Sequence[Seed]]) -> list[tuple[str, list[Seed]]]:
    """For each ordered pair of baselines (name -> its seeds on one mesh), two kinds of mix:

    * in a program with experts (`expert_weights`), the first's seeds for the expert weights (and their
      moments), the second's for everything else: expert parallelism's experts with FSDP's dense state is
      GShard's layout with ZeRO-3 for the rest (tokens over the data axes, experts over the expert axis);
    * the first's seeds for the parameters and the data, the second's for the rest of the carried state.
      Data parallel's parameters with FSDP's optimizer state is ZeRO-1/2 (parameters replicated for compute,
      moments sharded, gradients reduce-scattered, updated parameters all-gathered); Megatron's with FSDP's
      is Megatron + ZeRO-1.

    These mix whole roles at once, which one-decision moves (MCMC) and per-group mixing (the DP) reach only
    one group at a time. Returns (label, seeds), the expert mixes first, then in the order of `seed_sets` (the
    driver ranks the baselines fastest first); a mix with the same seeds as another or as a baseline itself
    is left out."""
    params = set(parameter_inputs(graph))
    rest = set(state_inputs(graph)) - params
    experts = set(expert_weights(graph))
    inputs = set(graph.inputs)
    # layouts of the computation itself (expert parallelism's GShard einsums) go with the experts' and the
    # parameters' role: they are where those compute
    compute = {s.value for seeds in seed_sets.values() for s in seeds if s.value not in inputs}
    roles: list[tuple[set[int], str, str]] = []  # (values the first baseline seeds, its role, the other's)
    if experts:
        roles.append((experts | compute, "experts", "rest"))
    if params and rest:
        roles.append(((inputs - rest) | compute, "parameters", "state"))
    tied = graph.carried()

    def key_of(seeds: list[Seed]) -> tuple:
        # (a dim a seed leaves open is None: ordered before any axes, so seeds of one value compare)
        return tuple(sorted((s.value, tuple(() if d is None else (tuple(d),) for d in s.dims), s.priority)
                            for s in seeds))

    out: list[tuple[str, list[Seed]]] = []
    seen: set[tuple] = {key_of(sa) for sa in seed_sets.values()}
    for first, role_a, role_b in roles:
        for a, sa in seed_sets.items():
            for b, sb in seed_sets.items():
                if a == b:
                    continue
                seeds = [s for s in sa if s.value in first] + [s for s in sb if s.value not in first]
                key = key_of(seeds)
                # the next step's state seeded like this one, so propagation lays out the update for it (the
                # plan would keep the carried layout anyway, resharding the result at the end)
                seeds += [Seed(tied[s.value], s.dims, s.cause, s.priority) for s in seeds if s.value in tied]
                if key in seen or not seeds:
                    continue
                seen.add(key)
                out.append((f"{a} {role_a} + {b} {role_b}", seeds))
    return out


def input_priority(graph: Graph, v: int) -> int:
    """The priority of a search seed on graph input `v`: `STORAGE_PRIORITY` for carried state, but for the
    expert weights and their moments (`expert_weights`: their expert dim is a batch dim of the einsum they
    feed, so their layout is where the experts compute, as the batch's is where the tokens do);
    `COMPUTE_PRIORITY` for the rest (the data)."""
    storage = graph.analysis("storage_inputs", lambda: frozenset(state_inputs(graph)) - frozenset(expert_weights(graph)))
    return STORAGE_PRIORITY if v in storage else COMPUTE_PRIORITY


def _seed(graph: Graph, v: int, dims: Sequence[Axes | None], name: str) -> Seed:
    return Seed(v, tuple(dims), _cause(name), input_priority(graph, v))


def storage_mixes(graph: Graph, plans: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Ordered pairs (a, b) of baseline names (-> their plans on one mesh) where `a` stores the carried state
    strictly more sharded than `b` does: on every dim, `b`'s axes are a prefix of `a`'s. `a`'s storage with
    `b`'s compute (the search's point with `a`'s state inputs and `b`'s choices for the rest) is the FSDP of
    `b`: ZeRO-3 when `b` is data parallel; FSDP x tensor parallel (MaxText's 2-D layout) when `b` is Megatron
    and `a` adds the data axes to each weight (`fsdp-tp`). Seeding `a`'s layout alone lets the weights' axes
    reach the activations first (an embedding table split on its embed dim takes the batch's axis from the
    lookup), which is not what FSDP computes."""
    state = state_inputs(graph)

    def layout(name: str) -> list[tuple[Axes, ...]]:
        return [tuple(plans[name].shardings[v].dims) for v in state]

    def refines(a: list, b: list) -> bool:
        return a != b and all(tuple(db) == tuple(da[:len(db)]) for sa, sb in zip(a, b) for da, db in zip(sa, sb))
    layouts = {n: layout(n) for n in plans}
    return [(a, b) for a in plans for b in plans if a != b and refines(layouts[a], layouts[b])]


def data_inputs(graph: Graph) -> list[int]:
    state = set(state_inputs(graph))
    return [v for v in graph.inputs if v not in state and graph.values[v].rank >= 1]


def _fit(axes: Sequence[str], size: int, mesh: Mapping[str, int]) -> Axes:
    """The longest prefix of `axes` whose device count divides `size`."""
    out: list[str] = []
    n = 1
    for a in axes:
        if mesh[a] > 1 and size % (n * mesh[a]) == 0:
            out.append(a)
            n *= mesh[a]
    return tuple(out)


def _fit_batch(axes: Sequence[str], size: int, mesh: Mapping[str, int]) -> Axes:
    """The axes a batch of `size` splits over: the set of `axes` over the most devices that divides it and,
    among sets as large, the innermost (the last axes of the mesh lie inside a node: a batch of 32 on
    `data=8` (across nodes) x `model=8` (inside) splits over `model`, so that its gradients are reduced
    over the fast links). When every axis fits, all of them, as `_fit` gives."""
    order = {a: i for i, a in enumerate(mesh)}
    usable = [a for a in axes if mesh[a] > 1]
    best: tuple = ()
    best_key = (1, ())
    for mask in range(1, 1 << len(usable)):
        chosen = tuple(a for i, a in enumerate(usable) if mask >> i & 1)
        n = math.prod(mesh[a] for a in chosen)
        if size % n:
            continue
        key = (n, tuple(sorted((order[a] for a in chosen), reverse=True)))
        if key > best_key:
            best, best_key = chosen, key
    return best


def _cause(name: str) -> Cause:
    return Cause("baseline", f"{name} baseline")


def _batch(graph: Graph, mesh: Mapping[str, int], axes: Sequence[str], name: str) -> list[Seed]:
    seeds = []
    for v in data_inputs(graph):
        val = graph.values[v]
        dims: list[Axes | None] = [None] * val.rank
        dims[0] = _fit_batch(axes, val.shape[0], mesh)
        seeds.append(Seed(v, tuple(dims), _cause(name), COMPUTE_PRIORITY))
    return seeds


def _replicated_state(graph: Graph, name: str) -> list[Seed]:
    return [_seed(graph, v, [() for _ in graph.values[v].shape], name) for v in state_inputs(graph)]


def data_parallel(graph: Graph, mesh: Mapping[str, int]) -> list[Seed]:
    """Batch over every mesh axis; parameters and optimizer state replicated."""
    return _batch(graph, mesh, list(mesh), "data-parallel") + _replicated_state(graph, "data-parallel")


def fsdp(graph: Graph, mesh: Mapping[str, int]) -> list[Seed]:
    """ZeRO-3: batch over every axis; each piece of state sharded over every axis on its largest divisible
    dim (gathered where it is used), never on the scanned dim of a scan's stacked state (`scanned_state`:
    each iteration reads the whole of it)."""
    seeds = _batch(graph, mesh, list(mesh), "fsdp")
    scanned = set(scanned_state(graph))
    for v in state_inputs(graph):
        val = graph.values[v]
        dims: list[Axes] = [() for _ in val.shape]
        for d in sorted(range(int(v in scanned), val.rank), key=lambda d: -val.shape[d]):
            ax = _fit(list(mesh), val.shape[d], mesh)
            if ax:
                dims[d] = ax
                break
        seeds.append(_seed(graph, v, dims, "fsdp"))
    return seeds


def _split_axes(mesh: Mapping[str, int]) -> tuple[list[str], str | None]:
    """(data axes, model axis): the last axis of size > 1 is the model axis when there are two or more."""
    big = [a for a in mesh if mesh[a] > 1]
    if len(big) < 2:
        return big, None
    return big[:-1], big[-1]


def megatron(graph: Graph, mesh: Mapping[str, int], stacked: Sequence[int] | None = None,
             axes: tuple[list[str], str | None] | None = None) -> list[Seed]:
    """Tensor parallel on the last mesh axis (column-parallel for expanding/input projections, row-parallel
    for output/down projections, chosen by name then by shape; an N-d kernel such as attention's
    (embed, heads, head_dim) or (heads, head_dim, embed) split on its first dim that is not the model
    width, `embed_size`: its heads; other N-d state, such as conv kernels and expert stacks, on its last dim;
    a 2-D table no dot reads on the dim a gather indexes (vocab-parallel embedding), or replicated when it
    is broadcast and added to the activations (position embeddings))
    with data parallel on the others (`axes`: (data axes, model axis)
    chosen otherwise). The `stacked` inputs' dim 0 is a layer dim (a stack of per-layer matrices), not a
    matrix dim (default: a scan's stacked state, `scanned_state`)."""
    data, model = _split_axes(mesh) if axes is None else axes
    seeds = _batch(graph, mesh, data, "megatron")
    if model is None:
        return seeds
    stacked = set(scanned_state(graph) if stacked is None else stacked)
    embed = embed_size(graph, stacked)
    experts, matrices, tables = set(expert_weights(graph)), _matrices(graph), _tables(graph)
    added = _added_tables(graph)
    for v in state_inputs(graph):
        val = graph.values[v]
        lead = 1 if v in stacked else 0  # a stacked layer dim is not a matrix dim
        shape = val.shape[lead:]
        dims: list[Axes] = [() for _ in val.shape]
        if len(shape) == 2 and v not in matrices and (v in tables or v in added):
            # not a projection: an embedding table is vocab-parallel (split on the dim its lookup indexes); a
            # table broadcast over the batch and added to the activations (position embeddings) stays
            # replicated, as in Megatron-LM: split on the model width it would split the residual stream, and
            # the attention output projection would compute column-parallel with its input gathered
            d = tables.get(v)
            if d is not None and d >= lead and shape[d - lead] % mesh[model] == 0:
                dims[d] = (model,)
        elif len(shape) == 2:
            d_in, d_out = shape
            row = bool(_ROW.search(_ARG.sub("", val.name or "", count=1))) or d_in > d_out
            d = 0 if row else 1
            if shape[d] % mesh[model] == 0:
                dims[lead + d] = (model,)
        elif len(shape) >= 3 and (v in experts or v not in matrices):  # expert stacks, conv kernels: last dim
            if shape[-1] % mesh[model] == 0:
                dims[-1] = (model,)
        elif len(shape) >= 3:
            d = next((d for d, n in enumerate(shape) if n != embed and n % mesh[model] == 0), None)
            if d is not None:
                dims[lead + d] = (model,)
        seeds.append(_seed(graph, v, dims, "megatron"))
    return seeds


def fsdp_tp(graph: Graph, mesh: Mapping[str, int]) -> list[Seed] | None:
    """2-D: Megatron's tensor parallel on the last mesh axis and FSDP (ZeRO-3) over the others, as MaxText's
    rules give (`embed -> fsdp`, `mlp`/`heads`/`vocab -> tensor`): the batch over the data axes, each piece
    of state split as Megatron splits it and also over the data axes on its largest other divisible dim
    (a projection's embed dim), never on a stacked layer dim; vectors (norm scales, biases) keep Megatron's
    layout, as MaxText's `norm -> None` (a few bytes saved per device would cost a collective at each use).
    None on a one-axis mesh."""
    data, model = _split_axes(mesh)
    if model is None or not data:
        return None
    stacked = set(scanned_state(graph))
    state = set(state_inputs(graph))
    out = []
    for s in megatron(graph, mesh, stacked):
        if s.value not in state:
            out.append(Seed(s.value, s.dims, _cause("fsdp-tp"), s.priority))
            continue
        val = graph.values[s.value]
        dims = list(s.dims)
        lead = int(s.value in stacked)
        for d in sorted(range(lead, val.rank if val.rank - lead >= 2 else 0), key=lambda d: -val.shape[d]):
            ax = () if dims[d] else _fit(data, val.shape[d], mesh)
            if ax:
                dims[d] = ax
                break
        out.append(Seed(s.value, tuple(dims), _cause("fsdp-tp"), s.priority))
    return out


def scanned_state(graph: Graph) -> list[int]:
    """Carried inputs that are a stack of per-iteration state of a scan (`nn.scan`'s stacked layer
    parameters): dim 0 is the scanned dim of a `scan_slice` they feed (directly or through a dtype cast or
    hint), and their optimizer moments (same shape, a path ending in the parameter's)."""
    def compute() -> list[int]:
        users = _users(graph)

        def sliced(v: int, depth: int = 0) -> bool:
            return any(op.primitive == "scan_slice" or (op.primitive in _PASS_THROUGH and depth < 3
                                                        and sliced(op.outputs[0], depth + 1))
                       for op, _ in users.get(v, ()))
        state = state_inputs(graph)
        return _with_moments(graph, [v for v in state if graph.values[v].rank >= 1 and sliced(v)])
    return graph.analysis("baseline_scanned_state", compute)


def _matrices(graph: Graph) -> set[int]:
    """Carried inputs a dot_general reads (directly or through a dtype cast, a hint or a scan's slice), and
    their optimizer moments: the matrices of projections (not conv kernels, norms or counters)."""
    users = _users(graph)

    def feeds_dot(v: int, depth: int = 0) -> bool:
        return any(op.primitive == "dot_general" or (op.primitive in _PASS_THROUGH | {"scan_slice"} and depth < 3
                                                     and feeds_dot(op.outputs[0], depth + 1))
                   for op, _ in users.get(v, ()))
    return graph.analysis("baseline_matrices", lambda: set(_with_moments(
        graph, [v for v in state_inputs(graph) if graph.values[v].rank >= 2 and feeds_dot(v)])))


def _tables(graph: Graph) -> dict[int, int]:
    """Carried inputs a gather looks rows up in (an embedding table: read directly or through a dtype cast
    or a hint), with the dim it indexes, and their optimizer moments with the same dim."""
    def compute() -> dict[int, int]:
        def indexed(v: int) -> int | None:
            for op, i in _reads_through_casts(graph, v):
                if op.primitive == "gather" and i == 0:
                    index_map = tuple(op.params["dimension_numbers"].start_index_map)
                    if len(index_map) == 1:
                        return index_map[0]
            return None
        found = {v: d for v in state_inputs(graph) if (d := indexed(v)) is not None}
        out: dict[int, int] = {}
        for v, d in found.items():
            for w in _with_moments(graph, [v]):
                out.setdefault(w, d)
        return out
    return graph.analysis("baseline_tables", compute)


_BROADCAST = frozenset({"broadcast_in_dim", "reshape"})


def _added_tables(graph: Graph) -> set[int]:
    """Carried inputs broadcast to more dims (over the batch) and added to the activations, as position
    embeddings are (directly or through a dtype cast or a hint), and their optimizer moments. (A parameter's
    own update is an add of its shape: not one of these.)"""
    def compute() -> set[int]:
        users = _users(graph)

        def added(v: int, rank: int, grown: bool, depth: int = 0) -> bool:
            for op, _ in users.get(v, ()):
                if op.primitive in ("add", "add_any") and grown:
                    return True
                if (op.primitive in _PASS_THROUGH | _BROADCAST) and depth < 3:
                    out = op.outputs[0]
                    if added(out, rank, grown or graph.values[out].rank > rank, depth + 1):
                        return True
            return False
        return set(_with_moments(graph, [v for v in state_inputs(graph) if graph.values[v].rank >= 1
                                         and added(v, graph.values[v].rank, False)]))
    return graph.analysis("baseline_added_tables", compute)


def embed_size(graph: Graph, stacked: Sequence[int] = ()) -> int | None:
    """The model width: the size that most matrices (state of rank >= 2 that a dot_general reads, a stacked
    layer dim left out) have among their dims (every projection of a Transformer reads or writes it), the
    smaller on a tie; None without matrices."""
    stacked, matrices = set(stacked), _matrices(graph)
    count: dict[int, int] = {}
    for v in state_inputs(graph):
        shape = graph.values[v].shape[int(v in stacked):]
        if len(shape) >= 2 and v in matrices:
            for n in set(shape):
                count[n] = count.get(n, 0) + 1
    return min(count, key=lambda n: (-count[n], n)) if count else None


_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p", "shardc_hint", "sharding_constraint"})


def _users(graph: Graph) -> dict[int, list]:
    """Each value's (op, operand index) uses."""
    def compute() -> dict[int, list]:
        users: dict[int, list] = {}
        for op in graph.ops:
            for i, v in enumerate(op.inputs):
                users.setdefault(v, []).append((op, i))
        return users
    return graph.analysis("baseline_users", compute)


def _with_moments(graph: Graph, weights: Sequence[int]) -> list[int]:
    """The state inputs among `weights` and their optimizer state (Adam's moments: same shape, a path ending
    in the weight's path)."""
    paths = {(graph.values[v].shape, _PREFIX.sub("", graph.values[v].name or "", count=1)) for v in weights}
    return [v for v in state_inputs(graph) if v in weights or any(
        graph.values[v].shape == shape and path and (graph.values[v].name or "").endswith(path)
        for shape, path in paths)]


def expert_weights(graph: Graph) -> list[int]:
    """Carried inputs that are a stack of per-expert weights: rank 3 or more, and dim 0 is a batch dim of a
    dot_general they feed (`EGCM,EMH->EGCH`: each expert's tokens meet that expert's matrix), directly or
    through a dtype cast or a hint. A (d_model, heads, head_dim) attention kernel is rank 3 too, but its
    dim 0 is contracted."""
    return graph.analysis("baseline_expert_weights", lambda: _expert_weights(graph))


def _reads_through_casts(graph: Graph, v: int) -> list[tuple[Any, int]]:
    """The ops that read `v`, directly or through up to three dtype casts or hints (`_PASS_THROUGH`, not
    listed themselves), with the operand index they read it at, in depth-first program order of users."""
    users = _users(graph)
    out: list[tuple[Any, int]] = []

    def walk(w: int, depth: int) -> None:
        for op, i in users.get(w, ()):
            if op.primitive in _PASS_THROUGH:
                if depth < 3:
                    walk(op.outputs[0], depth + 1)
            else:
                out.append((op, i))

    walk(v, 0)
    return out


def _batched_dim0_dots(graph: Graph, v: int) -> list[tuple[Any, int]]:
    """The dot_generals `v` feeds, directly or through a dtype cast or a hint, with its dim 0 a batch dim of
    theirs: (op, operand index)."""
    return [(op, i) for op, i in _reads_through_casts(graph, v)
            if op.primitive == "dot_general" and i < 2 and 0 in op.params["dimension_numbers"][1][i]]


def _expert_weights(graph: Graph) -> list[int]:
    state = state_inputs(graph)
    return _with_moments(graph, [v for v in state if graph.values[v].rank >= 3 and graph.values[v].shape[0] > 1
                                 and _batched_dim0_dots(graph, v)])


def expert_parallel(graph: Graph, mesh: Mapping[str, int]) -> list[Seed] | None:
    """MoE: the expert dim (dim 0 of the expert weights, `expert_weights`) on the last mesh axis, data
    parallel on the others, and GShard's layout of the computation between them (`_gshard_seeds`); None when
    the program has no expert weights."""
    data, model = _split_axes(mesh)
    axis = model or (data[-1] if data else None)
    if axis is None:
        return None
    experts = [v for v in expert_weights(graph) if graph.values[v].shape[0] % mesh[axis] == 0]
    if not experts:
        return None
    batch_axes = data if model else list(mesh)
    seeds = _batch(graph, mesh, batch_axes, "expert-parallel")
    for v in experts:
        val = graph.values[v]
        seeds.append(_seed(graph, v, ((axis,),) + tuple(() for _ in val.shape[1:]), "expert-parallel"))
    return seeds + _gshard_seeds(graph, mesh, set(experts), axis, batch_axes, "expert-parallel")


_REORDERING = _PASS_THROUGH | {"transpose"}  # ops between an einsum and the dot_general jnp.einsum makes of it


def _expert_dots(graph: Graph, experts: set[int]) -> list[tuple[Any, int, int]]:
    """The dot_generals in which an expert weight meets the tokens (`EGCM,EMH->EGCH` and, in the backward
    pass, the tokens' gradient `EGCH,EMH->EGCM`): (op, the other operand's index, position of the expert dim
    among the op's batch dims), in program order. The weights' own gradient (`EGCM,EGCH->EMH`) reads no weight."""
    found: dict[int, tuple[Any, int, int]] = {}
    for v in experts:
        for op, i in _batched_dim0_dots(graph, v):
            (_, _), batch = op.params["dimension_numbers"]
            found.setdefault(op.id, (op, 1 - i, list(batch[i]).index(0)))
    return [found[k] for k in sorted(found)]


def _gshard_seeds(graph: Graph, mesh: Mapping[str, int], experts: set[int], axis: str, batch_axes: Sequence[str],
                  name: str) -> list[Seed]:
    """GShard's layout around the experts (what its `split` hints say in a hinted MoE layer): each expert
    dot_general (`_expert_dots`) computes with its tokens and result split over the experts' `axis` on the
    expert dim, and the einsums on the other side of them (dispatch `GSEC,GSM->EGCM` before, combine
    `GSEC,GECM->GSM` after, and their gradients), found through transposes and casts, compute with the token
    groups (their batch dim) over the batch axes. The all-to-alls are then the reshards between the two.
    Without these, propagation gives the gating tensors [G, S, E, C] whichever layout reaches them first; the
    experts' (a few ops away) usually does, which all-gathers them and re-splits the dispatch mask."""
    users = _users(graph)
    seeds: dict[tuple[int, int], Axes] = {}

    def token_einsums(v: int, forward: bool, depth: int = 0) -> list[Any]:
        """The dot_generals reached from `v` through reordering ops (after it when `forward`)."""
        if depth > 4:
            return []
        if forward:
            found = []
            for op, _ in users.get(v, ()):
                if op.primitive == "dot_general":
                    found.append(op)
                elif op.primitive in _REORDERING:
                    found += token_einsums(op.outputs[0], True, depth + 1)
            return found
        p = graph.values[v].producer
        if p is None:
            return []
        op = graph.ops[p]
        if op.primitive == "dot_general":
            return [op]
        return token_einsums(op.inputs[0], False, depth + 1) if op.primitive in _REORDERING else []

    expert_dots = _expert_dots(graph, experts)
    expert_ops = {op.id for op, _, _ in expert_dots}
    for op, other, k in expert_dots:
        (_, _), batch = op.params["dimension_numbers"]
        seeds[(op.inputs[other], batch[other][k])] = (axis,)
        seeds[(op.outputs[0], k)] = (axis,)  # (dot_general puts the batch dims first, in order)
    for op, other, _ in expert_dots:
        for t in token_einsums(op.inputs[other], False) + token_einsums(op.outputs[0], True):
            if t.id in expert_ops:
                continue
            (_, _), batch = t.params["dimension_numbers"]
            for i in (0, 1):
                v = t.inputs[i]
                if not batch[i]:
                    continue
                d = batch[i][0]
                axes = _fit_batch(batch_axes, graph.values[v].shape[d], mesh)
                if axes:
                    seeds.setdefault((v, d), axes)
    by_value: dict[int, list[Axes | None]] = {}
    for (v, d), axes in seeds.items():
        dims = by_value.setdefault(v, [None] * graph.values[v].rank)
        if not {a for ax in dims if ax for a in ax} & set(axes):  # (one axis on one dim of a value)
            dims[d] = axes
    return [Seed(v, tuple(dims), _cause(name), COMPUTE_PRIORITY) for v, dims in by_value.items()
            if v not in experts]


def hints_only(graph: Graph, mesh: Mapping[str, int]) -> list[Seed]:
    """No seeds beyond the user's: what plain propagation of the hints gives."""
    return []


BASELINES: dict[str, Callable[[Graph, Mapping[str, int]], list[Seed] | None]] = {
    "hints": hints_only, "data-parallel": data_parallel, "fsdp": fsdp, "megatron": megatron, "fsdp-tp": fsdp_tp,
    "megatron-3d": megatron, "expert-parallel": expert_parallel,  # (megatron-3d: pipelined programs only)
}


# Baselines that store the carried state as their seeds say and compute as another baseline does (its
# layouts of every op and of the data): the FSDP of that baseline. Seeding the storage alone would let the
# weights' axes reach the activations first (an embedding table split on its embed dim over the data axes
# takes the batch's axis from the lookup), which is not what FSDP computes.
COMPUTE_OF: dict[str, str] = {"fsdp-tp": "megatron"}


def stacked_state(graph: Graph, layers: int) -> list[int]:
    """The carried inputs that are a stack of per-layer state: dim 0 is the pipelined stack's `layers`
    (its parameters and their optimizer moments)."""
    return [v for v in state_inputs(graph) if graph.values[v].rank >= 1 and graph.values[v].shape[0] == layers]


def _pipelined(name: str, graph: Graph, mesh: Mapping[str, int], pipeline: Any) -> list[Seed] | None:
    """Baseline `name` inside each stage of `pipeline`: on the mesh without the stage axis, with the
    stacked state's layer dim over the stage axis."""
    axis = pipeline.axis
    inner = {a: n for a, n in mesh.items() if a != axis}
    stacked = stacked_state(graph, pipeline.layers)
    if name == "megatron-3d":  # tensor parallel on the innermost axis that does not split the microbatches
        big = [a for a in inner if inner[a] > 1]
        model = next((a for a in reversed(big) if a not in pipeline.data), None)
        seeds = None if model is None else megatron(graph, inner, stacked, ([a for a in big if a != model], model))
    else:
        seeds = BASELINES[name](graph, inner) if inner else []
    if seeds is None:
        return None
    by_value = {s.value: s for s in seeds}
    out = [s for s in seeds if s.value not in stacked]
    for v in stacked:
        val = graph.values[v]
        s = by_value.get(v)
        dims = list(s.dims) if s is not None else [() for _ in val.shape]
        dims[0] = (axis,) + tuple(a for a in (dims[0] or ()) if a != axis)
        out.append(Seed(v, tuple(dims), _cause(name), COMPUTE_PRIORITY))  # (the stage axis places the compute)
    return out


def baseline_seeds(name: str, graph: Graph, mesh: Mapping[str, int], user_seeds: Sequence[Seed] = (),
                   pipeline: Any = None) -> list[Seed] | None:
    """The seeds of baseline `name` on this mesh, minus the dims the user pinned (hints win); None when
    the baseline does not apply (e.g. expert parallel without experts, Megatron on a 1-axis mesh,
    `megatron-3d` without a pipeline, `megatron` with one: there it is `megatron-3d`). With `pipeline` (a
    bound `shardc.pipeline.Pipeline` whose stage axis `mesh` has), each baseline runs inside the stages."""
    if pipeline is not None and pipeline.axis in mesh and pipeline.layers:
        if name == "megatron":
            return None
        seeds = _pipelined(name, graph, mesh, pipeline)
    elif name == "megatron-3d":
        return None
    elif name == "megatron" and _split_axes(mesh)[1] is None:
        return None  # (on one axis it would fight the batch hints most programs have; see docs/search.md)
    else:
        seeds = BASELINES[name](graph, mesh)
    if seeds is None:
        return None
    pinned: dict[int, dict[int, Axes]] = {}
    for s in user_seeds:
        for d, ax in enumerate(s.dims):
            if ax is not None:
                pinned.setdefault(s.value, {})[d] = tuple(ax)
    out = []
    for s in seeds:
        pins = pinned.get(s.value, {})
        used = {a for ax in pins.values() for a in ax}
        dims = []
        for d, ax in enumerate(s.dims):
            if d in pins or ax is None:
                dims.append(None)
            else:
                keep = tuple(a for a in ax if a not in used)
                dims.append(keep)
                used.update(keep)
        if any(x is not None for x in dims):
            out.append(Seed(s.value, tuple(dims), s.cause, s.priority))
    return out


def baseline_plan(name: str, problem, mesh):
    """Baseline `name` as a Plan of `problem` (a shardc.search.evaluate.Problem) on a jax Mesh, or None when
    it does not apply."""
    from shardc.search.evaluate import plan_from_seeds
    from shardc.sharding import mesh_shape

    user = problem.seeds_on(mesh)
    sizes = mesh_shape(mesh)
    extra = baseline_seeds(name, problem.graph, sizes, user, getattr(problem, "pipeline", None))
    if extra is None or name not in COMPUTE_OF:
        return None if extra is None else plan_from_seeds(problem, mesh, user + extra)
    from shardc.search.space import build_space, plan_choices, seeds_for, with_input_layouts

    compute = baseline_plan(COMPUTE_OF[name], problem, mesh)
    if compute is None:
        return None
    space = build_space(problem.graph, sizes, user)
    point = with_input_layouts(space, plan_choices(space, compute), extra, state_inputs(problem.graph))
    return plan_from_seeds(problem, mesh, user + seeds_for(space, point, user))
