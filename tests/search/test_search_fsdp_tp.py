"""FSDP x tensor parallel (MaxText's 2-D layout) in the search: a MaxText-style `nn.scan` + `nn.remat` decoder
planned bare (no rules, no shardings) must reach a plan at least as fast, in simulation, as the authors' layout
(their logical rules on `fsdp=4, tensor=2`, activations constrained as their code says)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardc
from bench.real_models import SCAN_RULES, ScannedDecoder
from shardc.cost.topology import Device, Level, Topology
from shardc.search.baselines import embed_size, fsdp_tp, megatron, parameter_inputs, scanned_state
from search_models import problem_of

# A CPU-host-like topology with fixed numbers (a measurement of this 2-core host's 8 XLA:CPU devices), so
# that the test does not depend on a calibration taken under load.
CPU = Topology("cpu-like", Device("cpu", {"float32": 4.3e10}, mem_bandwidth=5.4e9, memory=2**32, matmul_efficiency=1.0,
                                  vector_efficiency=1.0, op_overhead=4e-6, vector_flops=1.2e10),
               (Level("host", 8, 3.2e9, 2.4e-5, 9.3e-5),), overlap=False, reduce_scatter=False,
               combine_bytes=float("inf"), backend="cpu")
TX = optax.adamw(1e-3)
# (the widths of bench/real_models.py `scan`, 2 layers: smaller models do not show the gap the old search had)
MODEL = ScannedDecoder(vocab=1024, emb=256, heads=4, mlp=1024, layers=2)


def _step(params, opt_state, ids):
    def loss_fn(p):
        logits = MODEL.apply({"params": p}, ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _args():
    ids = jax.random.randint(jax.random.key(1), (16, 65), 0, MODEL.vocab)
    boxed = MODEL.init(jax.random.key(0), ids[:, :-1])["params"]
    params = nn.meta.unbox(boxed)
    return boxed, params, TX.init(params), ids


@pytest.fixture(scope="module")
def args():
    return _args()


def _graph(params, opt, ids):
    """The step's graph, its inputs named by their paths (`params['layers']['wi']['kernel']`)."""
    leaves = jax.tree_util.tree_flatten_with_path((params, opt, ids))[0]
    names = [("params", "opt_state", "ids")[path[0].idx] + jax.tree_util.keystr(path[1:]) for path, _ in leaves]
    return problem_of(_step, (params, opt, ids), names=names).graph


def _by_name(g, seeds):
    return {g.values[s.value].name: s.dims for s in seeds}


def test_scanned_layers_and_their_moments_are_stacked_state(args):
    _, params, opt, ids = args
    g = _graph(params, opt, ids)
    stacked = {g.values[v].name for v in scanned_state(g)}
    layer_params = {n for n in stacked if n.startswith("params")}
    assert layer_params == {f"params['layers']{k}" for k in ("['RMSNorm_0']['scale']", "['RMSNorm_1']['scale']",
                                                              "['key']", "['out']", "['query']", "['value']",
                                                              "['wi']['kernel']", "['wo']['kernel']")}
    assert len(stacked) == 3 * len(layer_params)  # and Adam's two moments of each
    assert not any("Embed" in n for n in stacked)
    # the loss depends on the scanned layers' weights through the loop's carry: they are parameters
    assert {g.values[v].name for v in parameter_inputs(g)} >= layer_params
    assert embed_size(g, scanned_state(g)) == MODEL.emb


def test_megatron_splits_heads_and_mlp_after_the_layer_dim(args):
    _, params, opt, ids = args
    g = _graph(params, opt, ids)
    seeds = _by_name(g, megatron(g, {"data": 4, "model": 2}))
    m = ("model",)
    assert seeds["params['layers']['query']"] == ((), (), m, ())  # [layers, embed, heads, head_dim]: heads
    assert seeds["params['layers']['out']"] == ((), m, (), ())  # [layers, heads, head_dim, embed]: heads
    assert seeds["params['layers']['wi']['kernel']"] == ((), (), m)  # column-parallel
    assert seeds["params['layers']['wo']['kernel']"] == ((), m, ())  # row-parallel


def test_fsdp_tp_is_maxtexts_layout(args):
    """embed -> the data axes, heads/mlp/vocab -> the model axis, norms not split over the data axes."""
    _, params, opt, ids = args
    g = _graph(params, opt, ids)
    seeds = _by_name(g, fsdp_tp(g, {"data": 4, "model": 2}))
    d, m = ("data",), ("model",)
    assert seeds["params['layers']['query']"] == ((), d, m, ())
    assert seeds["params['layers']['out']"] == ((), m, (), d)
    assert seeds["params['layers']['wi']['kernel']"] == ((), d, m)
    assert seeds["params['layers']['wo']['kernel']"] == ((), m, d)
    assert seeds["params['Embed_0']['embedding']"] == (m, d)
    assert seeds["opt_state[0].mu['layers']['wo']['kernel']"] == ((), m, d)  # the moments as their weight
    assert "data" not in str(seeds["params['layers']['RMSNorm_0']['scale']"])
    assert fsdp_tp(g, {"data": 8}) is None  # (needs a model axis)


def test_bare_search_is_at_least_as_fast_as_the_authors_layout(args):
    boxed, params, opt, ids = args
    mesh = shardc.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
    authors = shardc.auto(_step, mesh=mesh, rules=SCAN_RULES, search=False, topology=CPU)
    with jax.set_mesh(mesh):
        specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, SCAN_RULES)
    placed = jax.tree.map(jax.device_put, params, specs)
    a = authors.plan(placed, TX.init(placed), jax.device_put(ids, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "fsdp")))))
    t_authors = shardc.simulate(a, CPU).step_time
    bare = shardc.auto(_step, topology=CPU, seed=0)
    b = bare.plan(params, opt, ids)
    assert b.search.chosen.score.time <= t_authors * (1 + 1e-9), b.search.summary()
