"""Data side of the translation example: SWORD zText reader, BPE, corpora, batches."""
import struct
import zlib

import numpy as np
import pytest

from moe import data as mdata
from moe import sword
from moe.bpe import BPETokenizer, pretokenize


def _write_ztext_module(root, name, lang, verses_by_chapter):
    """A tiny zText module: one book ("Gen"), chapters of verses, written the way osis2mod lays it out."""
    data_rel = f"modules/texts/ztext/{name.lower()}/"
    (root / "mods.d").mkdir(parents=True, exist_ok=True)
    (root / "mods.d" / f"{name.lower()}.conf").write_text(
        f"[{name}]\nDataPath=./{data_rel}\nModDrv=zText\nCompressType=ZIP\nBlockType=BOOK\n"
        f"Versification=Tiny\nLang={lang}\nDescription=test module\n"
    )
    entries = ["", '<milestone type="x-importer"/>', '<div osisID="Gen" sID="b1" type="book"/><title>Gen</title>']
    for c, verses in enumerate(verses_by_chapter, 1):
        entries.append(f'<chapter n="{c}" osisID="Gen.{c}" sID="Gen.{c}"/>')
        for k, v in enumerate(verses):
            end = f'<chapter eID="Gen.{c}"/>' if k == len(verses) - 1 else ""
            entries.append(v + end)
    # Two blocks, to exercise the block table.
    half = len(entries) // 2
    blocks, bzv, bzz, bzs = [entries[:half], entries[half:]], b"", b"", b""
    for b, block in enumerate(blocks):
        raw, offsets = b"", []
        for e in block:
            enc = e.encode()
            offsets.append((len(raw), len(enc)))
            raw += enc
        comp = zlib.compress(raw)
        bzs += struct.pack("<III", len(bzz), len(comp), len(raw))
        bzz += comp
        for off, size in offsets:
            bzv += struct.pack("<IIH", b, off, size)
    d = root / data_rel
    d.mkdir(parents=True, exist_ok=True)
    (d / "ot.bzs").write_bytes(bzs)
    (d / "ot.bzv").write_bytes(bzv)
    (d / "ot.bzz").write_bytes(bzz)


def test_ztext_reader_and_alignment(tmp_path):
    _write_ztext_module(tmp_path, "TestEs", "es", [
        ['<w lemma="x">En el</w> principio.', "Y la tierra<note>una nota</note> &amp; el mar."],
        ["Segundo capítulo."],
    ])
    _write_ztext_module(tmp_path, "TestEn", "en", [
        ["In the beginning.", "\u00b6 And the <transChange>earth</transChange>."],
        ["Second chapter."],
    ])
    m = sword.find_module("testes", [tmp_path])
    assert m is not None and m.name == "TestEs" and m.driver == "zText"
    verses = list(sword.read_verses(m))
    assert [(v.book, v.chapter, v.verse) for v in verses] == [("Gen", 1, 1), ("Gen", 1, 2), ("Gen", 2, 1)]
    assert verses[1].text == "Y la tierra & el mar."
    pairs = mdata.sword_pairs("TestEs", "TestEn", roots=[tmp_path])
    assert [(a.text, b.text) for a, b in pairs] == [
        ("En el principio.", "In the beginning."),
        ("Y la tierra & el mar.", "And the earth."),
        ("Segundo capítulo.", "Second chapter."),
    ]
    assert sword.find_module("nope", [tmp_path]) is None
    with pytest.raises(mdata.CorpusMissing, match="apt-get install -y sword-text-sparv sword-text-kjv"):
        mdata.sword_pairs("Missing", "TestEn", roots=[tmp_path])


def test_installed_bible_if_available():
    if sword.find_module("spaRV1909eb") is None or sword.find_module("engKJV2006eb") is None:
        pytest.skip("sword-text-sparv / sword-text-kjv not installed")
    c = mdata.load_corpus("sparv", fallback=False)
    assert len(c.train) + len(c.test) > 31000
    assert len(c.test) == (len(c.train) + len(c.test)) // 50
    assert c.train[0] == ("EN el principio crió Dios los cielos y la tierra.",
                          "In the beginning God created the heaven and the earth.")


def test_missing_default_corpus_falls_back_with_install_hint(monkeypatch):
    monkeypatch.setattr(sword, "sword_roots", lambda: [])
    msgs = []
    c = mdata.load_corpus("sparv", synthetic_size=300, log=msgs.append)
    assert c.name == "synthetic"
    assert "apt-get install -y sword-text-sparv sword-text-kjv" in msgs[0]


def test_synthetic_task_is_deterministic_and_not_a_copy():
    a = mdata.synthetic_pairs(200, seed=3)
    assert a == mdata.synthetic_pairs(200, seed=3)
    for en, zo in a:
        assert en != zo and en.endswith(".") and zo.endswith(".")
        assert not set(en[:-1].split()) & set(zo[:-1].split())  # every word is translated
    c = mdata.load_corpus("synthetic", synthetic_size=500)
    assert not {s for s, _ in c.test} & {s for s, _ in c.train}
    # Verb agreement: same verb, singular vs plural subject -> different verb form (last word).
    sg = [z for e, z in a if e.split()[1] == "sees" or e.split()[2] == "sees"]
    pl = [z for e, z in a if " see " in f" {e} "]
    if sg and pl:
        assert {z.split()[-1].rstrip(".")[-2:] for z in sg} != {z.split()[-1].rstrip(".")[-2:] for z in pl}


def test_tsv_corpus(tmp_path):
    f = tmp_path / "pairs.tsv"
    f.write_text("".join(f"src {i}\ttgt {i}\n" for i in range(100)))
    c = mdata.load_corpus(data=str(f), test_every=10)
    assert len(c.test) == 10 and len(c.train) == 90
    bad = tmp_path / "bad.tsv"
    bad.write_text("no tab here\n")
    with pytest.raises(ValueError, match="source<TAB>target"):
        mdata.load_corpus(data=str(bad))


def test_bpe_roundtrip_and_determinism(tmp_path):
    texts = [s for p in mdata.synthetic_pairs(300) for s in p] + ["Dios creó los cielos, y la tierra: ¡Oh!"] * 2
    tok = BPETokenizer.train(texts, vocab_size=300)
    assert tok.vocab_size <= 300
    assert tok.pieces[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    for t in texts[:50] + texts[-1:]:
        assert tok.decode(tok.encode(t)) == t
    ids = tok.encode("the dog", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    tok2 = BPETokenizer.train(texts, vocab_size=300)
    assert tok2.pieces == tok.pieces and tok2.merges == tok.merges
    tok.save(tmp_path / "t.json")
    assert BPETokenizer.load(tmp_path / "t.json").encode(texts[0]) == tok.encode(texts[0])
    assert pretokenize("God, and") == ["\u2581God", ",", "\u2581and"]


def test_batch_stream_deterministic_and_resumable():
    rng = np.random.default_rng(0)
    src = [rng.integers(4, 50, rng.integers(1, 30)) for _ in range(500)]
    tgt = [rng.integers(4, 50, rng.integers(1, 30)) for _ in range(500)]
    s1 = mdata.BatchStream(src, tgt, [16, 32], 256, batch_multiple=8, seed=1)
    s2 = mdata.BatchStream(src, tgt, [16, 32], 256, batch_multiple=8, seed=1)
    for step in (0, 5, s1.per_epoch + 3, 3 * s1.per_epoch):
        b1, b2 = s1.batch(step), s2.batch(step)
        for k in b1:
            np.testing.assert_array_equal(b1[k], b2[k])
    b = s1.batch(0)
    assert b["src"].shape[0] % 8 == 0 and b["src"].shape == b["tgt_in"].shape == b["tgt_out"].shape
    assert (b["tgt_in"][:, 0] == 1).all()
    # tgt_out is tgt_in shifted left, ending in EOS.
    for r in range(b["src"].shape[0]):
        n = int((b["tgt_out"][r] != 0).sum())
        assert b["tgt_out"][r, n - 1] == 2
        np.testing.assert_array_equal(b["tgt_in"][r, 1:n], b["tgt_out"][r, : n - 1])
    # Different epochs see different orders.
    assert not np.array_equal(s1.batch(0)["src"], s1.batch(s1.per_epoch)["src"])
