"""The replay of XLA's reshard (shardc/cost/reshard.py) memoises its pure tile-assignment helpers (device groups,
transposed device orders, sub-tiling checks): a reshard priced with every memo warm from other reshards is the
one priced from cold memos (a caller that changed a memoised value would show here)."""
import random

from shardc.cost import reshard, reshard_path
from shardc.cost.reshard_path import _layouts, reshard_steps

MEMOS = [reshard._within_cached, reshard._replication_groups_cached, reshard._groups_across_cached,
         reshard._expand_cached, reshard._permuted, reshard._dims_reshard, reshard_path._steps, reshard_path._path]


def _cold() -> None:
    for memo in MEMOS:
        memo.cache_clear()


def test_warm_memos_price_reshards_as_cold_ones():
    rng = random.Random(0)
    cases = []
    for mesh in ({"stage": 4, "data": 8, "model": 2}, {"data": 4, "model": 4, "expert": 4}):
        for shape in ((4, 8, 16, 32), (16, 64, 8)):
            layouts = list(_layouts(len(shape), shape, mesh))
            cases += [(rng.choice(layouts), rng.choice(layouts), shape, mesh) for _ in range(25)]
    cold = []
    for src, dst, shape, mesh in cases:
        _cold()
        cold.append(reshard_steps(src, dst, shape, 4, mesh))
    _cold()
    warm = [reshard_steps(src, dst, shape, 4, mesh) for src, dst, shape, mesh in cases]
    rng.shuffle(order := list(range(len(cases))))
    again = {i: reshard_steps(*cases[i][:3], 4, cases[i][3]) for i in order}
    assert warm == cold and [again[i] for i in range(len(cases))] == cold
