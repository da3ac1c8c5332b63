"""A small byte-pair-encoding subword vocabulary, trained locally in pure Python.

Text is pre-split into words the SentencePiece way: a word that follows a space carries a leading ``▁``;
runs of letters, runs of digits and runs of punctuation are separate words, so ``"God, and"`` becomes
``["▁God", ",", "▁and"]``. BPE merges (Sennrich et al.) are learned inside words over the joint
source+target training text; ties are broken by the pair itself, so training is deterministic.
Decoding joins the pieces and turns ``▁`` back into spaces, which restores the whitespace-normalised text.
"""
from __future__ import annotations

import heapq
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["BPETokenizer", "pretokenize", "PAD", "BOS", "EOS", "UNK"]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
MARK = "\u2581"  # ▁
_WORD = re.compile(r" ?[^\W\d_]+| ?\d+| ?[^\w\s]+| ?_+", re.UNICODE)
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def pretokenize(text: str) -> list[str]:
    """Words of ``text`` with ``▁`` marking a preceding space (the first word gets one too)."""
    text = " " + normalize(text)
    return [w.replace(" ", MARK) for w in _WORD.findall(text)]


class BPETokenizer:
    """Subword tokenizer: ids 0..3 are ``<pad> <s> </s> <unk>``, then characters, then merged pieces."""

    def __init__(self, pieces: Sequence[str], merges: Sequence[tuple[str, str]]):
        self.pieces = list(pieces)
        self.merges = [tuple(m) for m in merges]
        self.piece_to_id = {p: i for i, p in enumerate(self.pieces)}
        self.ranks = {m: i for i, m in enumerate(self.merges)}
        self._cache: dict[str, list[str]] = {}

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    # ------------------------------------------------------------------ training
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8000, min_char_count: int = 2) -> "BPETokenizer":
        word_freq: Counter[str] = Counter()
        for t in texts:
            word_freq.update(pretokenize(t))
        chars: Counter[str] = Counter()
        for w, f in word_freq.items():
            for ch in w:
                chars[ch] += f
        alphabet = sorted(ch for ch, f in chars.items() if f >= min_char_count)
        alpha_set = set(alphabet)
        pieces = list(SPECIALS) + alphabet
        words = []
        freqs = []
        for w, f in sorted(word_freq.items()):
            words.append([ch if ch in alpha_set else UNK for ch in w])
            freqs.append(f)

        pair_count: dict[tuple[str, str], int] = defaultdict(int)
        where: dict[tuple[str, str], set[int]] = defaultdict(set)
        for i, syms in enumerate(words):
            for a, b in zip(syms, syms[1:]):
                if UNK in (a, b):
                    continue
                pair_count[(a, b)] += freqs[i]
                where[(a, b)].add(i)
        heap = [(-c, p) for p, c in pair_count.items()]
        heapq.heapify(heap)
        merges: list[tuple[str, str]] = []
        while len(pieces) < vocab_size and heap:
            negc, pair = heapq.heappop(heap)
            if pair_count.get(pair, 0) != -negc or negc == 0:
                continue  # stale entry
            if -negc < 2:
                break
            a, b = pair
            new = a + b
            merges.append(pair)
            pieces.append(new)
            changed: dict[tuple[str, str], int] = defaultdict(int)
            for i in list(where.pop(pair, ())):
                syms, f = words[i], freqs[i]
                for x, y in zip(syms, syms[1:]):
                    if UNK not in (x, y):
                        changed[(x, y)] -= f
                out, j = [], 0
                while j < len(syms):
                    if j + 1 < len(syms) and syms[j] == a and syms[j + 1] == b:
                        out.append(new)
                        j += 2
                    else:
                        out.append(syms[j])
                        j += 1
                words[i] = out
                for x, y in zip(out, out[1:]):
                    if UNK not in (x, y):
                        changed[(x, y)] += f
                        where[(x, y)].add(i)
            pair_count.pop(pair, None)
            for p, d in changed.items():
                if p == pair or d == 0:
                    continue
                c = pair_count.get(p, 0) + d
                if c <= 0:
                    pair_count.pop(p, None)
                else:
                    pair_count[p] = c
                    heapq.heappush(heap, (-c, p))
        return cls(pieces, merges)

    # ------------------------------------------------------------------ encode / decode
    def _encode_word(self, word: str) -> list[str]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        syms = [ch if ch in self.piece_to_id else UNK for ch in word]
        while len(syms) > 1:
            best, best_rank = None, None
            for k in range(len(syms) - 1):
                r = self.ranks.get((syms[k], syms[k + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = k, r
            if best is None:
                break
            syms = syms[:best] + [syms[best] + syms[best + 1]] + syms[best + 2 :]
        if len(self._cache) < 200_000:
            self._cache[word] = syms
        return syms

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for w in pretokenize(text):
            ids.extend(self.piece_to_id.get(p, self.unk_id) for p in self._encode_word(w))
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            p = self.pieces[i] if 0 <= i < len(self.pieces) else UNK
            out.append(" ?? " if p == UNK else p)
        return normalize("".join(out).replace(MARK, " "))

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        Path(path).write_text(
            json.dumps({"pieces": self.pieces, "merges": [list(m) for m in self.merges]}, ensure_ascii=False),
            encoding="utf-8",
        )

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(d["pieces"], [tuple(m) for m in d["merges"]])
