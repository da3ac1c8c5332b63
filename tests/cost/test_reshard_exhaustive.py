"""The reshard model against XLA's compiled programs, pair by pair: every (src, dst) pair of dim shardings on
a 2x4 mesh for a 2-D and a 3-D shape and on a 2x2x2 mesh for a 2-D shape, every partial-sum source on the
2x4 mesh (a dot contracting over sharded dims, its result pinned to its natural layout, then constrained to
the target), a fixed-seed sample of 1000 pairs of the 2x2x2 3-D space, and 128 pairs of a 4-D one (where one
all-to-all can move several axes).

Each space compiles in a few large batches (`bench.reshard_probe`, which also runs the full enumeration).
The oracle is the compiled program: the collectives XLA made for each reshard, kind by kind and byte for
byte, and whether it warned of an involuntary full rematerialization."""
from __future__ import annotations

import pytest

from bench.reshard_probe import SPACES, compile_cases, dims_cases, mismatches, partial_cases, predict, sampled_cases

SAMPLE = 1000

CASES = {  # name: (mesh, shape, cases)
    "2x4 (16,32)": ("2x4", (16, 32), lambda: dims_cases(2, SPACES["2x4"])),
    "2x4 (8,16,32)": ("2x4", (8, 16, 32), lambda: dims_cases(3, SPACES["2x4"])),
    "2x2x2 (16,32)": ("2x2x2", (16, 32), lambda: dims_cases(2, SPACES["2x2x2"])),
    "2x4 (16,32) partial sums": ("2x4", (16, 32), lambda: partial_cases(2, SPACES["2x4"])),
    "2x4 (8,16,32) partial sums": ("2x4", (8, 16, 32), lambda: partial_cases(3, SPACES["2x4"])),
    f"2x2x2 (8,16,32) sample of {SAMPLE}": ("2x2x2", (8, 16, 32), lambda: sampled_cases(3, SPACES["2x2x2"], SAMPLE)),
    "2x2x2 (8,8,16,16) sample of 128": ("2x2x2", (8, 8, 16, 16), lambda: sampled_cases(4, SPACES["2x2x2"], 128)),
}


def _show(bad: list, n: int = 5) -> str:
    return "\n".join(f"{src} partial{k} -> {dst}\n  model {pred}\n  xla   {obs}" for (src, k, dst), pred, obs in bad[:n])


REMAT = pytest.mark.involuntary_remat("compiles every reshard of the space, those XLA rematerializes included: "
                                      "its warning is what the model's flag is checked against")


@REMAT
@pytest.mark.parametrize("name", list(CASES))
def test_reshards_match_compiled_programs(name):
    mesh_name, shape, make = CASES[name]
    mesh, cases = SPACES[mesh_name], make()
    observed = compile_cases(mesh, shape, cases)
    bad = mismatches(mesh, shape, cases, observed)
    assert not bad["collectives"], f"{len(bad['collectives'])} of {len(cases)} differ:\n{_show(bad['collectives'])}"
    assert not bad["remat"], f"{len(bad['remat'])} full-rematerialization flags differ:\n{_show(bad['remat'])}"
    assert not bad["axes"], f"{len(bad['axes'])} differ in mesh axes:\n{_show(bad['axes'])}"
    # The space exercises what the model covers: each kind of collective XLA emits on CPU, and the fallback.
    kinds = {kind for colls, _ in observed for kind, *_ in colls}
    assert {"all-gather", "all-to-all", "collective-permute"} <= kinds
    assert ("all-reduce" in kinds) == any(k for _, k, _ in cases)
    assert any(remat for _, remat in observed), "no reshard in this space falls back to full replication"


@REMAT
def test_a_wrong_model_is_caught(monkeypatch):
    """The comparison sees a collective the model loses and a flag it gets wrong."""
    import bench.reshard_probe as probe

    mesh, shape = SPACES["2x4"], (16, 32)
    cases = [((("data",), ()), (), ((), ("data",))), (((), ("data",)), (), (("model",), ()))]
    observed = compile_cases(mesh, shape, cases)
    assert [remat for _, remat in observed] == [False, True] and all(colls for colls, _ in observed)
    assert not any(mismatches(mesh, shape, cases, observed).values())
    monkeypatch.setattr(probe, "reshard_collectives", lambda *a, **k: ())
    monkeypatch.setattr(probe, "is_involuntary_remat", lambda *a, **k: False)
    bad = mismatches(mesh, shape, cases, observed)
    assert len(bad["collectives"]) == 2 and len(bad["remat"]) == 1
    assert predict(mesh, shape, cases[1]) == ((), False)
