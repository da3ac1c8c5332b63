"""Names of a step's argument leaves by the step's own parameter names: `params['Dense_0']['kernel']`,
`opt_state[0].mu['Dense_0']['kernel']`, `batch['x']` rather than `[0]['Dense_0']['kernel']`,
`[1][0].mu[...]`, `[2]['x']` — as the user wrote them, in `plan.explain()` and in error messages."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
from jax.tree_util import DictKey, SequenceKey, keystr

__all__ = ["parameter_names", "path_name", "leaf_names"]


def parameter_names(fun: Callable) -> tuple[tuple[str, ...], str | None]:
    """The positional parameters of the function the user wrote (under `functools.wraps` layers such as
    shardc's static-argument and NNX wrappers, which keep positions), and its `*args` name if any."""
    try:
        sig = inspect.signature(inspect.unwrap(fun))
    except (TypeError, ValueError):
        return (), None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in sig.parameters.values() if p.kind in kinds)
    var = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    return names, var


def path_name(names: tuple[tuple[str, ...], str | None], path: Sequence[Any]) -> str:
    """The name of a key path into `(args, kwargs)` (`names`: `parameter_names` of the step)."""
    if len(path) < 2:
        return keystr(tuple(path[1:]))
    positional, var = names
    where, arg, rest = path[0], path[1], tuple(path[2:])
    if isinstance(where, SequenceKey) and where.idx == 0 and isinstance(arg, SequenceKey):
        i = arg.idx
        head = positional[i] if i < len(positional) else f"{var}[{i - len(positional)}]" if var else f"[{i}]"
    elif isinstance(arg, DictKey):
        head = str(arg.key)
    else:
        return keystr(tuple(path[1:]))
    return head + keystr(rest)


def leaf_names(fun: Callable, call: Any) -> list[str]:
    """A name per leaf of `call` = (args, kwargs), in flattening order."""
    names = parameter_names(fun)
    return [path_name(names, p) for p, _ in jax.tree_util.tree_flatten_with_path(call)[0]]
