"""Donated arguments of an `@shardc.auto` step (`donate_argnums=`, `donate_argnames=`, as `jax.jit` has).

As in `jax.jit`, a name in `donate_argnames` that is a positional parameter of the step donates that position
(so `step(model, optimizer, ...)` called positionally donates what `donate_argnames=("model", "optimizer")`
names), a position in `donate_argnums` donates that parameter when it is passed by keyword, and a keyword
argument named in `donate_argnames` is donated. `Donation.flat` gives the donated leaves of one call's
flattened `(args, kwargs)`, the order in which `@shardc.auto` passes them to the compiled program.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping

import jax

from annotations.errors import ShardingError, describe_function

__all__ = ["Donation"]


def _nums(value: Any) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (value,)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ShardingError(f"shardc.auto(donate_argnums={value!r}) needs non-negative ints "
                            f"(positions of positional arguments)")
    return items


def _names(value: Any) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (value,)
    if not all(isinstance(n, str) for n in items):
        raise ShardingError(f"shardc.auto(donate_argnames={value!r}) needs strings (names of the step's "
                            f"parameters)")
    return items


@dataclasses.dataclass(frozen=True)
class Donation:
    """Which arguments of a step are donated: positions (`nums`) and keyword names (`names`), each
    completed from the other through the step's signature."""

    nums: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    optional: tuple[int, ...] = ()  # positions donated by name: a call may leave them out (they have defaults)

    @classmethod
    def make(cls, fun: Callable, donate_argnums: Any = (), donate_argnames: Any = ()) -> "Donation":
        nums, names = set(_nums(donate_argnums)), set(_names(donate_argnames))
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        kinds = {p.kind for p in params}
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        known = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        if params and inspect.Parameter.VAR_KEYWORD not in kinds:
            bad = sorted(names - known)
            if bad:
                raise ShardingError(f"shardc.auto(donate_argnames={bad[0]!r}): {describe_function(fun)} has no such "
                                    f"parameter (its parameters: {[p.name for p in params]})")
        by_name = {positional.index(n) for n in names if n in positional} - nums
        for i in list(nums):
            if i < len(positional) and params[i].kind is not inspect.Parameter.POSITIONAL_ONLY:
                names.add(positional[i])
        return cls(tuple(sorted(nums | by_name)), tuple(sorted(names)), tuple(sorted(by_name)))

    def __bool__(self) -> bool:
        return bool(self.nums or self.names)

    def flat(self, args: tuple, kwargs: Mapping[str, Any], fun: Callable) -> list[int]:
        """Indices of the donated leaves of `jax.tree_util.tree_leaves((args, kwargs))`."""
        bad = [i for i in self.nums if i >= len(args) and i not in self.optional and not self._named(i, fun, kwargs)]
        if bad:
            raise ShardingError(f"shardc.auto(donate_argnums={self.nums}): {describe_function(fun)} was called with "
                                f"{len(args)} positional argument(s), so there is no argument {bad[0]} to donate")
        out, start = [], 0
        for i, a in enumerate(args):
            n = len(jax.tree_util.tree_leaves(a))
            if i in self.nums:
                out.extend(range(start, start + n))
            start += n
        for k in sorted(kwargs):  # (a dict flattens in key order)
            n = len(jax.tree_util.tree_leaves(kwargs[k]))
            if k in self.names:
                out.extend(range(start, start + n))
            start += n
        return out

    def _named(self, i: int, fun: Callable, kwargs: Mapping[str, Any]) -> bool:
        """Whether donated position `i` is passed by keyword in this call."""
        try:
            params = [p.name for p in inspect.signature(fun).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            return False
        return i < len(params) and params[i] in kwargs
