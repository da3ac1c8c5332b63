"""shardc under jax.distributed: 2 processes x 4 CPU devices on localhost (gloo collectives, loopback only)
train like one process with 8 devices, agree on the plan, and fail loudly when their plans differ."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import shardc
from shardc.distributed import check_plan_agreement, plan_digest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import mh_train  # noqa: E402

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(tmp_path, *extra):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    procs, outs = [], []
    for i in range(2):
        out = tmp_path / f"process{i}.json"
        log = open(tmp_path / f"process{i}.log", "w")
        cmd = [sys.executable, os.path.join(HERE, "mh_train.py"), "--process-id", str(i), "--num-processes", "2",
               "--port", str(port), "--out", str(out), *extra]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
        outs.append(out)
    try:
        for p, _ in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    for i, (p, _) in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n" + (tmp_path / f"process{i}.log").read_text()[-4000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    return _run_two_processes(tmp_path_factory.mktemp("multihost"), "--disagree")


@pytest.fixture(scope="module")
def single_process_result():
    return mh_train.train()


def test_two_processes_train_like_one(two_process_results, single_process_result):
    single = single_process_result
    assert single["processes"] == 1
    r0, r1 = two_process_results
    assert (r0["processes"], r1["processes"]) == (2, 2)
    assert len(r0["devices"]) == len(r1["devices"]) == 4 and not set(r0["devices"]) & set(r1["devices"])
    # Every process sees the same global loss, equal to the single-process 8-device run's.
    np.testing.assert_allclose(r0["losses"], r1["losses"], rtol=0, atol=0)
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5, atol=1e-6)
    assert r0["losses"][-1] < r0["losses"][0]
    # The same plan everywhere (device ids differ between the runs, the layouts do not).
    assert r0["digest"] == r1["digest"]
    assert r0["fingerprint"] == r1["fingerprint"] == single["fingerprint"]


def test_two_processes_agree_on_a_searched_plan(tmp_path, single_process_result):
    r0, r1 = _run_two_processes(tmp_path, "--search")
    assert r0["searched"] and r1["searched"]
    assert r0["digest"] == r1["digest"]  # the search is bounded by steps on a multi-process job: same plan
    np.testing.assert_allclose(r0["losses"], r1["losses"], rtol=0, atol=0)
    np.testing.assert_allclose(r0["losses"], single_process_result["losses"], rtol=1e-5, atol=1e-6)


def test_processes_that_plan_differently_fail_loudly(two_process_results):
    for r in two_process_results:
        msg = r["disagree"]
        assert "planned the step differently" in msg, msg
        assert "processes [0]" in msg and "processes [1]" in msg, msg
        assert f"process {r['process']}" in msg and "float32[8, 4]" in msg, msg
        assert ("[data, -]" if r["process"] == 0 else "[model, -]") in msg, msg
        assert "mh_train.py" in msg, msg


def test_plan_digest_is_deterministic_and_single_process_check_passes():
    mesh = shardc.make_mesh({"data": 4, "model": 2})

    def f(x, w):
        return shardc.split(x, 0, "data") @ w

    x, w = np.ones((8, 16), np.float32), np.ones((16, 4), np.float32)
    a = shardc.auto(f, mesh=mesh, search=False).plan(x, w)
    b = shardc.auto(f, mesh=mesh, search=False).plan(x, w)
    assert plan_digest(a) == plan_digest(b)
    assert check_plan_agreement(a) == plan_digest(a).hex()[:16]
    c = shardc.auto(lambda x, w: shardc.split(x, 0, "model") @ w, mesh=mesh, search=False).plan(x, w)
    assert plan_digest(c) != plan_digest(a)
