"""Static arguments of an `@shardc.auto` step (`static_argnums=`, `static_argnames=`, as `jax.jit` has).

A static argument is not traced: its value is part of the program (a flag, a config object, a string),
so each distinct value gets its own plan. `StaticArgs.split` takes a call apart into the static values (a
hashable key) and the traced arguments, where each static positional argument is replaced by `None` (an
empty pytree) so that positions, `donate_argnums` and the names of the inputs stay those of the call;
`bind` makes the function of the traced arguments that puts the static values back.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any, Callable, NamedTuple, Sequence

from annotations.errors import ShardingError, describe_function

__all__ = ["StaticArgs", "StaticSplit"]


class StaticSplit(NamedTuple):
    key: tuple  # ((position, value), ...), ((name, value), ...): hashable, keys the plan
    args: tuple  # the call's positional arguments with None at the static positions
    kwargs: dict  # the call's keyword arguments without the static ones


def _ints(value: Any, option: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise ShardingError(f"shardc.auto({option}={value!r}) needs ints (positions of positional arguments)")
    return items


def _names(value: Any, option: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) for n in items):
        raise ShardingError(f"shardc.auto({option}={value!r}) needs strings (names of keyword arguments)")
    return items


class StaticArgs:
    """Which arguments of `fun` are static. As in `jax.jit`, a name in `static_argnames` that is also a
    positional parameter of `fun` makes that position static, and the other way round."""

    def __init__(self, fun: Callable, static_argnums: Any = (), static_argnames: Any = ()) -> None:
        self.fun = fun
        nums = set(_ints(static_argnums, "static_argnums"))
        names = set(_names(static_argnames, "static_argnames"))
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if params:
            _check_against_signature(fun, params, positional, nums, names)
        for i in list(nums):
            if 0 <= i < len(positional) and params[i].kind is not inspect.Parameter.POSITIONAL_ONLY:
                names.add(positional[i])
        for n in list(names):
            if n in positional:
                nums.add(positional.index(n))
        self.nums = tuple(sorted(nums))
        self.names = tuple(sorted(names))

    def __bool__(self) -> bool:
        return bool(self.nums or self.names)

    def check_not_donated(self, donate_argnums: Sequence[int]) -> None:
        both = sorted(set(donate_argnums) & set(self.nums))
        if both:
            raise ShardingError(f"shardc.auto: argument {both[0]} of {describe_function(self.fun)} is both static "
                                f"and donated; a static argument is not a buffer, so it cannot be donated")

    def split(self, args: tuple, kwargs: dict) -> StaticSplit:
        n = len(args)
        positions = sorted({i + n if i < 0 else i for i in self.nums if -n <= i < n})
        static_pos = tuple((i, args[i]) for i in positions)
        static_kw = tuple((k, kwargs[k]) for k in self.names if k in kwargs)
        unhashable = next(((f"argument {w}", v) for w, v in static_pos + static_kw if not _hashable(v)), None)
        if unhashable is not None:
            where, value = unhashable
            raise ShardingError(
                f"{describe_function(self.fun)}: static {where} is of type {type(value).__name__}, which is not "
                f"hashable; a static argument's value keys the plan (as in jax.jit), so pass a hashable value "
                f"(a tuple, a frozen dataclass) or make the argument traced") from None
        dyn_args = tuple(None if i in positions else a for i, a in enumerate(args))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.names}
        return StaticSplit((static_pos, static_kw), dyn_args, dyn_kwargs)

    @staticmethod
    def search_path(search: Any, key: tuple) -> Any:
        """`search=` for one value's step: a plan file gets one file per value (`plan.json` ->
        `plan.<digest of the values>.json`, the same in every process), since each value is its own program."""
        if not (isinstance(search, str) and search.endswith(".json")):
            return search
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        return f"{search[:-len('.json')]}.{digest}.json"

    def bind(self, key: tuple) -> Callable:
        """`fun` of the traced arguments, with the static values of `key` put back."""
        static_pos, static_kw = dict(key[0]), dict(key[1])
        fun = self.fun

        @functools.wraps(fun)
        def with_static_args(*args: Any, **kwargs: Any) -> Any:
            full = [static_pos[i] if i in static_pos else a for i, a in enumerate(args)]
            return fun(*full, **kwargs, **static_kw)

        return with_static_args


def _check_against_signature(fun: Callable, params: list, positional: list[str], nums: set[int],
                             names: set[str]) -> None:
    """As jax.jit does when it wraps: a position past the parameters or a name that is not one is an error
    (unless the function takes *args / **kwargs)."""
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        bad = sorted(i for i in nums if not -len(positional) <= i < len(positional))
        if bad:
            raise ShardingError(f"shardc.auto(static_argnums={bad[0]}): {describe_function(fun)} has "
                                f"{len(positional)} positional parameter(s) {positional}")
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        known = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        bad_names = sorted(names - known)
        if bad_names:
            raise ShardingError(f"shardc.auto(static_argnames={bad_names[0]!r}): {describe_function(fun)} has no "
                                f"such parameter (its parameters: {[p.name for p in params]})")


def _hashable(value: Any) -> bool:
    try:
        hash(value)
        return True
    except TypeError:
        return False
