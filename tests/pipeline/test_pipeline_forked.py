"""Screens of candidate pipelines run ahead in forked children (shardc.pipeline.forked): the same choice, row
for row, as screening one candidate at a time here."""
import os
import warnings

import pytest

from shardc.pipeline import Pipeline
from shardc.pipeline.choose import choose_pipeline
from shardc.pipeline.forked import ForkedScreens

from choice_helpers import no_unpipelined_plan_fits
from test_pipeline_lowering import make_args, make_step

fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="forked screens need os.fork")


def _rows(rows):
    return [(c.name, c.time, c.peak, sorted(c.mesh.items()), c.pipeline) for c in rows]


def _counting_forks(monkeypatch):
    """Every ForkedScreens choose_pipeline makes, recorded; forks allowed for any program size."""
    import shardc.pipeline.choose as choose

    made = []

    class Counted(ForkedScreens):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(choose, "ForkedScreens", Counted)
    monkeypatch.setattr(choose, "_SCREEN_FORK_WORTH_S", 0.0)
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "2")
    return made


@fork_only
def test_screens_forked_ahead_choose_as_screens_here(monkeypatch):
    """Bounded siblings, a finalist and the megatron-3d rows: every row, the plan and its cost are those of
    the screens run here one by one, and the screens did run in children."""
    import shardc.pipeline.choose as choose

    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4, data=("data",), shards=2, defer_wgrad=True), Pipeline(2, 4, data=("data",), shards=2),
             Pipeline(2, 4, "1f1b", data=("data",), shards=2), Pipeline(4, 4, defer_wgrad=True), Pipeline(4, 4),
             Pipeline(4, 4, "1f1b"), Pipeline(2, 2, "circular", repeats=2, defer_wgrad=True)]
    opts = dict(topology="h100-sxm-8", budget_s=0.3, pipelines=pipes, finalists=1, floors=False)
    made = _counting_forks(monkeypatch)
    best, rows = choose_pipeline(step, args, **opts)
    forks, = made
    assert forks.forked >= 2 and forks.fallbacks == 0
    monkeypatch.setattr(choose, "_fork_limit", lambda *a: 0)
    best_here, rows_here = choose_pipeline(step, args, **opts)
    assert made[1].forked == 0
    assert _rows(rows) == _rows(rows_here)
    assert {c.name for c in rows} >= {"screened", "pipelined", "megatron-3d"}
    assert (best.pipeline, best.cost.step_time, best.cost.peak_memory) == \
           (best_here.pipeline, best_here.cost.step_time, best_here.cost.peak_memory)


@fork_only
def test_a_screen_forked_that_wins_is_planned_here(monkeypatch):
    """With no unpipelined plan fitting and no finalist, a screen run in a child wins: its plan is made in this
    process, the plan the screens here give."""
    import shardc.pipeline.choose as choose

    no_unpipelined_plan_fits(monkeypatch)
    step, args = make_step(None), make_args()
    pipes = [Pipeline(2, 4, data=("data",), shards=4), Pipeline(4, 4, "1f1b"), Pipeline(2, 2, data=("data",), shards=2)]
    opts = dict(topology="h100-sxm-8", budget_s=0.3, pipelines=pipes, finalists=0, floors=False)
    made = _counting_forks(monkeypatch)
    best, rows = choose_pipeline(step, args, **opts)
    assert made[0].forked >= 2
    monkeypatch.setattr(choose, "_fork_limit", lambda *a: 0)
    best_here, rows_here = choose_pipeline(step, args, **opts)
    assert _rows(rows) == _rows(rows_here)
    assert best.pipeline == best_here.pipeline and best.strategies == best_here.strategies
    assert best.cost.step_time == best_here.cost.step_time and best.pipeline_choice is not None


@fork_only
def test_a_forked_screen_warns_here_and_a_lost_child_is_run_here():
    parent = os.getpid()

    def run(key):
        if key == "lost" and os.getpid() != parent:
            os._exit(3)  # (the child dies without a word)
        warnings.warn(f"screened {key}", UserWarning)
        return key * 2

    forks = ForkedScreens(run, limit=2)
    assert forks.start("ab") and forks.start("lost") and not forks.start("more")  # (two at most)
    with pytest.warns(UserWarning, match="screened ab"):
        assert forks.take("ab") == "abab"
    with pytest.warns(RuntimeWarning, match="screening it again in this process"):
        assert forks.take("lost") == "lostlost"
    assert (forks.forked, forks.fallbacks, forks.running()) == (2, 1, 0)
    assert forks.take("here") == "herehere"  # (never started: computed here)
    forks.start("dropped")
    forks.drop("dropped")
    assert forks.running() == 0


@fork_only
def test_a_silent_child_is_killed_and_its_screen_run_here(monkeypatch):
    import time

    import shardc.pipeline.forked as forked

    parent = os.getpid()
    monkeypatch.setattr(forked, "STALL_S", 0.3)

    def run(key):
        if os.getpid() != parent:
            time.sleep(30)  # (hangs, as on a lock held at the fork)
        return key + "!"

    forks = ForkedScreens(run, limit=1)
    assert forks.start("slow")
    pid = forks._children["slow"][0]
    t = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="did not answer in 0 s"):
        assert forks.take("slow") == "slow!"
    assert time.perf_counter() - t < 10 and forks.running() == 0 and forks.fallbacks == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # (killed and reaped)
