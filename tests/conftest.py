"""Test configuration: 8 virtual CPU devices (and LLVM at -O0, which only makes compiling faster), set before
JAX initialises its backend; one pinned cpu-host measurement, so that plans priced on it (the default topology
on CPU devices) do not depend on how busy the machine is while the tests run; and no test may compile a program
in which XLA fell back to an "[SPMD] Involuntary full rematerialization" (a reshard done by replicating the
whole tensor) unless it is marked `involuntary_remat` with the reason it provokes one."""
import atexit
import os
import shutil
import tempfile

# LLVM at -O0: the tests compile thousands of small programs, and XLA:CPU's LLVM pass is most of each compile.
# The HLO XLA compiles (its sharding passes, collectives, fusions, buffer assignment and memory analysis, all of
# which the tests check) is the same at every backend level; only the machine code is less optimised.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Each test process has its own cache directory (never the user's ~/.cache/shardc).
_CACHE = tempfile.mkdtemp(prefix="shardc-tests-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["SHARDC_CACHE_DIR"] = _CACHE

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# A measurement of the reference 2-core machine (shardc.cost.calibrate.measure_cpu_host, rounded); the
# measurement itself is tested in tests/cost/test_cpu_host_topology.py, in a directory of its own. Device rates
# from a quiet run of cache version 5 (its memory bandwidth, measured then writing a fresh output, doubled: the
# in-place rate of version 6 was 1.9-4.6x the fresh one at load 5-9); collective fits (version 6) the medians of
# measurements at load 4-12 (fixed costs: 6 with work between the collectives; seconds per byte: 10); link
# bandwidth, latency and permute latency derived from them as `measure_cpu_host` derives them.
_FITS = {"all-reduce": (1.4e-4, 2.0e-5, 1.8e-9), "all-gather": (1.4e-4, 2.4e-5, 6.3e-10),
         "reduce-scatter": (1.2e-4, 2.7e-5, 1.3e-9), "all-to-all": (1.0e-4, 3.5e-5, 1.6e-9),
         "collective-permute": (3.4e-4, 0.0, 2.0e-9)}  # kind: (base, per_peer, per_byte)
REFERENCE_CPU_HOST = {"flops": 2.0e10, "vector_flops": 6.0e9, "bandwidth": 3.0e9, "overhead": 5.0e-6,
                      "link_bandwidth": 9.7e8, "latency": 2.0e-5, "devices": 8.0, "contention": 1.0,
                      "permute_latency": 3.4e-4, "fresh_memory_cost": 1.6e-9,
                      **{f"{kind}:{field}": value for kind, fit in _FITS.items()
                         for field, value in zip(("base", "per_peer", "per_byte", "per_byte_spread"), (*fit, 0.0))}}

from shardc.cost.calibrate import store  # noqa: E402

store(REFERENCE_CPU_HOST)


import pytest  # noqa: E402

from shardc.check import INVOLUNTARY_REMAT, xla_log  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "involuntary_remat(reason): the test provokes XLA's involuntary full "
                                       "rematerialization on purpose (it is not a failure there)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a test whose compiles made XLA log an involuntary full rematerialization (XLA writes it to the
    process's stderr; the captured text is passed on, so pytest still shows it)."""
    if item.get_closest_marker("involuntary_remat") is not None:
        return (yield)
    with xla_log() as lines:
        result = yield
    remat = [line.strip() for line in lines if INVOLUNTARY_REMAT in line]
    if remat:
        raise AssertionError(f"XLA fell back to involuntary full rematerialization {len(remat)} time(s) while "
                             f"this test compiled; the first: {remat[0][:600]}")
    return result


@pytest.fixture
def jax_persistent_cache(tmp_path):
    """jax's persistent compilation cache in a directory of this test's own, every program written to it (as a
    user's cache after a first run); as it was again afterwards."""
    from jax._src import compilation_cache

    options = {"jax_compilation_cache_dir": str(tmp_path / "jax-cache"),
               "jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": 0,
               "jax_enable_compilation_cache": True}
    old = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        yield tmp_path / "jax-cache"
    finally:
        for name, value in old.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
