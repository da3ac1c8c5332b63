"""Parallel text for the MoE translation example: corpora, held-out splits and deterministic batches.

Corpora (all read from local files, never downloaded or committed):

* ``sparv`` (default): Spanish->English Bible verses, Reina-Valera 1909 (Debian ``sword-text-sparv``)
  against the King James Version (Debian ``sword-text-kjv``), aligned verse by verse through the shared
  KJV versification (:mod:`moe.sword`). Public domain. Held out: every ``test_every``-th verse (default
  50th: 622 verses), or whole books with ``holdout_books``.
* ``trans-de-en``: German->English example sentences from the Ding dictionary (Debian ``trans-de-en``,
  GPL-2+). Test = every ``test_every``-th sentence; training = the other sentences plus multi-word
  dictionary phrases.
* ``tsv``: a user file of ``source<TAB>target`` lines (``--data``); test = every ``test_every``-th line.
* ``synthetic``: a generated toy language pair (English-like SVO -> verb-final "Zorbic" with case suffixes,
  adjective-noun reordering, number and person agreement, and a fixed lexicon). Not a copy task.

When the default corpus is not installed, :func:`load_corpus` says how to install it and falls back to the
synthetic task.
"""
from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from moe import sword

__all__ = [
    "Corpus",
    "CorpusMissing",
    "INSTALL_HINT",
    "load_corpus",
    "sword_pairs",
    "ding_pairs",
    "tsv_pairs",
    "synthetic_pairs",
    "BatchStream",
]

SPARV_MODULES = ("spaRV1909eb", "engKJV2006eb")
DING_PATH = Path("/usr/share/trans/de-en")
INSTALL_HINT = (
    "The default corpus (Spanish->English Bible, public domain) comes from two Debian packages. Install them "
    "with\n    sudo apt-get update && sudo apt-get install -y sword-text-sparv sword-text-kjv\n"
    "(or run `sudo sh moe/setup-data.sh`), then run the example again."
)
DING_HINT = (
    "The German->English corpus comes from the Debian package trans-de-en. Install it with\n"
    "    sudo apt-get update && sudo apt-get install -y trans-de-en\n(or run `sudo sh moe/setup-data.sh`)."
)


class CorpusMissing(RuntimeError):
    """A corpus' files are not installed; the message says how to install them."""


@dataclasses.dataclass
class Corpus:
    name: str
    src_lang: str
    tgt_lang: str
    train: list[tuple[str, str]]
    test: list[tuple[str, str]]
    description: str

    def summary(self) -> str:
        return (
            f"{self.name}: {self.src_lang}->{self.tgt_lang}, {len(self.train):,} training pairs, "
            f"{len(self.test):,} held-out pairs ({self.description})"
        )


# ----------------------------------------------------------------------------- SWORD Bible


def sword_pairs(
    src_module: str = SPARV_MODULES[0], tgt_module: str = SPARV_MODULES[1], roots=None
) -> list[tuple[sword.Verse, sword.Verse]]:
    """Verse-aligned (source verse, target verse) pairs of two KJV-versified zText modules."""
    mods = []
    for name in (src_module, tgt_module):
        m = sword.find_module(name, roots)
        if m is None:
            raise CorpusMissing(f"SWORD module {name} is not installed.\n{INSTALL_HINT}")
        mods.append(m)
    src = list(sword.read_verses(mods[0]))
    tgt = list(sword.read_verses(mods[1]))
    if len(src) != len(tgt):
        raise ValueError(f"{src_module} has {len(src)} verses but {tgt_module} has {len(tgt)}")
    pairs = []
    for a, b in zip(src, tgt):
        if (a.book, a.chapter, a.verse) != (b.book, b.chapter, b.verse):
            raise ValueError(f"verse misalignment: {a.book} {a.chapter}:{a.verse} vs {b.book} {b.chapter}:{b.verse}")
        if a.text and b.text:
            pairs.append((a, b))
    return pairs


def _sparv_corpus(test_every: int, holdout_books: Sequence[str] | None, roots=None) -> Corpus:
    pairs = sword_pairs(roots=roots)
    train, test = [], []
    books = {b.lower() for b in holdout_books or ()}
    for i, (a, b) in enumerate(pairs):
        held = (a.book.lower() in books) if books else (i % test_every == test_every - 1)
        (test if held else train).append((a.text, b.text))
    how = f"held out: books {', '.join(holdout_books)}" if books else f"held out: every {test_every}th verse"
    return Corpus("sparv", "es", "en", train, test, f"RV1909 -> KJV Bible verses; {how}")


# ----------------------------------------------------------------------------- Ding de-en

_BRACKETS = re.compile(r"\{[^}]*\}|\[[^\]]*\]|<[^>]*>|\([^)]*\)")
_SLASH = re.compile(r"(\S+?)/\S+")


def _ding_clean(s: str) -> str:
    s = _BRACKETS.sub(" ", s)
    s = s.split("; ")[0]
    s = _SLASH.sub(r"\1", s)
    return re.sub(r"\s+", " ", s).strip(" ;,")


def ding_pairs(path: Path = DING_PATH) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(sentence pairs, phrase pairs) from the Ding dictionary file: sentences have >= 4 German words and
    end in . ? or !; phrases are other aligned sub-entries with >= 2 words on both sides."""
    path = Path(path)
    if not path.exists():
        raise CorpusMissing(f"{path} not found.\n{DING_HINT}")
    sentences: dict[str, str] = {}
    phrases: dict[str, str] = {}
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("#") or " :: " not in line:
                continue
            de, en = line.rstrip("\n").split(" :: ", 1)
            des, ens = de.split(" | "), en.split(" | ")
            if len(des) != len(ens):
                continue
            for d, e in zip(des, ens):
                d, e = _ding_clean(d), _ding_clean(e)
                if not d or not e:
                    continue
                nd, ne = len(d.split()), len(e.split())
                if nd >= 4 and d[-1] in ".?!" and e[-1] in ".?!":
                    sentences.setdefault(d, e)
                elif nd >= 2 and ne >= 2 and nd <= 12 and ne <= 12:
                    phrases.setdefault(d, e)
    return sorted(sentences.items()), sorted(phrases.items())


def _ding_corpus(test_every: int, path: Path = DING_PATH) -> Corpus:
    sents, phrases = ding_pairs(path)
    test = [p for i, p in enumerate(sents) if i % test_every == test_every - 1]
    train = [p for i, p in enumerate(sents) if i % test_every != test_every - 1] + phrases
    return Corpus(
        "trans-de-en", "de", "en", train, test,
        f"Ding dictionary: {len(sents):,} example sentences + {len(phrases):,} phrases; "
        f"held out: every {test_every}th sentence",
    )


# ----------------------------------------------------------------------------- user TSV


def tsv_pairs(path: str | Path) -> list[tuple[str, str]]:
    out = []
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n\r")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) < 2:
                raise ValueError(f"{path}:{n}: expected 'source<TAB>target', got {line[:80]!r}")
            if parts[0].strip() and parts[1].strip():
                out.append((parts[0].strip(), parts[1].strip()))
    if not out:
        raise ValueError(f"{path}: no sentence pairs found")
    return out


# ----------------------------------------------------------------------------- synthetic task

_EN_NOUNS = (
    "dog cat bird horse farmer king queen child teacher doctor fish wolf sailor baker singer "
    "soldier merchant student painter fox"
).split()
_EN_ADJ = "big small old young red green happy angry quiet brave tired clever".split()
_EN_VERBS = [  # (3sg, plural)
    ("sees", "see"), ("likes", "like"), ("follows", "follow"), ("helps", "help"), ("finds", "find"),
    ("calls", "call"), ("watches", "watch"), ("feeds", "feed"), ("pushes", "push"), ("greets", "greet"),
    ("paints", "paint"), ("visits", "visit"),
]
_EN_ADV = "today yesterday often slowly quickly".split()
_SYLL = "ka ri mo tu ne sa lo vi pe zu da go fi ha ju be".split()


_IRREGULAR = {"wolf": "wolves", "child": "children", "fish": "fish"}


def _plural(noun: str) -> str:
    if noun in _IRREGULAR:
        return _IRREGULAR[noun]
    return noun + ("es" if noun.endswith(("s", "x", "sh", "ch")) else "s")


def _zorbic_lexicon(seed: int = 1234) -> dict[str, str]:
    rng = random.Random(seed)
    words = _EN_NOUNS + _EN_ADJ + [v[1] for v in _EN_VERBS] + _EN_ADV
    lex, used = {}, set()
    for w in words:
        while True:
            t = "".join(rng.choice(_SYLL) for _ in range(rng.choice((2, 2, 3))))
            if t not in used:
                used.add(t)
                lex[w] = t
                break
    return lex


def synthetic_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (English-like, Zorbic) pairs. Zorbic: subject object verb [adverb]; nouns take the case suffix
    -n (subject) / -m (object) plus plural -i; adjectives follow their noun and agree in number (-i);
    the verb agrees with the subject's number (-ta singular, -tu plural) and takes -ko when the object is
    plural; "the" becomes the clitic le- and "a"/"some" is dropped.
    Example: "the big dog sees a small cat" -> "ledog-n big cat-m small see-ta" with every stem mapped
    through a fixed lexicon, e.g. "lebusa-n vito rijuka-m mone gosa-ta"."""
    lex = _zorbic_lexicon()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        def np_(role):
            plural = rng.random() < 0.4
            definite = rng.random() < 0.6
            noun = rng.choice(_EN_NOUNS)
            adjs = rng.sample(_EN_ADJ, rng.choice((0, 0, 1, 1, 2)))
            words = adjs + [_plural(noun) if plural else noun]
            det = "the" if definite else ("some" if plural else ("an" if words[0][0] in "aeiou" else "a"))
            en = " ".join([det] + words)
            case = "n" if role == "subj" else "m"
            z_noun = ("le" if definite else "") + lex[noun] + ("i" if plural else "") + case
            z = " ".join([z_noun] + [lex[a] + ("i" if plural else "") for a in adjs])
            return en, z, plural

        s_en, s_z, s_pl = np_("subj")
        o_en, o_z, o_pl = np_("obj")
        v3, vpl = rng.choice(_EN_VERBS)
        adv = rng.choice(_EN_ADV) if rng.random() < 0.3 else None
        en = f"{s_en} {vpl if s_pl else v3} {o_en}" + (f" {adv}" if adv else "")
        verb = lex[vpl] + ("tu" if s_pl else "ta") + ("ko" if o_pl else "")
        z = f"{s_z} {o_z} {verb}" + (f" {lex[adv]}" if adv else "")
        out.append((en + ".", z + "."))
    return out


def _synthetic_corpus(n: int = 20000, test_n: int = 500, seed: int = 0) -> Corpus:
    pairs = synthetic_pairs(n + test_n, seed)
    seen = set()
    train, test = [], []
    for p in pairs:
        if len(test) < test_n and p[0] not in seen and len(train) >= n:
            test.append(p)
        elif len(train) < n:
            train.append(p)
            seen.add(p[0])
    # Held-out sentences never occur in training.
    test = [p for p in test if p[0] not in seen]
    return Corpus("synthetic", "en", "zorbic", train, test, "generated reordering + agreement task")


# ----------------------------------------------------------------------------- entry point


def load_corpus(
    name: str = "sparv",
    data: str | None = None,
    test_every: int = 50,
    holdout_books: Sequence[str] | None = None,
    synthetic_size: int = 20000,
    seed: int = 0,
    fallback: bool = True,
    log=print,
) -> Corpus:
    """Load a corpus by name (``sparv``, ``trans-de-en``, ``synthetic``) or a TSV file (``data``).

    If the corpus' files are missing and ``fallback`` is true, print how to install them and return the
    synthetic task instead.
    """
    if data:
        pairs = tsv_pairs(data)
        test = [p for i, p in enumerate(pairs) if i % test_every == test_every - 1]
        train = [p for i, p in enumerate(pairs) if i % test_every != test_every - 1]
        return Corpus(Path(data).name, "src", "tgt", train, test, f"user TSV; held out: every {test_every}th line")
    try:
        if name == "sparv":
            return _sparv_corpus(test_every, holdout_books)
        if name in ("trans-de-en", "ding", "de-en"):
            return _ding_corpus(test_every)
        if name == "synthetic":
            return _synthetic_corpus(synthetic_size, seed=seed)
    except CorpusMissing as e:
        if not fallback:
            raise
        log(f"*** {e}\n*** Falling back to the built-in synthetic translation task.")
        return _synthetic_corpus(synthetic_size, seed=seed)
    raise ValueError(f"unknown corpus {name!r}: use sparv, trans-de-en, synthetic or --data FILE.tsv")


# ----------------------------------------------------------------------------- batches


class BatchStream:
    """Deterministic, resumable batches: ``batch(step)`` depends only on (seed, step).

    Pairs are grouped into length buckets; each bucket has its own fixed batch shape
    ``[tokens_per_batch // bucket_len (rounded to batch_multiple), bucket_len]`` so the number of distinct
    shapes (compilations) is the number of buckets. Every epoch shuffles the pairs inside each bucket and
    the order of the batches with a generator seeded by (seed, epoch); leftovers that do not fill a batch
    are skipped in that epoch (they are different pairs each epoch).
    """

    def __init__(
        self,
        src: Sequence[Sequence[int]],
        tgt: Sequence[Sequence[int]],
        buckets: Sequence[int],
        tokens_per_batch: int,
        batch_multiple: int = 8,
        seed: int = 0,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
    ):
        self.buckets = sorted(buckets)
        self.seed, self.pad_id, self.bos_id, self.eos_id = seed, pad_id, bos_id, eos_id
        self.src = [np.asarray(s, np.int32) for s in src]
        self.tgt = [np.asarray(t, np.int32) for t in tgt]
        self.members: list[list[int]] = [[] for _ in self.buckets]
        self.skipped = 0
        for i, (s, t) in enumerate(zip(self.src, self.tgt)):
            need = max(len(s), len(t) + 1)  # target gets BOS (input) / EOS (output)
            for b, length in enumerate(self.buckets):
                if need <= length:
                    self.members[b].append(i)
                    break
            else:
                self.skipped += 1
        self.batch_sizes = []
        for length in self.buckets:
            bs = max(batch_multiple, (tokens_per_batch // length) // batch_multiple * batch_multiple)
            self.batch_sizes.append(bs)
        self.per_epoch = sum(len(m) // bs for m, bs in zip(self.members, self.batch_sizes))
        if self.per_epoch == 0:
            raise ValueError("not enough data for a single batch; lower --batch-tokens")
        self._epoch_cache: tuple[int, list[tuple[int, np.ndarray]]] | None = None

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(bs, L) for bs, L, m in zip(self.batch_sizes, self.buckets, self.members) if len(m) >= bs]

    def _plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        plan = []
        for b, (members, bs) in enumerate(zip(self.members, self.batch_sizes)):
            idx = np.asarray(members)[rng.permutation(len(members))]
            for k in range(len(members) // bs):
                plan.append((b, idx[k * bs : (k + 1) * bs]))
        order = rng.permutation(len(plan))
        plan = [plan[i] for i in order]
        self._epoch_cache = (epoch, plan)
        return plan

    def epoch_of(self, step: int) -> float:
        return step / self.per_epoch

    def batch(self, step: int) -> dict[str, np.ndarray]:
        epoch, k = divmod(step, self.per_epoch)
        b, idx = self._plan(epoch)[k]
        return self.make(idx, self.buckets[b])

    def make(self, idx, length: int) -> dict[str, np.ndarray]:
        n = len(idx)
        src = np.full((n, length), self.pad_id, np.int32)
        tin = np.full((n, length), self.pad_id, np.int32)
        tout = np.full((n, length), self.pad_id, np.int32)
        for r, i in enumerate(idx):
            s, t = self.src[i], self.tgt[i]
            src[r, : len(s)] = s
            tin[r, 0] = self.bos_id
            tin[r, 1 : len(t) + 1] = t
            tout[r, : len(t)] = t
            tout[r, len(t)] = self.eos_id
        return {"src": src, "tgt_in": tin, "tgt_out": tout}
