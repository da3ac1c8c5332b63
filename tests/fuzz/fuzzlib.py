"""Random programs for fuzzing shardc, and the oracle that checks one.

A `Program` is a straight-line list of `Step`s over numbered values (value i is made by step i):
inputs, einsums with random subscripts, elementwise chains, reshapes that split, merge and refactor
dims, transposes, reductions, broadcasts, concatenates, slices, gathers, pads, reverses, cumsums,
dynamic slices — and `split`/`shard`/`replicate` hints — on a random mesh of 8 devices with 1-3 axes.
It is plain data: its repr is Python that rebuilds it, so a failure found by the generator pastes
into `test_fuzz_regressions.py` as it is.

`programs()` is the hypothesis strategy; `check_program(p)` runs `p` unsharded (jax.jit, one device)
and under `@shardc.auto` on its mesh and asserts that

* forward values and gradients agree (float32 tolerance scaled by the values' magnitude);
* the compiled program's input/output shardings, and the returned arrays' shardings, are the plan's;
* the compiled program's collectives are the plan's (kinds and bytes, as the simulator counts them), and
  XLA logged no involuntary full rematerialization (with `strict_collectives=False` a difference is
  recorded in the outcome instead of raised: see `Outcome.collectives_differ`);
* every hinted dim is placed as the hint says;
* no op fell back to the conservative (replicate-everything) rule: the fuzzer only uses covered
  primitives, so a fallback means a rule failed on a shape.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import flax.linen as nn

import shardc
from annotations import UNCONSTRAINED
from shardc.check import compare, xla_log
from shardc.fresh_compile import uncached
from annotations.primitive import resolve_dims

__all__ = ["Step", "Program", "programs", "check_program", "evaluate", "make_args", "describe", "MESHES"]

Attrs = tuple[tuple[str, Any], ...]

MESHES: tuple[tuple[tuple[str, int], ...], ...] = (
    (("x", 8),),
    (("x", 2), ("y", 4)),
    (("x", 4), ("y", 2)),
    (("x", 2), ("y", 2), ("z", 2)),
    (("x", 1), ("y", 8)),
    (("x", 2), ("y", 1), ("z", 4)),
)
SIZES = (1, 2, 3, 4, 4, 6, 8, 8, 8, 12, 16, 16)
MAX_ELEMS = 2048
MAX_RANK = 4


@dataclasses.dataclass(frozen=True)
class Step:
    """One value of the program: `kind` applied to earlier values `args`, with attributes `attrs`."""

    kind: str
    args: tuple[int, ...]
    attrs: Attrs
    shape: tuple[int, ...]
    dtype: str = "float32"

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default


@dataclasses.dataclass(frozen=True)
class Program:
    """Steps over an 8-device mesh; `outputs` are value ids. `step_mode`: the function takes its float
    inputs as one tuple and returns (outputs, inputs - 0.1 * grads), like a train step (carried state).
    The output cotangents of the gradient are a last argument (a tuple), or with `const_cotangents`
    constants closed over (XLA then folds them into the backward pass; see the regression tests)."""

    mesh: tuple[tuple[str, int], ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    step_mode: bool = False
    const_cotangents: bool = False

    @property
    def inputs(self) -> list[int]:
        return [i for i, s in enumerate(self.steps) if s.kind == "input"]

    @property
    def float_inputs(self) -> list[int]:
        return [i for i in self.inputs if self.steps[i].dtype == "float32"]


# ----------------------------------------------------------------------------------------- evaluation

UNARY: dict[str, Callable[[Any], Any]] = {
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "neg": jnp.negative,
    "square": lambda x: 0.5 * jnp.square(x),
    "log1p_sq": lambda x: jnp.log1p(x * x),
    "sigmoid": jax.nn.sigmoid,
    "scale": lambda x: x * 0.5 + 1.0,
}
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "max": jnp.maximum,
}
REDUCE: dict[str, Callable[..., Any]] = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean}


def _shard(x: Any, spec: Sequence[Any]) -> Any:
    return shardc.shard(x, [UNCONSTRAINED if e == "?" else e for e in spec])


@functools.lru_cache(maxsize=None)
def _mesh(items: tuple[tuple[str, int], ...]) -> Any:
    return shardc.make_mesh(dict(items))


def _hint(x: Any, step: Step, mesh: tuple[tuple[str, int], ...]) -> Any:
    how = step.attr("how")
    if how == "wsc" and not mesh:  # the unsharded reference: jax's constraint is the identity
        return x
    if how == "split":
        return shardc.split(x, step.attr("dim"), step.attr("axes"))
    if how == "shard":
        return _shard(x, step.attr("spec"))
    if how == "wsc":  # jax's own constraint, on the program's mesh
        entries = [P.UNCONSTRAINED if e == "?" else e for e in step.attr("spec")]
        return jax.lax.with_sharding_constraint(x, NamedSharding(_mesh(mesh), P(*entries)))
    return shardc.replicate(x)


def _maybe_hint(x: Any, spec: Sequence[Any] | None) -> Any:
    return x if spec is None else _shard(x, spec)


def apply_step(step: Step, vals: Sequence[Any], mesh: tuple[tuple[str, int], ...] = ()) -> Any:
    """The value of one non-input step given the values before it."""
    a = [vals[i] for i in step.args]
    k = step.kind
    if k == "einsum":
        return jnp.einsum(step.attr("spec"), *a)
    if k == "unary":
        return UNARY[step.attr("fn")](a[0])
    if k == "binary":
        return BINARY[step.attr("fn")](a[0], a[1])
    if k == "reshape":
        return jnp.reshape(a[0], step.shape)
    if k == "transpose":
        return jnp.transpose(a[0], step.attr("perm"))
    if k == "reduce":
        return REDUCE[step.attr("fn")](a[0], axis=step.attr("dims"))
    if k == "broadcast":
        return jnp.broadcast_to(jnp.expand_dims(a[0], step.attr("pos")), step.shape)
    if k == "concat":
        return jnp.concatenate(a, axis=step.attr("dim"))
    if k == "slice":
        return lax.slice(a[0], step.attr("start"), step.attr("limit"), step.attr("strides"))
    if k == "gather":
        idx = a[1] if len(a) > 1 else np.asarray(step.attr("indices"), np.int32)
        return jnp.take(a[0], idx, axis=step.attr("dim"))
    if k == "pad":
        return lax.pad(a[0], jnp.asarray(step.attr("value", 0.0), a[0].dtype), step.attr("config"))
    if k == "rev":
        return lax.rev(a[0], step.attr("dims"))
    if k == "cumsum":
        return jnp.cumsum(a[0], axis=step.attr("dim"))
    if k == "dynamic_slice":
        return lax.dynamic_slice(a[0], step.attr("start"), step.shape)
    if k == "scatter_add":
        index = (slice(None),) * step.attr("dim") + (np.asarray(step.attr("indices"), np.int32),)
        return a[0].at[index].add(a[1])
    if k == "update_slice":
        return lax.dynamic_update_slice(a[0], a[1], step.attr("start"))
    if k == "where":
        return jnp.where(a[0] > 0.1, a[0], a[1])
    if k == "sort":
        return jnp.sort(a[0], axis=step.attr("dim"))
    if k == "argmax":
        return jnp.argmax(a[0], axis=step.attr("dim")).astype(a[0].dtype)  # (float64 in the float64 adjudication)
    if k == "scan":  # ys[t] = c_t, c_{t+1} = c_t / 2 + tanh(xs[t]); an optional hint on the carry inside
        inner = step.attr("inner")

        def body(c: Any, x: Any) -> tuple[Any, Any]:
            c = _maybe_hint(0.5 * c + jnp.tanh(x), inner)
            return c, c

        return lax.scan(body, a[0], a[1])[1]
    if k == "fori":
        inner = step.attr("inner")
        return lax.fori_loop(0, step.attr("n"), lambda i, c: _maybe_hint(0.9 * c + 0.1 * jnp.sin(c), inner), a[0])
    if k == "nested_loop":  # a fori_loop inside a scan, both carrying c; the inner body reads a loop-invariant w
        inner = step.attr("inner")

        def cell(c: Any, x: Any) -> tuple[Any, Any]:
            c = lax.fori_loop(0, step.attr("n"), lambda i, h: _maybe_hint(0.5 * h + 0.5 * jnp.tanh(h @ a[2]), inner),
                              c + x)
            return c, c

        return lax.scan(cell, a[0], a[1])[1]
    if k == "rnn":  # ys[t] = c_{t+1} = tanh(c_t @ w + xs[t]): its gradient adds c_t^T @ g_t into w's cotangent each trip
        inner = step.attr("inner")

        def rnn_cell(c: Any, x: Any) -> tuple[Any, Any]:
            c = _maybe_hint(jnp.tanh(c @ a[2] + x), inner)
            return c, c

        return lax.scan(rnn_cell, a[0], a[1])[1]
    if k == "rnn_proj":  # ys[t] = c_{t+1} = tanh(c_t @ w + xs[t] @ v): an input projection no carry needs (an LSTM's)
        inner = step.attr("inner")

        def proj_cell(c: Any, x: Any) -> tuple[Any, Any]:
            c = _maybe_hint(jnp.tanh(c @ a[2] + x @ a[3]), inner)
            return c, c

        return lax.scan(proj_cell, a[0], a[1])[1]
    if k == "cond":  # both branches hint their result alike (differently is a ShardingError: test_bad_inputs)
        inner = step.attr("inner")
        return lax.cond(jnp.sum(a[0]) > 0, lambda v: _maybe_hint(jnp.tanh(v), inner),
                        lambda v: _maybe_hint(v * 0.5 - 0.1, inner), a[0])
    if k == "jit_chain":  # a nested jit (inlined by shardc's graph builder) with a hint inside
        return jax.jit(lambda v: _maybe_hint(jnp.tanh(v) * 1.5, step.attr("inner")))(a[0])
    if k == "remat_chain":
        return jax.checkpoint(lambda v: _maybe_hint(jnp.sin(v) * v, step.attr("inner")))(a[0])
    if k == "vmap_hint":  # a hint written per row, vmapped over dim `dim`
        d = step.attr("dim")
        return jax.vmap(lambda r: _shard(r, step.attr("spec")), in_axes=d, out_axes=d)(a[0])
    if k == "hint":
        return _hint(a[0], step, mesh)
    raise ValueError(f"unknown step kind {k!r}")


def evaluate(prog: Program, inputs: Sequence[Any], reference: bool = False) -> tuple[Any, ...]:
    """The program's outputs for values of its inputs (in `prog.inputs` order). `reference`: as the
    unsharded reference computes them, with `with_sharding_constraint` hints as the identity they are
    (on the program's mesh, plain jax.jit would let XLA's own propagation plan the reference, and XLA's
    partitioner can abort on what it chooses: test_fuzz_regressions.py::test_xla_spmd_abort_...)."""
    vals: list[Any] = []
    it = iter(inputs)
    mesh = () if reference else prog.mesh
    for step in prog.steps:
        vals.append(next(it) if step.kind == "input" else apply_step(step, vals, mesh))
    return tuple(vals[i] for i in prog.outputs)


def _weights(shape: tuple[int, ...], salt: int) -> np.ndarray:
    """A fixed, non-constant cotangent for one output (so every gradient element matters)."""
    n = math.prod(shape)
    return np.cos(np.arange(n, dtype=np.float32) * 0.7 + salt).reshape(shape).astype(np.float32)


def _box(x: Any, step: Step) -> Any:
    """An input with Flax partitioning metadata (`meta`: per-dim mesh axes) is passed boxed."""
    meta = step.attr("meta")
    return x if meta is None else nn.Partitioned(x, names=meta)


def _unbox(x: Any) -> Any:
    return x.value if isinstance(x, nn.Partitioned) else x


def program_function(prog: Program, reference: bool = False) -> Callable[..., Any]:
    """What is compiled: outputs and gradients (step mode: outputs and updated float inputs).
    `reference`: the unsharded reference's version (see `evaluate`)."""
    inputs, floats = prog.inputs, prog.float_inputs
    weights = [_weights(prog.steps[o].shape, i) for i, o in enumerate(prog.outputs)]

    def with_grads(*args: Any) -> Any:
        if not prog.const_cotangents:
            *args, cts = args
        by_id = dict(zip(inputs, [_unbox(a) for a in args]))

        def f(*fl: Any) -> tuple[Any, ...]:
            env = dict(by_id)
            env.update(zip(floats, fl))
            return evaluate(prog, [env[i] for i in inputs], reference)

        outs, pullback = jax.vjp(f, *[by_id[i] for i in floats])
        if prog.const_cotangents:  # (constants of the outputs' dtypes: float64 in the float64 adjudication)
            cts = tuple(jnp.asarray(w, o.dtype) for w, o in zip(weights, outs))
        return outs, pullback(tuple(cts))

    if not prog.step_mode:
        return with_grads

    ints = [i for i in inputs if i not in floats]

    def train_step(params: tuple[Any, ...], *rest: Any) -> Any:
        env = dict(zip(floats, params))
        env.update(zip(ints, rest))
        outs, grads = with_grads(*[env[i] for i in inputs], *rest[len(ints):])
        new = [_unbox(p) - 0.1 * g for p, g in zip(params, grads)]
        return outs, tuple(_box(n, prog.steps[i]) for n, i in zip(new, floats))

    return train_step


def make_args(prog: Program, seed: int = 0) -> tuple[Any, ...]:
    """Arguments of `program_function(prog)`: floats uniform in [-1, 1], indices in range."""
    rng = np.random.default_rng(seed)
    vals = {}
    for i in prog.inputs:
        s = prog.steps[i]
        if s.dtype == "float32":
            vals[i] = _box(rng.uniform(-1, 1, s.shape).astype(np.float32), s)
        else:
            vals[i] = rng.integers(0, s.attr("high"), s.shape).astype(np.int32)
    cts = () if prog.const_cotangents else \
        (tuple(_weights(prog.steps[o].shape, k) for k, o in enumerate(prog.outputs)),)
    if prog.step_mode:
        ints = [vals[i] for i in prog.inputs if i not in prog.float_inputs]
        return (tuple(vals[i] for i in prog.float_inputs), *ints, *cts)
    return (*(vals[i] for i in prog.inputs), *cts)


def describe(prog: Program) -> str:
    """Readable pseudo-code of a program (for failure reports)."""
    lines = [f"mesh {dict(prog.mesh)}{'  (train-step mode)' if prog.step_mode else ''}"]
    for i, s in enumerate(prog.steps):
        attrs = ", ".join(f"{k}={v!r}" for k, v in s.attrs)
        args = ", ".join(f"v{a}" for a in s.args)
        lines.append(f"  v{i}: {s.dtype}{list(s.shape)} = {s.kind}({args}{'; ' if attrs and args else ''}{attrs})")
    lines.append(f"  return {', '.join(f'v{o}' for o in prog.outputs)}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- generation


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _axis_choices(mesh: dict[str, int], size: int, free: Sequence[str]) -> list[tuple[str, ...]]:
    """Ordered tuples of distinct free axes whose size product divides `size` (at most 2 axes)."""
    out: list[tuple[str, ...]] = []
    for a in free:
        if size % mesh[a] == 0:
            out.append((a,))
            for b in free:
                if b != a and size % (mesh[a] * mesh[b]) == 0:
                    out.append((a, b))
    return out


class _NoCandidate(Exception):
    """The op drawn has no value it can apply to (try another op)."""


class _Gen:
    """Program under construction inside a hypothesis `draw`."""

    def __init__(self, draw: Any, mesh: tuple[tuple[str, int], ...]) -> None:
        self.draw = draw
        self.mesh_items = mesh
        self.mesh = dict(mesh)
        self.steps: list[Step] = []

    # -- helpers -----------------------------------------------------------------------------------
    def add(self, kind: str, args: Sequence[int], shape: Sequence[int], dtype: str = "float32", **attrs: Any) -> int:
        self.steps.append(Step(kind, tuple(args), tuple(attrs.items()), tuple(int(s) for s in shape), dtype))
        return len(self.steps) - 1

    def shape(self, v: int) -> tuple[int, ...]:
        return self.steps[v].shape

    def floats(self, pred: Callable[[tuple[int, ...]], bool] = lambda s: True) -> list[int]:
        return [i for i, s in enumerate(self.steps) if s.dtype == "float32" and pred(s.shape)]

    def operand(self, pred: Callable[[tuple[int, ...]], bool] = lambda s: True) -> int:
        """A float value for an op's main operand: usually the newest that fits, so ops form chains
        and hints travel through several ops."""
        cands = self.floats(pred)
        if cands and self.coin(3):
            return cands[-1]
        return self.pick(cands)

    def pick(self, cands: Sequence[Any]) -> Any:
        if not cands:
            raise _NoCandidate
        return self.draw(st.sampled_from(list(cands)))

    def coin(self, p_true_of_4: int = 2) -> bool:
        return self.draw(st.integers(0, 3)) < p_true_of_4

    def new_shape(self, rank: int | None = None) -> tuple[int, ...]:
        r = rank if rank is not None else self.draw(st.integers(1, 3))
        dims: list[int] = []
        for _ in range(r):
            dims.append(self.pick([s for s in SIZES if math.prod(dims) * s <= MAX_ELEMS // 4] or [1]))
        return tuple(dims)

    def new_input(self, shape: Sequence[int]) -> int:
        if self.coin(1):  # Flax partitioning metadata on the argument: a seed on a graph input
            meta = tuple(None if e in ("?", None) else (e[0] if len(e) == 1 else e) for e in self.spec(shape))
            if any(meta):
                return self.add("input", (), shape, meta=meta)
        return self.add("input", (), shape)

    def same_shape_operand(self, shape: tuple[int, ...]) -> int:
        cands = self.floats(lambda s: s == shape)
        if cands and self.coin(2):
            return self.pick(cands)
        return self.new_input(shape)

    # -- ops ---------------------------------------------------------------------------------------
    def einsum(self) -> int | None:
        a = self.operand(lambda s: 1 <= len(s) <= MAX_RANK)
        sa = self.shape(a)
        letters = iter("abcdefghijklmnop")
        la = [next(letters) for _ in sa]
        size = dict(zip(la, sa))
        if self.coin(2):  # an existing value as the other operand
            b = self.pick(self.floats(lambda s: 1 <= len(s) <= MAX_RANK))
            sb = self.shape(b)
            lb, free = [], list(la)
            for s in sb:
                match = [l for l in free if size[l] == s]
                if match and self.coin(3):
                    l = self.pick(match)
                    free.remove(l)
                else:
                    l = next(letters)
                    size[l] = s
                lb.append(l)
        else:  # a new weight sharing some of a's dims
            shared = self.draw(st.lists(st.sampled_from(la), unique=True, min_size=1, max_size=len(la)))
            lb = list(shared)
            for _ in range(self.draw(st.integers(0, 2 if len(lb) < 3 else 0))):
                l = next(letters)
                size[l] = self.pick([2, 4, 6, 8])
                lb.insert(self.draw(st.integers(0, len(lb))), l)
            b = self.new_input([size[l] for l in lb])
        everything = list(dict.fromkeys(la + lb))
        out = self.draw(st.lists(st.sampled_from(everything), unique=True, min_size=1,
                                 max_size=min(MAX_RANK, len(everything))))
        shape = [size[l] for l in out]
        if math.prod(shape) > MAX_ELEMS:
            return None
        return self.add("einsum", (a, b), shape, spec=f"{''.join(la)},{''.join(lb)}->{''.join(out)}")

    def unary(self) -> int:
        a = self.operand()
        return self.add("unary", (a,), self.shape(a), fn=self.pick(sorted(UNARY)))

    def binary(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        if self.coin(3):
            b = self.same_shape_operand(sa)
        else:  # numpy broadcasting: a trailing part of a's shape, some dims 1
            k = self.draw(st.integers(1, len(sa)))
            tail = [1 if self.coin(1) else s for s in sa[len(sa) - k:]]
            b = self.same_shape_operand(tuple(tail))
        args = (a, b) if self.coin(2) else (b, a)
        return self.add("binary", args, sa, fn=self.pick(sorted(BINARY)))

    def reshape(self) -> int | None:
        a = self.operand(lambda s: len(s) >= 1)
        sa = list(self.shape(a))
        how = self.pick(["split", "merge", "refactor"])
        if how == "split":
            d = self.draw(st.integers(0, len(sa) - 1))
            divs = [p for p in _divisors(sa[d]) if 1 < p < sa[d]]
            if not divs or len(sa) >= MAX_RANK:
                return None
            p = self.pick(divs)
            shape = sa[:d] + [p, sa[d] // p] + sa[d + 1:]
        elif how == "merge":
            if len(sa) < 2:
                return None
            d = self.draw(st.integers(0, len(sa) - 2))
            shape = sa[:d] + [sa[d] * sa[d + 1]] + sa[d + 2:]
        else:
            n, shape = math.prod(sa), []
            rank = self.draw(st.integers(1, MAX_RANK))
            for _ in range(rank - 1):
                divs = [p for p in _divisors(n) if p > 1] or [1]
                p = self.pick(divs)
                shape.append(p)
                n //= p
            shape.append(n)
        if shape == sa:
            return None
        return self.add("reshape", (a,), shape)

    def transpose(self) -> int | None:
        a = self.operand(lambda s: len(s) >= 2)
        sa = self.shape(a)
        perm = tuple(self.draw(st.permutations(range(len(sa)))))
        if perm == tuple(range(len(sa))):
            return None
        return self.add("transpose", (a,), [sa[p] for p in perm], perm=perm)

    def reduce(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        dims = tuple(sorted(self.draw(st.lists(st.integers(0, len(sa) - 1), unique=True, min_size=1,
                                               max_size=len(sa)))))
        shape = [s for i, s in enumerate(sa) if i not in dims]
        return self.add("reduce", (a,), shape, fn=self.pick(sorted(REDUCE)), dims=dims)

    def broadcast(self) -> int | None:
        a = self.operand(lambda s: len(s) < MAX_RANK)
        sa = list(self.shape(a))
        pos = self.draw(st.integers(0, len(sa)))
        n = self.pick([2, 3, 4, 8])
        shape = sa[:pos] + [n] + sa[pos:]
        if math.prod(shape) > MAX_ELEMS:
            return None
        return self.add("broadcast", (a,), shape, pos=pos)

    def concat(self) -> int | None:
        a = self.operand(lambda s: len(s) >= 1)
        sa = list(self.shape(a))
        d = self.draw(st.integers(0, len(sa) - 1))
        fits = self.floats(lambda s: len(s) == len(sa) and all(x == y for i, (x, y) in enumerate(zip(s, sa)) if i != d))
        if self.coin(2):
            b = self.pick(fits)
        else:
            sb = list(sa)
            sb[d] = self.pick([1, 2, 4, 6])
            b = self.new_input(sb)
        shape = list(sa)
        shape[d] += self.shape(b)[d]
        if math.prod(shape) > MAX_ELEMS:
            return None
        args = (a, b) if self.coin(2) else (b, a)
        return self.add("concat", args, shape, dim=d)

    def slice_(self) -> int | None:
        a = self.operand(lambda s: any(x >= 2 for x in s))
        sa = self.shape(a)
        start, limit, strides = [0] * len(sa), list(sa), [1] * len(sa)
        d = self.pick([i for i, s in enumerate(sa) if s >= 2])
        start[d] = self.draw(st.integers(0, sa[d] - 1))
        limit[d] = self.draw(st.integers(start[d] + 1, sa[d]))
        strides[d] = self.pick([1, 1, 2])
        shape = list(sa)
        shape[d] = -(-(limit[d] - start[d]) // strides[d])
        return self.add("slice", (a,), shape, start=tuple(start), limit=tuple(limit), strides=tuple(strides))

    def gather(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        d = self.draw(st.integers(0, len(sa) - 1))
        ishape = tuple(self.draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=2)))
        shape = list(sa[:d]) + list(ishape) + list(sa[d + 1:])
        if self.coin(2):
            idx = self.add("input", (), ishape, dtype="int32", high=sa[d])
            return self.add("gather", (a, idx), shape, dim=d)
        # (negative indices wrap; one past the end is out of bounds: jnp.take fills NaN, XLA folds it)
        flat = self.draw(st.lists(st.integers(-sa[d], sa[d]), min_size=math.prod(ishape), max_size=math.prod(ishape)))
        indices = np.asarray(flat).reshape(ishape).tolist()
        return self.add("gather", (a,), shape, dim=d, indices=_tuplify(indices))

    def pad(self) -> int | None:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        d = self.draw(st.integers(0, len(sa) - 1))
        lo, hi, interior = self.draw(st.integers(0, 2)), self.draw(st.integers(0, 2)), self.draw(st.integers(0, 1))
        config = tuple((lo, hi, interior) if i == d else (0, 0, 0) for i in range(len(sa)))
        shape = list(sa)
        shape[d] = lo + hi + sa[d] + max(sa[d] - 1, 0) * interior
        if math.prod(shape) > MAX_ELEMS:
            return None
        return self.add("pad", (a,), shape, config=config)

    def rev(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        dims = tuple(sorted(self.draw(st.lists(st.integers(0, len(sa) - 1), unique=True, min_size=1,
                                               max_size=len(sa)))))
        return self.add("rev", (a,), sa, dims=dims)

    def cumsum(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        return self.add("cumsum", (a,), self.shape(a), dim=self.draw(st.integers(0, len(self.shape(a)) - 1)))

    def dynamic_slice(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        sizes = [self.draw(st.integers(1, s)) for s in sa]
        start = tuple(self.draw(st.integers(0, s - z)) for s, z in zip(sa, sizes))
        return self.add("dynamic_slice", (a,), sizes, start=start)

    def hint(self) -> int | None:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        names = list(self.mesh)
        how = self.pick(["split", "split", "shard", "shard", "count", "replicate"])
        if how == "replicate":
            return self.add("hint", (a,), sa, how="replicate")
        if how in ("split", "count"):
            d = self.draw(st.integers(0, len(sa) - 1))
            choices = _axis_choices(self.mesh, sa[d], names)
            if how == "count":
                counts = sorted({math.prod(self.mesh[x] for x in c) for c in choices} - {1})
                if not counts:
                    return None
                return self.add("hint", (a,), sa, how="split", dim=d, axes=self.pick(counts))
            if not choices:
                return None
            axes = self.pick(choices)
            return self.add("hint", (a,), sa, how="split", dim=d, axes=axes[0] if len(axes) == 1 and self.coin(2) else axes)
        return self.add("hint", (a,), sa, how=self.pick(["shard", "shard", "wsc"]), spec=self.spec(sa))

    def spec(self, shape: Sequence[int]) -> tuple[Any, ...]:
        """A valid per-dim spec: "?" (open), None (replicated) or mesh axes that divide the dim."""
        spec: list[Any] = []
        used: set[str] = set()
        for s in shape:
            options: list[Any] = ["?", None] + _axis_choices(self.mesh, s, [n for n in self.mesh if n not in used])
            e = self.pick(options)
            if isinstance(e, tuple):
                used.update(e)
            spec.append(e)
        return tuple(spec)

    def inner_spec(self, shape: Sequence[int]) -> tuple[Any, ...] | None:
        return self.spec(shape) if self.coin(2) else None

    def operand_of_shape(self, shape: Sequence[int]) -> int:
        """An existing float value of exactly this shape, or a new input."""
        shape = tuple(shape)
        cands = self.floats(lambda s: s == shape)
        if cands and self.coin(2):
            return self.pick(cands)
        return self.new_input(shape)

    def scatter_add(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        d = self.draw(st.integers(0, len(sa) - 1))
        k = self.draw(st.integers(1, 3))
        indices = tuple(self.draw(st.lists(st.integers(0, sa[d] - 1), min_size=k, max_size=k)))
        upd = self.operand_of_shape(sa[:d] + (k,) + sa[d + 1:])
        return self.add("scatter_add", (a, upd), sa, dim=d, indices=indices)

    def update_slice(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        sizes = [self.draw(st.integers(1, s)) for s in sa]
        start = tuple(self.draw(st.integers(0, s - z)) for s, z in zip(sa, sizes))
        return self.add("update_slice", (a, self.operand_of_shape(sizes)), sa, start=start)

    def where(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        return self.add("where", (a, self.operand_of_shape(self.shape(a))), self.shape(a))

    def sort(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        return self.add("sort", (a,), self.shape(a), dim=self.draw(st.integers(0, len(self.shape(a)) - 1)))

    def argmax(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        d = self.draw(st.integers(0, len(sa) - 1))
        return self.add("argmax", (a,), sa[:d] + sa[d + 1:], dim=d)

    def scan(self) -> int | None:
        a = self.operand(lambda s: 1 <= len(s) < MAX_RANK)
        sa = self.shape(a)
        t = self.pick([2, 3, 4])
        if t * math.prod(sa) > MAX_ELEMS:
            return None
        xs = self.operand_of_shape((t,) + sa)
        return self.add("scan", (a, xs), (t,) + sa, inner=self.inner_spec(sa))

    def fori(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        sa = self.shape(a)
        return self.add("fori", (a,), sa, n=self.pick([1, 2, 3]), inner=self.inner_spec(sa))

    def _loop_with_weight(self, min_rank: int) -> tuple[tuple[int, int, int], tuple[int, ...]] | None:
        """(carry, stacked inputs over 2 or 3 trips, a square matrix on the carry's last dim) and the stacked
        shape, for a loop whose body multiplies its carry by that matrix; None when it would be too large."""
        a = self.operand(lambda s: min_rank <= len(s) < MAX_RANK)
        sa = self.shape(a)
        t = self.pick([2, 3])
        if t * math.prod(sa) > MAX_ELEMS:
            return None
        return (a, self.operand_of_shape((t,) + sa), self.operand_of_shape((sa[-1], sa[-1]))), (t,) + sa

    def nested_loop(self) -> int | None:
        drawn = self._loop_with_weight(1)
        if drawn is None:
            return None
        args, shape = drawn
        return self.add("nested_loop", args, shape, n=self.pick([1, 2]), inner=self.inner_spec(shape[1:]))

    def rnn(self) -> int | None:
        drawn = self._loop_with_weight(2)
        if drawn is None:
            return None
        args, shape = drawn
        return self.add("rnn", args, shape, inner=self.inner_spec(shape[1:]))

    def rnn_proj(self) -> int | None:
        drawn = self._loop_with_weight(2)
        if drawn is None:
            return None
        args, shape = drawn
        v = self.operand_of_shape((shape[-1], shape[-1]))
        return self.add("rnn_proj", args + (v,), shape, inner=self.inner_spec(shape[1:]))

    def jit_chain(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        return self.add("jit_chain", (a,), self.shape(a), inner=self.inner_spec(self.shape(a)))

    def remat_chain(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        return self.add("remat_chain", (a,), self.shape(a), inner=self.inner_spec(self.shape(a)))

    def vmap_hint(self) -> int:
        a = self.operand(lambda s: len(s) >= 2)
        sa = self.shape(a)
        d = self.draw(st.integers(0, len(sa) - 1))
        return self.add("vmap_hint", (a,), sa, dim=d, spec=self.spec(sa[:d] + sa[d + 1:]))

    def cond(self) -> int:
        a = self.operand(lambda s: len(s) >= 1)
        return self.add("cond", (a,), self.shape(a), inner=self.inner_spec(self.shape(a)))


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(e) for e in x) if isinstance(x, list) else x


OPS = ("einsum", "einsum", "unary", "binary", "reshape", "reshape", "transpose", "reduce", "broadcast",
       "concat", "slice_", "gather", "pad", "rev", "cumsum", "dynamic_slice", "hint", "hint", "hint", "hint")
# Beyond the list: scatters, selects, sorts, argmax and control flow (regions joined by ties).
EXTRA_OPS = ("scatter_add", "update_slice", "where", "sort", "argmax", "scan", "fori", "cond", "nested_loop",
             "jit_chain", "remat_chain", "vmap_hint", "rnn")


# Programs with loops, for the loop restructuring's checks (shardc/loops.py): recurrences (`rnn`, and `rnn_proj`
# with an input projection to hoist and whose input gradient sinks) drawn often. (Not in EXTRA_OPS: the other soaks'
# seeds draw the programs they drew.)
LOOP_OPS = OPS + ("rnn", "rnn", "rnn_proj", "rnn_proj", "rnn_proj", "scan", "nested_loop", "fori", "einsum")


@st.composite
def programs(draw: Any, min_ops: int = 2, max_ops: int = 8, meshes: Sequence[Any] = MESHES,
             ops: Sequence[str] = OPS + EXTRA_OPS, const_cotangents: bool = False) -> Program:
    """A random program (see the module docstring)."""
    g = _Gen(draw, draw(st.sampled_from(list(meshes))))
    for _ in range(draw(st.integers(1, 2))):
        g.new_input(g.new_shape())
    n = draw(st.integers(min_ops, max_ops))
    made = 0
    if draw(st.integers(0, 3)) < 3:  # most programs start from a hinted input, as train steps do
        made += g.hint() is not None
    for _ in range(4 * n):
        if made >= n:
            break
        kind = draw(st.sampled_from(list(ops)))
        try:
            v = getattr(g, kind)()
        except _NoCandidate:
            v = None
        made += v is not None
    # Every value reaches an output (jit would prune an unused input, and dead code checks nothing).
    used = {a for s in g.steps for a in s.args}
    sinks = [i for i in g.floats() if i not in used]
    hinted = [i for i, s in enumerate(g.steps) if s.kind == "hint" and i not in sinks]
    extra = draw(st.lists(st.sampled_from(hinted), unique=True, max_size=1)) if hinted else []
    outputs = tuple(sinks + extra)
    return Program(g.mesh_items, tuple(g.steps), outputs, step_mode=draw(st.booleans()),
                   const_cotangents=const_cotangents)


# ----------------------------------------------------------------------------------------- the oracle


def check_seeded(seed_value: int, count: int, check: Callable[[Program], Any], **program_options: Any) -> list[Any]:
    """`check` on `count` programs drawn with hypothesis seed `seed_value` (`programs(**program_options)`; the
    same programs on every run: no example database), shrinking a failure; returns what each check returned."""
    from hypothesis import HealthCheck, Phase, given, seed, settings

    seen: list[Any] = []

    @seed(seed_value)
    @settings(max_examples=count, deadline=None, database=None, derandomize=False,
              phases=(Phase.explicit, Phase.generate, Phase.shrink), print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(**program_options))
    def run(prog: Program) -> None:
        seen.append(check(prog))

    run()
    return seen


class FuzzFailure(AssertionError):
    """A program on which shardc disagrees with plain JAX or with its own plan."""


def _close(got: Any, want: Any, what: str, rtol: float = 2e-4) -> None:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if g.shape != w.shape:
        raise FuzzFailure(f"{what}: shape {g.shape} != {w.shape}")
    finite = np.isfinite(w)
    if not finite.all():  # overflow in the reference: the same elements must overflow the same way
        if not np.array_equal(g[~finite], w[~finite], equal_nan=True):
            raise FuzzFailure(f"{what}: non-finite elements differ from the unsharded run")
        g, w = g[finite], w[finite]
    scale = 1.0 + float(np.max(np.abs(w))) if w.size else 1.0
    err = float(np.max(np.abs(g - w))) if w.size else 0.0
    if not np.isfinite(err) or err > rtol * scale:
        raise FuzzFailure(f"{what}: max |sharded - unsharded| = {err:.3g} (scale {scale:.3g})")


def _same_sharding(actual: Any, planned: Any, ndim: int, what: str) -> None:
    if not actual.is_equivalent_to(planned, ndim):
        raise FuzzFailure(f"{what}: compiled/actual sharding {actual} but the plan says {planned}")


def _check_hints(plan: shardc.Plan) -> int:
    """Every closed dim of every hint is placed as hinted in the plan; returns the number checked."""
    n = 0
    for op in plan.graph.ops:
        if op.primitive != "shardc_hint":
            continue
        spec = op.params["spec"]
        vid = op.outputs[0]
        placed = plan.shardings[vid].dims
        for d, want in enumerate(resolve_dims(spec, plan.mesh)):
            if want is UNCONSTRAINED:
                continue
            n += 1
            if tuple(placed[d]) != tuple(want):
                raise FuzzFailure(f"hint {spec.describe()} on {plan.graph.values[vid].shape}: dim {d} planned "
                                  f"{placed[d]} but hinted {want}")
    return n


def _check_metadata(prog: Program, plan: shardc.Plan) -> int:
    """Inputs with Flax metadata are placed as the metadata says; returns the number of dims checked."""
    n = 0
    for k, i in enumerate(prog.float_inputs if prog.step_mode else prog.inputs):
        meta = prog.steps[i].attr("meta")
        if meta is None:
            continue
        want = tuple(() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in meta)
        got = plan.shardings[plan.graph.inputs[k]].dims
        n += len(want)
        if got != want:
            raise FuzzFailure(f"input {plan.input_names[k]} has metadata {meta} but is planned {got}")
    return n


def collective_difference(plan: shardc.Plan, compiled: Any, log: Sequence[str]) -> str | None:
    """How the compiled program's collectives differ from the plan's, kind by kind and byte for byte (as
    the simulator counts them), or an involuntary rematerialization XLA logged; None when they agree."""
    report = compare(plan, compiled, log)
    if report.involuntary_remats:
        return f"XLA: {report.involuntary_remats[0].strip()[:300]}"
    for row in report.rows:
        if row.quantity.endswith(" bytes") and row.quantity != "peak memory bytes" and row.predicted != row.compiled:
            return f"{row.quantity}: the plan has {row.predicted:,.0f}, the compiled program {row.compiled:,.0f}"
    return None


def _check_shardings_well_formed(plan: shardc.Plan) -> None:
    """Every planned sharding names mesh axes once each and divides its dims evenly."""
    sizes = plan.mesh_sizes
    for v, sh in zip(plan.graph.values, plan.shardings):
        axes = [a for d in sh.dims for a in d]
        if len(axes) != len(set(axes)) or any(a not in sizes for a in axes) or len(sh.dims) != len(v.shape):
            raise FuzzFailure(f"value {v.name} {v.shape} planned {sh}: bad axes")
        for d, (size, ax) in enumerate(zip(v.shape, sh.dims)):
            if size % math.prod(sizes[a] for a in ax):
                raise FuzzFailure(f"value {v.name} {v.shape} planned {sh}: dim {d} not divisible")


@dataclasses.dataclass
class Outcome:
    """What one check saw (for counts in the soak report)."""

    hints_checked: int
    reshards: int
    sharded_values: int
    values: int
    upstream_bug: str | None = None  # a known XLA miscompilation of shardc's (correct) program
    rounding: bool = False  # off the float32 reference by more than rtol, but no less accurate than it
    collectives_differ: str | None = None  # the compiled collectives are not the plan's (non-strict checks)


# XLA passes that miscompile some correct sharded programs, with the regression test that pins each.
# When shardc's result is wrong, its program is compiled again with the pass disabled: if that result
# is right, shardc's program was right and the failure is XLA's (recorded, not a shardc failure).
KNOWN_XLA_BUGS: dict[str, str] = {
    "scatter_expander": "XLA CPU's scatter expander + algsimp miscompile a scatter-add into a dim sharded over "
                        "the mesh when it is added to a resharded value (test_fuzz_regressions.py::"
                        "test_xla_cpu_scatter_add_into_a_sharded_dim)",
}


def _results_close(got: Any, ref: Any, what: str, rtol: float = 2e-4) -> None:
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(ref))):
        _close(g, w, f"{what} leaf {i}", rtol)


def _to64(a: Any) -> Any:
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype == np.float32 else a


# An unsharded float32 result further than this (relative to the result's scale) from the float64 one is
# ill-conditioned: two summation orders' errors are both of that size, and their ratio says nothing.
ILL_CONDITIONED = 1e-3
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _float32_sensitivity(fun: Callable, args64: Any, truth: Sequence[np.ndarray], draws: int = 4) -> list[float]:
    """Per result, how far the float64 run moves when every float input is perturbed by float32's rounding (each
    element by a random relative amount of at most 2**-24, `draws` times, a fixed seed): the spread rounding alone
    gives float32 runs of a program that amplifies it (e.g. `sin` of large values)."""
    rng = np.random.default_rng(0)
    spread = [0.0] * len(truth)
    with jax.enable_x64(True):
        run = jax.jit(fun)
        for _ in range(draws):
            moved = jax.tree.map(lambda a: a * (1 + 2.0**-24 * rng.uniform(-1, 1, a.shape))
                                 if a.dtype == np.float64 else a, args64)
            for i, (o, t) in enumerate(zip(jax.tree.leaves(run(*moved)), truth)):
                o = np.asarray(o, np.float64)
                both = np.isfinite(t) & np.isfinite(o)
                if both.any():
                    spread[i] = max(spread[i], float(np.max(np.abs(o[both] - t[both]))))
    return spread


def _as_accurate_as_unsharded(fun: Callable, args: Any, got: Any, ref: Any,
                              sharded64: Callable | None = None) -> bool:
    """Float32 results of a reordered computation differ by rounding; when they differ by more than the
    tolerance, ask a float64 run which is right: the sharded result must be no further from it than
    twice the unsharded float32 result's own error (or within tolerance of it). Where that does not settle
    it because float32 cannot say — the unsharded float32 result is ill-conditioned (`ILL_CONDITIONED`), the
    sharded error is within twice the spread float32 rounding of the inputs alone gives
    (`_float32_sensitivity`), or an element is out of float32's range (its true value above `FLOAT32_MAX`, or
    the unsharded float32 run overflowed it too) — the sharded program itself is run in float64 (`sharded64`)
    and must equal the float64 unsharded result: a wrong sharding is wrong in any dtype."""
    args64 = jax.tree.map(_to64, args)
    with jax.enable_x64(True):
        truth = jax.jit(fun)(*args64)
        truth = [np.asarray(t, np.float64) for t in jax.tree.leaves(truth)]
    ill: list[int] = []
    spread: list[float] | None = None
    for i, (g, w, t) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(ref), truth)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != t.shape or np.isfinite(g[~np.isfinite(t)]).any():
            return False
        fin = np.isfinite(t)
        lost = fin & ~np.isfinite(g)  # finite in float64, not in the sharded float32 run
        if lost.any() or (fin & ~np.isfinite(w)).any():
            kept = lost & np.isfinite(w) & ~(np.abs(t) > FLOAT32_MAX)  # lost where float32 holds it and did unsharded
            if sharded64 is None or kept.any():
                return False
            ill.append(i)
            continue
        if not fin.any():
            continue
        scale = float(np.max(np.abs(t[fin])))
        err_sharded = float(np.max(np.abs(g[fin] - t[fin])))
        err_unsharded = float(np.max(np.abs(w[fin] - t[fin])))
        if err_sharded > max(2 * err_unsharded, 2e-4 * (1 + scale)):
            if sharded64 is None:
                return False
            if not err_unsharded > ILL_CONDITIONED * scale:
                spread = spread if spread is not None else _float32_sensitivity(fun, args64, truth)
                if not err_sharded <= 2 * spread[i]:
                    return False
            ill.append(i)
    if not ill:
        return True
    with jax.enable_x64(True):
        got64 = [np.asarray(x, np.float64) for x in jax.tree.leaves(sharded64(*args64))]
    for i in ill:
        g, t = got64[i], truth[i]
        fin = np.isfinite(t)
        if g.shape != t.shape or float(np.max(np.abs(g[fin] - t[fin]))) > 1e-9 * (1 + float(np.max(np.abs(t[fin])))):
            return False
    return True


def _known_xla_bug(info: Any, flat: Sequence[Any], got: Any, ref: Any) -> str | None:
    """The known XLA bug that explains a wrong result: shardc's lowered program, compiled as usual,
    gives exactly what shardc returned, and compiled without the faulty pass gives the right result."""
    lowered = info.jitted.lower(*flat)
    try:
        _results_close(got, lowered.compile()(*flat), "shardc's result vs its compiled program's", rtol=0.0)
    except FuzzFailure:
        return None  # wrong numbers that do not come from the compiled program: shardc's own
    for passes, description in KNOWN_XLA_BUGS.items():
        try:
            out = lowered.compile(compiler_options={"xla_disable_hlo_passes": passes})(*flat)
            _results_close(out, ref, "result")
        except Exception:  # noqa: BLE001 - still wrong (or not compilable so): not this bug
            continue
        return description
    return None


# XLA's algebraic simplifier is not exact on NaN and infinity (it folds `x * 0` of a converted predicate into a
# select, so 0 * inf is 0): where shardc's result is non-finite and the unsharded run's is not, the unsharded
# program compiled without it says what IEEE arithmetic gives; if that is shardc's result, the difference is the
# simplifier's choice on one program and not the other (a reshard between the two ops hides the pattern).
NON_IEEE_SIMPLIFIER = ("algsimp", "XLA's algebraic simplifier rewrites arithmetic on NaN/inf in the unsharded program "
                                  "(x * 0 of a converted predicate made a select): shardc's result is the IEEE one, "
                                  "the unsharded program's compiled without the simplifier (fuzz seed 130000)")


# XLA:CPU's all-reduce of max or min drops NaN (pure JAX: `jnp.max` of [nan, 1, 2, .5] split over 2 devices is
# 2.0; pinned by test_fuzz_regressions.py::test_xla_cpu_all_reduce_max_drops_nan). A program with such an
# all-reduce and a result finite where the unsharded one is NaN is the runtime's (see `nan_dropped`).
NAN_DROPPING_ALL_REDUCE = ("XLA:CPU's all-reduce of max/min drops NaN: shardc's program reduces partial maxima "
                           "across devices, which the unsharded program does on one (seed 700)")


def max_min_all_reduces(hlo: str) -> bool:
    """Whether a compiled HLO module has an all-reduce whose reduction is a max or a min."""
    roots = dict(re.findall(r"^%?([\w.\-]+) [^\n]*?\{\n(?:[^\n]*\n)*?\s*ROOT [^=]+= \S+ (\w+)\(", hlo, re.M))
    return any(roots.get(name) in ("maximum", "minimum")
               for name in re.findall(r"all-reduce(?:-start)?\([^\n]*?to_apply=%?([\w.\-]+)", hlo))


def nan_dropped(got: Any, ref: Any) -> bool:
    """Whether some result is finite where the unsharded one is NaN (what a NaN-dropping max/min all-reduce
    does; its consequences downstream, a max's gradient taken at another element, differ in finite values too,
    so those are not compared: a program with such an all-reduce and such a result is not adjudicated further)."""
    return any(bool((np.isnan(np.asarray(w, np.float64)) & np.isfinite(np.asarray(g, np.float64))).any())
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref)) if np.shape(g) == np.shape(w))


def _ieee_reference_agrees(reference: Callable, args: Any, got: Any, ref: Any) -> bool:
    """Whether `got` differs from `ref` only where one of them is non-finite, and equals the unsharded program
    compiled without XLA's algebraic simplifier (`NON_IEEE_SIMPLIFIER`)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        both = np.isfinite(g) & np.isfinite(w)
        if g.shape != w.shape or not np.allclose(g[both], w[both], rtol=2e-4, atol=2e-4):
            return False
    exact = jax.jit(reference).lower(*args).compile(compiler_options={"xla_disable_hlo_passes": NON_IEEE_SIMPLIFIER[0]})
    try:
        _results_close(got, exact(*args), "IEEE reference")
    except FuzzFailure:
        return False
    return True


def xla_semantics_difference(reference: Callable, args: Any, got: Any, ref: Any, hlo: Callable[[], str]) -> str | None:
    """Why `got` (a sharded run compiled to the HLO text `hlo()` returns) differs from the unsharded `ref` by
    XLA's doing rather than shardc's — its simplifier's non-IEEE folds (`NON_IEEE_SIMPLIFIER`), XLA:CPU's
    NaN-dropping max/min all-reduce (`NAN_DROPPING_ALL_REDUCE`) — or None."""
    if _ieee_reference_agrees(reference, args, got, ref):
        return NON_IEEE_SIMPLIFIER[1]
    if nan_dropped(got, ref) and max_min_all_reduces(hlo()):
        return NAN_DROPPING_ALL_REDUCE
    return None


def _compare(reference: Callable, args: Any, got: Any, info: Any, what: str,
             sharded64: Callable | None = None) -> tuple[bool, str | None]:
    """Assert shardc's `got` equals the unsharded reference on `args`: within float32 tolerance, or no
    less accurate than the reference against a float64 run (`_as_accurate_as_unsharded`), or wrong only
    by a known XLA bug. Returns (rounding, upstream bug)."""
    ref = jax.jit(reference)(*args)
    try:
        _results_close(got, ref, what)
        return False, None
    except FuzzFailure:
        if _as_accurate_as_unsharded(reference, args, got, ref, sharded64):
            return True, None
        upstream = _known_xla_bug(info, jax.tree.leaves(args), got, ref) or xla_semantics_difference(
            reference, args, got, ref, lambda: info.jitted.lower(*jax.tree.leaves(args)).compile().as_text())
        if upstream is None:
            raise
        return False, upstream


# The search's budget per program with `check_program(search=True)` (seconds on the reference machine, turned
# into a count of plans: the same plan on a busy machine).
SEARCH_BUDGET_S = 0.5


def planned(fun: Callable, mesh: Any, seed: int = 0, search: bool = False) -> Any:
    """`shardc.auto` of a generated program on its mesh: its hints' plan, or with `search` the strategy search's
    (budget `SEARCH_BUDGET_S`, `seed`)."""
    if search:
        return shardc.auto(fun, mesh=mesh, search=True, budget_s=SEARCH_BUDGET_S, seed=seed)
    return shardc.auto(fun, mesh=mesh, search=False)


def _same_plan(fun: Callable, mesh: Any, plan: Any, seed: int, search: bool) -> Any:
    """`fun` under `plan`, to be traced again in float64: the hints' plan, or a searched `plan` rebuilt from the
    search's decisions on the new trace (`shardc.auto`'s retrace of a priced plan), since a search of the float64
    program would price other bytes and may choose another plan."""
    if not search:
        return shardc.auto(fun, mesh=mesh, search=False)
    from shardc.auto import AutoFunction  # (the retrace option is internal: `shardc.pipeline.choose` runs plans so)

    again = AutoFunction(fun, mesh=mesh, search=True, budget_s=SEARCH_BUDGET_S, seed=seed, _resume=plan)

    def run(*args: Any) -> Any:
        out = again(*args)
        if list(again.plan(*args).shardings) != list(plan.shardings):
            raise FuzzFailure("the float64 retrace of the searched plan planned other shardings")
        return out

    return run


def with_loops_restructured(fun: Callable) -> Callable:
    """`fun` as `shardc.loops.restructure_loops` rewrites its traced program (traced again for each call's
    argument types: the float64 adjudication traces it in float64)."""
    from shardc.loops import restructure_loops

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        out = restructure_loops(closed)
        program = closed if out is None else out[0]
        flat = jax.core.eval_jaxpr(program.jaxpr, program.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), flat)

    return run


def check_program(prog: Program, seed: int = 0, strict_collectives: bool = True, search: bool = False,
                  loops: bool = False) -> Outcome:
    """Run `prog` unsharded and under shardc and assert the properties in the module docstring
    (a collective difference is raised when `strict_collectives`, else recorded in the outcome). `search`: the
    plan is the strategy search's on the program's mesh (`search=True`, a small budget) instead of the hints'
    — layouts no hint asks for, lowered and compiled; the float64 run of the sharded program that settles
    ill-conditioned results runs that same plan then (`_same_plan`), not a search of its own. `loops`: the program
    shardc plans and runs is the one with its loops restructured (`with_loops_restructured`); the reference is
    the program as written."""
    fun = program_function(prog)
    if loops:
        fun = with_loops_restructured(fun)
    reference = program_function(prog, reference=True)
    args = make_args(prog, seed)
    mesh = shardc.make_mesh(dict(prog.mesh))
    auto = planned(fun, mesh, seed, search)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = auto.compiled_info(*args)
    plan = info.plan
    if plan.graph.conservative_primitives or any("sharding rule" in str(w.message) for w in caught):
        raise FuzzFailure(f"conservative fallback for {sorted(plan.graph.conservative_primitives)}: "
                          + "; ".join(str(w.message) for w in caught))
    got = auto(*args)
    flat = jax.tree.leaves(args)
    sharded64 = _same_plan(fun, mesh, plan, seed, search)  # (traced afresh for float64)
    rounding, upstream = _compare(reference, args, got, info, "result", sharded64)
    with uncached(), xla_log() as log:  # (its warnings: compiled afresh)
        compiled = info.jitted.lower(*flat).compile()
    differ = collective_difference(plan, compiled, log)
    if differ is not None and strict_collectives:
        raise FuzzFailure(differ)
    in_s = compiled.input_shardings[0]  # None for an input jit pruned (unused): nothing to compare
    out_s = jax.tree.leaves(compiled.output_shardings)
    planned_in, planned_out = plan.input_shardings(), plan.output_shardings()
    if len(in_s) != len(planned_in) or len(out_s) != len(planned_out):
        raise FuzzFailure(f"compiled program has {len(in_s)} inputs/{len(out_s)} outputs, plan "
                          f"{len(planned_in)}/{len(planned_out)}")
    for i, (s, p, x) in enumerate(zip(in_s, planned_in, flat)):
        if s is not None:
            _same_sharding(s, p.named(mesh), np.ndim(x), f"input {plan.input_names[i]}")
    for i, (s, p, y) in enumerate(zip(out_s, planned_out, jax.tree.leaves(got))):
        _same_sharding(s, p.named(mesh), y.ndim, f"output {plan.output_names[i]}")
        _same_sharding(y.sharding, p.named(mesh), y.ndim, f"returned array {plan.output_names[i]}")
    hints = _check_hints(plan) + _check_metadata(prog, plan)
    _check_shardings_well_formed(plan)
    if prog.step_mode and upstream is None:  # a second step takes the first's carried state as it comes out
        args2 = (jax.tree.leaves(got)[-len(prog.float_inputs):], *args[1:])
        args2 = (tuple(args2[0]), *args2[1:])
        got2 = auto(*args2)  # shardc takes its own outputs as they are placed
        rounding2, upstream = _compare(reference, jax.tree.map(np.asarray, args2), got2, info, "step 2 result",
                                       sharded64)
        rounding = rounding or rounding2
    sharded = sum(1 for sh in plan.shardings if sh.axes())
    return Outcome(hints, len(plan.reshards), sharded, len(plan.shardings), upstream, rounding, differ)


# ----------------------------------------------------------------------------------------- shrinking


def _drop_step(prog: Program, i: int, replacement: int | None) -> Program | None:
    """`prog` without step i; its uses read `replacement` instead (None: the step must be unused)."""
    steps: list[Step] = []
    new_id: dict[int, int | None] = {}
    for j, s in enumerate(prog.steps):
        if j == i:
            new_id[j] = new_id.get(replacement) if replacement is not None else None
            continue
        args = tuple(new_id[a] for a in s.args)
        if any(a is None for a in args):
            return None
        new_id[j] = len(steps)
        steps.append(dataclasses.replace(s, args=args))  # type: ignore[arg-type]
    outs = tuple(dict.fromkeys(o2 for o in prog.outputs if (o2 := new_id.get(o)) is not None))
    if not outs:
        return None
    return dataclasses.replace(prog, steps=tuple(steps), outputs=outs)


def _well_formed(prog: Program) -> bool:
    used = {a for s in prog.steps for a in s.args} | set(prog.outputs)
    return bool(prog.inputs) and all(i in used for i in prog.inputs)


def shrink_program(prog: Program, fails: Callable[[Program], bool], budget: int = 200) -> Program:
    """A smaller program that still `fails`: drop outputs, drop steps (or bypass them by an argument of
    the same shape), leave train-step mode — greedily, until nothing more goes or `budget` tries."""
    tries = 0

    def still_fails(q: Program | None) -> bool:
        nonlocal tries
        if q is None or not _well_formed(q) or tries >= budget:
            return False
        tries += 1
        return fails(q)

    changed = True
    while changed and tries < budget:
        changed = False
        for o in list(prog.outputs):
            q = dataclasses.replace(prog, outputs=tuple(x for x in prog.outputs if x != o))
            if q.outputs and still_fails(q):
                prog, changed = q, True
        for i in reversed(range(len(prog.steps))):
            if i >= len(prog.steps):
                continue
            s = prog.steps[i]
            for r in [None] + [a for a in s.args if prog.steps[a].shape == s.shape]:
                q = _drop_step(prog, i, r)
                if still_fails(q):
                    prog, changed = q, True  # type: ignore[assignment]
                    break
        for flag in ("step_mode", "const_cotangents"):
            if getattr(prog, flag):
                q = dataclasses.replace(prog, **{flag: False})
                if still_fails(q):
                    prog, changed = q, True
    return prog
