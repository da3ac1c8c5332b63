"""The variables of a jaxpr evaluated one equation at a time, as shardc's interpreters walk programs (the
plan's lowering, the search's remat, explicit-sharding rewriting, deferred weight gradients)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from jax.extend import core as jcore

__all__ = ["JaxprEnv", "open_jaxpr", "retraced"]


class JaxprEnv:
    """Values bound to a jaxpr's constants and inputs, and to each equation's outputs as they are made."""

    def __init__(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> None:
        self._values: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        self._values.update(zip(jaxpr.invars, args))

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else self._values[v]

    def reads(self, vs: Sequence[Any]) -> list[Any]:
        return [self.read(v) for v in vs]

    def write(self, vs: Sequence[Any], xs: Sequence[Any]) -> None:
        """Bind outputs (a dropped output, `_`, is not kept)."""
        for v, x in zip(vs, xs):
            if not isinstance(v, jcore.DropVar):
                self._values[v] = x


def open_jaxpr(sub: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a closed or open jaxpr."""
    return (sub.jaxpr, sub.consts) if isinstance(sub, jcore.ClosedJaxpr) else (sub, ())


def retraced(closed: jcore.ClosedJaxpr, run: Callable[..., Any]) -> jcore.ClosedJaxpr:
    """`run` (an interpreter of `closed`: its flat inputs in, its flat outputs out) traced on `closed`'s input
    types, weak types kept."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in closed.in_avals]
    return jax.make_jaxpr(run)(*avals)
