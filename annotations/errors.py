"""The one error type of shardc, and where in the user's code a problem comes from.

Lives in the `annotations` package because it is the lowest layer: `shardc` depends on `annotations`,
never the other way round. `shardc.ShardingError` is this class.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from types import FrameType
from typing import Any

__all__ = ["ShardingError", "SourceLine", "caller_source_line", "describe_function"]


class ShardingError(ValueError):
    """A sharding request that cannot be honoured: unknown axis, bad dim, non-divisible size, conflict.

    Messages name the tensor, the dim, the sizes involved and the user's source line.
    """


@dataclasses.dataclass(frozen=True, slots=True)
class SourceLine:
    """A position in the user's code."""

    file: str
    line: int
    function: str = ""

    def __str__(self) -> str:
        where = f"{_short_path(self.file)}:{self.line}"
        return f"{where} ({self.function})" if self.function else where


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel




def _library_prefixes() -> tuple[str, ...]:
    import importlib.util

    prefixes = []
    for name in ("annotations", "shardc", "jax", "jaxlib", "flax", "optax", "contextlib", "functools"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            origin = spec.origin
            prefixes.append(os.path.dirname(origin) if origin.endswith("__init__.py") else origin)
    return tuple(prefixes)


_PREFIXES: tuple[str, ...] | None = None
# Code without a file that is the user's own: a script on standard input, `python -c`, `exec` of a string,
# the interactive console, IPython cells. Other "<...>" names are Python's internals ("<frozen runpy>").
_USER_PSEUDO_FILES = ("<stdin>", "<string>", "<console>", "<input>", "<ipython-input-")


def is_library_file(path: str) -> bool:
    """True for files of annotations/shardc/jax/flax/optax and the standard library wrappers they use."""
    global _PREFIXES
    if _PREFIXES is None:
        _PREFIXES = _library_prefixes()
    return path.startswith(_PREFIXES) or (path.startswith("<") and not path.startswith(_USER_PSEUDO_FILES))


def caller_source_line(frame: FrameType | None = None) -> SourceLine | None:
    """The innermost frame on the stack that is user code (not shardc, jax, flax or optax)."""
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if not is_library_file(path):
            return SourceLine(path, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return None


def describe_function(fun: Any) -> str:
    """`name (file:line)` of a user's function, for messages."""
    name = getattr(fun, "__qualname__", None) or type(fun).__name__
    code = getattr(inspect.unwrap(fun), "__code__", None)
    if code is None:
        return name
    return f"{name} ({SourceLine(code.co_filename, code.co_firstlineno)})"
