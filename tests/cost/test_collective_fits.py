"""Collectives priced by measured fits (`CollectiveFit`): a fixed cost by kind and group size plus seconds per
payload byte, fitted from chains of small and large collectives (`shardc.cost.calibrate`), carried by a
topology level, round-tripped through topology files and the calibration cache; levels without fits (every
preset) keep the ring formulas."""
import json

import pytest

import shardc.cost.calibrate as calibrate
from shardc.cost.collectives import Collective, collective_phases, collective_time, ring_time
from shardc.cost.presets import preset
from shardc.cost.topology import COLLECTIVE_KINDS, CollectiveFit, Level, Topology

US = 1e-6


def test_fit_recovers_fixed_cost_and_bytes_cost():
    true = CollectiveFit("all-to-all", 30 * US, 20 * US, 1.5e-9)
    small, large = 1024, 262144
    got = calibrate._fit("all-to-all", {g: (small, true.seconds(g, small)) for g in (2, 8)},
                         (large, true.seconds(8, large)))
    for field in calibrate._FIT_FIELDS:
        assert getattr(got, field) == pytest.approx(getattr(true, field), rel=1e-6, abs=1e-18)
    # a group in between: the fixed cost is linear in n - 1
    assert got.seconds(4, 65536) == pytest.approx(30 * US + 3 * 20 * US + 65536 * 1.5e-9)
    # one group size (odd device counts, 2 devices): a fixed cost and a rate
    one = calibrate._fit("all-reduce", {3: (small, true.seconds(3, small))}, (large, true.seconds(3, large)))
    assert one.per_peer == 0 and one.seconds(3, 4096) == pytest.approx(true.seconds(3, 4096))


def test_a_noisy_negative_slope_is_clamped_not_negative():
    # the large payload measured faster than the small one (a busy moment): no negative seconds per byte
    got = calibrate._fit("all-gather", {2: (1024, 50 * US), 8: (1024, 150 * US)}, (262144, 140 * US))
    assert got.per_byte == 0 and got.fixed(2) == pytest.approx(50 * US) and got.fixed(8) == pytest.approx(150 * US)
    assert all(got.seconds(n, b) > 0 for n in (2, 4, 8) for b in (0, 1024, 1 << 20))


def test_a_smaller_group_measured_slower_is_taken_as_noise():
    # pairs measured slower than all eight devices (a busy moment, as a CI run saw: fixed(8) fitted to 0):
    # the larger group's fixed cost for both, never a fixed cost that shrinks with the group or reaches zero
    got = calibrate._fit("all-gather", {2: (1024, 140 * US), 8: (1024, 20 * US)}, (262144, 300 * US))
    assert got.per_peer == 0 and got.fixed(2) == pytest.approx(got.fixed(8)) and got.fixed(8) > 0
    zero = calibrate._fit("all-to-all", {2: (1024, 0.0), 8: (1024, 0.0)}, (262144, 0.0))
    assert zero.fixed(8) >= calibrate._MIN_FIXED and zero.fixed(2) >= calibrate._MIN_FIXED


def _level(fits=(), permute_latency=None):
    return Level("host", 8, 1e9, 20 * US, permute_latency, tuple(fits))


def _topo(level):
    return Topology("t", preset("h100-sxm-8").device, (level,), overlap=False, backend="cpu")


def test_a_level_prices_a_kind_by_its_fit_and_the_others_by_the_ring():
    a2a = CollectiveFit("all-to-all", 40 * US, 20 * US, 2e-9, 0.0)
    perm = CollectiveFit("collective-permute", 150 * US, 0.0, 1e-9, 0.0)
    topo = _topo(_level((a2a, perm), permute_latency=500 * US))
    mesh = {"x": 4, "y": 2}
    mapping = topo.map_mesh(mesh)
    B = 4096
    t = collective_time(Collective("all-to-all", ("x", "y"), B), topo, mapping, mesh)
    assert t == pytest.approx(40 * US + 7 * 20 * US + B * 2e-9)
    # a small all-to-all over 8 devices costs far more than one ring step: its fixed cost is its own
    assert t > 5 * topo.levels[0].latency
    # over a pair of devices: the fit's fixed cost at n = 2
    assert collective_time(Collective("all-to-all", ("y",), B), topo, mapping, mesh) == pytest.approx(
        60 * US + B * 2e-9)
    # the permute's fit replaces the level's permute latency, whatever its group
    for axes in (("y",), ("x", "y")):
        assert collective_time(Collective("collective-permute", axes, B), topo, mapping, mesh) == pytest.approx(
            150 * US + B * 1e-9)
    # a kind without a fit keeps the ring formula
    ar = Collective("all-reduce", ("x", "y"), B)
    assert collective_time(ar, topo, mapping, mesh) == pytest.approx(ring_time("all-reduce", 8, B, 1e9, 20 * US)[0])
    # the bytes each device sends are the ring formula's either way
    (phase,) = collective_phases(Collective("all-to-all", ("x", "y"), B), topo, mapping, mesh)
    assert phase.bytes == pytest.approx(7 / 8 * B)


def test_fits_round_trip_through_a_topology_file(tmp_path):
    fits = tuple(CollectiveFit(k, (10 + i) * US, 2 * US, 1e-9 * (i + 1), -1e-10 * i)
                 for i, k in enumerate(COLLECTIVE_KINDS))
    topo = _topo(_level(fits))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(topo.to_dict()))
    back = Topology.from_file(path)
    assert back.levels == topo.levels and back.levels[0].fit("all-gather") == fits[1]
    with pytest.raises(Exception, match="unknown collective kind"):
        d = topo.to_dict()
        d["levels"][0]["collectives"][0]["kind"] = "all-to-some"
        Topology.from_dict(d)


@pytest.mark.parametrize("name", ["h100-sxm-8", "h100-sxm-8x2", "a100-40g-8", "tpu-v4-8", "tpu-v5e-16"])
def test_presets_have_no_fits_and_keep_the_ring_formulas(name):
    topo = preset(name)
    assert all(not lv.collectives for lv in topo.levels)
    assert "collectives" not in json.dumps(topo.to_dict())
    inner = topo.levels[0]
    mesh = {"a": inner.size}
    mapping = topo.map_mesh(mesh)
    B = 1 << 20
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        want = ring_time(kind, inner.size, B, inner.bandwidth, inner.latency)[0]
        assert collective_time(Collective(kind, ("a",), B), topo, mapping, mesh) == pytest.approx(want, rel=1e-12)
    cp = collective_time(Collective("collective-permute", ("a",), B), topo, mapping, mesh)
    assert cp == pytest.approx(B / inner.bandwidth + inner.latency, rel=1e-12)


def _measurement(**fits):
    m = {"flops": 2e10, "vector_flops": 6e9, "bandwidth": 1.5e9, "overhead": 5e-6, "link_bandwidth": 3.5e9,
         "latency": 2.3e-5, "devices": 8.0, "contention": 1.0, "permute_latency": 5e-4, "fresh_memory_cost": 0.0}
    for kind, fit in fits.items():
        m.update({f"{fit.kind}:{f}": getattr(fit, f) for f in calibrate._FIT_FIELDS})
    return m


def test_cpu_host_takes_its_fits_from_the_cached_measurement(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))  # (not the session's pinned measurement)
    fits = {k.replace("-", "_"): CollectiveFit(k, 50 * US, 15 * US, 1e-9, 1e-9) for k in COLLECTIVE_KINDS}
    calibrate.store(_measurement(**fits))
    level = calibrate.cpu_host().levels[0]
    assert {f.kind for f in level.collectives} == set(COLLECTIVE_KINDS)
    assert level.fit("all-to-all") == fits["all_to_all"]
    # a measurement from before the fits (cache version 5, or one pinned by hand) prices by the ring model
    calibrate.store(_measurement())
    assert calibrate.cpu_host().levels[0].collectives == ()


def test_a_chain_measured_within_noise_of_its_baseline_is_measured_again(monkeypatch):
    # a busy moment made the permute chain about as fast as the chain without collectives (a CI run fitted its
    # fixed cost to the floor): it is run again, with its baseline, and the faster of the two runs kept
    base, perm, ar = (None, 0, 256), ("collective-permute", 8, 256), ("all-reduce", 8, 256)
    rounds_seen = []
    measured = [{base: 5e-3, perm: 5.05e-3, ar: 6e-3}, {base: 4e-3, perm: 6.5e-3}]

    def fake_round_robin(runs, rounds):
        rounds_seen.append((sorted(runs, key=repr), rounds))
        return measured.pop(0)

    monkeypatch.setattr(calibrate, "_round_robin", fake_round_robin)
    best = calibrate._chain_times({base: None, perm: None, ar: None}, 7)
    assert best == {base: 4e-3, perm: 5.05e-3, ar: 6e-3}
    assert rounds_seen[1] == (sorted([base, perm], key=repr), 14)  # only the lost chain and its baseline
    # a chain that keeps losing is run at most _FIT_RETRIES more times, then fitted at the floor
    calls = []
    monkeypatch.setattr(calibrate, "_round_robin", lambda runs, rounds: calls.append(1) or {k: 1e-3 for k in runs})
    assert calibrate._chain_times({base: None, perm: None}, 7) == {base: 1e-3, perm: 1e-3}
    assert len(calls) == 1 + calibrate._FIT_RETRIES
