"""Meshes scored by forked workers (shardc.search.workers): the same plan and report as one process, a failed
or dead worker costs time but not the result, children are reaped, and no fork where a child may not work."""
import dataclasses
import os
import warnings

import jax
import pytest

import shardc.search.workers as workers
from shardc.search.driver import _worker_limit, search_plan
from shardc.search.mesh_work import MeshWork
from shardc.sim import as_topology
from search_models import forks, mlp_args, mlp_forward, problem_of  # noqa: F401 (forks: a fixture)

MESHES = [{"data": 8}, {"data": 4, "model": 2}, {"data": 2, "model": 4}, {"model": 8}, {"model": 2, "data": 4}]


def _step(x, w1, w2):
    l, g = jax.value_and_grad(lambda w1, w2: mlp_forward(x, w1, w2).mean(), argnums=(0, 1))(w1, w2)
    return w1 - g[0], w2 - g[1], l


def _search(pb, n, **kw):
    return search_plan(pb, MESHES, budget_s=kw.pop("budget_s", 0.3), seed=0, progress=False, workers=n, **kw)


def _same(a, b):
    """Plans and reports equal in everything the search decided and counted."""
    (pa, ra), (pb, rb) = a, b
    assert (ra.chosen, ra.baselines, ra.meshes, ra.seeds, ra.searched, ra.groups, ra.layout_cost) == \
           (rb.chosen, rb.baselines, rb.meshes, rb.seeds, rb.searched, rb.groups, rb.layout_cost)
    assert (ra.evaluations, ra.plan_budget, ra.candidate_meshes) == (rb.evaluations, rb.plan_budget,
                                                                    rb.candidate_meshes)
    assert (pa.shardings, pa.strategies, pa.reshards) == (pb.shardings, pb.strategies, pb.reshards)


@pytest.fixture(scope="module")
def problem():
    return problem_of(_step, mlp_args())


@pytest.fixture(scope="module")
def alone(problem):
    return _search(problem, 1)


def _reaped(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("n", [2, 3])
def test_workers_plan_as_one_process_does(problem, alone, forks, n):
    _same(_search(problem, n), alone)
    assert len(forks) == n - 1 and all(_reaped(p) for p in forks)


def test_with_the_pcg_rewriting_too(forks):
    """pcg=True: each searched mesh's best plan rewritten in the worker that searched it (the meshes' rewritings
    at once), its PCG sent back whole (its operators' primitives and parameters as references to the objects
    both processes hold: no worker lost, no search again alone)."""
    pb = dataclasses.replace(problem_of(_step, mlp_args()), pcg=True)
    one = _search(pb, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a worker lost is a warning before the search runs again alone)
        two = _search(pb, 2)
    _same(two, one)
    a, b = one[0].pcg, two[0].pcg
    assert forks and a is not None and b.pcg.key() == a.pcg.key()
    assert dataclasses.replace(b, pcg=None, seconds=0) == dataclasses.replace(a, pcg=None, seconds=0)


def test_a_budget_that_ends_phase_one_early_counts_the_same_meshes(problem, forks):
    """A small budget stops scoring after the first meshes: a worker's speculative meshes are dropped."""
    one = _search(problem, 1, budget_s=0.01, max_meshes=1)
    two = _search(problem, 2, budget_s=0.01, max_meshes=1)
    assert len(one[1].meshes) < len(MESHES)
    _same(two, one)
    assert forks and all(_reaped(p) for p in forks)


def _raise_boom():
    raise RuntimeError("boom in a worker")


@pytest.mark.parametrize("fault, said", [(_raise_boom, "(?s)boom in a worker.*searching again in this process alone"),
                                         (lambda: os._exit(3), "stopped answering")], ids=["raises", "dies"])
def test_a_failing_or_dead_worker_costs_time_not_the_result(problem, alone, forks, monkeypatch, fault, said):
    parent = os.getpid()
    real = MeshWork.score

    def faulty_in_a_child(self, *a):
        if os.getpid() != parent:
            fault()
        return real(self, *a)

    monkeypatch.setattr(MeshWork, "score", faulty_in_a_child)
    with pytest.warns(RuntimeWarning, match=said):
        got = _search(problem, 2)
    _same(got, alone)
    assert forks and all(_reaped(p) for p in forks)


def test_no_fork_where_a_child_may_not_work(problem):
    assert _worker_limit(2, problem, MESHES, _budget(problem)) == 2
    assert _worker_limit(1, problem, MESHES, _budget(problem)) == 1
    assert _worker_limit(2, problem, MESHES[:1], _budget(problem)) == 1
    assert _worker_limit(2, problem, MESHES, _budget(problem, cap=True)) == 1  # what a cap stops must not vary
    host = as_topology("cpu-host")  # one that times ops with XLA on this host (the tests' does not)
    host = dataclasses.replace(host, device=dataclasses.replace(host.device, measured_ops=("conv_general_dilated",)))
    measured = problem_of(_step, mlp_args(), topology=host)
    assert _worker_limit(2, measured, MESHES, _budget(measured)) == 1


def test_a_small_program_is_not_worth_a_fork(problem, alone, forks, monkeypatch):
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "2")
    _same(_search(problem, None), alone)  # (its first mesh scores in milliseconds)
    assert forks == []


def test_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "3")
    assert workers.default_workers() == 3
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "two")
    with pytest.raises(ValueError, match="SHARDC_SEARCH_WORKERS='two'"):
        workers.default_workers()
    monkeypatch.delenv("SHARDC_SEARCH_WORKERS")
    assert 1 <= workers.default_workers() <= workers.MAX_WORKERS


def _budget(problem, cap=None):
    from shardc.search.budget import Budget

    return Budget.for_search(1.0, problem.graph, 8, cap=cap)


def test_a_mesh_searched_beside_another_of_its_process_moves_to_an_idle_one(problem, forks):
    """Meshes 0 and 2 are both scored here; searched together, mesh 2 is scored again and searched in the
    child, with the same result as here alone."""
    from shardc.search.budget import Budget
    from shardc.search.driver import _mesh_of

    def jobs():
        return [(i, m, _mesh_of(m), []) for i, m in enumerate(MESHES[:3])]

    def run(n):
        pool = workers.MeshPool(MeshWork(problem, ("hints", "data-parallel", "megatron"), True, 8))
        if n > 1:
            pool.spread(jobs(), n)
        try:
            scored = [pool.scored(j) for j in jobs()]
            made_in = pool.process_of(2)
            res = pool.search([0, 2], lambda i: jobs()[i], 12.0, Budget(None, None), 0, 50)
            # a baseline of mesh 2, made where mesh 2 was scored, compared on its mesh where it is searched now
            rec = scored[2].considered[0]
            plan = pool.call_on(made_in, "plan", rec.plan_id)
            groups = pool.call(2, "groups", 2, None, plan, rec.score.time)
            return [[(c.score, c.point) for c in [*r.considered, r.final]] + [r.charges] for r in res], \
                pool.evaluations([0, 1, 2]), plan.shardings, groups, dict(pool._owner)
        finally:
            pool.close()

    alone, here = run(1)[:4], run(2)
    assert here[4][2] == 1 and here[4][0] == 0  # (mesh 2 moved to the child)
    assert here[:4] == alone
    assert len(forks) == 1 and _reaped(forks[0])


@pytest.mark.parametrize("pcg", [False, True])
def test_a_plan_made_with_workers_runs_as_jax_jit(forks, monkeypatch, pcg):
    """Through @shardc.auto, forking whatever the program's size: the chosen plan (made in a worker or here,
    with its PCG rewritten when pcg=True) runs and equals jax.jit."""
    import jax.numpy as jnp
    import numpy as np

    import shardc
    import shardc.search.driver as driver

    monkeypatch.setattr(driver, "_FORK_WORTH_S", 0.0)
    monkeypatch.setenv("SHARDC_SEARCH_WORKERS", "2")

    def step(x, w1, w2):
        l, g = jax.value_and_grad(lambda w1, w2: mlp_forward(x, w1, w2).mean(), argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g[0], w2 - 0.1 * g[1], l

    args = mlp_args()
    f = shardc.auto(step, search=True, topology="h100-sxm-8", pcg=pcg)
    got, want = f(*args), jax.jit(step)(*args)
    assert forks and all(_reaped(p) for p in forks)
    assert (f.plan(*args).search.chosen.name == "search+pcg") == pcg  # (this MLP's PCG rewrite pays on h100)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(jnp.asarray(b)), rtol=1e-6, atol=1e-6)


def test_a_mesh_of_devices_crosses_between_workers():
    """A rewritten PCG on a mesh made in the worker (`shardc.pcg.refine`: an axis split into sub-axes) holds that
    mesh's devices, which do not pickle: they travel as references (a worker was lost and the search ran again
    alone before)."""
    import numpy as np
    from jax.sharding import Mesh

    read, write = os.pipe()
    channel = workers._Channel(read, write, [])
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("model", "data.0", "data.1"))
    channel.send(("reply", {"mesh": mesh}))
    kind, got = channel.recv()
    assert kind == "reply" and got["mesh"] == mesh and list(got["mesh"].devices.flat) == list(mesh.devices.flat)
