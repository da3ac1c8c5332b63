"""Compile-time values of small integer constants, as XLA's constant folding knows them.

XLA folds a chain of ops over constants before it partitions, so what such a chain computes shapes the
program: a gather whose indices fold to one index is a slice (`shardc.cost.windows`). JAX often computes
indices from a constant array (`jnp.take` wraps negative ones with `lt`, `add`, `select_n`), so the graph
keeps the value of each small integer constant (`Value.array`, scalars' in `Value.literal`) and
`constant_array` evaluates the ops of `FOLD_RULES` over them with numpy.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from shardc.ir.graph import Graph

__all__ = ["SMALL", "FOLD_RULES", "small_integer_array", "constant_array"]

SMALL = 64  # the most elements a kept (or folded) constant has


def small_integer_array(value: Any) -> np.ndarray | None:
    """`value` as a read-only numpy array when it is an integer or boolean array of at most `SMALL`
    elements (else None)."""
    if value is None or getattr(value, "dtype", None) is None or getattr(value, "size", SMALL + 1) > SMALL:
        return None
    if np.dtype(value.dtype).kind not in "iub":
        return None
    try:
        array = np.array(value)
    except Exception:  # noqa: BLE001 - a value numpy cannot read (a tracer) is no constant
        return None
    array.setflags(write=False)
    return array


def _broadcast(params: Any, args: Sequence[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    dims = params["broadcast_dimensions"]
    src = args[0]
    expanded = src.reshape([src.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))])
    return np.broadcast_to(expanded, shape)


def _select_n(params: Any, args: Sequence[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    which, cases = args[0].astype(np.int64), args[1:]
    return np.choose(np.broadcast_to(which, shape), [np.broadcast_to(c, shape) for c in cases])


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda params, args, shape: fn(args[0], args[1])


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda params, args, shape: fn(args[0])


# Per primitive: its result from its operands' values (numpy arrays), its params and its result's shape.
FOLD_RULES: dict[str, Callable[[Any, Sequence[np.ndarray], tuple[int, ...]], np.ndarray]] = {
    "add": _binary(np.add), "sub": _binary(np.subtract), "mul": _binary(np.multiply),
    "max": _binary(np.maximum), "min": _binary(np.minimum),
    "lt": _binary(np.less), "le": _binary(np.less_equal), "gt": _binary(np.greater),
    "ge": _binary(np.greater_equal), "eq": _binary(np.equal), "ne": _binary(np.not_equal),
    "and": _binary(np.bitwise_and), "or": _binary(np.bitwise_or), "neg": _unary(np.negative),
    "not": _unary(np.invert),
    "select_n": _select_n, "broadcast_in_dim": _broadcast,
    "reshape": lambda params, args, shape: args[0].reshape(shape),
    "squeeze": lambda params, args, shape: args[0].reshape(shape),
    "expand_dims": lambda params, args, shape: args[0].reshape(shape),
    "convert_element_type": lambda params, args, shape: args[0],
    "concatenate": lambda params, args, shape: np.concatenate(args, axis=params["dimension"]),
    "clamp": lambda params, args, shape: np.clip(args[1], args[0], args[2]),
    "iota": lambda params, args, shape: np.broadcast_to(
        np.arange(shape[params["dimension"]]).reshape(
            [-1 if d == params["dimension"] else 1 for d in range(len(shape))]), shape),
}


def constant_array(graph: Graph, v: int) -> np.ndarray | None:
    """The value of integer (or boolean) value `v` when it is known at compile time and small: a kept
    constant, a scalar literal, or an op of `FOLD_RULES` over such values; None otherwise."""
    cache: dict[int, np.ndarray | None] = graph.analysis("constant_arrays", dict)
    pending = [v]
    while pending:
        u = pending[-1]
        if u in cache:
            pending.pop()
            continue
        value = graph.values[u]
        if value.dtype is None or value.dtype.kind not in "iub" or int(np.prod(value.shape)) > SMALL:
            cache[u] = None
        elif value.array is not None:
            cache[u] = value.array
        elif value.literal is not None and value.shape == ():
            cache[u] = np.asarray(value.literal, value.dtype)
        elif value.producer is None or graph.ops[value.producer].primitive not in FOLD_RULES:
            cache[u] = None
        else:
            op = graph.ops[value.producer]
            missing = [a for a in op.inputs if a not in cache]
            if missing:
                pending.extend(missing)
                continue
            args = [cache[a] for a in op.inputs]
            cache[u] = None if any(a is None for a in args) else _fold(op, args, value)
        pending.pop()
    return cache[v]


def _fold(op: Any, args: Sequence[np.ndarray], value: Any) -> np.ndarray | None:
    """Op's (single) result over known operands, cast to the result's dtype; None if numpy cannot."""
    if len(op.outputs) != 1:
        return None
    try:
        out = np.asarray(FOLD_RULES[op.primitive](op.params, args, value.shape)).astype(value.dtype)
    except Exception:  # noqa: BLE001 - parameters this table does not model: not folded
        return None
    if out.shape != value.shape:
        return None
    out.setflags(write=False)
    return out
