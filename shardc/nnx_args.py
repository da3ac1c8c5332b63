"""NNX objects as arguments of an `@shardc.auto` step, updated in place as `nnx.jit` does.

An NNX train step takes the model and the optimizer and mutates them: `optimizer.update(model, grads)`.
Traced as a plain pytree function, those mutations would land on copies made during tracing and be lost
— every call would start again from the same parameters. `NnxCall` turns such a call into a pure one:

- all graph nodes among the arguments (`nnx.Module`, `nnx.Optimizer`, `nnx.Rngs`, any `nnx.Object`,
  wherever they sit in the argument tree) are split together with `nnx.split`, so a variable two of them
  share is one input. Variables are not nodes here: an `nnx.State` (the `nnx.split`/`nnx.merge` style of
  a pure step) stays an ordinary pytree argument, as under `jax.jit`;
- each node is replaced in the argument tree by its own part of that state (an `nnx.State`, whose
  variables keep their `with_partitioning` metadata: those are hints as before);
- the pure function merges the nodes back, runs the user's step on them and returns the step's result
  followed by each node's new state, a top-level output with the tree structure of the state that came
  in, so shardc ties it to it (it leaves in the layout it came in, docs/architecture.md);
- after the run, `nnx.update` writes the new state into the caller's objects.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

import jax

from annotations.errors import ShardingError, describe_function
from shardc.arg_names import parameter_names, path_name

__all__ = ["NnxCall", "split_call"]


def _is_graph_node(x: Any) -> bool:
    if "flax.nnx" not in sys.modules:  # no NNX object exists before flax.nnx is imported (importing it costs ~1 s)
        return False
    from flax import nnx

    return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class NnxCall:
    """Where the graph nodes of one call's arguments are, and how they were split (hashable: a cache key)."""

    treedef: Any  # of (args, kwargs), graph nodes as leaves
    node_positions: tuple[int, ...]  # leaf indices holding graph nodes
    graphdef: Any  # nnx.split of the tuple of those nodes
    node_keys: tuple[tuple, ...] = ()  # each node's key path into (args, kwargs), for names

    def pure(self, fun: Callable) -> Callable:
        """`fun` as a function of the split arguments returning `(result, node 0's new state, ...)`."""
        from flax import nnx

        @functools.wraps(fun)
        def pure_step(*args: Any, **kwargs: Any) -> tuple:
            leaves = self.treedef.flatten_up_to((args, kwargs))
            state = nnx.State({i: leaves[p] for i, p in enumerate(self.node_positions)})
            nodes = nnx.merge(self.graphdef, state)
            for i, p in enumerate(self.node_positions):
                leaves[p] = nodes[i]
            call_args, call_kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
            out = fun(*call_args, **call_kwargs)
            self._check_only_variables_changed(state, nodes, fun)
            # (result, node 0's new state, node 1's, ...): each node's new state is a top-level output with its
            # input's tree structure, which is what shardc ties as carried state
            return (out, *self._parts(nnx.state(nodes)))

        # read by AutoFunction when it names the outputs
        pure_step.shardc_output_names = functools.partial(self.output_names, fun=fun)
        return pure_step

    def output_names(self, paths: list, fun: Callable | None = None) -> list[str]:
        """Names of the pure step's outputs (key paths into `(result, node 0's state, ...)`): the result's
        as usual (`out[...]`), each node's new state as its argument (by `fun`'s parameter names) marked
        `(updated)`."""
        from jax.tree_util import keystr

        names = parameter_names(fun) if fun is not None else ((), None)
        nodes = [path_name(names, k) for k in self.node_keys]
        return [f"out{keystr(p[1:])}" if p[0].idx == 0 else f"{nodes[p[0].idx - 1]}{keystr(p[1:])} (updated)"
                for p in paths]

    def _check_only_variables_changed(self, state_in: Any, nodes: tuple, fun: Callable) -> None:
        """What `update` carries back is the objects' Variables (new ones too, e.g. `sow`). A step that
        changes anything else (`model.flag = 1`, `model.eval()`) would silently leave the caller's objects
        different from what `nnx.jit` leaves: refuse it while tracing."""
        from flax import nnx

        carried = nnx.merge(self.graphdef, state_in)
        nnx.update(carried, nnx.state(nodes))
        if nnx.graphdef(carried) != nnx.graphdef(nodes):
            raise ShardingError(
                f"{describe_function(fun)} changes attributes of its NNX arguments that are not Variables (a plain attribute "
                f"such as `model.flag = 1`, or `model.eval()` / `model.train()`); @shardc.auto carries back only "
                f"the objects' Variables (parameters, statistics, RNG state, optimizer state). Make those "
                f"changes outside the step, or keep the value in an nnx.Variable")

    def update(self, nodes: tuple, new_parts: tuple) -> None:
        """Write a run's new node states into the caller's objects."""
        from flax import nnx

        nnx.update(nodes, nnx.State(dict(enumerate(new_parts))))

    def _parts(self, state: Any) -> tuple:
        from flax import nnx

        return tuple(state[i] if i in state else nnx.State({}) for i in range(len(self.node_positions)))


def split_call(args: tuple, kwargs: dict) -> tuple[NnxCall, tuple, dict, tuple] | None:
    """`(call, pure args, pure kwargs, nodes)` when the arguments hold NNX graph nodes, else None."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_graph_node)
    leaves = [x for _, x in pairs]
    positions = tuple(i for i, x in enumerate(leaves) if _is_graph_node(x))
    if not positions:
        return None
    from flax import nnx

    nodes = tuple(leaves[p] for p in positions)
    graphdef, state = nnx.split(nodes)
    call = NnxCall(treedef, positions, graphdef, tuple(tuple(pairs[p][0]) for p in positions))
    parts = call._parts(state)
    for i, p in enumerate(positions):
        leaves[p] = parts[i]
    pure_args, pure_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    return call, pure_args, pure_kwargs, nodes
