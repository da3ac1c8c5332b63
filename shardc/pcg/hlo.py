"""Counting the collectives of a compiled program, to check it against what the PCG names."""
from __future__ import annotations

import collections
import re

__all__ = ["hlo_collectives", "KINDS"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
_ARRAY = re.compile(r"[a-z]+[0-9]*\[[^\]]*\]")


def hlo_collectives(text: str) -> collections.Counter:
    """How many tensors each kind of collective moves in an HLO module's text.

    XLA combines independent all-reduces (and reduce-scatters, all-gathers) into one tuple-shaped op;
    each tensor of the tuple counts once. An all-to-all counts once per instruction (XLA prints a
    tiled all-to-all with one operand per chunk); async `-start` ops count once and `-done` not at all.
    """
    out: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = _LINE.search(line)
        if not m:
            continue
        shape, kind, start = m.groups()
        if kind in ("all-to-all", "collective-permute") or start:
            out[kind] += 1
        else:
            out[kind] += max(1, len(_ARRAY.findall(shape)))
    return out
