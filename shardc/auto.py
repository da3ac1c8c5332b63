"""`@shardc.auto`: trace, plan, lower and run a train step sharded over a mesh.

    @shardc.auto(mesh=mesh)
    def train_step(params, opt_state, batch): ...

On the first call for an abstract signature (tree structure, shapes, dtypes, metadata) the step is
traced to a jaxpr, hints are collected (in-program `split`/`replicate`/`shard`, Flax metadata on the
inputs), propagated into a Plan, and the plan is lowered to `jax.jit` with in/out shardings. Later
calls with the same signature reuse it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import time
import traceback
import warnings
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.tree_util import keystr

import annotations as _annotations
from annotations.errors import ShardingError, SourceLine, caller_source_line
from annotations.errors import describe_function as _describe
from shardc.ir.build import build_graph
from shardc.ir.graph import Graph, Op
from shardc.arg_names import leaf_names
from shardc.carried import CarriedShapes, ReplanWarning
from shardc.nnx_args import NnxCall, split_call
from shardc.distributed import check_plan_agreement, is_multiprocess, to_global
from shardc.flax_rules import rules_context, warn_unhinted_params
from shardc.jit_shardings import JitShardings, same_mesh
from shardc.lower import jit_plan
from shardc.metadata import has_logical_boxes, input_hints
from shardc.placement import PlacementWarning, call_mesh, fits, is_placed, placed_dims, replacement_note
from shardc.plan import Plan, build_plan, is_abstract, require_devices, topology_pricer
from shardc.propagate import Cause, Seed, propagate
from shardc.seeds import input_seed, program_seeds
from shardc.sharding import make_mesh, mesh_shape
from shardc.donation import Donation
from shardc.fast_call import FastCall
from shardc.explicit import caller_mesh, explicit_axes, is_explicit_mode_error, retype, trace_explicit
from shardc.static_args import StaticArgs
from shardc.waste import IdleDevicesWarning, user_stacklevel, waste_warning
import shardc.search.integrate as _search
from shardc.ties import check_ties
from shardc.remat import without_own_remat
from shardc.loops import restructure_loops
from shardc.search.loop_choice import choose_loops
from shardc.search.remat_choice import apply_choice, choose_remat
from shardc.pipeline.jit import check_mesh, pipeline_meshes
from shardc.pipeline.stacks import find_stacks, largest, pipelining
from shardc.pipeline.value import Pipeline

__all__ = ["auto", "AutoFunction", "plan", "plan_for", "Compiled"]


@dataclasses.dataclass
class Compiled:
    """Everything made for one abstract signature."""

    plan: Plan
    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any
    jitted: Any
    timings: dict[str, float]
    # inputs placed in a layout of their own that a stronger hint overrides (in_shardings, Flax metadata): why
    overridden: dict[int, str] = dataclasses.field(default_factory=dict)
    placement_warned: bool = False  # (re-placements are reported once per plan)


def _default_mesh() -> Mesh:
    return make_mesh({"data": len(jax.devices())})


class _NnxRoute(NamedTuple):
    """A call with NNX objects: the pure step for its argument structure, the split, and what to update."""

    step: "AutoFunction"
    call: NnxCall
    args: tuple
    kwargs: dict
    nodes: tuple


class AutoFunction:
    """A function planned and run sharded by shardc (what `@shardc.auto` returns)."""

    def __init__(self, fun: Callable, *, mesh: Mesh | None = None, rules: Any = None,
                 donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = (),
                 topology: Any = None, search: Any = True,
                 budget_s: float | None = None, seed: int = 0, devices: int | None = None,
                 static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
                 time_cap_s: float | None = None, in_shardings: Any = None, out_shardings: Any = None,
                 remat: bool | str = True, memory_limit: float | None = None, pipeline: Any = None,
                 pcg: bool = False, _source: SourceLine | None = None, _shared: Any = None,
                 _priced_only: bool = False, _resume: Any = None,
                 _on_graph: Callable[[Any, Any], None] | None = None) -> None:
        if not callable(fun):
            raise TypeError(f"shardc.auto expects a function, got {type(fun).__name__}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ShardingError(f"shardc.auto(mesh=...) needs a jax.sharding.Mesh (see shardc.make_mesh), got {type(mesh).__name__}")
        # in_shardings / out_shardings as jax.jit takes them (shardc/jit_shardings.py); NamedShardings fix the mesh
        self.shardings = JitShardings.make(in_shardings, out_shardings, _source or caller_source_line())
        mesh = self._mesh_of_shardings(mesh, devices)
        self.mesh = mesh
        self.rules = _check_rules(rules)
        self.donation = Donation.make(fun, donate_argnums, donate_argnames)
        self.donate_argnums = self.donation.nums
        self.topology = topology
        self.search = search
        self.budget_s = budget_s
        self.time_cap_s = time_cap_s  # a wall-clock cap on the search (None: none, so the plan is reproducible)
        # remat: the search may make repeated layers recompute activations when memory decides (shardc/remat.py)
        self.remat = remat
        self.memory_limit = memory_limit  # bytes per device the plan must fit (default: the topology's memory)
        self._remat_resume: Any = None  # the RematChoice while retracing under the mesh the search chose
        self._loops_resume: Any = None  # and the LoopChoice (pcg=True: shardc/search/loop_choice.py)
        self.seed = seed
        self._cache: dict[Any, Compiled] = {}
        self._carried = CarriedShapes()
        self._mesh_given = mesh is not None
        self._search_resume: Any = None  # the SearchReport while retracing under the mesh the search chose
        self._pcg_resume: Any = None  # and the PCGChoice the search made for that plan (pcg=True)
        # devices: plan for this many devices (the search's mesh shapes; more than this host has gives a
        # plan that can be simulated and explained but not run, see shardc.plan_for).
        if devices is not None and (not isinstance(devices, int) or devices < 1 or not _search.enabled(search)):
            raise ShardingError(f"shardc.auto(devices={devices!r}) needs a positive int and search=True (the "
                                f"search chooses a mesh of that many devices)")
        self.devices = devices
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ShardingError(f"shardc.auto(seed={seed!r}) needs an int (the search's random seed)")
        _check_search_options(search, budget_s, time_cap_s)
        if not (isinstance(remat, bool) or remat == "replace"):
            raise ShardingError(f"shardc.auto(remat={remat!r}): expected True (the search may rematerialize repeated "
                                f"layers when memory decides), \"replace\" (the same, and the program's own "
                                f"jax.checkpoint / nn.remat may be replaced) or False")
        if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float))
                                         or not memory_limit > 0):
            raise ShardingError(f"shardc.auto(memory_limit={memory_limit!r}): expected a positive number of bytes per "
                                f"device (or None for the topology's device memory)")
        if not isinstance(pcg, bool):
            raise ShardingError(f"shardc.auto(pcg={pcg!r}): expected True (the plan's PCG is rewritten with proved "
                                f"rules and runs when that is faster) or False")
        self.pcg = pcg  # rewrite the chosen plan's PCG with proved rules (shardc/pcg/choice.py)
        # pipeline: a shardc.pipeline.Pipeline; the step's layer stack runs as that pipeline (docs/pipeline.md)
        self.pipeline = _check_pipeline(pipeline, mesh, devices, search)
        self._stack: Any = None  # the layer stack the pipeline cuts (found on the first trace)
        # pipeline=True: the first call chooses the pipeline, or none (shardc/pipeline/auto_choice.py)
        self._choosing_pipeline = pipeline is True
        self._pipeline_choice: Any = None  # what that choice scored (Plan.pipeline_choice)
        # the stack, tracing mesh and traced programs shared by the candidates of one pipeline choice
        # (shardc/pipeline/reuse.py; set by choose_pipeline, None otherwise)
        self._shared = _shared
        if _shared is not None:
            _shared.prepare(self)
        # a plan to price, not to run (choose_pipeline's screens): the searched plan is not rebuilt from a
        # trace under the mesh the search chose, and it is not lowered
        self._priced_only = _priced_only
        # called with (program, graph) once the traced program's graph is built, before it is planned; may raise
        # to stop planning it (choose_pipeline's floor: shardc/pipeline/floor.py)
        self._on_graph = _on_graph
        if _resume is not None:  # a priced plan of this step made to run: retraced under its mesh, not searched
            self.mesh, self._search_resume, self._remat_resume = _resume.mesh, _resume.search, _resume.remat
            self._pcg_resume, self._loops_resume = _resume.pcg, getattr(_resume, "loops", None)
        self._options = dict(mesh=mesh, rules=rules, donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                             topology=topology, search=search,
                             budget_s=budget_s, seed=seed, devices=devices, static_argnums=static_argnums,
                             static_argnames=static_argnames, time_cap_s=time_cap_s, remat=remat,
                             memory_limit=memory_limit, pipeline=pipeline, pcg=pcg, in_shardings=in_shardings,
                             out_shardings=out_shardings, _source=self.shardings.source)
        self._mesh_steps: dict[tuple, AutoFunction] = {}  # mesh=None: per mesh the arguments were placed on
        self._placed_plans: dict[tuple, Compiled] = {}  # per signature and layouts of placed arguments
        # the layout the first plan on a mesh gave each donated argument (state carried from call to call), so
        # that programs of other shapes (a batch bucket) take and leave that state alike: (mesh, index, aval) -> dims
        self._carried_layouts: dict[tuple, tuple] = {}
        self._warned_unhinted = False  # (the UnhintedParamsWarning is said once)
        self._nnx_steps: dict[NnxCall, AutoFunction] = {}  # per NNX argument structure (shardc/nnx_args.py)
        self._static = StaticArgs(fun, static_argnums, static_argnames)
        self._static.check_not_donated(self.donate_argnums)
        self._static_steps: dict[tuple, AutoFunction] = {}  # per value of the static arguments
        self._warned_static_meshes = False  # (`_warn_if_static_meshes_differ` says it once)
        self._warned_waste = False  # (`_warn_if_wasteful` says it once)
        self._fast: FastCall | None = None  # the previous plain call, for the next one's fast path

    # -- public --------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if self._fast is not None and (flat := self._fast.placed(tree, leaves)) is not None:
            c = self._fast.compiled  # the previous call's tree, avals and layouts (shardc/fast_call.py)
            out = c.jitted(*flat)
            self._carried.record_outputs(out, c.plan.output_names)
            return jax.tree_util.tree_unflatten(c.out_tree, out)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return self._inline(args, kwargs)
        if (static := self._static_step(args, kwargs)) is not None:
            step, args, kwargs = static
            out = step(*args, **kwargs)
            self._warn_if_static_meshes_differ()
            return out
        if (nnx := self._nnx_step(args, kwargs)) is not None:
            out, *new_state = nnx.step(*nnx.args, **nnx.kwargs)
            nnx.call.update(nnx.nodes, tuple(new_state))
            return out
        if (placed := self._placed_step(args, kwargs)) is not None:
            return placed[0](*args, **kwargs)
        self._carried.check(tree, leaves, _describe(self.fun))
        c = self._compiled(args, kwargs)
        require_devices(c.plan)
        _check_donated_once(leaves, c.plan, self.fun)
        _check_not_deleted(leaves, c.plan, self.fun)
        self._warn_replacements(c, leaves)
        targets = [s.named(c.plan.mesh) for s in c.plan.input_shardings()]
        flat = [self._place(x, t) for x, t in zip(leaves, targets)]
        out = c.jitted(*flat)
        caller = caller_mesh(leaves, c.plan.mesh)
        if caller is not None:  # results typed as jax.jit types them there
            out = retype(out, caller)
        self._carried.record(tree, leaves, c.plan.input_names, out, c.plan.output_names)
        plain = caller is None and all(t.is_fully_addressable for t in targets)
        self._fast = FastCall.of(tree, leaves, targets, c) if plain else None
        return jax.tree_util.tree_unflatten(c.out_tree, out)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments, without running."""
        if (inner := self._inner_step(args, kwargs)) is not None:
            step, args, kwargs = inner
            return step.plan(*args, **kwargs)
        return self._compiled(args, kwargs).plan

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The lowered program (over the flattened arguments), as `jax.jit(...).lower` gives."""
        if (inner := self._inner_step(args, kwargs)) is not None:
            step, args, kwargs = inner
            return step.lower(*args, **kwargs)
        c = self._compiled(args, kwargs)
        require_devices(c.plan)
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        # As a call would place them: an argument committed elsewhere than the plan lays it out (a layout
        # that is no hint, e.g. split over a mesh axis of size 1) is lowered at the plan's layout.
        placed = [self._abstract_at(x, s, c.plan.mesh) for x, s in zip(leaves, c.plan.input_shardings())]
        return c.jitted.lower(*placed)

    def compiled_info(self, *args: Any, **kwargs: Any) -> Compiled:
        """Plan, jaxpr, trees, jitted function and timings for these arguments."""
        if (inner := self._inner_step(args, kwargs)) is not None:
            step, args, kwargs = inner
            return step.compiled_info(*args, **kwargs)
        return self._compiled(args, kwargs)

    # -- internals -----------------------------------------------------------------------------------
    def _inner_step(self, args: tuple, kwargs: dict) -> tuple["AutoFunction", tuple, dict] | None:
        """The step that plans this call when it is not this one's own: the step of its static values, or
        the pure step of its NNX objects; with the arguments to pass it. None: this step plans it."""
        if (static := self._static_step(args, kwargs)) is not None:
            return static
        if (nnx := self._nnx_step(args, kwargs)) is not None:
            return nnx.step, nnx.args, nnx.kwargs
        return self._placed_step(args, kwargs)

    def _static_step(self, args: tuple, kwargs: dict) -> tuple["AutoFunction", tuple, dict] | None:
        """With static arguments: the step for their values (one per value, as jax.jit keeps one program
        per value) and the call's traced arguments (shardc/static_args.py); else None."""
        if not self._static:
            return None
        key, dyn_args, dyn_kwargs = self._static.split(args, kwargs)
        step = self._static_steps.get(key)
        if step is None:
            shardings = self.shardings.for_static([i for i, _ in key[0]], len(args), _describe(self.fun))
            options = {**self._options, "static_argnums": (), "static_argnames": (),
                       "search": self._static.search_path(self.search, key), "in_shardings": shardings.in_shardings}
            step = self._static_steps[key] = AutoFunction(self._static.bind(key), **options)
        return step, dyn_args, dyn_kwargs

    def _warn_if_static_meshes_differ(self) -> None:
        """Static values planned on different meshes re-place the arguments at every switch between them
        (and a re-placed array is a copy: donation does not free the caller's buffer): say so, once."""
        if self._warned_static_meshes:
            return
        meshes = {tuple(s.mesh.shape.items()) for s in self._static_steps.values() if s.mesh is not None}
        if len(meshes) > 1:
            self._warned_static_meshes = True
            warnings.warn(f"shardc: {_describe(self.fun)}'s static argument values were planned on different meshes "
                          f"({', '.join(str(dict(m)) for m in sorted(meshes))}): each switch between them re-places "
                          f"the arguments, and donation does not free buffers that were re-placed; pass mesh=... to "
                          f"plan every value on one mesh", ReplanWarning, stacklevel=3)

    def _warn_if_wasteful(self, plan: Plan) -> None:
        """A plan whose devices repeat the same work (nothing split with search=False, or a mesh axis that
        splits no tensor) says so, once per function (shardc/waste.py)."""
        if self._warned_waste:
            return
        topology = plan.cost.topology.name if plan.cost is not None else ""
        text = waste_warning(plan, search=_search.enabled(self.search), topology=topology)
        if text is not None:
            self._warned_waste = True
            warnings.warn(f"{text} ({_describe(self.fun)})", IdleDevicesWarning, stacklevel=user_stacklevel())

    def _nnx_step(self, args: tuple, kwargs: dict) -> _NnxRoute | None:
        """For arguments holding NNX objects: the pure step that plans and runs them (one per argument
        structure), the split, the pure arguments and the objects to update afterwards; else None."""
        split = split_call(args, kwargs)
        if split is None:
            return None
        call, pure_args, pure_kwargs, nodes = split
        step = self._nnx_steps.get(call)
        if step is None:
            outs = self.shardings.for_nnx(len(call.node_positions)).out_shardings
            step = self._nnx_steps[call] = AutoFunction(call.pure(self.fun), **{**self._options, "out_shardings": outs})
        return _NnxRoute(step, call, pure_args, pure_kwargs, nodes)

    def _placed_step(self, args: tuple, kwargs: dict) -> tuple["AutoFunction", tuple, dict] | None:
        """With mesh=None, when arguments are placed on a mesh over this host's devices (or `jax.set_mesh`
        entered one): the step planned on that mesh, as jax.jit runs on the mesh of its arguments — unless
        this step's plan for the call is on that mesh and keeps every placed layout already."""
        if self._mesh_given or self.devices is not None:
            return None
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        mesh = call_mesh(leaves, jax.devices())
        if mesh is None:
            return None
        c = self._cache.get(self._signature((args, kwargs)))
        if c is not None and same_mesh(c.plan.mesh, mesh) \
                and fits(c.plan.input_shardings(), mesh, leaves, c.overridden):
            return None
        key = (tuple(mesh.shape.items()), tuple(d.id for d in mesh.devices.flat))
        step = self._mesh_steps.get(key)
        if step is None:
            step = self._mesh_steps[key] = AutoFunction(self.fun, **{**self._options, "mesh": mesh})
        return step, args, kwargs

    def _mesh_of_shardings(self, mesh: Mesh | None, devices: int | None) -> Mesh | None:
        """The mesh to plan on: `mesh`, else the mesh of the NamedShardings in in_shardings/out_shardings
        (which must be `mesh` when both are given)."""
        named = self.shardings.mesh()
        if named is None:
            return mesh
        if mesh is not None:
            self.shardings.check_mesh(mesh, _describe(self.fun))
            return mesh
        if devices is not None:
            raise ShardingError(f"shardc.plan_for / devices={devices}: in_shardings or out_shardings hold "
                                f"NamedShardings on a mesh of this host, but this plan is for a mesh the search "
                                f"chooses; pass PartitionSpecs (read on the chosen mesh) instead")
        return named

    def _warn_replacements(self, c: Compiled, leaves: Sequence[Any]) -> None:
        """Arguments placed in a layout of their own that the plan takes in another: a PlacementWarning each,
        once per plan."""
        if c.placement_warned:
            return
        c.placement_warned = True
        for i, (x, s) in enumerate(zip(leaves, c.plan.input_shardings())):
            note = replacement_note(x, s.named(c.plan.mesh), c.plan.input_names[i], c.overridden.get(i, ""))
            if note is not None:
                warnings.warn(f"shardc: {_describe(self.fun)}: {note}", PlacementWarning, stacklevel=3)

    def _inline(self, args: tuple, kwargs: dict) -> Any:
        """Called while something else traces (another @shardc.auto function, jax.jit, grad, vmap):
        the function becomes part of that program, its hints written against this mesh."""
        outer = _annotations.current_mesh()
        if outer is not None and self.mesh is not None and outer != self.mesh:
            raise ShardingError(
                f"{_describe(self.fun)} is a @shardc.auto function on mesh {dict(self.mesh.shape)} called "
                f"inside a program planned on mesh {dict(outer.shape)}; a nested call becomes part of the outer "
                f"program, so give both the same mesh (or call the undecorated function)")
        with _annotations.mesh_context(outer if outer is not None else self._mesh()):
            return self.fun(*args, **kwargs)

    def _abstract_at(self, x: Any, sharding: Any, mesh: Mesh) -> Any:
        """`x` to lower with: itself when `_place` would leave it as it is, else its shape and dtype at the
        plan's layout."""
        current = getattr(x, "sharding", None)
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or current is None:
            return x
        target = sharding.named(mesh)
        if current == target:
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target, weak_type=getattr(x, "weak_type", False))

    def _place(self, x: Any, target: NamedSharding) -> Any:
        """`x` in the layout the plan takes it in (`target`)."""
        if not target.is_fully_addressable and not isinstance(x, jax.core.Tracer) \
                and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return to_global(x, target)  # multi-process: a value every process holds in full
        current = getattr(x, "sharding", None)
        # An equivalent layout on another mesh object (e.g. the same devices with the axes in another order)
        # is still a mismatch for jax.jit: re-place it (no copy when the shards are where they should be).
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and current is not None \
                and current != target:
            return jax.device_put(x, target)
        return x

    def _mesh(self) -> Mesh:
        if self.mesh is None:
            self.mesh = _default_mesh()
        return self.mesh

    def _signature(self, call: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(call)
        avals = []
        for x in leaves:
            try:
                a = jax.typeof(x)
                avals.append((tuple(a.shape), str(a.dtype), getattr(a, "weak_type", False)))
            except TypeError:
                avals.append(("static", repr(x)))
        return tree, tuple(avals)

    def _compiled(self, args: tuple, kwargs: dict) -> Compiled:
        key = self._signature((args, kwargs))
        c = self._cache.get(key)
        if c is None:
            c = self._build(args, kwargs)
            self._cache[key] = c
            return c
        # Arguments placed in layouts this plan does not keep get a plan of their own (as jax.jit compiles one
        # per input sharding); those it keeps, or that are merely replicated, reuse it.
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if is_abstract(c.plan.mesh) or fits(c.plan.input_shardings(), c.plan.mesh, leaves, c.overridden):
            return c
        placed_key = (key, tuple(placed_dims(x, c.plan.mesh) for x in leaves))
        if placed_key not in self._placed_plans:
            self._placed_plans[placed_key] = self._build(args, kwargs)
        return self._placed_plans[placed_key]

    def _trace(self, call: tuple[tuple, dict]) -> tuple[Any, Any, Any]:
        mesh = self._mesh()
        flat, in_tree = jax.tree_util.tree_flatten(call)
        out_tree_box: list[Any] = []

        def flat_fun(*flat_args: Any) -> list[Any]:
            args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat_args)
            if self.pipeline is not None and self._stack is not None:
                with pipelining(self.pipeline, self._stack.index):
                    out = self.fun(*args, **kwargs)
            else:
                out = self.fun(*args, **kwargs)
            leaves, out_tree = jax.tree_util.tree_flatten(out)
            out_tree_box.append(out_tree)
            return leaves

        for i, x in enumerate(flat):
            try:
                jax.typeof(x)
            except TypeError:
                path = keystr(jax.tree_util.tree_flatten_with_path(call)[0][i][0][1:])
                raise ShardingError(f"shardc.auto: argument leaf {path} is of type {type(x).__name__}, not an array; "
                                    f"pass arrays, or name the argument in static_argnums / static_argnames "
                                    f"(or close over Python values)") from None
        user_fun = inspect.unwrap(self.fun)  # under the wrappers of NNX and static arguments
        if inspect.isfunction(user_fun):  # JAX's tracing errors then name the user's function, not ours
            flat_fun.__name__, flat_fun.__qualname__ = user_fun.__name__, user_fun.__qualname__
            flat_fun.__code__ = flat_fun.__code__.replace(co_filename=user_fun.__code__.co_filename,
                                                         co_firstlineno=user_fun.__code__.co_firstlineno,
                                                         co_name=user_fun.__code__.co_name)
        try:
            # When the search chooses the mesh, the tracing mesh is a stand-in: a hint's divisibility is checked
            # on each candidate mesh instead (a batch of 12 splits over 4 devices, not over 8).
            provisional = _search.enabled(self.search) and not self._mesh_given
            with _annotations.mesh_context(mesh), _annotations.provisional_mesh(provisional), jax.set_mesh(mesh), \
                    rules_context(self.rules):  # Flax's logical rules context, as jax.jit users enter it
                # Trace from shapes and dtypes only: an argument still placed on another mesh (a key returned
                # by an earlier run) must not bring that mesh into the trace.
                if self.pipeline is not None and self._stack is None:  # which layer stack to pipeline
                    with find_stacks() as seen:  # (a function of its own: JAX would reuse this trace for flat_fun)
                        jax.make_jaxpr(lambda *a: flat_fun(*a))(*[_abstract(x) for x in flat])
                    self._stack = largest(seen)
                    if self._stack is None:
                        raise ShardingError(f"shardc.auto(pipeline=...): {_describe(self.fun)} has no layer stack to "
                                            f"pipeline (a jax.lax.scan or nn.scan over stacked per-layer parameters "
                                            f"that carries the activations)")
                try:
                    closed = jax.make_jaxpr(flat_fun)(*[_abstract(x) for x in flat])
                except ValueError as e:  # explicit-sharding code (jax.make_mesh's default): traced as jax.jit does
                    if not (is_explicit_mode_error(e) and (axes := explicit_axes(flat))):
                        raise
                    closed = trace_explicit(flat_fun, flat, mesh, axes)
        except ValueError as e:
            if isinstance(e, ShardingError) or not _is_jax_sharding_error(e):
                raise
            raise ShardingError(
                f"{_describe(self.fun)}: a sharding constraint in the program, or Flax partitioning metadata that "
                f"Flax applies as one, does not fit its value on mesh {dict(mesh.shape)} (plain jax.jit under "
                f"jax.set_mesh(mesh) fails the same way): {str(e).splitlines()[0]}" + _flax_note(e)) from e
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                jax.errors.TracerBoolConversionError, TypeError) as e:
            if isinstance(e, TypeError) and "concrete" not in str(e):
                raise
            e.add_note("shardc.auto traces every argument as an array (Python ints and floats too); name the "
                       "arguments that must stay static, such as shapes or flags, in static_argnums / "
                       "static_argnames (as with jax.jit), or close over them (functools.partial)")
            raise
        return closed, in_tree, out_tree_box[-1]

    def _build(self, args: tuple, kwargs: dict) -> Compiled:
        if self._choosing_pipeline:
            self._choose_pipeline(args, kwargs)
        roots = tuple(args) + tuple(kwargs[k] for k in sorted(kwargs))
        # may set a tracing mesh with the axes named by the metadata and by in_shardings/out_shardings
        meta_axes = _search.mesh_for_metadata(self, roots, self.shardings.named_axes())
        mesh = self._mesh()
        # When the search chooses the mesh, the tracing mesh is provisional: the search checks the hints
        # on each candidate mesh instead (a dim that 8 does not divide may still split over 2 or 4).
        provisional = _search.enabled(self.search) and not self._mesh_given
        # Flax metadata is checked before tracing: inside the trace Flax would apply it as a sharding
        # constraint and fail with JAX's error (an unknown axis, an axis named twice, a dim that does not divide).
        hints = input_hints(roots, mesh.axis_names if provisional else mesh, self.rules, _describe(self.fun))
        self._warn_unhinted_params(args, kwargs, roots, hints)
        t0 = time.perf_counter()
        trace_fn = self._trace if self._shared is None else \
            functools.partial(self._shared.trace, self, trace_fn=self._trace)
        closed, in_tree, out_tree = _search.trace(self, trace_fn, (args, kwargs), meta_axes)
        mesh = self._mesh()  # the search may have chosen a tracing mesh that has the axes the program names
        t1 = time.perf_counter()
        # Positional leaves come first, then keyword ones (sorted by name), as (args, kwargs) flattens; named
        # by the step's parameters (params['Dense_0']['kernel'], not [0]['Dense_0']['kernel']).
        in_paths = leaf_names(self.fun, (args, kwargs))
        namer = getattr(self.fun, "shardc_output_names", None)  # an NNX step's own names (shardc/nnx_args.py)
        out_paths = namer(_paths_of(out_tree)) if namer else [f"out{keystr(p)}" for p in _paths_of(out_tree)]
        own_remat_removed = False
        if self.remat == "replace" and _search.enabled(self.search):  # the search decides remat in their place
            with _internal_errors("removing the program's own remat from", self.fun):
                unrematted = without_own_remat(closed)
            own_remat_removed, closed = unrematted is not closed, unrematted
        loops_choice, self._loops_resume = self._loops_resume, None
        if loops_choice is not None and loops_choice.chosen:  # retraced under the mesh the search chose
            with _internal_errors("restructuring the loops of", self.fun):
                closed = restructure_loops(closed)[0]
        remat_choice, self._remat_resume = self._remat_resume, None
        if remat_choice is not None:  # retraced under the mesh the search chose: the same rewrite
            with _internal_errors("rematerializing", self.fun):
                closed = apply_choice(closed, remat_choice)
        with _internal_errors("building the graph of", self.fun):
            graph = build_graph(closed, in_paths, out_paths)
        t2 = time.perf_counter()
        with _internal_errors("collecting the hints of", self.fun):
            overridden: dict[int, str] = {}
            seeds = [] if provisional else \
                self._input_seeds(graph, args, kwargs, out_tree, mesh, overridden) + program_seeds(graph, mesh)
            _tie_carried_state(graph, in_tree, out_tree, args)
        if self._on_graph is not None:
            self._on_graph(closed, graph)
        notes = []
        if own_remat_removed:
            notes.append("remat='replace': the program's own jax.checkpoint / nn.remat was removed (outside loop "
                         "bodies); the search decides what the layers recompute")
        if graph.conservative_primitives:
            notes.append("replicated (no sharding rule): " + ", ".join(sorted(graph.conservative_primitives)))
        if _search.enabled(self.search):
            donate = self.donation.flat(args, kwargs, self.fun)

            def plan_of(program: Any, graph: Any = None) -> Plan:
                if graph is None:
                    graph = build_graph(program, in_paths, out_paths)
                    _tie_carried_state(graph, in_tree, out_tree, args)
                return _search.plan_by_search(
                    self, graph,
                    lambda m: self._input_seeds(graph, args, kwargs, out_tree, m) + program_seeds(graph, m), in_paths,
                    out_paths, notes, program, donate, self._mesh_given, meta_axes)

            def plan_program(program: Any) -> tuple[Any, Plan, Any]:
                if remat_choice is not None or not self.remat or self._search_resume is not None:
                    return program, plan_of(program, graph if program is closed else None), remat_choice
                # the remat policy is a decision of the search too (shardc/search/remat_choice.py)
                return choose_remat(program, lambda p: plan_of(p, graph if p is closed else None))

            with _internal_errors("searching a plan for", self.fun):
                if self.pcg and self._search_resume is None and loops_choice is None \
                        and _search.plan_file(self.search) is None:
                    # (pcg=True: the program with its loops restructured is searched too: loop_choice.py; not
                    # with a plan file, which pins the program's decisions)
                    program, the_plan, remat_choice, loops_choice = choose_loops(closed, plan_program)
                else:
                    program, the_plan, remat_choice = plan_program(closed)
                if program is not closed:  # (restructured or rematerialized: the plan's own graph)
                    closed, graph = program, the_plan.graph
            # (the axis order counts: {data: 4, expert: 2} and {expert: 2, data: 4} lay devices out differently)
            if list(the_plan.mesh_sizes.items()) != list(mesh.shape.items()) and not is_abstract(the_plan.mesh) \
                    and not self._priced_only:
                # retrace under the chosen mesh, keeping the decisions
                self.mesh, self._search_resume, self._remat_resume = the_plan.mesh, the_plan.search, remat_choice
                self._pcg_resume, self._loops_resume = the_plan.pcg, loops_choice
                return self._build(args, kwargs)
            the_plan = dataclasses.replace(the_plan, remat=remat_choice, loops=loops_choice)
        else:
            with _internal_errors("propagating shardings in", self.fun):
                prop = propagate(graph, dict(mesh.shape), seeds)
                check_ties(graph, prop)
            with _internal_errors("planning", self.fun):
                price = None
                if self.topology is not None:  # (an op's layout is weighed in seconds on the topology it is priced on)
                    from shardc.sim import as_topology

                    price = topology_pricer(as_topology(self.topology), mesh_shape(mesh))
                the_plan = build_plan(graph, mesh, prop, input_names=in_paths, output_names=out_paths, warnings=notes,
                                      price=price)
        if is_multiprocess():
            check_plan_agreement(the_plan)
        t3 = time.perf_counter()
        donate = self.donation.flat(args, kwargs, self.fun)
        the_plan = dataclasses.replace(the_plan, program=closed, donated=tuple(donate), pipeline=None
                                       if self.pipeline is None else self.pipeline.bind(self._stack.layers,
                                                                                        self._stack.name))
        # The simulated cost goes with the plan (plan.explain() shows it) on the topology given, or, when the
        # search chose the plan (or loaded it from its file), on the one it scores plans on (the devices at hand).
        topology = self.topology
        if topology is None and _search.enabled(self.search):
            topology = _search.default_topology(math.prod(the_plan.mesh_sizes.values()))
        if topology is not None:
            from shardc.sim import simulate

            the_plan = dataclasses.replace(the_plan, cost=simulate(the_plan, topology))
        if self._pipeline_choice is not None:  # (what explain() shows of the choice)
            the_plan = dataclasses.replace(the_plan, pipeline_choice=self._pipeline_choice)
        if the_plan.pcg is None and self._pcg_resume is not None:  # the search's, made before the retrace
            the_plan = dataclasses.replace(the_plan, pcg=self._pcg_resume)
        self._pcg_resume = None
        choice = the_plan.pcg  # (the search's PCG choice for this plan: shardc/search/driver.py)
        if self.pcg and self.pipeline is None and choice is None:  # the PCG rewritten with proved rules
            from shardc.pcg.choice import choose_pcg

            with _internal_errors("rewriting the PCG of", self.fun):
                choice = choose_pcg(the_plan, closed, topology if topology is not None else _search.default_topology(
                    math.prod(the_plan.mesh_sizes.values())), donated=tuple(donate), memory_limit=self.memory_limit)
            the_plan = dataclasses.replace(the_plan, pcg=choice)
        self._warn_if_wasteful(the_plan)
        with _internal_errors("lowering", self.fun):
            if is_abstract(the_plan.mesh) or self._priced_only:
                jitted = None
            elif choice is not None and choice.chosen:  # the rewritten PCG runs: its shard_map lowering
                from shardc.pcg.choice import jit_pcg

                jitted = jit_pcg(the_plan, choice.pcg, donate)
            else:
                jitted = jit_plan(the_plan, closed, donate)
        timings = {"trace_s": t1 - t0, "graph_s": t2 - t1, "propagate_s": t3 - t2}
        if provisional:  # (the chosen mesh's seeds say which placed arguments a stronger hint overrides)
            self._input_seeds(graph, args, kwargs, out_tree, the_plan.mesh, overridden)
        if jitted is not None:
            self._remember_carried_layouts(the_plan, args, kwargs)
        return Compiled(the_plan, closed, in_tree, out_tree, jitted, timings, overridden)

    def _choose_pipeline(self, args: tuple, kwargs: dict) -> None:
        """pipeline=True: choose the pipeline (or none) on the devices at hand, then build the chosen plan from
        the choice's decisions (shardc/pipeline/auto_choice.py)."""
        from shardc.pipeline.auto_choice import choose_for_step
        from shardc.search.driver import _mesh_of
        from shardc.sim import as_topology

        n = self.devices or len(jax.devices())
        topology, why = _search.pricing_topology(self, n)
        chosen = choose_for_step(self.fun, args, kwargs, self._options, topology, n, self.budget_s)
        self._choosing_pipeline = False
        self.pipeline, self._stack, self._pipeline_choice = chosen.pipeline, None, chosen.choice
        self.mesh = _mesh_of(chosen.mesh_sizes)
        # (the choice planned with topology= given; this step prices on it for its own reason)
        report = dataclasses.replace(chosen.search, topology=f"{as_topology(topology).name} ({why})")
        self._search_resume, self._remat_resume = report, chosen.remat

    def _carried_key(self, mesh: Any, index: int, x: Any) -> tuple:
        a = jax.typeof(x)
        return tuple(mesh.shape.items()), index, tuple(a.shape), str(a.dtype)

    def _remember_carried_layouts(self, plan: Plan, args: tuple, kwargs: dict) -> None:
        """Record the layout `plan` gives each donated argument, unless an earlier plan on its mesh did."""
        roots = tuple(args) + tuple(kwargs[k] for k in sorted(kwargs))
        leaves = jax.tree_util.tree_leaves(roots)
        shardings = plan.input_shardings()
        for i in self.donation.flat(args, kwargs, self.fun):
            if i < len(leaves) and i < len(shardings):
                self._carried_layouts.setdefault(self._carried_key(plan.mesh, i, leaves[i]), shardings[i].dims)

    def _carried_layout(self, mesh: Any, index: int, x: Any, donated: frozenset[int]) -> tuple | None:
        """The layout an earlier plan on `mesh` gave this donated argument (None: no such plan, or not donated)."""
        if index not in donated or not self._carried_layouts:
            return None
        try:
            return self._carried_layouts.get(self._carried_key(mesh, index, x))
        except TypeError:  # not an array
            return None

    def _input_seeds(self, graph: Graph, args: tuple, kwargs: dict, out_tree: Any, mesh: Any,
                     overridden: dict[int, str] | None = None) -> list[Seed]:
        """Seeds on the inputs — per leaf in_shardings, else Flax metadata, else the layout the argument is
        placed in (shardc/placement.py) — and on the outputs (out_shardings). `overridden` collects the placed
        arguments whose layout a stronger hint overrides."""
        owner = _describe(self.fun)
        roots = tuple(args) + tuple(kwargs[k] for k in sorted(kwargs))
        given = self.shardings.input_dims(args, kwargs, mesh, owner)
        hints = input_hints(roots, mesh.axis_names, self.rules, owner)
        leaves = jax.tree_util.tree_leaves(roots)
        donated = frozenset(self.donation.flat(args, kwargs, self.fun)) if self._carried_layouts else frozenset()
        seeds = []
        for i, (pinned, h, x) in enumerate(zip(given, hints, leaves)):
            placed = placed_dims(x, mesh) if not is_abstract(mesh) else None
            carried = self._carried_layout(mesh, i, x, donated) if not is_abstract(mesh) else None
            if pinned is not None or h is not None:
                if placed is not None and overridden is not None:
                    overridden[i] = "in_shardings sets its layout" if pinned else "its Flax metadata sets its layout"
                dims, cause = (pinned[0], Cause("in_shardings", pinned[1], self.shardings.source)) if pinned \
                    else (h.dims, Cause("metadata", h.description, None))
            elif placed is not None:
                dims, cause = placed, Cause("placed", f"placed on the mesh as {x.sharding.spec}", None)
            elif carried is not None:  # state a program of another shape laid out: every program keeps it so
                dims, cause = carried, Cause("carried", "donated state, laid out as this step's first plan on the "
                                                        "mesh lays it out (programs of other shapes share it)", None)
            else:
                continue
            try:
                seeds.append(input_seed(graph, i, dims, mesh, cause))
            except ShardingError as e:  # metadata does not record where the model set it: name the step
                raise ShardingError(f"{e} (an argument of {owner})") from None
        shapes = [graph.values[v].shape for v in graph.outputs]
        for vid, pinned in zip(graph.outputs, self.shardings.output_dims(out_tree, shapes, mesh)):
            if pinned is not None:
                seeds.append(Seed(vid, pinned[0], Cause("out_shardings", pinned[1], self.shardings.source), 0))
        return seeds

    def _warn_unhinted_params(self, args: tuple, kwargs: dict, roots: tuple, hints: Sequence[Any]) -> None:
        """With rules=: parameters that no hint reaches (unboxed, no in_shardings, not placed) are worth a
        warning that says how to pass their shardings (shardc/flax_rules.py)."""
        if not self.rules or self._warned_unhinted:
            return
        covered = self.shardings.covers(args, kwargs)
        pairs = jax.tree_util.tree_flatten_with_path(roots)[0]
        hinted = [h is not None or c or is_placed(x) for h, c, (_, x) in zip(hints, covered, pairs)]
        sizes = [math.prod(getattr(x, "shape", ())) for _, x in pairs]
        self._warned_unhinted = warn_unhinted_params([p for p, _ in pairs], hinted, sizes, has_logical_boxes(roots),
                                                     _describe(self.fun), _argument_names(self.fun, len(args), kwargs))


def _is_jax_sharding_error(e: ValueError) -> bool:
    """A ValueError JAX raises while checking a sharding (with_sharding_constraint, a PartitionSpec)."""
    text = str(e)
    return "with_sharding_constraint" in text or "Resource axis" in text or type(e).__name__ == "DuplicateSpecError"


def _flax_note(e: BaseException) -> str:
    """Flax's nn.DenseGeneral applies its kernel's metadata to the flattened 2-D kernel while it checks
    shapes, so metadata naming every dim of a 3-D kernel fails under any mesh: say so when that is where."""
    frames = traceback.extract_tb(e.__traceback__)
    if any(f.filename.endswith("flax/linen/linear.py") and "DenseGeneral" in (f.line or "") + f.name for f in frames) \
            or any("kernel_init_wrap" in f.name for f in frames):
        return (". Flax checks an nn.DenseGeneral kernel by re-running its initializer on the flattened 2-D kernel, "
                "where names for every dim of the kernel do not fit: name the leading dims only (e.g. (None, 'model') "
                "for a kernel [in, heads, head_dim], read as a PartitionSpec: the rest replicated) or use nn.Dense "
                "and reshape")
    return ""


def _check_search_options(search: Any, budget_s: Any, time_cap_s: Any = None) -> None:
    """`search` is True/False/None, "dp", "mcmc", "baselines" or a path ending in .json (in a directory that
    exists); `budget_s` and `time_cap_s` positive numbers of seconds or None."""
    if isinstance(search, str) and search.endswith(".json"):
        folder = os.path.dirname(os.path.abspath(search))
        if not os.path.isdir(folder):
            raise ShardingError(f"shardc.auto(search={search!r}): the directory {folder} does not exist, so the "
                                f"searched plan could not be saved there")
    elif search not in (True, False, None, "dp", "mcmc", "baselines"):
        raise ShardingError(f"shardc.auto(search={search!r}): expected True, False, 'dp', 'mcmc', 'baselines' or a "
                            f"path ending in '.json' (where the plan is saved and loaded)")
    for name, value in (("budget_s", budget_s), ("time_cap_s", time_cap_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ShardingError(f"shardc.auto({name}={value!r}): expected a positive number of seconds (or None "
                                f"for the default)")


def _check_rules(rules: Any) -> Any:
    """Logical axis rules: pairs (logical name, mesh axis | tuple of mesh axes | None), or a dict."""
    if rules is None:
        return None
    if isinstance(rules, dict):
        rules = list(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ShardingError(f"shardc.auto(rules=...) needs a sequence of (logical axis, mesh axes) pairs such as "
                            f"[('batch', 'data'), ('mlp', 'model'), ('embed', None)], got {type(rules).__name__} {rules!r:.60}")
    for entry in rules:
        ok = isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
        physical = entry[1] if ok else None
        ok = ok and (physical is None or isinstance(physical, str)
                     or (isinstance(physical, (tuple, list)) and all(isinstance(a, str) for a in physical)))
        if not ok:
            raise ShardingError(f"shardc.auto(rules=...): entry {entry!r} is not a (logical axis name, mesh axis "
                                f"name | tuple of names | None) pair")
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # (shardc's own frames, for `_internal_errors`)


@contextlib.contextmanager
def _internal_errors(phase: str, fun: Callable) -> Any:
    """An unexpected exception inside one of shardc's passes becomes a ShardingError that says which
    function, which pass and which line of shardc failed, and that it is a shardc bug; the original is
    kept as `.internal` (set SHARDC_DEBUG=1 to let it through unchanged, with its traceback)."""
    try:
        yield
    except ShardingError:
        raise
    except Exception as e:
        if os.environ.get("SHARDC_DEBUG"):
            raise
        frames = traceback.extract_tb(e.__traceback__)
        line = lambda f: SourceLine(f.filename, f.lineno, f.name)  # noqa: E731
        ours = [f for f in frames if os.path.abspath(f.filename).startswith(_PACKAGE_DIR)]
        at = f" at {line((ours or frames)[-1])}" if frames else ""
        if ours and ours[-1] is not frames[-1]:  # (raised in a library shardc called: say both)
            at += f" (raised in {line(frames[-1])})"
        err = ShardingError(f"shardc failed while {phase} {_describe(fun)}: internal {type(e).__name__}{at}: {e}. "
                            f"This is a bug in shardc, not in your program; please report it "
                            f"(SHARDC_DEBUG=1 shows the full traceback)")
        err.internal = e  # type: ignore[attr-defined]
        raise err from None


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and weak type of an argument, without its placement."""
    a = jax.typeof(x)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))


def _argument_names(fun: Callable, num_args: int, kwargs: Mapping[str, Any]) -> list[str]:
    """The step's parameter names of a call's positional arguments then its keyword ones (sorted, as they
    flatten); `[i]` where the signature does not say."""
    try:
        params = [p.name for p in inspect.signature(inspect.unwrap(fun)).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"[{i}]" for i in range(num_args)] + sorted(kwargs)


def _paths_of(tree: Any) -> list[Any]:
    dummy = jax.tree_util.tree_unflatten(tree, list(range(tree.num_leaves)))
    return [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _check_donated_once(flat: Sequence[Any], plan: Plan, fun: Callable) -> None:
    """A donated buffer passed twice in one call (`step(x, x)` with both donated) would be freed while
    still in use (XLA crashes the process on several devices): a ShardingError naming both arguments."""
    donated = set(plan.donated or ())
    if not donated:
        return
    first: dict[int, int] = {}
    for i, x in enumerate(flat):
        if not isinstance(x, jax.Array):
            continue
        j = first.setdefault(id(x), i)
        if j != i and (i in donated or j in donated):
            names = plan.input_names
            raise ShardingError(f"{_describe(fun)}: the same array is passed as {names[j]} and {names[i]}, and "
                                f"donate_argnums donates it; donate it once, or pass a copy (jnp.copy(x))")


def _check_not_deleted(flat: Sequence[Any], plan: Plan, fun: Callable) -> None:
    """An argument whose buffer an earlier call consumed (donated, or `.delete()`d): a ShardingError naming it
    (XLA:CPU was handed the dead buffer and could crash the process)."""
    for i, x in enumerate(flat):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise ShardingError(f"{_describe(fun)}: argument {plan.input_names[i]} ({x.dtype}{list(x.shape)}) was "
                                f"deleted: an earlier call donated its buffer (donate_argnums) or it was deleted. "
                                f"Pass the value that call returned instead (state = step(state, batch))")


def _tie_carried_state(graph: Graph, in_tree: Any, out_tree: Any, args: Any) -> None:
    """Tie each output leaf that is the next step's version of an input leaf (same subtree structure,
    same shapes; of several such outputs, the one whose leaves most surely update the input's) to that input, so
    both get one sharding and step 2 does not reshard."""
    from shardc.cost.flops import ELEMENTWISE
    from shardc.ir.build import _tie_rule

    arg_trees = [_unboxed_structure(jax.tree_util.tree_structure(a)) for a in args]
    arg_starts, s = [], 0
    for a in args:
        arg_starts.append(s)
        s += len(jax.tree_util.tree_leaves(a))
    node = out_tree.node_data()
    out_children = out_tree.children() if node is not None and node[0] in (tuple, list) else [out_tree]
    starts, s = [], 0
    for c in out_children:
        starts.append(s)
        s += c.num_leaves
    hinted: dict[int, set[int]] = {}  # value -> the hints of it (transitively)
    for op in graph.ops:
        if op.is_hint:
            for v in (op.inputs[0], *hinted.get(op.inputs[0], ())):
                hinted.setdefault(v, set()).add(op.outputs[0])

    def unhinted(b: int) -> int:
        """The value `b` is a hint (of a hint ...) of, or `b`."""
        while (p := graph.values[b].producer) is not None and graph.ops[p].is_hint:
            b = graph.ops[p].inputs[0]
        return b

    def updates(a: int, b: int) -> int:
        """How surely output leaf `b` is input leaf `a` updated: 2 when an elementwise op reading `a` makes it
        (`p - lr * g`, optax's `p + u`), 1 when another op other than a hint reading `a` does (a transpose of it
        is more likely a metric than the next step's state), 0 otherwise (both maybe through hints; `a` itself
        re-hinted is not an update of it)."""
        p = graph.values[unhinted(b)].producer
        if p is None or not ({a} | hinted.get(a, set())) & set(graph.ops[p].inputs):
            return 0
        return 2 if graph.ops[p].primitive in ELEMENTWISE else 1

    used: set[int] = set()
    for ai, at in enumerate(arg_trees):
        best: tuple[int, list[tuple[int, int]], int] | None = None
        for ci, child in enumerate(out_children):
            if ci in used or at != _unboxed_structure(child) or child.num_leaves == 0:
                continue
            pairs = [(graph.inputs[arg_starts[ai] + k], graph.outputs[starts[ci] + k]) for k in range(child.num_leaves)]
            if all(graph.values[a].shape == graph.values[b].shape and graph.values[a].dtype == graph.values[b].dtype
                   for a, b in pairs):
                # of outputs shaped like the argument ((metrics, new_params) both like params), the one that
                # updates it; of equals, the one with fewer hinted leaves (a value the step re-laid out for
                # another use, not the next step's state), then the first
                score = (sum(updates(a, b) for a, b in pairs), -sum(unhinted(b) != b for _, b in pairs))
                if best is None or score > best[0]:
                    best = (score, pairs, ci)
        if best is not None:
            used.add(best[2])
            for a, b in best[1]:
                if a != b:
                    graph.add_op(Op(len(graph.ops), "tie", (a,), (b,), {}, _tie_rule(graph.values[a].shape),
                                    region="io"))


def _check_pipeline(pipeline: Any, mesh: Mesh | None, devices: int | None, search: Any) -> Any:
    """`pipeline=` of shardc.auto: None, or a Pipeline on a given mesh that has its stage and data axes (or,
    planning for `devices` without a mesh, on the meshes `pipeline_meshes` makes for it). True: chosen on the
    first call (None until then)."""
    if pipeline is None or pipeline is False:
        return None
    if pipeline is True:
        from shardc.pipeline.auto_choice import check_choosing

        check_choosing(mesh, search)
        return None
    if not isinstance(pipeline, Pipeline):
        raise ShardingError(f"shardc.auto(pipeline={pipeline!r}): expected a shardc.pipeline.Pipeline, "
                            f"False or None")
    if mesh is None and devices is None:
        raise ShardingError("shardc.auto(pipeline=...) needs mesh= with the pipeline's stage axis, or devices= "
                            "(shardc.plan_for) to plan on the meshes the pipeline implies")
    if mesh is not None:
        check_mesh(pipeline, dict(mesh.shape))
    else:
        pipeline_meshes(pipeline, devices)
    return pipeline


def _unboxed_structure(tree: Any) -> Any:
    """A pytree structure with Flax's metadata boxes (`nn.Partitioned` and other `AxisMetadata`) replaced by
    what they hold: parameters passed boxed to one step and unboxed to the next have one structure."""
    node = tree.node_data()
    if node is None:
        return "*" if tree.num_leaves == 1 else None
    children = tree.children()
    if _is_axis_metadata(node[0]) and len(children) == 1:
        return _unboxed_structure(children[0])
    aux = node[1] if isinstance(node[1], (tuple, str, int, type(None))) else repr(node[1])
    return (node[0], aux if node[0] is not tuple and node[0] is not list else len(children),
            tuple(_unboxed_structure(c) for c in children))


def _is_axis_metadata(node_type: type) -> bool:
    try:
        from flax.core.meta import AxisMetadata
    except ImportError:  # pragma: no cover - flax is a dependency of the Flax integration only
        return False
    return isinstance(node_type, type) and issubclass(node_type, AxisMetadata)


def auto(fun: Callable | None = None, **options: Any) -> Any:
    """Decorator: `@shardc.auto` or `@shardc.auto(mesh=..., rules=..., in_shardings=..., out_shardings=...,
    donate_argnums=..., donate_argnames=..., static_argnums=..., search=...)` — the options of `jax.jit` keep their
    meaning (docs/jax_flax.md).

    By default the strategy search chooses every sharding the hints leave open (and, with `mesh=None`, the
    mesh shape), costed by the simulator on `topology` (default: the devices this step runs on — the
    measured `cpu-host` on CPU devices, the matching preset on H100/A100/TPU; `shardc.cost.local`);
    `search=False` propagates the hints alone, as GSPMD/Shardy do. The search's budget counts simulated
    plans, so the same seed gives the same plan however busy the machine (`time_cap_s` adds a wall-clock
    cap, at that price). `pcg=True` rewrites the chosen plan's Parallel Computation Graph with Z3-proved rules
    under the same simulator and memory limit and runs it when that is faster (docs/pcg.md; off by default:
    it costs a full simulation per candidate rewrite). `pipeline=True` (no `mesh=`) chooses a pipeline — stages,
    microbatches, schedule — or none on the first call and runs the chosen plan; `pipeline=Pipeline(...)` runs
    a given one (docs/pipeline.md). See docs/search.md."""
    _check_options("auto", options)
    options.setdefault("_source", caller_source_line())  # (where in_shardings / out_shardings were written)
    if fun is None:
        return lambda f: AutoFunction(f, **options)
    return AutoFunction(fun, **options)


_AUTO_OPTIONS = frozenset(p for p in inspect.signature(AutoFunction.__init__).parameters
                           if p not in ("self", "fun") and not p.startswith("_"))


# choose_pipeline's own options, which plan_for(pipeline=True) passes on
_CHOOSE_OPTIONS = ("screen_budget_s", "finalists", "prune_siblings", "bound_siblings", "floors", "on_choice",
                   "progress")


def _check_options(entry: str, options: Mapping[str, Any]) -> None:
    unknown = sorted(set(options) - _AUTO_OPTIONS)
    if unknown:
        tail = "" if entry == "auto" else (f". Pass the step's own keyword arguments as "
                                           f"kwargs={{{unknown[0]!r}: ...}}")
        raise TypeError(f"shardc.{entry}: unknown option(s) {unknown}; the options are those of shardc.auto "
                        f"({', '.join(sorted(_AUTO_OPTIONS))}){tail}")


def plan(f: Any, *args: Any, mesh: Mesh | None = None, kwargs: Mapping[str, Any] | None = None,
         **options: Any) -> Plan:
    """The Plan of `f(*args, **kwargs)`. `f` is an `@shardc.auto` function or a plain one."""
    _check_options("plan", options)
    if not isinstance(f, AutoFunction):
        f = AutoFunction(f, mesh=mesh, **options)
    return f.plan(*args, **(kwargs or {}))


def plan_for(f: Any, *args: Any, topology: Any, devices: int | None = None, search: Any = True,
             kwargs: Mapping[str, Any] | None = None, **options: Any) -> Plan:
    """The searched Plan of `f(*args, **kwargs)` for `topology` (all of its devices unless `devices` is
    given), which may have more devices than this host: e.g. plan for `"h100-sxm-8x8"` (64 GPUs) on an
    8-device machine. Such a plan lives on a mesh shape without devices (`jax.sharding.AbstractMesh`):
    `plan.explain()`, `plan.search`, `shardc.simulate(plan, topology)` and `save_plan` work; running or
    lowering it raises a ShardingError. Other options are those of `shardc.auto` (budget_s, seed, rules,
    donate_argnums); the step's own keyword arguments go in `kwargs`. `pipeline=True` chooses a pipeline too
    (`shardc.pipeline.choose.choose_pipeline` on all of the topology's devices: the unpipelined search, every
    candidate pipeline screened, the fastest searched in full; its options `screen_budget_s`, `finalists`,
    `prune_siblings`, `bound_siblings`, `floors`, `on_choice` and `progress` are passed on) and returns the fastest plan that
    fits."""
    from shardc.sim import as_topology

    choose = options.get("pipeline") is True
    choosing = {k: options.pop(k) for k in _CHOOSE_OPTIONS if k in options} if choose else {}
    _check_options("plan_for", options)
    n = devices if devices is not None else as_topology(topology).num_devices
    fun = f.fun if isinstance(f, AutoFunction) else f
    if choose:
        if kwargs or devices is not None or search is not True:
            raise ShardingError("shardc.plan_for(pipeline=True): chooses among pipelines on all of the topology's "
                                "devices with the search on; kwargs=, devices= and search= are not supported with it "
                                "(pass a shardc.pipeline.Pipeline to plan a given one)")
        from shardc.pipeline.choose import choose_pipeline

        rest = {k: v for k, v in options.items() if k not in ("pipeline", "budget_s")}
        best, _ = choose_pipeline(fun, args, topology=topology, budget_s=options.get("budget_s"), **choosing, **rest)
        return best
    return AutoFunction(fun, topology=topology, search=search, devices=n, **options).plan(*args, **(kwargs or {}))
