"""Catch a train step whose carried state changes shape between calls.

`state = step(state, batch)` feeds a call's outputs back as the next call's arguments. If an output
comes back with another shape than the argument it replaces, every call is a new signature: shardc
would silently re-trace, re-plan and recompile on each step. `CarriedShapes` remembers the previous
call's outputs (weakly) and warns (`ReplanWarning`, once per function) when an argument *is* one of them
and its shape differs from what the previous call took in that position. A warning, not an error: the
results are right, and composing a shape-changing function with itself (`f(f(x))`) is legitimate.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Sequence

import jax

__all__ = ["CarriedShapes", "ReplanWarning"]


class ReplanWarning(UserWarning):
    """Calls that re-plan or re-place their arguments each time: a call's outputs came back as the next call's
    arguments with another shape, or static argument values were planned on different meshes."""


def _aval(x: Any) -> tuple[tuple[int, ...], str] | None:
    try:
        a = jax.typeof(x)
    except TypeError:
        return None
    return tuple(a.shape), str(a.dtype)


def _fmt(aval: tuple[tuple[int, ...], str]) -> str:
    return f"{aval[1]}{list(aval[0])}"


class CarriedShapes:
    """The previous call of one AutoFunction: its argument tree and avals, and its outputs by identity."""

    def __init__(self) -> None:
        self._tree: Any = None
        self._avals: list[Any] = []
        self._names: Sequence[str] = ()
        self._outs: dict[int, tuple[weakref.ref, str]] = {}
        self._warned = False

    def check(self, tree: Any, leaves: Sequence[Any], where: str) -> None:
        """Warn if a leaf is an output of the previous call whose shape differs from the argument it
        replaces (same argument tree as the previous call)."""
        if self._warned or self._tree is None or not self._outs or tree != self._tree:
            return
        for k, x in enumerate(leaves):
            hit = self._outs.get(id(x))
            if hit is None or hit[0]() is not x:
                continue
            now, before = _aval(x), self._avals[k]
            if now is not None and before is not None and now != before:
                name = self._names[k] if k < len(self._names) else f"leaf {k}"
                self._warned = True
                warnings.warn(
                    f"the outputs of {where} change shape between calls: argument {name} is {_fmt(now)}, "
                    f"returned as {hit[1]} by the previous call, which took {_fmt(before)} there. State "
                    f"carried from step to step (params, optimizer state, caches) should keep its shape, or "
                    f"every call re-plans and recompiles; pad it to a fixed size instead.", ReplanWarning,
                    stacklevel=3)
                return

    def record(self, tree: Any, leaves: Sequence[Any], names: Sequence[str], outs: Sequence[Any],
               out_names: Sequence[str]) -> None:
        self._tree, self._avals, self._names = tree, [_aval(x) for x in leaves], names
        self.record_outputs(outs, out_names)

    def record_outputs(self, outs: Sequence[Any], out_names: Sequence[str]) -> None:
        """A call with the recorded call's tree and avals (the fast path): only its outputs are new."""
        self._outs = {}
        for o, n in zip(outs, out_names):
            try:
                self._outs[id(o)] = (weakref.ref(o), n)
            except TypeError:  # not weak-referenceable (Python scalars): never carried state we could miss
                pass
