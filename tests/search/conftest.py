"""Fixtures shared by the search tests."""
import pytest

import shardc.search.workers as workers


@pytest.fixture
def forks(monkeypatch):
    """The pids of the search workers forked during the test."""
    pids = []
    real = workers.MeshPool._fork

    def counted(*a):
        child = real(*a)
        pids.append(child.pid)
        return child

    monkeypatch.setattr(workers.MeshPool, "_fork", staticmethod(counted))
    return pids
