"""Plans are priced on the devices that will run the step unless `topology=` names another cluster: the
measured cpu-host on CPU devices, the matching preset on known accelerators, a measured profile otherwise."""
import jax
import jax.numpy as jnp
import optax
import pytest

import shardc
import shardc.cost.calibrate as calibrate
import shardc.search.integrate as integrate
from shardc.cost.local import local_topology, preset_for

TX = optax.adam(1e-3)


@pytest.mark.parametrize("kind,n,name", [
    ("NVIDIA H100 80GB HBM3", 8, "h100-sxm-8"), ("NVIDIA H100 80GB HBM3", 4, "h100-sxm-8"),
    ("NVIDIA H100 80GB HBM3", 16, "h100-sxm-8x2"), ("NVIDIA A100-SXM4-40GB", 8, "a100-40g-8"),
    ("NVIDIA A100-SXM4-40GB", 16, None), ("TPU v4", 4, "tpu-v4-8"), ("TPU v5 lite", 8, "tpu-v5e-8"),
    ("TPU v5e", 16, "tpu-v5e-16"), ("TPU v5 lite", 12, None), ("NVIDIA L4", 8, None), ("cpu", 8, None),
])
def test_known_accelerators_get_their_preset(kind, n, name):
    assert preset_for(kind, n) == name
    if name is not None:
        assert shardc.Topology.preset(name).num_devices >= n


def test_cpu_devices_get_the_measured_host_and_others_a_measured_profile():
    topo = local_topology()
    assert topo.name == "cpu-host" and topo.num_devices == 8 and topo.device.vector_peak > 0
    other = calibrate.measured_local()  # what an accelerator without a preset gets (here: of the CPU devices)
    assert other.name == "measured-cpu" and other.overlap and other.num_devices == 8
    assert other.device.flops_per_s("float32") == topo.device.flops_per_s("float32")


def test_more_devices_than_the_host_need_a_named_topology():
    with pytest.raises(shardc.ShardingError, match="planning for 16 devices.*8.*topology="):
        local_topology(16)


def _step(params, opt_state, x):
    def loss(p):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    l, g = jax.value_and_grad(loss)(params)
    updates, opt_state = TX.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, l


def _args():
    params = {"w1": jnp.ones((256, 1024)) * 0.01, "w2": jnp.ones((1024, 256)) * 0.01}
    return params, TX.init(params), jnp.ones((512, 256))


def test_the_default_search_prices_plans_on_the_host_and_says_so():
    integrate._PLAN_CACHE.clear()
    plan = shardc.auto(_step, budget_s=0.5).plan(*_args())
    assert plan.cost.topology.name == "cpu-host"
    assert plan.cost.topology.to_dict() == local_topology().to_dict()
    text = " ".join(plan.explain().split())  # (wrapped at 120 columns)
    assert "priced on cpu-host (the devices this step runs on: measured on" in text
    named = shardc.auto(_step, budget_s=0.5, topology="tpu-v5e-8").plan(*_args())
    assert named.cost.topology.name == "tpu-v5e-8"
    assert "priced on tpu-v5e-8 (topology= given)" in " ".join(named.explain().split())


def test_the_plan_follows_the_measurement_and_the_same_cache_gives_the_same_plan(tmp_path, monkeypatch):
    """A host whose links are a million times slower gets a plan without communication; each measurement,
    read back from its cache, gives the same plan again."""
    import conftest

    monkeypatch.setattr(integrate, "_PLAN_CACHE", {})
    fingerprints = {}
    ref = conftest.REFERENCE_CPU_HOST
    for name, slower in (("fast", 1.0), ("slow", 1e6)):
        monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path / name))
        # (the links: the ring model's bandwidth, and each collective kind's measured seconds per byte)
        calibrate.store({**ref, "link_bandwidth": ref["link_bandwidth"] / slower,
                         **{k: v * slower for k, v in ref.items() if k.endswith(":per_byte")}})
        plans = []
        for _ in range(2):
            integrate._PLAN_CACHE.clear()
            plans.append(shardc.auto(_step, budget_s=0.5, seed=1).plan(*_args()))
        assert plans[0].fingerprint() == plans[1].fingerprint()
        fingerprints[name] = plans[0]
    assert sum(fingerprints["slow"].cost.comm_bytes.values()) == 0
    assert sum(fingerprints["fast"].cost.comm_bytes.values()) > 0


@pytest.mark.parametrize("name", ["plain_lm", "scan_gqa"])
def test_language_models_priced_on_the_host_split_the_batch(name):
    """Priced on the H100 preset (the default before), these LMs' plans replicated the batch and left the data
    axis idle on the 8 CPU devices; priced on the devices that run them, the batch is split and no axis idles."""
    import warnings

    from bench.fresh_models import MODELS
    from shardc.waste import IdleDevicesWarning

    step, args = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdleDevicesWarning)
        plan = shardc.auto(step, budget_s=1.0).plan(*args)
    ids = plan.shardings[plan.graph.inputs[-1]]  # the token ids [batch, time]
    assert ids.dims[0], f"batch replicated: {ids} on {plan.mesh_sizes}"
