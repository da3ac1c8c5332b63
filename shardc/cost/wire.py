"""The element size a backend's collectives carry a dtype in (their payload on the wire).

XLA:CPU has no bfloat16 collectives: its float-normalization converts a bfloat16 operand to float32 before
every all-reduce, all-gather, all-to-all and collective-permute and converts the result back, so the
compiled program moves float32 bytes (`f32[...] all-gather(convert(...))`). float16 keeps its width there.
Every pass that counts a collective's bytes (the planner's reshards, the simulator, the PCG) takes the
element size from `wire_itemsize`, so the plan says what the compiled program moves.
"""
from __future__ import annotations

from typing import Any

__all__ = ["wire_itemsize", "WIDENED"]

# backend -> dtype name -> the element size its collectives carry instead
WIDENED: dict[str, dict[str, int]] = {"cpu": {"bfloat16": 4}}


def wire_itemsize(dtype: Any, backend: str) -> int:
    """Bytes per element of a collective of `dtype` on `backend` ("cpu", "gpu", "tpu"; "": as stored). A
    value without a dtype counts as 4 bytes."""
    if dtype is None:
        return 4
    size = int(dtype.itemsize)
    widened = WIDENED.get(backend)
    return widened.get(str(dtype), size) if widened else size
