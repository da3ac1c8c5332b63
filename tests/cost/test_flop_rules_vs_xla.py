"""FLOP rules count what XLA's cost analysis counts, primitive by primitive; the profiler caches on disk."""
import jax
import jax.numpy as jnp
import pytest

from shardc.cost.estimator import AnalyticalEstimator, FakeEstimator, OpKey
from shardc.cost.flops import count_op
from shardc.cost.profile import ProfilingEstimator
from shardc.cost.program import program_info
from shardc.cost.topology import Topology
from shardc.ir.build import build_graph

X = jnp.ones((32, 48))
Y = jnp.ones((48, 16))
IMG = jnp.ones((2, 8, 8, 4))  # NHWC
KER = jnp.ones((3, 3, 4, 6))  # HWIO


def _conv(x, w, padding, strides=(1, 1), rhs_dilation=(1, 1), groups=1):
    return jax.lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=rhs_dilation,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups)


def _pool(x, window):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, window, "VALID")


def _conv_loss(x, w):
    return jnp.sum(_conv(x, w, "SAME", strides=(2, 2)) ** 2)

CASES = {
    "dot_general": (lambda x, y: x @ y, (X, Y)),
    "add": (lambda x: x + x, (X,)),
    "mul": (lambda x: x * x, (X,)),
    "exp": (lambda x: jnp.exp(x), (X,)),
    "reduce_sum": (lambda x: jnp.sum(x, axis=1), (X,)),
    "reduce_sum_long": (lambda x: jnp.sum(x), (jnp.ones((3000,)),)),
    "reduce_max": (lambda x: jnp.max(x, axis=0), (X,)),
    "integer_pow": (lambda x: x ** 3, (X,)),
    "select_n": (lambda x: jnp.where(x > 0, x, 2 * x), (X,)),
    "transpose": (lambda x: x.T, (X,)),
    "argmax": (lambda x: jnp.argmax(x, axis=1), (X,)),
    "cumsum": (lambda x: jnp.cumsum(x, axis=1), (X,)),
    "cumsum_short": (lambda x: jnp.cumsum(x, axis=0), (jnp.ones((8, 5)),)),
    # Convolutions: XLA counts only the kernel taps that read an input element, not those over padding
    # (11% of a 3x3 SAME conv's taps on an 8x8 image; the CPU-scale CNN of bench/fidelity.py).
    "conv_same": (lambda x, w: _conv(x, w, "SAME"), (IMG, KER)),
    "conv_valid": (lambda x, w: _conv(x, w, "VALID"), (IMG, KER)),
    "conv_strided": (lambda x, w: _conv(x, w, "SAME", strides=(2, 2)), (IMG, KER)),
    "conv_dilated": (lambda x, w: _conv(x, w, "SAME", rhs_dilation=(2, 2)), (IMG, KER)),
    "conv_grouped": (lambda x, w: _conv(x, w[:, :, :2, :], "SAME", groups=2), (IMG, KER)),
    # Max pooling and its gradient (select_and_scatter_add), as in the CNN of bench/fidelity.py
    "max_pool": (lambda x: _pool(x, (1, 3, 3, 1)), (IMG,)),
    "max_pool_grad": (lambda g, x: jax.vjp(lambda x: _pool(x, (1, 2, 2, 1)), x)[1](g)[0],
                      (jnp.ones((2, 4, 4, 4)), IMG)),
    "max_pool_grad_1d": (lambda g, x: jax.vjp(lambda x: _pool(x, (1, 2, 1)), x)[1](g)[0],
                         (jnp.ones((2, 4, 4)), IMG[:, 0])),
    "conv_grads": (lambda x, w: jax.grad(_conv_loss, (0, 1))(x, w), (IMG, KER)),  # lhs- and rhs-dilated convs
}


def _xla_flops(fn, args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost).get("flops", 0.0))


def _ours(fn, args):
    g = build_graph(jax.make_jaxpr(fn)(*args))  # inlines jnp's jitted helpers, as the simulator sees them
    live = program_info(g, jax.default_backend()).live  # (XLA drops dead ops, as the simulator does)
    total = 0.0
    for op in g.ops:
        if not live[op.id]:
            continue
        ins = [g.values[v].shape for v in op.inputs]
        outs = [g.values[v].shape for v in op.outputs]
        total += count_op(op.primitive, ins, outs, op.params, backend=jax.default_backend()).flops
    return total


@pytest.mark.parametrize("name", list(CASES))
def test_flops_match_cost_analysis(name):
    fn, args = CASES[name]
    assert _ours(fn, args) == pytest.approx(_xla_flops(fn, args), rel=0.02, abs=1)


def test_roofline_is_compute_or_memory_bound():
    dev = Topology.preset("h100-sxm-8").device
    est = AnalyticalEstimator(dev)
    mm = OpKey("dot_general", (("dimension_numbers", (((1,), (0,)), ((), ()))),), ((4096, 4096), (4096, 4096)),
               ((4096, 4096),), ("float32", "float32"), ("float32",))
    t = est.op_time(mm)
    assert t == pytest.approx(2 * 4096**3 / (dev.flops_per_s("float32") * dev.matmul_efficiency) + dev.op_overhead)
    add = OpKey("add", (), ((1 << 20,), (1 << 20,)), ((1 << 20,),), ("float32",) * 2, ("float32",))
    assert est.op_time(add) == pytest.approx(3 * 4 * (1 << 20) / (dev.mem_bandwidth * dev.vector_efficiency)
                                             + dev.op_overhead)
    fused = OpKey("add", (), ((1 << 20,), (1 << 20,)), ((1 << 20,),), ("float32",) * 2, ("float32",),
                  (True, False), (True,))
    assert est.op_time(fused) < est.op_time(add)  # reads one operand from registers, writes nothing
    assert FakeEstimator({"add": 2.0}).op_time(add) == 2.0


def test_profiler_measures_once_and_caches_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    dev = Topology.preset("h100-sxm-8").device
    key = OpKey("dot_general", (("dimension_numbers", (((1,), (0,)), ((), ()))), ("precision", None),
                                ("preferred_element_type", jnp.float32), ("out_sharding", None)),
                ((64, 64), (64, 64)), ((64, 64),), ("float32", "float32"), ("float32",))
    params = dict(key.params)
    first = ProfilingEstimator(dev, repeats=3, warmup=1)
    t = first.op_time(key, params)
    assert t > 0 and first.measured == 1
    second = ProfilingEstimator(dev, repeats=3, warmup=1)  # a new process would read the same file
    assert second.op_time(key, params) == t and second.measured == 0
    assert (tmp_path / "op-profiles.json").exists()
    reshape = OpKey("reshape", (("new_sizes", (64, 64)),), ((4096,),), ((64, 64),), ("float32",), ("float32",))
    assert second.op_time(reshape, {"new_sizes": (64, 64), "dimensions": None}) == \
        AnalyticalEstimator(dev).op_time(reshape)  # shape params: not run alone, modelled
