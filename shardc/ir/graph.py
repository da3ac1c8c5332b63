"""The graph IR: values (tensors) and ops over them, built once from a jaxpr and read by every pass."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from annotations.errors import SourceLine, is_library_file
from shardc.rules.core import FactorRule

__all__ = ["Value", "Op", "Graph", "source_line_of"]


@dataclasses.dataclass(slots=True)
class Value:
    """One tensor of the program. `producer` is the op that defines it (None for inputs/constants)."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    name: str
    producer: int | None = None
    is_const: bool = False
    literal: int | float | None = None  # a scalar literal's value (a dynamic slice's constant start index)
    array: np.ndarray | None = None  # a small integer constant's value (`shardc.ir.folding.SMALL`): gather indices

    @property
    def nbytes(self) -> int:
        n = int(self.dtype.itemsize) if self.dtype is not None else 4
        for s in self.shape:
            n *= s
        return n

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(slots=True)
class Op:
    """One primitive application (or a `tie` joining a region's values to the outside)."""

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]
    rule: FactorRule
    conservative: bool = False
    source_info: Any = None
    region: str = ""

    @property
    def source(self) -> SourceLine | None:
        return source_line_of(self.source_info)

    @property
    def is_hint(self) -> bool:
        return self.primitive in ("shardc_hint", "sharding_constraint")


def source_line_of(source_info: Any) -> SourceLine | None:
    """The innermost user frame (not jax/flax/optax/shardc) of a jaxpr eqn's source_info."""
    if source_info is None:
        return None
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return None
    codes, lastis = tb.raw_frames()
    frames = list(zip(codes, lastis))
    # The user's own line; failing that (ops made inside Flax/optax), the innermost line outside JAX.
    for keep in (lambda path: not is_library_file(path), lambda path: not _is_jax_file(path)):
        for code, lasti in frames:
            if keep(code.co_filename):
                line = code.co_firstlineno
                try:
                    line = type(tb).code_addr2line(code, lasti)
                except Exception:  # pragma: no cover - older jaxlib
                    pass
                return SourceLine(code.co_filename, line, code.co_qualname)
    return None


_JAX_DIRS: tuple[str, ...] | None = None


def _is_jax_file(path: str) -> bool:
    global _JAX_DIRS
    if _JAX_DIRS is None:
        import os

        import jax
        import jaxlib

        import annotations
        import shardc

        _JAX_DIRS = tuple(os.path.dirname(m.__file__) for m in (jax, jaxlib, annotations, shardc))
    return path.startswith(_JAX_DIRS) or path.startswith("<")


def _dtype(dtype: Any) -> Any:
    """A numpy dtype, or JAX's extended dtype as it is (typed PRNG keys: `key<fry>` has an itemsize
    but is no numpy dtype)."""
    if dtype is None:
        return None
    import jax

    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return np.dtype(dtype)


_T = TypeVar("_T")


@dataclasses.dataclass
class Graph:
    """Ops in program order over values. `inputs`/`outputs` are the flattened train-step args/results."""

    values: list[Value] = dataclasses.field(default_factory=list)
    ops: list[Op] = dataclasses.field(default_factory=list)
    inputs: list[int] = dataclasses.field(default_factory=list)
    outputs: list[int] = dataclasses.field(default_factory=list)
    users: list[list[int]] = dataclasses.field(default_factory=list)
    # value id of each top-level jaxpr variable, for lowering
    top_level: dict[Any, int] = dataclasses.field(default_factory=dict)
    # which eqn of the top-level jaxpr made which op ids
    conservative_primitives: set[str] = dataclasses.field(default_factory=set)
    # values a region reads that no op of it takes as an operand: a cond's branch index (XLA computes it
    # whenever the cond runs)
    region_reads: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # iterations of each scan region (a scan with no scanned operand or result, e.g. a fori_loop with
    # static bounds, has no scan_slice/scan_stack op to read its length from)
    region_trips: dict[str, int] = dataclasses.field(default_factory=dict)
    # scan regions that run their iterations in reverse (`reverse=True`, as the transpose of a scan is): their
    # body computes its index as `length - 1 - i`, which XLA's loop-invariant code motion rewrites
    region_reversed: set[str] = dataclasses.field(default_factory=set)

    def analysis(self, name: str, compute: Callable[[], _T]) -> _T:
        """`compute()`, once per graph: a plan-independent analysis cached on the graph under `name`."""
        cache = self.__dict__.setdefault("_shardc_analyses", {})
        if name not in cache:
            cache[name] = compute()
        return cache[name]

    def share_analyses(self, other: "Graph", names: tuple[str, ...]) -> None:
        """Take `other`'s cached analyses `names` (those it has) as this graph's own."""
        theirs = other.__dict__.get("_shardc_analyses", {})
        mine = self.__dict__.setdefault("_shardc_analyses", {})
        mine.update((n, theirs[n]) for n in names if n in theirs)

    def add_value(self, shape: tuple[int, ...], dtype: Any, name: str = "", *, is_const: bool = False,
                  literal: int | float | None = None, array: np.ndarray | None = None) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, tuple(int(s) for s in shape), _dtype(dtype), name or f"%{vid}",
                                 is_const=is_const, literal=literal, array=array))
        self.users.append([])
        return vid

    def add_op(self, op: Op) -> int:
        self.ops.append(op)
        for v in op.inputs:
            self.users[v].append(op.id)
        for v in op.outputs:
            if self.values[v].producer is None:
                self.values[v].producer = op.id
        return op.id

    def hint_ops(self) -> list[Op]:
        return [op for op in self.ops if op.is_hint]

    def carried(self) -> dict[int, int]:
        """Carried train-step state: graph input -> the output that is its next value (the io ties)."""
        return {op.inputs[0]: op.outputs[0] for op in self.ops if op.primitive == "tie" and op.region == "io"}

    def __repr__(self) -> str:
        return f"Graph({len(self.ops)} ops, {len(self.values)} values, {len(self.inputs)} inputs)"
