"""The rule library: hand-written rules (`data/library.rules`) and generated ones (`data/generated.rules`,
written by `python -m shardc generate-rules`)."""
from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Sequence

from shardc.pcg.lang import Rule, parse_rules

__all__ = ["library_rules", "generated_rules", "all_rules", "data_path", "LIBRARY_FILE", "GENERATED_FILE", "LOOP_RULES",
           "loop_rules_proved", "rules_proved"]

LIBRARY_FILE = "library.rules"
GENERATED_FILE = "generated.rules"
# The rules `shardc.loops` rests on (a loop's trips as one tensor), both directions: proved like the others but
# not PCG rewrites (the optimizer does not try them; `usable_rules`).
LOOP_RULES = ("chunk_dot", "chunk_dotc", "chunk_ew1", "chunk_ew2", "dotc_concat", "sum_concat")


def data_path(name: str) -> Path:
    return Path(str(resources.files("shardc.pcg").joinpath("data", name)))


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[Rule, ...]:
    path = data_path(name)
    if not path.exists():
        return ()
    return tuple(parse_rules(path.read_text()))


def library_rules() -> list[Rule]:
    """The hand-written rules."""
    return list(_load(LIBRARY_FILE))


def generated_rules() -> list[Rule]:
    """The generated rules (empty until `python -m shardc generate-rules` has written them)."""
    return list(_load(GENERATED_FILE))


def all_rules() -> list[Rule]:
    return library_rules() + generated_rules()


def rules_proved(names: Sequence[str]) -> bool:
    """Whether every rule named is in the library and proved (the proof record): what a rewrite resting on them
    asks before it runs."""
    from shardc.pcg.verify import verify_rule

    by_name = {r.name: r for r in library_rules()}
    return all(n in by_name and verify_rule(by_name[n]).proved for n in names)


def loop_rules_proved() -> bool:
    """Whether every rule of `LOOP_RULES` (`shardc.loops`) is in the library and proved."""
    return rules_proved(LOOP_RULES)
