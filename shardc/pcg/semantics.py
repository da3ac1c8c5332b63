"""Per-device semantics of rule terms, over numpy arrays of any element type.

A value is either global (`G`: one array, what every device of the group holds after a Combine or a
Reduce) or distributed (`D`: one piece per device). Parallel ops move between the two exactly as the
collectives do; compute ops run on each device's piece (a `G` argument is the same on every device).
At the level of global values Partition and Combine would be identities and every rule would look
true; here a rule holds only if every device ends up with the same piece.

The same interpreter evaluates symbolic arrays (entries are `z3.Real`s, elementwise functions are
uninterpreted) for proofs, and float arrays for fingerprints in rule generation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shardc.pcg.lang import PVar, Term, Var, eval_param

__all__ = ["G", "D", "IllTyped", "Model", "evaluate", "SEMANTICS", "flat_pairs"]


class IllTyped(Exception):
    """The term is not defined on these shapes/kinds (a shape mismatch, a per-device value where a
    global one is needed, ...)."""


@dataclasses.dataclass(frozen=True)
class G:
    arr: np.ndarray


@dataclasses.dataclass(frozen=True)
class D:
    pieces: tuple[np.ndarray, ...]


Val = G | D


class Model:
    """How to interpret the degree, elementwise function variables and scalar variables."""

    def __init__(self, n: int, fn: Callable[[str, int], Callable[..., Any]], scalar: Callable[[str], Any]) -> None:
        self.n = n
        self.fn = fn
        self.scalar = scalar


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise IllTyped(msg)


def _dim(x: np.ndarray, d: Any) -> int:
    _need(isinstance(d, (int, np.integer)) and 0 <= d < x.ndim, f"dim {d} out of range for rank {x.ndim}")
    return int(d)


def _split(x: np.ndarray, n: int, d: int) -> list[np.ndarray]:
    d = _dim(x, d)
    _need(x.shape[d] % n == 0, f"dim {d} of size {x.shape[d]} does not split {n} ways")
    return np.split(x, n, axis=d)


def _as_g(v: Val, op: str) -> np.ndarray:
    _need(isinstance(v, G), f"{op} needs a global value")
    return v.arr


def _as_d(v: Val, op: str) -> tuple[np.ndarray, ...]:
    _need(isinstance(v, D), f"{op} needs a per-device value")
    return v.pieces


def _same_shapes(xs: Sequence[np.ndarray], op: str) -> None:
    _need(all(x.shape == xs[0].shape for x in xs), f"{op}: pieces have different shapes")


def _sum(xs: Sequence[np.ndarray]) -> np.ndarray:
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


# -- parallel ops ------------------------------------------------------------------------------------

def _partition(m: Model, p: tuple, v: Val) -> Val:
    return D(tuple(_split(_as_g(v, "partition"), m.n, p[0])))


def _combine(m: Model, p: tuple, v: Val) -> Val:
    xs = _as_d(v, "combine")
    d = _dim(xs[0], p[0])
    _need(all(x.ndim == xs[0].ndim for x in xs), "combine: ranks differ")
    try:
        return G(np.concatenate(xs, axis=d))
    except ValueError as e:
        raise IllTyped(f"combine: {e}") from None


def _replicate(m: Model, p: tuple, v: Val) -> Val:
    return D((_as_g(v, "replicate"),) * m.n)


def _reduce(m: Model, p: tuple, v: Val) -> Val:
    xs = _as_d(v, "reduce")
    _same_shapes(xs, "reduce")
    return G(_sum(xs))


def _reduce_scatter(m: Model, p: tuple, v: Val) -> Val:
    xs = _as_d(v, "reduce_scatter")
    _same_shapes(xs, "reduce_scatter")
    return D(tuple(_split(_sum(xs), m.n, p[0])))


def _all_to_all(m: Model, p: tuple, v: Val) -> Val:
    xs = _as_d(v, "all_to_all")
    _same_shapes(xs, "all_to_all")
    s, t = p
    _need(s != t, "all_to_all: source and target dims are the same")
    _dim(xs[0], s)
    chunks = [_split(x, m.n, t) for x in xs]  # chunks[j][i]: device j's chunk for device i
    return D(tuple(np.concatenate([chunks[j][i] for j in range(m.n)], axis=s) for i in range(m.n)))


def _permute(m: Model, p: tuple, v: Val) -> Val:
    xs = _as_d(v, "permute")
    k = int(p[0])
    return D(tuple(xs[(i - k) % m.n] for i in range(m.n)))


# -- compute ops (per device) ------------------------------------------------------------------------

def _same(op: str, *xs: np.ndarray) -> None:
    _need(all(x.shape == xs[0].shape for x in xs), f"{op}: shapes {[x.shape for x in xs]} differ")


def _elementwise(fn: Callable[..., Any], *xs: np.ndarray) -> np.ndarray:
    if all(x.dtype != object for x in xs):
        return np.asarray(fn(*xs))
    return np.vectorize(lambda *a: fn(*a), otypes=[object])(*xs)


def _transpose(m: Model, p: tuple, x: np.ndarray) -> np.ndarray:
    perm = p[0]
    _need(isinstance(perm, tuple) and sorted(perm) == list(range(x.ndim)), f"transpose: {perm} is no permutation of rank {x.ndim}")
    return np.transpose(x, perm)


def _concat(m: Model, p: tuple, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    d = _dim(x, p[0])
    _need(x.ndim == y.ndim and all(a == b for i, (a, b) in enumerate(zip(x.shape, y.shape)) if i != d),
          f"concat: shapes {x.shape} and {y.shape}")
    return np.concatenate([x, y], axis=d)


def _chunk(m: Model, p: tuple, x: np.ndarray) -> np.ndarray:
    d, i, k = p
    _need(isinstance(k, int) and k > 0 and isinstance(i, int) and 0 <= i < k, f"chunk: bad index {i} of {k}")
    return _split(x, k, d)[i]


def _dot(m: Model, p: tuple, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    _need(x.ndim >= 1 and w.ndim >= 1 and x.shape[-1] == w.shape[0], f"dot: shapes {x.shape} and {w.shape}")
    return np.tensordot(x, w, axes=1)


def _dotc(m: Model, p: tuple, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    a, b = _dim(x, p[0]), _dim(w, p[1])
    _need(x.shape[a] == w.shape[b], f"dotc[{a}, {b}]: shapes {x.shape} and {w.shape}")
    return np.tensordot(x, w, axes=([a], [b]))


def _binary(fn: Callable[[Any, Any], Any], name: str) -> Callable[..., np.ndarray]:
    def op(m: Model, p: tuple, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        _same(name, x, y)
        return fn(x, y)
    return op


def _merge(m: Model, p: tuple, x: np.ndarray) -> np.ndarray:
    d = _dim(x, p[0])
    _need(d + 1 < x.ndim, f"merge: no dim after {d} in rank {x.ndim}")
    return x.reshape(x.shape[:d] + (x.shape[d] * x.shape[d + 1],) + x.shape[d + 2:])


def _unmerge(m: Model, p: tuple, x: np.ndarray) -> np.ndarray:
    d, inner = _dim(x, p[0]), p[1]
    _need(isinstance(inner, int) and inner > 0 and x.shape[d] % inner == 0, f"unmerge: {x.shape[d]} by {inner}")
    return x.reshape(x.shape[:d] + (x.shape[d] // inner, inner) + x.shape[d + 1:])


COMPUTE: dict[str, Callable[..., np.ndarray]] = {
    "add": _binary(lambda x, y: x + y, "add"),
    "sub": _binary(lambda x, y: x - y, "sub"),
    "mul": _binary(lambda x, y: x * y, "mul"),
    "neg": lambda m, p, x: -x,
    "scale": lambda m, p, x: x * p[0],
    "ew1": lambda m, p, x: _elementwise(m.fn(p[0], 1), x),
    "ew2": lambda m, p, x, y: (_same("ew2", x, y), _elementwise(m.fn(p[0], 2), x, y))[1],
    "dot": _dot,
    "dotc": _dotc,
    "transpose": _transpose,
    "concat": _concat,
    "chunk": _chunk,
    "sum": lambda m, p, x: np.sum(x, axis=_dim(x, p[0])),
    "merge": _merge,
    "unmerge": _unmerge,
}

PARALLEL: dict[str, Callable[[Model, tuple, Val], Val]] = {
    "partition": _partition, "combine": _combine, "replicate": _replicate, "reduce": _reduce,
    "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "permute": _permute,
}

SEMANTICS = {**COMPUTE, **PARALLEL}


def _lift(fn: Callable[..., np.ndarray], m: Model, params: tuple, args: Sequence[Val]) -> Val:
    if any(isinstance(a, D) for a in args):
        return D(tuple(fn(m, params, *[a.pieces[i] if isinstance(a, D) else a.arr for a in args])
                       for i in range(m.n)))
    return G(fn(m, params, *[a.arr for a in args]))


def evaluate(term: Term, inputs: Mapping[str, Val], params: Mapping[str, Any], model: Model,
             memo: dict | None = None) -> Val:
    """The value of `term` with tensor variables bound to `inputs` and parameters to `params`
    (which should include "n", the degree)."""
    memo = {} if memo is None else memo
    if isinstance(term, Var):
        return inputs[term.name]
    key = id(term)
    if key in memo:
        return memo[key]
    args = [evaluate(a, inputs, params, model, memo) for a in term.args]
    try:
        ps = tuple(_param_value(p, params, model) for p in term.params)
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise IllTyped(f"{term.op}: parameter {e}") from None
    if term.op in PARALLEL:
        out = PARALLEL[term.op](model, ps, args[0])
    else:
        try:
            out = _lift(COMPUTE[term.op], model, ps, args)
        except (ValueError, IndexError) as e:
            raise IllTyped(f"{term.op}: {e}") from None
    memo[key] = out
    return out


def _param_value(p: Any, params: Mapping[str, Any], model: Model) -> Any:
    if isinstance(p, PVar) and p.name not in params:
        raise KeyError(p.name)
    return eval_param(p, params)


def flat_pairs(a: Val, b: Val, n: int) -> list[tuple[Any, Any, str]]:
    """Entry pairs (lhs, rhs, where) that must be equal for a == b on every device; IllTyped if the
    shapes differ."""
    pa = a.pieces if isinstance(a, D) else (a.arr,) * n
    pb = b.pieces if isinstance(b, D) else (b.arr,) * n
    out = []
    for dev, (x, y) in enumerate(zip(pa, pb)):
        if x.shape != y.shape:
            raise IllTyped(f"device {dev} holds shape {x.shape} on the left and {y.shape} on the right")
        for idx in np.ndindex(*x.shape):
            out.append((x[idx], y[idx], f"device {dev} entry {list(idx)}"))
    return out
