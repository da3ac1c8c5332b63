"""Read SWORD Bible modules (zText driver) directly from their files, with the standard library only.

Debian ships public-domain Bibles as SWORD modules, e.g. ``sword-text-sparv`` (Spanish Reina-Valera 1909,
module ``spaRV1909eb``) and ``sword-text-kjv`` (King James Version, module ``engKJV2006eb``). Both use the
zText driver with the KJV versification, so their verse entries line up index by index; no libsword
needed.

File format (per testament ``ot``/``nt`` in the module's DataPath):

* ``.bzs`` — one 12-byte record per compressed block: ``<III`` = offset in ``.bzz``, compressed size,
  uncompressed size (little endian);
* ``.bzv`` — one 10-byte record per verse *entry*: ``<IIH`` = block number, offset in the uncompressed
  block, size in bytes (0 = empty entry);
* ``.bzz`` — the zlib-compressed blocks (``CompressType=ZIP``), UTF-8 OSIS markup inside.

Entry layout of the KJV versification, per testament: entry 0 (empty), entry 1 (module/testament
heading), then for every book one book-intro entry followed, for every chapter, by one chapter-heading
entry and then one entry per verse. OT: 2 + 39 + 929 + 23,145 = 24,115 entries; NT: 2 + 27 + 260 + 7,957
= 8,246. osis2mod writes the book (``<div type="book" osisID=.. sID=..>``) and chapter
(``<chapter osisID="Gen.1" sID=..>``) start markers into the intro/heading entries, which is how verses
are numbered here.
"""
from __future__ import annotations

import dataclasses
import html
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Iterator

__all__ = ["SwordModule", "Verse", "find_module", "read_entries", "read_verses", "clean_osis", "sword_roots"]

# Versification facts checked when a module claims Versification=KJV.
KJV_BOOKS = {"ot": 39, "nt": 27}
KJV_CHAPTERS = {"ot": 929, "nt": 260}
KJV_VERSES = {"ot": 23145, "nt": 7957}


@dataclasses.dataclass(frozen=True)
class SwordModule:
    name: str
    conf: Path
    data_path: Path
    driver: str
    compress: str
    versification: str
    language: str
    description: str


@dataclasses.dataclass(frozen=True)
class Verse:
    testament: str  # "ot" | "nt"
    index: int  # entry index in the testament's .bzv
    book: str  # OSIS book id, e.g. "Gen"
    book_number: int  # 1..66 in canonical order
    chapter: int
    verse: int
    text: str  # cleaned plain text


def sword_roots() -> list[Path]:
    """Where modules are looked for: $SWORD_PATH, ~/.sword, /usr/share/sword, /usr/local/share/sword."""
    roots = []
    env = os.environ.get("SWORD_PATH")
    if env:
        roots += [Path(p) for p in env.split(os.pathsep) if p]
    roots += [Path.home() / ".sword", Path("/usr/share/sword"), Path("/usr/local/share/sword")]
    return roots


def _parse_conf(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    section = None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out["__name__"] = section
            continue
        if "=" in line and section is not None:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), v.strip())
    return out


def find_module(name: str, roots: list[Path] | None = None) -> SwordModule | None:
    """The installed module called ``name`` (case-insensitive), or None."""
    for root in roots if roots is not None else sword_roots():
        mods = root / "mods.d"
        if not mods.is_dir():
            continue
        for conf in sorted(mods.glob("*.conf")):
            try:
                c = _parse_conf(conf)
            except OSError:
                continue
            if c.get("__name__", "").lower() != name.lower():
                continue
            data = (root / c.get("DataPath", "")).resolve()
            return SwordModule(
                name=c["__name__"],
                conf=conf,
                data_path=data,
                driver=c.get("ModDrv", ""),
                compress=c.get("CompressType", ""),
                versification=c.get("Versification", "KJV"),
                language=c.get("Lang", ""),
                description=c.get("Description", ""),
            )
    return None


def read_entries(data_path: Path, testament: str) -> list[str]:
    """All verse entries (raw OSIS strings, '' when empty) of one testament of a zText module."""
    data_path = Path(data_path)
    bzs = (data_path / f"{testament}.bzs").read_bytes()
    bzv = (data_path / f"{testament}.bzv").read_bytes()
    bzz = (data_path / f"{testament}.bzz").read_bytes()
    if len(bzs) % 12 or len(bzv) % 10:
        raise ValueError(f"{data_path}: {testament}.bzs/.bzv sizes are not multiples of 12/10 bytes")
    blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs), 12)]
    cache: dict[int, bytes] = {}
    out = []
    for i in range(0, len(bzv), 10):
        block, offset, size = struct.unpack_from("<IIH", bzv, i)
        if size == 0:
            out.append("")
            continue
        if block not in cache:
            start, csize, _ = blocks[block]
            cache[block] = zlib.decompress(bzz[start : start + csize])
        out.append(cache[block][offset : offset + size].decode("utf-8", errors="replace"))
    return out


_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)
_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")
_BOOK = re.compile(r'<div\b[^>]*\btype="book"[^>]*>')
_CHAPTER = re.compile(r"<chapter\b[^>]*>")
_OSIS_ID = re.compile(r'osisID="([^"]+)"')


def clean_osis(text: str) -> str:
    """Plain text of an OSIS fragment: footnotes dropped, tags stripped (their text kept), entities
    decoded, the KJV paragraph sign removed, whitespace collapsed."""
    text = _NOTE.sub(" ", text)
    text = _TAG.sub("", text)
    text = html.unescape(text).replace("\u00b6", " ")
    return _SPACE.sub(" ", text).strip()


def _start_marker(regex, entry):
    for m in regex.finditer(entry):
        tag = m.group(0)
        if "sID=" in tag and "eID=" not in tag:
            ident = _OSIS_ID.search(tag)
            if ident:
                return ident.group(1)
    return None


def read_verses(module: SwordModule) -> Iterator[Verse]:
    """Every verse of the module, in canonical order, with book/chapter/verse from the markup."""
    if module.driver.lower() != "ztext":
        raise ValueError(f"{module.name}: only the zText driver is supported, module uses {module.driver!r}")
    if module.compress and module.compress.upper() != "ZIP":
        raise ValueError(f"{module.name}: only CompressType=ZIP is supported, module uses {module.compress!r}")
    book_number = 0
    for testament in ("ot", "nt"):
        if not (module.data_path / f"{testament}.bzv").exists():
            continue
        entries = read_entries(module.data_path, testament)
        book, chapter, verse = None, 0, 0
        n_books = n_chapters = n_verses = 0
        for idx, entry in enumerate(entries):
            if idx < 2:
                continue
            b = _start_marker(_BOOK, entry)
            if b is not None:
                book, chapter, verse = b, 0, 0
                book_number += 1
                n_books += 1
                continue
            c = _start_marker(_CHAPTER, entry)
            if c is not None:
                chapter, verse = int(c.rsplit(".", 1)[-1]), 0
                n_chapters += 1
                continue
            if book is None or chapter == 0:
                continue
            verse += 1
            n_verses += 1
            yield Verse(testament, idx, book, book_number, chapter, verse, clean_osis(entry))
        if module.versification.upper() == "KJV" and (
            n_books != KJV_BOOKS[testament]
            or n_chapters != KJV_CHAPTERS[testament]
            or n_verses != KJV_VERSES[testament]
        ):
            raise ValueError(
                f"{module.name} ({testament}): found {n_books} books, {n_chapters} chapters, {n_verses} verses;"
                f" the KJV versification has {KJV_BOOKS[testament]}, {KJV_CHAPTERS[testament]},"
                f" {KJV_VERSES[testament]}"
            )
