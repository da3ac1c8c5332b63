"""The per-call fast path of `@shardc.auto`: a repeated call with the previous call's argument structure, shapes
and layouts goes straight to the compiled program.

`AutoFunction.__call__` does much per call in Python (routing static and NNX arguments, the plan's signature,
placement checks and notes, carried-state checks), 45-80 us per argument leaf, where `jax.jit` dispatches in C++:
8-13 ms a call with 168 leaves (a ResNet-18 train step's), 1.2 ms with this path (`bench/dispatch.py`). After a
call took the plain route, `FastCall` keeps what it found (the argument tree, each leaf's shape, dtype and weak
type, the layout the plan takes it in, the compiled program); the next call whose arguments are the same tree and
avals, each leaf already in the plan's layout (the previous step's outputs) or an uncommitted value to place there
(a fresh batch), is placed and run without the rest, which could not have changed its outcome. A Python scalar (a
learning rate passed each step) matches a scalar of the same Python type, as the full route traces it (a weakly
typed 0-d array). Anything else (tracers, other layouts, other shapes, another ambient mesh) takes the full route,
which records anew.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["FastCall"]

_ArrayImpl = type(jax.numpy.zeros(()))  # jaxlib's concrete array type (tracers are not of it)
_SCALARS = (bool, int, float, complex)  # Python scalars: traced as weakly typed 0-d arrays by their type


@dataclasses.dataclass(frozen=True)
class FastCall:
    """The previous plain call: its argument tree, per leaf (shape, dtype, weak type) and target sharding, the
    compiled program (`shardc.auto.Compiled`), the positions it donates and the ambient mesh it ran under."""

    tree: Any
    avals: tuple[tuple[tuple[int, ...], Any, bool] | type, ...]  # (shape, dtype, weak type), or a scalar's type
    targets: tuple[Any, ...]
    compiled: Any
    donated: frozenset[int]
    ambient: Any

    @staticmethod
    def of(tree: Any, leaves: Sequence[Any], targets: Sequence[Any], compiled: Any) -> "FastCall | None":
        """The record of a call that took the plain route; None when a leaf is neither an array nor a Python scalar."""
        avals = []
        for x in leaves:
            if type(x) in _SCALARS:
                avals.append(type(x))
            elif isinstance(x, (_ArrayImpl, np.ndarray)):
                avals.append((tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))))
            else:
                return None
        return FastCall(tree, tuple(avals), tuple(targets), compiled, frozenset(compiled.plan.donated or ()),
                        jax.sharding.get_mesh())

    def placed(self, tree: Any, leaves: Sequence[Any]) -> list[Any] | None:
        """This call's leaves in the plan's layouts, or None when the call must take the full route."""
        if tree != self.tree or jax.sharding.get_mesh() is not self.ambient:
            return None
        donated = {id(leaves[i]) for i in self.donated}
        if len(donated) < len(self.donated):
            return None  # an array donated twice: the full route raises the error that names both arguments
        out = []
        for i, (x, aval, target) in enumerate(zip(leaves, self.avals, self.targets)):
            if donated and id(x) in donated and i not in self.donated:
                return None  # (a donated array passed again elsewhere: likewise)
            if type(aval) is type:  # a Python scalar last time: one of the same type now
                if type(x) is not aval:
                    return None
                out.append(jax.device_put(x, target))
                continue
            shape, dtype, weak = aval
            if type(x) is _ArrayImpl:
                if x.shape != shape or x.dtype != dtype or x.weak_type != weak or x.is_deleted():
                    return None
                if x.sharding != target:
                    if getattr(x, "_committed", True):  # laid out by the user: the full route decides
                        return None  # (and reports) its placement
                    x = jax.device_put(x, target)
            elif type(x) is np.ndarray and not weak and x.shape == shape and x.dtype == dtype:
                x = jax.device_put(x, target)
            else:
                return None
            out.append(x)
        return out
