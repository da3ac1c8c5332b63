"""The proof record: which rule texts Z3 proved, and under which verifier.

Proving the 321 library and generated rules takes seconds of Z3 per process, too much to pay inside
every plan search. `python -m shardc verify-rules --record` proves them and writes
`data/proofs.record`: the SHA-256 of every proved rule's canonical text, under a `verifier` line that
is the SHA-256 of the modules defining what a proof means (the rule language, the per-device
semantics, the verifier and its (degree, rank) checks). `verify_rule` accepts a rule without running
Z3 only if its exact text is in the record and the record's verifier is this code's: an edited rule,
a rule that was never proved, or any change to the semantics or the verifier sends it back to Z3
(and a refuted rule is never applied). `tests/pcg/test_proof_record.py` fails when the record is
stale or lists a rule Z3 does not prove now.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from pathlib import Path
from typing import Iterable

__all__ = ["RECORD_FILE", "ProofRecord", "rule_key", "verifier_id", "load_record", "recorded",
           "format_record", "write_record", "clear_record_cache"]

RECORD_FILE = "proofs.record"
_HEADER = ("# shardc PCG proof record, written by `python -m shardc verify-rules --record`; do not edit.\n"
           "# One line per rule Z3 proved: SHA-256 of its canonical text, then its name.\n")


@dataclasses.dataclass(frozen=True)
class ProofRecord:
    """Rule-text digests proved under the verifier whose digest is `verifier`."""
    verifier: str
    proved: frozenset[str]


def rule_key(text: str) -> str:
    """The digest a rule is recorded under: its canonical one-line text (its name does not matter)."""
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def verifier_id() -> str:
    """Digest of the source of the modules that decide whether a rule is proved."""
    from shardc.pcg import grid, lang, semantics, verify

    h = hashlib.sha256()
    for module in (lang, semantics, grid, verify):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()


def _default_path() -> Path:
    from shardc.pcg.library import data_path

    return data_path(RECORD_FILE)


@functools.lru_cache(maxsize=4)
def load_record(path: Path | None = None) -> ProofRecord | None:
    """The record at `path` (default: the packaged one), or None if there is none or it is malformed."""
    path = path or _default_path()
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    verifier = None
    proved = set()
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "verifier":
            verifier = rest.strip()
        elif len(word) == 64 and all(c in "0123456789abcdef" for c in word):
            proved.add(word)
        else:
            return None  # not a record this code wrote: trust none of it
    if verifier is None:
        return None
    return ProofRecord(verifier, frozenset(proved))


def clear_record_cache() -> None:
    load_record.cache_clear()


def recorded(text: str, record: ProofRecord | None = None) -> bool:
    """True if the rule with this canonical text was proved under this exact verifier."""
    record = record if record is not None else load_record()
    return record is not None and record.verifier == verifier_id() and rule_key(text) in record.proved


def format_record(proved: Iterable[tuple[str, str]]) -> str:
    """The record file's text for (name, canonical text) pairs Z3 proved just now."""
    lines = [_HEADER, f"verifier {verifier_id()}\n"]
    seen = set()
    for name, text in proved:
        key = rule_key(text)
        if key not in seen:
            seen.add(key)
            lines.append(f"{key} {name}\n")
    return "".join(lines)


def write_record(proved: Iterable[tuple[str, str]], path: Path | None = None) -> Path:
    path = path or _default_path()
    path.write_text(format_record(proved))
    clear_record_cache()
    return path
