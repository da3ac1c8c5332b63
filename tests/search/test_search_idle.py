"""Idle work (shardc.search.idle): tasks this process runs while its search workers work — run oldest first,
failures dropped, never nested — and a search with idle work queued makes the plan it makes without."""
import os
import time

import jax
import pytest

import shardc.search.idle as idle
import shardc.search.workers as workers
from shardc.search.driver import search_plan
from search_models import forks, mlp_args, mlp_forward, problem_of  # noqa: F401 (forks: a fixture)

MESHES = [{"data": 8}, {"data": 4, "model": 2}, {"data": 2, "model": 4}, {"model": 8}]


def _step(x, w1, w2):
    l, g = jax.value_and_grad(lambda w1, w2: mlp_forward(x, w1, w2).mean(), argnums=(0, 1))(w1, w2)
    return w1 - g[0], w2 - g[1], l


def test_tasks_run_oldest_first_failures_dropped_discarded_skipped():
    ran = []

    def fail():
        ran.append("fail")
        raise RuntimeError("an optional task failing")

    with idle.idle_work() as q:
        for k in "abc":
            q.add(k, lambda k=k: ran.append(k))
        q.add("f", fail)
        q.add("d", lambda: ran.append("d"))
        q.discard("b")
        assert idle.pending() and len(q) == 4
        idle.run_while(lambda: len(ran) < 2)
        assert ran == ["a", "c"]
        idle.run_while(lambda: True)
        assert ran == ["a", "c", "fail", "d"] and q.ran == 4 and not idle.pending()
    assert not idle.pending()
    idle.run_while(lambda: True)  # (no queue: nothing to run)


def test_a_task_does_not_run_other_tasks():
    seen = []

    def outer():
        seen.append(idle.pending())
        idle.run_while(lambda: True)  # (a search inside a task: runs no other task)

    with idle.idle_work() as q:
        q.add(0, outer)
        q.add(1, lambda: seen.append("inner"))
        idle.run_while(lambda: len(seen) < 1)
        assert seen == [False] and len(q) == 1


@pytest.fixture(scope="module")
def problem():
    return problem_of(_step, mlp_args())


def _decided(result):
    plan, rep = result
    return (rep.chosen, rep.baselines, rep.meshes, rep.seeds, rep.searched, rep.groups, rep.evaluations,
            plan.shardings, plan.strategies, plan.reshards)


def test_a_search_runs_the_idle_work_and_makes_the_same_plan(problem, forks):
    """With idle work queued, every mesh goes to a child (one more than without) and this process runs the
    tasks while it waits; the plan and report are those of one process."""
    alone = search_plan(problem, MESHES, budget_s=0.3, seed=0, progress=False, workers=1)
    pids, ranks = [], []

    def task():
        pids.append(os.getpid())
        ranks.extend(_niceness(forks))
        time.sleep(0.02)

    with idle.idle_work() as q:
        for k in range(1000):  # (more than the search's waits can take)
            q.add(k, task)
        here = search_plan(problem, MESHES, budget_s=0.3, seed=0, progress=False, workers=2)
    assert _decided(here) == _decided(alone)
    assert pids and set(pids) == {os.getpid()} and q.ran == len(pids)
    assert len(forks) == 2  # (two children: this process scored and searched no mesh)
    # (the children rank below this process meanwhile: its tasks go first when the cores are contended)
    assert ranks and min(ranks) == os.getpriority(os.PRIO_PROCESS, 0) + idle.IDLE_NICENESS, ranks
    for pid in forks:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_without_idle_work_the_children_rank_as_this_process(problem, forks, monkeypatch):
    ranks = []
    real = workers.MeshPool.scored

    def scored(self, job):
        ranks.extend(_niceness(forks))
        return real(self, job)

    monkeypatch.setattr(workers.MeshPool, "scored", scored)
    search_plan(problem, MESHES, budget_s=0.3, seed=0, progress=False, workers=2)
    assert forks and ranks and set(ranks) == {os.getpriority(os.PRIO_PROCESS, 0)}, ranks


def _niceness(pids):
    """The niceness of those of `pids` still running."""
    out = []
    for pid in pids:
        try:
            out.append(os.getpriority(os.PRIO_PROCESS, pid))
        except OSError:
            pass
    return out


def test_another_threads_search_runs_none_of_these_tasks():
    import threading

    seen = []
    with idle.idle_work() as q:
        q.add(0, lambda: seen.append(threading.get_ident()))
        t = threading.Thread(target=lambda: seen.append(("pending", idle.pending())) or idle.run_while(lambda: True))
        t.start()
        t.join()
        assert seen == [("pending", False)] and len(q) == 1
